"""A real tritonserver on the tiny model, shared by the integration tests.

Besides the repository's models it serves an extra repository with `prefill_bad`,
a prefill pointed at a model path that does not exist, loaded on demand only.
"""

from __future__ import annotations

import shutil

import pytest

from pdchat.clients.chat import GrpcChat, HttpChat
from pdchat.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer

MODELS = ("renderer", "prefill", "decode", "chat_ensemble")
MISSING_MODEL_PATH = "/nonexistent/model-dir"


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir):
    extra = tmp_path_factory.mktemp("extra_repository")
    bad = extra / "prefill_bad"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY / "prefill", bad, ignore=shutil.ignore_patterns("__pycache__"))
    config = (bad / "config.pbtxt").read_text().replace('name: "prefill"', 'name: "prefill_bad"')
    (bad / "config.pbtxt").write_text(config + f'parameters {{ key: "model" value {{ string_value: "{MISSING_MODEL_PATH}" }} }}\n')
    instance = TritonServer(
        env={"PDCHAT_MODEL": "tiny"},
        load_models=MODELS,
        extra_args=(f"--model-repository={extra}",),
        log_path=tmp_path_factory.getbasetemp() / "tritonserver.log",
    )
    instance.start()
    yield instance
    instance.stop()
    assert instance.leaked_shm() == [], "the server left shared-memory regions behind"


@pytest.fixture(params=["grpc", "http"])
def protocol(request):
    return request.param


@pytest.fixture
def chat_client(server, protocol):
    client = GrpcChat(server.grpc_url) if protocol == "grpc" else HttpChat(server.http_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_chat(server):
    client = GrpcChat(server.grpc_url)
    yield client
    client.close()
