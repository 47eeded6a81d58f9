"""The replay's state between steps: the clock, the tasks present, what has become of each task, the events to come.

Changes happen at step boundaries. After a step, the tasks that took their last step depart (completing
at the step's end), and so do those an evaluation after the step stopped early (:meth:`Fleet.evaluated`, its
pass's seconds on the clock first). At a window boundary of the step loop (every step on a plan without a pipelined
replica; ``arrivals.replay``), :meth:`Fleet.apply_due` applies every event with ``at <= clock``, as ``lorafleet
train`` reads its queue there: a task that arrives during a window joins at its end, a cancelled one leaves there
(its completion time is that boundary, the first at or after its ``at``; a cancel of a task that has already left
does nothing). A move's rebuild (:meth:`Fleet.wait`) belongs to the boundary it is made at: an event that lands in
it is applied at the end of the new deployment's first window, as ``lorafleet train`` reads its queue once a
boundary, when the loop reaches it (``train.changes``: one change a boundary). When no task is present the fleet
idles and the clock jumps to the next event (:meth:`Fleet.idle`); idle time is not charged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from lorafleet.arrivals.trace import Trace


@dataclass(frozen=True)
class TaskOutcome:
    """What became of one task under one strategy."""

    name: str
    arrival_s: float
    steps: int
    """Steps it asked for."""
    steps_done: int = 0
    start_s: float | None = None
    """When its first step began (None: it never ran)."""
    completion_s: float | None = None
    """When it departed: the end of its last step, or the boundary its cancel took effect at."""
    cancelled: bool = False
    stopped: bool = False
    """It stopped early: an evaluation's loss stopped improving (``eval_replay``)."""
    gpu_s: float = 0.0
    """Its GPU-seconds of the steps it took part in (``accounting.task_gpu_seconds``)."""
    eval_gpu_s: float = 0.0
    """Its GPU-seconds of its evaluations (``eval_replay``), apart from its steps'."""
    tokens: int = 0


class Fleet:
    """One strategy's replay of a trace, between its steps (module docstring)."""

    def __init__(self, trace: Trace) -> None:
        # (at, order, k, kind, name): arrivals first at equal times, then cancels, each in trace order
        self._events = deque(
            sorted(
                [(a.at_s, 0, k, "add", a.task.name) for k, a in enumerate(trace.arrivals)]
                + [(c.at_s, 1, k, "cancel", c.task) for k, c in enumerate(trace.cancels)]
            )
        )
        self.outcomes = {a.task.name: TaskOutcome(a.task.name, a.at_s, int(a.task.spec.steps)) for a in trace.arrivals}
        self.present: list[str] = []
        """The tasks taking part in the next step, in arrival order."""
        self.clock = 0.0
        """Simulated seconds since the trace began."""
        self.step = 0
        """Global steps run (the next step's number)."""
        self.step_s: list[float] = []
        """Each global step's makespan."""
        self.step_gpu_s = 0.0
        """Σ over steps of makespan x the GPUs of the plan that ran it."""
        self.eval_gpu_s = 0.0
        """Σ over evaluations of their pass's seconds x the GPUs of the plan that ran it."""

    @property
    def next_event_s(self) -> float | None:
        """When the next event not yet applied is due (None: every event has been applied)."""
        return self._events[0][0] if self._events else None

    def apply_due(self) -> bool:
        """Apply every event due by now; True when the task set changed."""
        changed = False
        while self._events and self._events[0][0] <= self.clock:
            _, _, _, kind, name = self._events.popleft()
            if kind == "add":
                self.present.append(name)
                changed = True
            elif name in self.present:  # else it has completed already: nothing to cancel
                self.present.remove(name)
                self.outcomes[name] = replace(self.outcomes[name], completion_s=self.clock, cancelled=True)
                changed = True
        return changed

    def idle(self) -> bool:
        """With no task present: the clock jumps to the next event (not charged); False when none is left."""
        if not self._events:
            return False
        self.clock = max(self.clock, self._events[0][0])
        return True

    def wait(self, seconds: float) -> None:
        """The clock waits (a migration's rebuild) before the next step; the events due meanwhile are applied at the end
        of the next window (module doc)."""
        self.clock += seconds

    def steps_left(self) -> int:
        """The most steps a present task has still to take."""
        return max(self.outcomes[n].steps - self.outcomes[n].steps_done for n in self.present)

    def first_departure(self) -> int:
        """Steps from now until the first present task has taken its last step (with no event between)."""
        return min(self.outcomes[n].steps - self.outcomes[n].steps_done for n in self.present)

    def own_step(self, name: str, step: int) -> int:
        """Task ``name``'s own step at global step ``step`` (>= the next one), the task set staying as it is."""
        return self.outcomes[name].steps_done + step - self.step

    def record(self, makespan_s: float, gpus: int, owed: Mapping[str, float], tokens: Mapping[str, int]) -> list[str]:
        """The next global step ran on ``gpus`` GPUs: the clock advances by its makespan; every present task
        has taken one more step and owes ``owed[task]`` GPU-seconds; those that took their last step depart
        (returned)."""
        start = self.clock
        self.clock += makespan_s
        self.step_s.append(makespan_s)
        self.step_gpu_s += makespan_s * gpus
        self.step += 1
        for name in list(self.present):
            o = self.outcomes[name]
            o = replace(
                o,
                steps_done=o.steps_done + 1,
                start_s=start if o.start_s is None else o.start_s,
                gpu_s=o.gpu_s + owed[name],
                tokens=o.tokens + int(tokens.get(name, 0)),
            )
            self.outcomes[name] = o
        done = [name for name in self.present if self.outcomes[name].steps_done >= self.outcomes[name].steps]
        self._depart(done)
        return done

    def evaluated(self, seconds: float, gpus: int, owed: Mapping[str, float], stopped: Collection[str]) -> None:
        """An evaluation pass ran after the step on ``gpus`` GPUs: the clock advances by its ``seconds``, each task
        evaluated owes ``owed[task]``; the present tasks it ``stopped`` depart, as tasks that took their steps do."""
        self.clock += seconds
        self.eval_gpu_s += seconds * gpus
        for name, gpu_s in owed.items():
            self.outcomes[name] = replace(self.outcomes[name], eval_gpu_s=self.outcomes[name].eval_gpu_s + gpu_s)
        left = [name for name in self.present if name in stopped]
        for name in left:
            self.outcomes[name] = replace(self.outcomes[name], stopped=True)
        self._depart(left)

    def _depart(self, names: Collection[str]) -> None:
        """The tasks ``names`` depart at this step boundary."""
        for name in names:
            self.outcomes[name] = replace(self.outcomes[name], completion_s=self.clock)
            self.present.remove(name)
