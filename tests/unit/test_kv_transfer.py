"""KV connectors: publish on one side, pull on the other (once), nothing held afterwards."""

import dataclasses
import os
import stat
import threading
import time

import numpy as np
import pytest

from pdchat.core.kv import shm as shm_module
from pdchat.core.kv.base import KVBudgetExceeded, KVHandle, KVUnavailable
from pdchat.core.kv.connector import Connectors, KVHandover
from pdchat.core.kv.shm import OWNER_PREFIX, KVDirectoryRefused, ShmConnector, kv_directory


def kv(tokens=16, seed=0):
    return np.random.default_rng(seed).standard_normal((4, 2, 2, tokens, 64)).astype(np.float32)


def named(name):
    """A handle naming `name` on this host, as a forged or stale one would."""
    from pdchat.core.kv.shm import HOST_ID

    return KVHandle("shm", (1,), time.time() + 60, 0, {"name": name, "host": HOST_ID})


def mode(path):
    return stat.S_IMODE(path.lstat().st_mode)


def kv_files(directory):
    """The names in `directory` but the owner locks of the connectors still open."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(OWNER_PREFIX))


@pytest.fixture
def directory(tmp_path):
    return tmp_path / "kv"  # made by the connector


@pytest.fixture
def shm(directory):
    connector = ShmConnector(directory, budget_bytes=1 << 20, ttl_s=60)
    yield connector
    connector.close()


@pytest.fixture
def decode(directory, shm):
    connector = ShmConnector(directory)
    yield connector
    connector.close()


def test_the_default_directory_is_this_users_own_and_private(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_module, "SHM_ROOT", tmp_path)
    connector = ShmConnector()
    assert connector.directory == kv_directory() == tmp_path / f"pdchat-{os.getuid()}"
    connector.publish(kv(), 1)
    [published] = connector.held()
    assert mode(connector.directory) == 0o700 and mode(published) == 0o600
    connector.close()


def test_shm_cycle_is_exact_single_use_reuses_the_pages_and_leaves_nothing(shm, decode):
    data = kv()
    handle = shm.publish(data, 7)
    assert handle.first_token_id == 7 and handle.connector == "shm" and shm.held_bytes() == data.nbytes
    pulled = decode.pull(handle)
    assert np.array_equal(pulled, data)
    with pytest.raises(KVUnavailable, match="already pulled or gone"):
        decode.pull(handle)
    assert shm.held_bytes() == data.nbytes, "a claimed KV counts until decode is done with it"
    decode.done(handle)
    assert shm.held_bytes() == 0
    [free] = shm.directory.glob("pdchat_kvfree_*")
    assert mode(free) == 0o600
    smaller = kv(8, seed=1)
    second = shm.publish(smaller, 8)
    assert not free.exists(), "the handed-back file carries the next KV"
    assert [mode(p) for p in shm.held()] == [0o600]
    assert np.array_equal(decode.pull(second), smaller)
    # (`pulled` may now show the new KV: done() promises nothing reads it any more.)
    decode.done(second)
    shm.close()
    decode.close()
    assert list(shm.directory.iterdir()) == []


def test_racing_pulls_of_one_handle_have_exactly_one_winner(shm, decode, directory):
    handle = shm.publish(kv(), 1)
    pullers = [decode, ShmConnector(directory)]
    start = threading.Barrier(8)
    outcomes = []

    def pull(connector):
        start.wait()
        try:
            outcomes.append(connector.pull(handle))
        except KVUnavailable:
            outcomes.append(None)

    threads = [threading.Thread(target=pull, args=(pullers[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [kv_ for kv_ in outcomes if kv_ is not None]
    assert len(outcomes) == 8 and len(winners) == 1 and np.array_equal(winners[0], kv())


def test_done_hands_back_only_what_this_connector_claimed(shm, decode, directory):
    handle = shm.publish(kv(), 1)
    decode.pull(handle)
    ShmConnector(directory).done(handle)  # not its claim: the puller may still map the pages
    assert shm.held_bytes() == kv().nbytes and list(directory.glob("pdchat_kvfree_*")) == []
    decode.done(handle)
    assert shm.held_bytes() == 0


def test_discarded_kv_is_handed_back_at_once_unless_it_was_claimed(shm, decode, directory):
    first, second = shm.publish(kv(100), 1), shm.publish(kv(100), 2)  # 800 KiB of a 1 MiB budget
    with pytest.raises(KVBudgetExceeded):
        shm.publish(kv(100), 3)
    decode.discard(first)  # its request ended in decode's queue
    assert shm.held_bytes() == kv(100).nbytes and len(list(directory.glob("pdchat_kvfree_*"))) == 1
    with pytest.raises(KVUnavailable, match="already pulled or gone"):
        decode.pull(first)
    shm.publish(kv(100), 3)  # into the discarded file's pages
    assert list(directory.glob("pdchat_kvfree_*")) == []
    decode.pull(second)
    decode.discard(second)  # claimed: the puller still maps it
    assert shm.held_bytes() == 2 * kv(100).nbytes
    decode.discard(first)  # gone: nothing to do
    decode.discard(dataclasses.replace(second, location={**second.location, "host": "elsewhere"}))


def test_a_handover_ended_before_its_pull_discards_its_kv_once_and_pulls_no_more(directory):
    prefill, decode = Connectors(directory=directory), Connectors(directory=directory)
    try:
        shm = prefill.get("shm")
        unpulled = KVHandover(decode, shm.publish(kv(), 1))
        assert unpulled.end() and not unpulled.end()
        with pytest.raises(KVUnavailable, match="ended before its KV was pulled"):
            unpulled.pull()
        pulled = KVHandover(decode, shm.publish(kv(), 2))
        assert np.array_equal(pulled.pull(), kv())
        assert not pulled.end(), "pulled KV goes back through done(), not a discard"
        deadline = time.monotonic() + 5  # the discard is made on the connectors' own thread
        while shm.held_bytes() > kv().nbytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert shm.held_bytes() == kv().nbytes, "only the pulled KV is held, until done()"
        pulled.done()
        assert shm.held_bytes() == 0
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("unsafe", ["world_writable", "group_readable", "symlink", "file", "foreign_owner"])
def test_a_directory_others_could_use_is_refused(tmp_path, monkeypatch, unsafe):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = tmp_path / "kv"
    if unsafe == "world_writable":
        path.mkdir()
        path.chmod(0o777)
    elif unsafe == "group_readable":
        path.mkdir()
        path.chmod(0o750)
    elif unsafe == "symlink":
        path.symlink_to(private)
    elif unsafe == "file":
        path.write_bytes(b"")
    else:
        path.mkdir(mode=0o700)
        real_uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(KVDirectoryRefused, match=f"refusing KV directory {path}"):
        ShmConnector(path)
    assert list(private.iterdir()) == [], "nothing written through the link"


def test_a_directory_made_unsafe_later_is_refused_at_once(shm, decode):
    handle = shm.publish(kv(), 1)
    shm.directory.chmod(0o755)
    with pytest.raises(KVUnavailable, match="lets group or others in"):
        decode.pull(handle)
    with pytest.raises(KVDirectoryRefused):
        shm.publish(kv(), 2)
    shm.directory.chmod(0o700)
    assert np.array_equal(decode.pull(handle), kv())


def test_shm_budget_is_freed_by_decode_being_done(shm, decode):
    first = shm.publish(kv(100), 1)  # 400 KiB of a 1 MiB budget
    shm.publish(kv(100), 2)
    with pytest.raises(KVBudgetExceeded, match="budget of 1 MiB"):
        shm.publish(kv(100), 3)
    decode.pull(first)
    with pytest.raises(KVBudgetExceeded):
        shm.publish(kv(100), 3)
    decode.done(first)
    shm.publish(kv(100), 3)


def test_shm_sweep_frees_expired_kv_of_any_engine(directory):
    crashed = ShmConnector(directory, ttl_s=0.01, engine_id="dead")
    crashed.publish(kv(), 1)
    survivor = ShmConnector(directory, ttl_s=60, engine_id="a1fe")
    kept = survivor.publish(kv(), 2)
    time.sleep(0.05)
    assert survivor.sweep() == 1
    assert kv_files(directory) == [kept.location["name"]]


def test_kv_claimed_but_never_handed_back_is_swept_once_expired(directory):
    prefill = ShmConnector(directory, ttl_s=0.05)
    handle = prefill.publish(kv(), 1)
    pulled = ShmConnector(directory).pull(handle)  # then decode crashes: no done()
    [claimed] = directory.glob("pdchat_kvpulled_*")
    assert prefill.held() == [claimed]
    assert prefill.sweep() == 0
    time.sleep(0.1)
    assert prefill.sweep() == 1 and kv_files(directory) == []
    assert np.array_equal(pulled, kv()), "a mapping outlives its file"


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "pdchat_kv_x",
        "",
        "pdchat_kv_ab_1_cd/../x",
        "pdchat_kvfree_ab_1_cd",
        "pdchat_kvpulled_ab_1_cd_ef",
        ".pdchat_kv_ab_1_cd",  # only a published KV pulls
    ],
)
def test_shm_refuses_names_that_are_not_a_published_kv(shm, name):
    with pytest.raises(KVUnavailable, match="not a shm KV name"):
        shm.pull(named(name))


def test_nixl_round_trip_notifies_the_holder_which_frees():
    pytest.importorskip("nixl_cu12")
    from pdchat.core.kv.nixl import NixlConnector

    prefill, decode = NixlConnector(ttl_s=60), NixlConnector()
    try:
        data = kv(64)
        handle = prefill.publish(data, 3)
        assert handle.first_token_id == 3 and set(handle.location) == {"agent", "metadata", "id", "addr"}
        assert prefill.held_bytes() == data.nbytes
        assert np.array_equal(decode.pull(handle), data)
        deadline = time.monotonic() + 5
        while prefill.held_bytes() and time.monotonic() < deadline:
            prefill.sweep()
            time.sleep(0.01)
        assert prefill.held_bytes() == 0
        expired = dataclasses.replace(prefill.publish(data, 4), expires_at=time.time() - 1)
        with pytest.raises(KVUnavailable, match="expired"):
            decode.pull(expired)
    finally:
        prefill.close()
        decode.close()
    assert prefill.held_bytes() == 0


def test_nixl_discard_tells_the_holder_to_free_without_a_read():
    pytest.importorskip("nixl_cu12")
    from pdchat.core.kv.nixl import NixlConnector

    prefill, decode = NixlConnector(ttl_s=60), NixlConnector()
    try:
        kept, discarded = prefill.publish(kv(), 1), prefill.publish(kv(), 2)
        decode.discard(discarded)
        deadline = time.monotonic() + 5
        while prefill.held_bytes() > kv().nbytes and time.monotonic() < deadline:
            prefill.sweep()
            time.sleep(0.01)
        assert prefill.held_bytes() == kv().nbytes
        assert np.array_equal(decode.pull(kept), kv()), "the other KV is still there to pull"
        with pytest.raises(KVUnavailable, match="malformed"):
            decode.discard(dataclasses.replace(kept, location={}))
    finally:
        prefill.close()
        decode.close()


def test_foreign_entries_neither_stop_the_sweeper_nor_fail_a_publish(shm, decode, caplog):
    directory = shm.directory
    (directory / "pdchat_kv_000000000000_1_00").mkdir()  # expired by its name, but a directory
    (directory / "pdchat_kvfree_000000000000_1_00").mkdir()
    os.mkfifo(directory / "pdchat_kv_000000000000_2_00")  # a FIFO: opening it for reading would block
    (directory / "pdchat_kv_not-a-kv-name").write_bytes(b"x")
    (directory / "pdchat_kv_000000000000_3_00").symlink_to(directory / "pdchat_kv_not-a-kv-name")
    expired = directory / f"pdchat_kv_{shm.engine_id}_1_ab"
    expired.write_bytes(b"old")
    assert shm.sweep() == 1 and not expired.exists()
    handle = shm.publish(kv(), 1)
    assert shm.held_bytes() == kv().nbytes
    assert np.array_equal(decode.pull(handle), kv())
    for planted in ("pdchat_kv_000000000000_2_00", "pdchat_kv_000000000000_3_00", "pdchat_kv_000000000000_1_00"):
        with pytest.raises(KVUnavailable):
            ShmConnector(directory).pull(named(planted))
    shm.sweep()
    assert sum("pdchat_kvfree_000000000000_1_00" in r.getMessage() for r in caplog.records) == 1, (
        "logged once, not per sweep"
    )


def test_the_background_sweeper_survives_a_failing_sweep(directory):
    seen = []

    def on_sweep(held):
        seen.append(held)
        if len(seen) == 1:
            raise RuntimeError("metrics endpoint hiccup")

    connectors = Connectors(on_sweep=on_sweep, directory=directory)
    connectors.SWEEP_INTERVAL_S = 0.05
    connectors.get("shm")
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    connectors.close()
    assert len(seen) >= 3


def test_shm_kv_from_another_host_is_refused_not_mapped(tmp_path):
    from dataclasses import replace

    from pdchat.core.kv.shm import HOST_ID

    prefill, decode = ShmConnector(tmp_path), ShmConnector(tmp_path)
    handle = prefill.publish(kv(), 3)
    assert handle.location["host"] == HOST_ID
    elsewhere = replace(handle, location={**handle.location, "host": "another-boot:4026531993"})
    with pytest.raises(KVUnavailable, match="from another host"):
        decode.pull(elsewhere)
    assert np.array_equal(decode.pull(handle), kv())  # the genuine handle still pulls
    prefill.close()


@pytest.fixture(params=["shm", "nixl"])
def connector_pair(request, tmp_path):
    """(connector name, publisher's Connectors, puller's Connectors), closed after the test."""
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    options = {"ttl_s": 60} if request.param == "nixl" else {"directory": str(tmp_path / "kv"), "ttl_s": 60}
    publisher, puller = Connectors(**options), Connectors(**options)
    yield request.param, publisher, puller
    publisher.close()
    puller.close()


def test_a_pull_from_a_token_on_is_exactly_that_tail_of_the_kv(connector_pair):
    connector, publisher, puller = connector_pair
    whole = kv(tokens=40, seed=3)
    handle = KVHandle.from_json(publisher.publish(connector, whole, 7).to_json())
    tail = puller.pull(handle, 32)
    assert tail.shape == (4, 2, 2, 8, 64) and np.array_equal(tail, whole[:, :, :, 32:])
    puller.done(handle)


def test_a_prefetched_handover_pulls_once_and_serves_any_tail_from_memory(connector_pair):
    """decode prefetches a KV whose pull waits on the network (NIXL) before the request joins
    its batch; the scheduler's pull of the blocks it lacks is then a slice, no transfer."""
    connector, publisher, puller = connector_pair
    whole = kv(tokens=40, seed=5)
    handle = KVHandle.from_json(publisher.publish(connector, whole, 7).to_json())
    handover = KVHandover(puller, handle)
    assert handover.pull_waits is (connector == "nixl")
    handover.prefetch()
    puller.close()  # no transfer is left to make
    assert np.array_equal(handover.pull(32), whole[:, :, :, 32:]) and np.array_equal(handover.pull(), whole)
    assert not handover.end(), "a prefetched KV was pulled: nothing to discard"
    expired = KVHandover(puller, dataclasses.replace(handle, expires_at=time.time() - 1))
    expired.prefetch()  # the failure is kept for the scheduler's pull, which then recomputes
    with pytest.raises(KVUnavailable, match="expired"):
        expired.pull(8)


