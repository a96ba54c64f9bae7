"""KV connectors: publish on one side, pull on the other, nothing held afterwards."""

import os
import time

import numpy as np
import pytest

from pdchat.core.kv_transfer import Connectors, KVBudgetExceeded, KVUnavailable, ShmConnector


def kv(tokens=16, seed=0):
    return np.random.default_rng(seed).standard_normal((4, 2, 2, tokens, 64)).astype(np.float32)


@pytest.fixture
def shm(tmp_path):
    connector = ShmConnector(tmp_path, budget_bytes=1 << 20, ttl_s=60)
    yield connector
    connector.close()


def test_shm_round_trip_is_exact_and_done_hands_the_pages_back_for_reuse(shm):
    data = kv()
    handle = shm.publish(data, {"first_token_id": 7})
    assert handle["first_token_id"] == 7 and shm.held_bytes() == data.nbytes
    decode = ShmConnector(shm.directory)
    pulled = decode.pull(handle)
    assert np.array_equal(pulled, data)
    decode.done(handle)
    assert shm.held_bytes() == 0
    with pytest.raises(KVUnavailable, match="is gone"):
        decode.pull(handle)
    [free] = list(shm.directory.glob("pdchat_kvfree_*"))
    smaller = kv(8, seed=1)
    second = shm.publish(smaller)
    assert not free.exists(), "the handed-back file carries the next KV"
    assert np.array_equal(decode.pull(second), smaller)
    # (`pulled` may now show the new KV: done() promises nothing reads it any more.)
    decode.done(second)
    shm.close()
    assert list(shm.directory.iterdir()) == []


def test_shm_budget_is_freed_by_decode_being_done(shm):
    first = shm.publish(kv(100))  # 400 KiB of a 1 MiB budget
    shm.publish(kv(100))
    with pytest.raises(KVBudgetExceeded, match="budget of 1 MiB"):
        shm.publish(kv(100))
    ShmConnector(shm.directory).pull(first)
    ShmConnector(shm.directory).done(first)
    shm.publish(kv(100))


def test_shm_sweep_frees_expired_kv_of_any_engine(tmp_path):
    crashed = ShmConnector(tmp_path, ttl_s=0.01, engine_id="dead")
    crashed.publish(kv())
    survivor = ShmConnector(tmp_path, ttl_s=60, engine_id="live")
    kept = survivor.publish(kv())
    time.sleep(0.05)
    assert survivor.sweep() == 1
    assert [p.name for p in tmp_path.iterdir()] == [kept["name"]]


def test_shm_refuses_names_outside_its_pattern(shm):
    for name in ("../etc/passwd", "pdchat_kv_x", ""):
        with pytest.raises(KVUnavailable, match="not a shm KV name"):
            shm.pull({"name": name, "shape": [1]})


def test_nixl_round_trip_notifies_the_holder_which_frees():
    nixl = pytest.importorskip("nixl_cu12")
    assert nixl
    from pdchat.core.nixl_connector import NixlConnector

    prefill, decode = NixlConnector(ttl_s=60), NixlConnector()
    try:
        data = kv(64)
        handle = prefill.publish(data, {"first_token_id": 3})
        assert prefill.held_bytes() == data.nbytes
        assert np.array_equal(decode.pull(handle), data)
        deadline = time.monotonic() + 5
        while prefill.held_bytes() and time.monotonic() < deadline:
            prefill.sweep()
            time.sleep(0.01)
        assert prefill.held_bytes() == 0
        expired = dict(prefill.publish(data), expires_at=time.time() - 1)
        with pytest.raises(KVUnavailable, match="expired"):
            decode.pull(expired)
    finally:
        prefill.close()
        decode.close()
    assert prefill.held_bytes() == 0


def test_foreign_entries_named_like_kv_neither_stop_the_sweeper_nor_fail_a_publish(shm, caplog):
    directory = shm.directory
    (directory / "pdchat_kv_000000000000_1_00").mkdir()  # expired by its name, but a directory
    (directory / "pdchat_kvfree_000000000000_1_00").mkdir()
    os.mkfifo(directory / "pdchat_kv_000000000000_2_00")  # a FIFO: opening it for reading would block
    (directory / "pdchat_kv_not-a-kv-name").write_bytes(b"x")
    (directory / "pdchat_kv_000000000000_3_00").symlink_to(directory / "pdchat_kv_not-a-kv-name")
    expired = directory / f"pdchat_kv_{shm.engine_id}_1_ab"
    expired.write_bytes(b"old")
    assert shm.sweep() == 1 and not expired.exists()
    handle = shm.publish(kv(), {"first_token_id": 1})
    assert shm.held_bytes() == kv().nbytes
    assert np.array_equal(ShmConnector(directory).pull(handle), kv())
    for planted in ("pdchat_kv_000000000000_2_00", "pdchat_kv_000000000000_3_00", "pdchat_kv_000000000000_1_00"):
        with pytest.raises(KVUnavailable):
            ShmConnector(directory).pull({"name": planted, "shape": [1]})
    shm.sweep()
    assert sum("pdchat_kv_000000000000_1_00" in r.getMessage() for r in caplog.records) == 1, "logged once, not per sweep"


def test_the_background_sweeper_survives_a_failing_sweep(tmp_path):
    seen = []

    def on_sweep(held):
        seen.append(held)
        if len(seen) == 1:
            raise RuntimeError("metrics endpoint hiccup")

    connectors = Connectors(on_sweep=on_sweep, directory=tmp_path)
    connectors.SWEEP_INTERVAL_S = 0.05
    connectors.get("shm")
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    connectors.close()
    assert len(seen) >= 3
