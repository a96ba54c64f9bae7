"""The outbox runs calls in order on one thread, polls watched streams, and bounds its queue."""

import threading
import time

from pdchat.triton.outbox import Outbox


def wait_for(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_calls_run_in_order_on_one_thread_other_than_the_callers():
    outbox = Outbox("test-outbox")
    seen = []
    for index in range(100):
        outbox.call(lambda index=index: seen.append((index, threading.current_thread().name)))
    outbox.close()
    assert [index for index, _ in seen] == list(range(100))
    assert {name for _, name in seen} == {"test-outbox"}


def test_a_failing_call_does_not_stop_the_ones_after_it():
    outbox = Outbox("test-outbox")
    seen = []

    def broken():
        raise RuntimeError("send failed")

    outbox.call(broken)
    outbox.call(lambda: seen.append("after"))
    outbox.close()
    assert seen == ["after"]


def test_a_watched_stream_is_cancelled_once_when_its_client_leaves_and_never_after_unwatch():
    outbox = Outbox("test-outbox", poll_s=0.01)
    left = threading.Event()
    cancelled, polled_after_unwatch = [], []
    outbox.watch("a", left.is_set, lambda: cancelled.append("a"))
    outbox.watch("b", lambda: polled_after_unwatch.append("b") or True, lambda: cancelled.append("b"))
    outbox.unwatch("b")
    time.sleep(0.05)
    assert cancelled == [], "nobody left yet"
    left.set()
    wait_for(lambda: cancelled)
    time.sleep(0.05)
    outbox.close()
    assert cancelled == ["a"] and polled_after_unwatch == []


def test_a_stream_that_cannot_be_asked_is_taken_as_gone():
    outbox = Outbox("test-outbox", poll_s=0.01)
    cancelled = threading.Event()

    def broken():
        raise RuntimeError("stub gone")

    outbox.watch("a", broken, cancelled.set)
    assert cancelled.wait(5)
    outbox.close()


def test_unwatch_from_inside_a_call_takes_effect_at_once():
    outbox = Outbox("test-outbox", poll_s=0.2)
    cancelled = []
    outbox.watch("a", lambda: True, lambda: cancelled.append("a"))
    outbox.call(lambda: outbox.unwatch("a"))  # as a stream's last send does
    time.sleep(0.5)
    outbox.close()
    assert cancelled == []


def test_a_producer_faster_than_the_outbox_waits_instead_of_piling_up():
    outbox = Outbox("test-outbox", max_pending=2)
    release = threading.Event()
    outbox.call(release.wait)  # holds the thread
    produced = []

    def produce():
        for index in range(5):
            outbox.call(lambda: None)
            produced.append(index)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(0.1)
    assert len(produced) <= 3, "the queue is bounded: the producer waits"
    release.set()
    producer.join(5)
    outbox.close()
    assert produced == list(range(5))


def test_post_never_waits_for_room_and_keeps_the_order():
    """execute() posts: blocked on a full outbox while the outbox thread sends, a decode stub
    deadlocked. Posted calls queue past max_pending, in order with the calls around them."""
    outbox = Outbox("test-outbox", max_pending=1)
    release, ran = threading.Event(), []
    outbox.call(release.wait)  # holds the thread
    outbox.call(lambda: ran.append("called"))  # the queue is full now
    for index in range(3):
        outbox.post(lambda index=index: ran.append(index))  # returns at once
    release.set()
    outbox.close()
    assert ran == ["called", 0, 1, 2]
