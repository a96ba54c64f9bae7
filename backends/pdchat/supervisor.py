"""Keep the processes of a pdchat stack running: restart one that died, after a backoff,
within a restart budget; past the budget, give up (the caller stops the stack).

No Triton or subprocess here: a supervised process is a `Child` (the launcher's
tritonservers and router implement it), and time is a clock the caller may replace, so
the policy is tested without a server.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after `first_delay_s`, doubling up to `max_delay_s` with each restart in the
    last `window_s`; at most `max_restarts` restarts in any `window_s` per process."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 600.0
    # A restarted process not ready by then has failed again. Generous: a tritonserver that
    # restarts while its peer serves the load on the same cores loads its models at a
    # fraction of their idle speed (200 s and more for tiny's six stubs on 2 busy cores, 35 s
    # idle), and a restart given up is started again from nothing.
    start_timeout_s: float = 600.0
    progress_interval_s: float = 30.0  # how often a restart still starting is logged, with its progress

    def describe(self) -> str:
        return f"at most {self.max_restarts} in {self.window_s:g} s"


class RestartBudget:
    """The restarts of one process, against a policy."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.total = 0  # restarts granted, ever
        self._recent: deque[float] = deque()  # when each restart of the last window was granted

    def grant(self, now: float) -> float | None:
        """After a failure at `now`: the delay before the next restart (counted from now
        on), or None when the budget of the last window is spent."""
        while self._recent and self._recent[0] <= now - self.policy.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.max_delay_s, self.policy.first_delay_s * 2 ** len(self._recent))
        self._recent.append(now)
        self.total += 1
        return delay

    @property
    def recent(self) -> int:
        """Restarts granted in the last window, as of the last grant."""
        return len(self._recent)


class Child(Protocol):
    """A process the supervisor keeps running."""

    @property
    def name(self) -> str: ...

    def exited(self) -> bool:
        """Whether the process has exited (False before it was first started)."""

    def exit_report(self) -> str:
        """How it exited, with the end of its log."""

    def reap(self) -> None:
        """Kill what is left of it (a process that never got ready, its children) and
        clean up what it left (shared memory)."""

    def spawn(self) -> None:
        """Start it again as before (the same ports), without waiting for it."""

    def is_ready(self) -> bool:
        """One readiness probe."""

    def progress(self) -> str:
        """How far a start got, for the log (e.g. which models loaded); "" when it cannot tell."""


class Supervisor:
    """Watches `children`; restarts one that died (or that failed to get ready after a
    restart) once its backoff has passed, reaping what it left at once. With
    `restart=False`, or once a child's budget is spent, `poll` reports the failure
    instead and the caller stops the stack.

    NOTE: `poll` never blocks on a child coming up, so a second failure, or `stop`, is
    seen within one interval whatever else is restarting."""

    def __init__(
        self,
        children: Sequence[Child],
        policy: RestartPolicy = RestartPolicy(),
        *,
        restart: bool = True,
        say: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.children = list(children)
        self.policy = policy
        self.restart = restart
        self.budgets = {child.name: RestartBudget(policy) for child in self.children}
        self._say = say
        self._clock = clock
        self._down_until: dict[str, float] = {}  # waiting out a backoff, by name
        self._starting_until: dict[str, float] = {}  # restarted, not yet ready, by name
        self._report_at: dict[str, float] = {}  # when a start still under way is logged next, by name

    def restarts(self) -> dict[str, int]:
        """Restarts so far, by child."""
        return {name: budget.total for name, budget in self.budgets.items()}

    def run(self, stop: threading.Event, interval_s: float = 0.5) -> bool:
        """Poll every `interval_s` until `stop` is set (True) or a child could not be kept
        running (False)."""
        while not stop.wait(interval_s):
            if not self.poll():
                return False
        return True

    def poll(self) -> bool:
        """One look at every child; False once one failed for good."""
        now = self._clock()
        for child in self.children:
            name = child.name
            if name in self._down_until:
                if now >= self._down_until[name]:
                    del self._down_until[name]
                    self._starting_until[name] = now + self.policy.start_timeout_s
                    self._report_at[name] = now + self.policy.progress_interval_s
                    try:
                        child.spawn()
                    except OSError as exc:
                        del self._starting_until[name]
                        if not self._failed(child, f"{name} could not be started: {exc}", now):
                            return False
            elif name in self._starting_until:
                if child.exited():
                    del self._starting_until[name]
                    if not self._failed(child, child.exit_report(), now):
                        return False
                elif child.is_ready():
                    took = now - (self._starting_until.pop(name) - self.policy.start_timeout_s)
                    self._say(
                        f"{name} is back (restart {self.budgets[name].total}, ready {took:.0f} s after its start)"
                    )
                elif now >= self._starting_until[name]:
                    del self._starting_until[name]
                    why = f"{name} was not ready {self.policy.start_timeout_s:g} s after its restart"
                    if progress := child.progress():
                        why += f" ({progress})"
                    if not self._failed(child, why, now):
                        return False
                elif now >= self._report_at[name]:
                    self._report_at[name] = now + self.policy.progress_interval_s
                    self._say(self._still_starting(child, now))
            elif child.exited() and not self._failed(child, child.exit_report(), now):
                return False
        return True

    def _still_starting(self, child: Child, now: float) -> str:
        """'prefill is not ready yet, 30 s into restart 1 (up to 600 s): <its progress>'."""
        started = self._starting_until[child.name] - self.policy.start_timeout_s
        line = (
            f"{child.name} is not ready yet, {now - started:.0f} s into restart {self.budgets[child.name].total} "
            f"(up to {self.policy.start_timeout_s:g} s)"
        )
        progress = child.progress()
        return f"{line}: {progress}" if progress else line

    def _failed(self, child: Child, report: str, now: float) -> bool:
        """Report a failure; reap the child and schedule its restart if allowed (True)."""
        self._say(report)
        if not self.restart:
            return False
        budget = self.budgets[child.name]
        delay = budget.grant(now)
        if delay is None:
            self._say(f"{child.name} failed again after {budget.recent} restarts ({self.policy.describe()}): giving up")
            return False
        child.reap()
        self._down_until[child.name] = now + delay
        self._say(
            f"restarting {child.name} in {delay:g} s: restart {budget.total} "
            f"({budget.recent} in the last {self.policy.window_s:g} s, {self.policy.describe()})"
        )
        return True
