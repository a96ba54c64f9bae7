"""Ad-hoc: a decode step's time with KV events off and on (docs/kv-cache.md#kv-events).

In process, on the tiny model: 16 rows of 256-token prompts step 64 times (each row keys
4 blocks on the way), first with no event sink, then with a publisher on a local tcp port
and a subscriber reading it; the rounds alternate, and the median step of each setting is
printed. Run: .venv/bin/python scripts/kv_events_step_timing.py
"""

from __future__ import annotations

import statistics
import threading
import time

import zmq

from pdchat import embedded, registry
from pdchat.core.generation.engine import CausalLM, DecodeBatch
from pdchat.core.kv_events import BlockEvents, KVEventPublisher
from pdchat.core.settings import MIB, KVPoolOptions
from pdchat.launcher import free_port

ROWS, PROMPT, STEPS, ROUNDS = 16, 256, 64, 3


def round_of_steps(engine: CausalLM, salt: str) -> list[float]:
    batch = DecodeBatch(engine)
    for row in range(ROWS):
        prompt = [(row * 7919 + i) % 1000 + 1 for i in range(PROMPT)]
        batch.join(engine.prefill(prompt, cache_salt=salt)[1])
    times, tokens = [], [1] * ROWS
    for _ in range(STEPS):
        start = time.perf_counter()
        logits = batch.step(tokens)
        times.append(time.perf_counter() - start)
        tokens = [int(t) for t in logits.argmax(-1)]
    batch.leave(list(range(ROWS)))
    return times


def main() -> None:
    engine = CausalLM(embedded.ensure_model(registry.TINY), "cpu", pool=KVPoolOptions(256 * MIB, 16, True))
    port = free_port()
    sink = BlockEvents()
    publisher = KVEventPublisher(sink, endpoint=f"tcp://*:{port}", block_size=16, topic="kv-events")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    received = [0]
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if sub.poll(50):
                sub.recv_multipart()
                received[0] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    off, on = [], []
    round_of_steps(engine, "warm-up")
    for index in range(ROUNDS):
        engine.pool.events = None
        off += round_of_steps(engine, f"off-{index}")
        engine.pool.events = sink
        on += round_of_steps(engine, f"on-{index}")
    engine.pool.events = None
    time.sleep(0.2)
    publisher.close()
    stop.set()
    reader.join()
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    print(f"{ROWS} rows, {PROMPT}-token prompts, {STEPS} steps x {ROUNDS} rounds per setting")
    print(f"median step: events off {off_ms:.2f} ms, on {on_ms:.2f} ms ({on_ms / off_ms:.3f}x)")
    p90_off, p90_on = (statistics.quantiles(times, n=10)[-1] * 1e3 for times in (off, on))
    print(f"p90 step: off {p90_off:.2f} ms, on {p90_on:.2f} ms")
    stats = publisher.stats()
    print(f"published {stats.published} messages, received {received[0]}, dropped {stats.dropped_events} events")
    context.destroy(linger=0)


if __name__ == "__main__":
    main()
