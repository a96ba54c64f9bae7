"""decode's published load (pdchat.ensemble.decode_load) and what chat reads from it."""

import os

from pdchat.ensemble.decode_load import DecodeLoad, LoadSlot


def test_a_server_whose_decode_publishes_nothing_never_reads_idle(tmp_path):
    assert DecodeLoad(tmp_path).held() is None and not DecodeLoad(tmp_path).idle()
    assert DecodeLoad(tmp_path / "absent").held() is None


def test_the_counts_of_every_instance_add_up_and_idle_is_all_zero(tmp_path):
    load = DecodeLoad(tmp_path)
    first, second = LoadSlot(tmp_path, "decode_0_0", 1024), LoadSlot(tmp_path, "decode_0_1", 1024)
    assert load.held() == 0 and load.idle(), "a new slot publishes 0"
    first.set(3)
    assert load.held() == 3 and not load.idle()
    second.set(2)
    first.set(0)
    assert load.held() == 2
    second.set(0)
    assert load.idle()
    first.close()
    assert load.held() == 0 and not (tmp_path / "decode-load.decode_0_0").exists()
    second.close()
    assert load.held() is None


def test_a_slot_rewrites_its_count_only_when_it_changes(tmp_path):
    slot = LoadSlot(tmp_path, "decode_0_0", 1024)
    slot.set(4)
    fd = os.open(slot.path, os.O_WRONLY)  # another count in the file, as set(4) would overwrite it
    os.pwrite(fd, (7).to_bytes(8, "little"), 0)
    os.close(fd)
    slot.set(4)
    assert DecodeLoad(tmp_path).held() == 7, "set() of the published count wrote again"
    slot.set(5)
    assert DecodeLoad(tmp_path).held() == 5
    slot.close()


def test_decode_has_room_while_no_instance_queues_for_room_and_every_pool_holds_the_request(tmp_path):
    load = DecodeLoad(tmp_path)
    assert load.has_room(10**6), "nothing published: nothing known against it"
    first, second = LoadSlot(tmp_path, "decode_0_0", 1024), LoadSlot(tmp_path, "decode_0_1", 512)
    first.set(4)
    assert load.has_room(512), "sequences held, none queued: room left"
    assert not load.has_room(513), "larger than one instance's pool"
    second.set(5, 1)
    assert not load.has_room(1) and load.held() == 9
    second.set(4, 0)
    assert load.has_room(1)
    first.close()
    second.close()


def test_other_files_of_the_server_directory_are_not_read(tmp_path):
    (tmp_path / "nonces").mkdir()
    (tmp_path / "key").write_bytes(os.urandom(32))
    slot = LoadSlot(tmp_path, "decode_0_0", 1024)
    slot.set(1)
    assert DecodeLoad(tmp_path).held() == 1
    slot.close()
