"""Tasks arriving and departing: replay a trace under three re-planning strategies and compare their GPU-seconds.

``lorafleet simulate WORKLOAD --arrivals TRACE`` (docs/arrivals.md). One concern a module:

- the trace file's format and checks: :mod:`lorafleet.specs.trace`; the trace resolved against its
  workload (:class:`Trace`, :func:`load_trace`): :mod:`.trace`;
- the strategies, one object each behind one interface (:class:`Strategy`, :class:`Change`,
  ``Replanner.on_change``): :mod:`.strategies`;
- the replay's state between steps (the clock, the tasks present, :class:`TaskOutcome`): :mod:`.fleet`;
- the plan source each step is planned by: :mod:`.source`;
- the replay on the one step loop, ``lorafleet.loop.run_loop`` (:func:`replay_trace`,
  :class:`ArrivalOptions`, :class:`StrategyRun`, :class:`ArrivalsResult`), an event applied at a window boundary
  and a change decided by the rules ``lorafleet train`` follows (``planner.decision``): :mod:`.replay`.

Pure numpy and lorafleet's types: no torch.
"""

from __future__ import annotations

from lorafleet.arrivals.fleet import TaskOutcome
from lorafleet.arrivals.replay import ArrivalOptions, ArrivalsResult, StrategyRun, replay_trace
from lorafleet.arrivals.strategies import Change, Strategy
from lorafleet.arrivals.trace import Arrival, Trace, load_trace
from lorafleet.specs.trace import Cancel

__all__ = [
    "Arrival",
    "ArrivalOptions",
    "ArrivalsResult",
    "Cancel",
    "Change",
    "Strategy",
    "StrategyRun",
    "TaskOutcome",
    "Trace",
    "load_trace",
    "replay_trace",
]
