"""TritonServer.start as the launcher, the supervisor and the tests use it: a server killed by
a signal while its models load (as Triton 2.51's python backend rarely is, when a stub dies as
it initializes) is started once more on its ports; one killed again, or one that exits because
a model failed to load, is reported, not retried."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pdchat.launcher import ServerError, TritonServer

pytestmark = pytest.mark.faults

# A python model that, while the marker file holds a count above 0, takes one from it and
# aborts its tritonserver (the stub's parent) from initialize().
MODEL = textwrap.dedent(
    """
    import os
    import signal
    from pathlib import Path

    import numpy as np
    import triton_python_backend_utils as pb_utils

    MARKER = Path({marker!r})


    class TritonPythonModel:
        def initialize(self, args):
            left = int(MARKER.read_text())
            if left > 0:
                MARKER.write_text(str(left - 1))
                os.kill(os.getppid(), signal.SIGABRT)
            if left < 0:
                raise ValueError("this model does not load")

        def execute(self, requests):
            out = pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))
            return [pb_utils.InferenceResponse(output_tensors=[out]) for _ in requests]
    """
)
CONFIG = """
backend: "python"
max_batch_size: 0
output [{ name: "OUT", data_type: TYPE_INT32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


def repository(tmp_path: Path, aborts: int) -> tuple[Path, Path]:
    """(model repository, marker): one model that aborts its server `aborts` times as it
    loads, then loads (or, for -1, fails to load)."""
    marker = tmp_path / "aborts_left"
    marker.write_text(str(aborts))
    model = tmp_path / "repo" / "flaky"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(MODEL.format(marker=str(marker)))
    return tmp_path / "repo", marker


def starts_in(log: Path) -> int:
    return log.read_text().count("loading: flaky:1")


def test_a_server_killed_while_it_starts_is_started_once_more(tmp_path, capfd):
    repo, marker = repository(tmp_path, aborts=1)
    server = TritonServer(model_repository=repo, log_path=tmp_path / "server.log")
    with server:
        assert server.is_ready() and marker.read_text() == "0"
        assert starts_in(server.log_path) == 2
    assert "was killed by SIGABRT" in capfd.readouterr().err
    assert not server.leaked_shm()


def test_a_server_killed_twice_while_it_starts_is_reported(tmp_path):
    repo, marker = repository(tmp_path, aborts=2)
    server = TritonServer(model_repository=repo, log_path=tmp_path / "server.log")
    with pytest.raises(ServerError, match="during start"):
        server.start(timeout=120)
    assert marker.read_text() == "0" and starts_in(server.log_path) == 2
    assert server.process.poll() is not None and not server.leaked_shm()


def test_a_server_whose_model_fails_to_load_is_not_tried_again(tmp_path):
    repo, _ = repository(tmp_path, aborts=-1)
    server = TritonServer(model_repository=repo, log_path=tmp_path / "server.log")
    with pytest.raises(ServerError, match="exited with code 1 during start"):
        server.start(timeout=120)
    assert starts_in(server.log_path) == 1
