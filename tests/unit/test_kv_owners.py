"""KV a dead engine left in shared memory is swept at once by any survivor; a live engine's
never is. An engine lives while its owner lock is held (core.kv.shm)."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pdchat.core.kv import shm as shm_module
from pdchat.core.kv.base import KVHandle
from pdchat.core.kv.connector import Connectors
from pdchat.core.kv.shm import HOST_ID, OWNER_PREFIX, ShmConnector, sweep_directory

FAR_MS = int((time.time() + 3600) * 1000)  # nothing here expires during a test

PREFILL = """
import sys
import numpy as np
from pdchat.core.kv.shm import ShmConnector
prefill = ShmConnector(sys.argv[1])
for token in (1, 2):
    print(prefill.publish(np.zeros((2, 8), np.float32), token).to_json(), flush=True)
sys.stdin.read()
"""


def kv_files(directory):
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(OWNER_PREFIX))


@pytest.fixture
def directory(tmp_path):
    return tmp_path / "kv"


@pytest.fixture
def decode(directory):
    connector = ShmConnector(directory)
    yield connector
    connector.close()


def test_what_a_dead_engine_left_goes_at_the_next_sweep_and_its_published_kv_waits_for_its_pull(directory, decode):
    live = ShmConnector(directory)
    handed_back = live.publish(np.ones((2, 8), np.float32), 1)
    decode.pull(handed_back)
    decode.done(handed_back)
    waiting = live.publish(np.ones((2, 8), np.float32), 2)
    # A fake dead owner: its lock file is there and nobody holds it, as after a kill -9.
    (directory / f"{OWNER_PREFIX}dead0").write_bytes(b"")
    left = {
        f"pdchat_kvfree_dead0_{FAR_MS}_01",  # handed back to it
        f".pdchat_kv_dead0_{FAR_MS}_02",  # it was writing this one
        f"pdchat_kvpulled_{live.engine_id}_{FAR_MS}_03_dead0",  # it claimed this one
    }
    published = f"pdchat_kv_dead0_{FAR_MS}_04"
    for name in (*left, published):
        (directory / name).write_bytes(np.zeros(16, np.float32).tobytes())
    before = set(kv_files(directory))

    assert sweep_directory(directory) == 3
    assert set(kv_files(directory)) == before - left, "only what the dead engine left went"
    assert waiting.location["name"] in kv_files(directory) and live.held_bytes() == 64
    assert (directory / f"{OWNER_PREFIX}dead0").exists(), "its published KV still names it"

    handle = KVHandle("shm", (16,), FAR_MS / 1000, 0, {"name": published, "host": HOST_ID})
    assert np.array_equal(decode.pull(handle), np.zeros(16, np.float32)), "a dead prefill's KV still pulls"
    assert decode.sweep() == 0, "claimed by a live decode: kept"
    decode.done(handle)
    assert decode.sweep() == 1
    assert not (directory / f"{OWNER_PREFIX}dead0").exists(), "no file names it any more: its lock goes too"
    assert kv_files(directory) == sorted(p.name for p in directory.glob("pdchat_kv*_" + live.engine_id + "_*"))
    live.close()


def test_a_prefill_killed_with_sigkill_has_its_handed_back_kv_swept_by_the_survivor(directory, decode):
    prefill = subprocess.Popen(
        [sys.executable, "-c", PREFILL, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        handed_back, waiting = (KVHandle.from_json(prefill.stdout.readline()) for _ in range(2))
        decode.pull(handed_back)
        decode.done(handed_back)
        [free] = directory.glob("pdchat_kvfree_*")
        assert decode.sweep() == 0 and free.exists(), "its owner lives: nothing of it goes"
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(10)
        assert decode.sweep() == 1 and not free.exists()
        assert kv_files(directory) == [waiting.location["name"]], "its published KV waits for a pull"
    finally:
        prefill.kill()
        prefill.wait()


def test_an_engine_id_held_by_a_live_connector_is_refused_and_a_dead_ones_is_taken_over(directory, monkeypatch):
    monkeypatch.setattr(shm_module, "_OWNER_LOCK_TRIES", 2)
    first = ShmConnector(directory, engine_id="ab12")
    with pytest.raises(ValueError, match="taken by a live connector"):
        ShmConnector(directory, engine_id="ab12")
    first.close()
    (directory / f"{OWNER_PREFIX}cd34").write_bytes(b"")  # its owner died
    again = ShmConnector(directory, engine_id="cd34")
    assert sweep_directory(directory) == 0 and (directory / f"{OWNER_PREFIX}cd34").exists()
    again.close()
    assert list(directory.iterdir()) == []


def test_a_survivor_that_made_no_connector_yet_sweeps_a_dead_engines_kv_and_lock(directory, monkeypatch):
    monkeypatch.setattr(Connectors, "SWEEP_INTERVAL_S", 0.05)
    absent = directory.parent / "never-made"
    idle = Connectors(directory=absent)  # a process that never uses shm KV makes no directory
    time.sleep(0.2)
    idle.close()
    assert not absent.exists()

    ShmConnector(directory).close()  # the directory exists, as on a host that ran a server before
    (directory / f"{OWNER_PREFIX}dead0").write_bytes(b"")  # a kill -9'd prefill's lock...
    (directory / f"pdchat_kvfree_dead0_{FAR_MS}_01").write_bytes(b"\0" * 64)  # ...and what decode handed back to it
    restarted = Connectors(directory=directory)  # e.g. its restarted server, before its first publish
    try:
        deadline = time.monotonic() + 2
        while list(directory.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(directory.iterdir()) == [], "swept within a few sweep intervals, lock and all"
    finally:
        restarted.close()


def test_a_check_tells_a_live_engines_kv_from_what_a_dead_one_left(directory, decode):
    (directory / f"{OWNER_PREFIX}dead0").write_bytes(b"")
    assert shm_module.live_engines(directory) == {decode.engine_id}
    assert (directory / f"{OWNER_PREFIX}dead0").exists(), "a check removes nothing"
    names = [
        f"pdchat_kvfree_dead0_{FAR_MS}_01",  # handed back to the dead one
        f"pdchat_kvfree_{decode.engine_id}_{FAR_MS}_02",  # a live engine's pages, kept for reuse
        f"pdchat_kv_dead0_{FAR_MS}_03",  # published: may still be pulled
        f"pdchat_kvpulled_{decode.engine_id}_{FAR_MS}_04_dead0",  # the dead one claimed it
    ]
    assert shm_module.left_by_dead_engines(names, {decode.engine_id}) == [names[0], names[3]]
