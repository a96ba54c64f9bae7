"""A prompt's pass takes more torch threads while the host's other cores sit idle, the same
logits whatever it takes; and the prefill scheduler asks before every pass."""

import threading

import pytest
import torch

from pdchat.core.generation.engine import CausalLM, PromptPrefill
from pdchat.core.generation.pass_threads import IdleCores, PassThreads, cpu_times
from pdchat.core.generation.prefill_scheduler import PrefillScheduler, PrefillTask

STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 {idle0} 0 0 0 0 0 0
cpu1 50 0 50 {idle1} 10 0 0 5 7 0
intr 12345
"""


def stat(idle0: int, idle1: int) -> str:
    return STAT.format(idle0=idle0, idle1=idle1)


def test_cpu_times_sum_the_cores_asked_for():
    # idle + iowait; the total counts steal, not guest (inside user already)
    assert cpu_times(stat(400, 300), [1]) == (310, 50 + 50 + 300 + 10 + 5)
    assert cpu_times(stat(400, 300), [0, 1]) == (710, 500 + 415)
    assert cpu_times(stat(400, 300), [7]) == (0, 0)


class Stat:
    """/proc/stat's text, each read the next of `texts`."""

    def __init__(self, *texts: str):
        self.texts = list(texts)

    def __call__(self) -> str:
        return self.texts.pop(0)


def test_idle_cores_are_the_share_of_idle_ticks_since_the_last_look():
    busier = STAT.replace("cpu0 50 0 50", "cpu0 250 0 50").format(idle0=500, idle1=400)
    idle = IdleCores([0, 1], Stat(stat(400, 300), stat(500, 400), busier), own=lambda: 0)
    assert idle.since_last() == 0.0  # nothing before the first look
    assert idle.since_last() == pytest.approx(2.0)  # 100 + 100 ticks passed, all idle
    assert idle.since_last() == pytest.approx(0.0)  # 200 passed, cpu0 busy throughout


def test_a_core_this_process_ran_on_beyond_its_base_counts_as_free():
    """A burst's pass on both cores left none idle: the next pass must not fall back to
    `base` for it (every other pass of a burst ran on half the cores)."""

    def busy(user: int) -> str:  # both cores busy `user` ticks, none idle since the first look
        return STAT.replace("cpu0 50 0 50", f"cpu0 {user} 0 50").replace("cpu1 50 0 50", f"cpu1 {user} 0 50")

    own = iter([0, 200, 300])  # 200 ticks: both cores ours; then 100: one ours, one another process's
    texts = Stat(stat(400, 300), busy(150).format(idle0=400, idle1=300), busy(250).format(idle0=400, idle1=300))
    idle = IdleCores([0, 1], texts, own=own.__next__, own_base=1)
    idle.since_last()
    assert idle.since_last() == pytest.approx(1.0), "both cores ours: the one beyond base is free"
    assert idle.since_last() == pytest.approx(0.0), "our base core ours, the other busy"


def test_no_proc_stat_means_nothing_idle():
    def missing() -> str:
        raise FileNotFoundError("/proc/stat")

    assert IdleCores([0, 1], missing).since_last() == 0.0


class Idle:
    def __init__(self, *cores: float):
        self.cores = list(cores)

    def since_last(self) -> float:
        return self.cores.pop(0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def threads_for(*idle_cores: float, base: int = 1, most: int = 4) -> tuple[list[int], list[int]]:
    """The threads each pass took, and the calls that set them, a pass every second."""
    clock, calls = Clock(), []
    threads = PassThreads(base, most, Idle(*idle_cores), calls.append, clock=clock)
    taken = []
    for _ in idle_cores:
        taken.append(threads.before_pass())
        clock.now += 1.0
    return taken, calls


def test_a_pass_takes_a_thread_per_idle_core_up_to_most():
    taken, calls = threads_for(0.0, 0.7, 0.55, 2.6, 9.0, 0.1)
    assert taken == [1, 2, 1, 4, 4, 1]  # six tenths of a core idle count as one
    assert calls == [2, 1, 4, 1]  # set only when it changes


def test_most_at_base_never_looks():
    taken, calls = threads_for(3.0, base=2, most=1)
    assert taken == [2] and calls == []


def test_passes_close_together_keep_the_first_ones_threads():
    clock, calls = Clock(), []
    threads = PassThreads(1, 2, Idle(1.0, 0.0), calls.append, clock=clock)
    assert threads.before_pass() == 2
    clock.now += 0.005  # the next chunk of a long prompt
    assert threads.before_pass() == 2
    clock.now += 1.0
    assert threads.before_pass() == 1


def test_the_scheduler_asks_before_every_pass():
    asked, done = [], threading.Event()

    class TwoChunks:
        steps = 0
        next_pass_tokens = 512
        passes_left = 2

        def step(self):
            self.steps += 1
            return "kv" if self.steps == 2 else None

        def abandon(self):
            pass

    scheduler = PrefillScheduler(before_pass=lambda tokens: asked.append(tokens))
    scheduler.submit(PrefillTask(start=TwoChunks, done=lambda _: done.set(), fail=lambda exc: None))
    assert done.wait(5)
    scheduler.close()
    assert asked == [512, 512]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """A stage's engine as prefill makes it: one torch thread, so the C kernels when this host builds them."""
    before = torch.get_num_threads()
    try:
        return CausalLM(tiny_model_dir, "cpu", threads=1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tokens", [17, 300])
def test_the_logits_do_not_change_with_the_threads(engine, tokens):
    prompt = [(5 + 7 * i) % engine.vocab_size for i in range(tokens)]
    before = torch.get_num_threads()
    logits = []
    try:
        for index, threads in enumerate((1, 2)):
            engine.set_threads(threads)  # torch's and the kernels' (which split rows past 16)
            prefill = PromptPrefill(engine, prompt, cache_salt=f"threads-{index}", chunk=512)
            logits.append(prefill.step()[0].clone())
            prefill.release()
    finally:
        engine.set_threads(1)
        torch.set_num_threads(before)
    assert torch.equal(logits[0], logits[1])