def test_decode_s_source_counts_each_pull_and_gives_none_for_kv_it_cannot_have(directory):
    """decode recomputes the prompt from the ids where the KV cannot be had: the source says
    None, counted "recomputed"; a pull that worked is counted "pulled"."""
    prefill, decode = Connectors(directory=directory), Connectors(directory=directory)
    counted: list[str] = []
    try:
        shm = prefill.get("shm")
        fields = KVHandover(decode, shm.publish(kv(), 1)).decode_source("r1", counted.append)
        assert fields["prefetch_kv"] is None  # shm's pull waits on nothing
        assert np.array_equal(fields["kv_source"](0), kv()) and counted == ["pulled"]
        gone = KVHandover(decode, shm.publish(kv(), 2))
        source = gone.decode_source("r2", counted.append)["kv_source"]
        gone.end()  # its request ended before the pull: the KV is discarded, a pull gets none
        assert source(0) is None and counted == ["pulled", "recomputed"]
    finally:
        decode.close()
        prefill.close()


def test_decode_pulling_only_the_blocks_it_lacks_decodes_what_a_full_pull_does(tiny_model_dir, tmp_path):
    """Decode caches turn 1's prompt; turn 2's KV is pulled from its first uncached token and
    the answer equals a decode server that pulled it all (greedy, fp32)."""
    from pdchat.core.generation.engine import CausalLM, DecodeBatch
    from pdchat.core.kv.base import tokens_from

    prefill, warm, cold = (CausalLM(tiny_model_dir, "cpu") for _ in range(3))
    turn1 = [(5 * i) % 3000 + 10 for i in range(100)]
    turn2 = turn1 + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    connectors = Connectors(directory=str(tmp_path / "kv"), ttl_s=60)
    try:

        def exported(prompt):
            logits, sequence = prefill.prefill(prompt)
            kv = prefill.export_kv(sequence)
            sequence.release()
            return int(logits.argmax()), KVHandle.from_json(connectors.publish("shm", kv, 0).to_json())

        _, first_handle = exported(turn1)
        warm.import_kv(lambda start: connectors.pull(first_handle, start), turn1).release()
        first, handle = exported(turn2)
        starts = []

        def pull(start):
            starts.append(start)
            return connectors.pull(handle, start)

        def answer(engine, source):
            batch = DecodeBatch(engine)
            batch.join(engine.import_kv(source, turn2))
            tokens = [first]
            for _ in range(8):
                tokens.append(int(batch.step([tokens[-1]])[0].argmax()))
            batch.leave([0])
            return tokens

        partial = answer(warm, pull)
        connectors.done(handle)
        _, full_handle = exported(turn2)  # a fresh handle for the cold server's full pull
        full = answer(cold, lambda start: tokens_from(connectors.pull(full_handle), start))
        connectors.done(full_handle)
        assert starts == [96], "the 6 full blocks of turn 1 came from decode's cache"
        assert partial == full
    finally:
        connectors.close()
