"""A sweep's winner promoted (``specs.sweep``): ``adapters/<sweep>/`` becomes the winning member's best adapter.

Each member is exported to ``adapters/<sweep>/members/<member>/`` like any task (``TaskSpec.export_dir``). At
the run's end, the winner's files (its best adapter, ``last/``, the tokenizer) are copied to the top of
``adapters/<sweep>/``, each file replaced whole; its model card becomes the sweep's (the winner's own card, named
for the sweep, with the winning values and the members' table: ``lorafleet.sweep_report``), and ``sweep.json``
beside it holds the sweep's results. ``keep_members: false`` then removes ``members/``. Promoting again (a resumed
run that ends again) writes the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lorafleet.rundir import RunDir
from lorafleet.runtime.checkpoint_files import CARD, LAST_DIR
from lorafleet.specs.io import staged_directory, write_text_atomic
from lorafleet.specs.sweep import MEMBERS_DIR, value_label
from lorafleet.specs.workload import TaskSpec
from lorafleet.sweep_report import SweepResult, save_results, sweep_results
from lorafleet.train.queue.ledger import Ledger

SWEEP_FILE = "sweep.json"
"""The sweep's results, beside its winner's adapter."""


def run_tasks(run_dir: RunDir) -> tuple[TaskSpec, ...]:
    """Every task the run in ``run_dir`` has had: its ledger's (departed ones included), else its resolved
    workload's; none when it has neither."""
    from lorafleet.specs.workload import WorkloadSpec
    from lorafleet.workload import read_yaml

    ledger = Ledger.load(run_dir.root)
    if ledger is not None:
        return tuple(e.spec for e in ledger.entries)
    if not run_dir.resolved_workload.is_file():
        return ()
    return WorkloadSpec.model_validate(read_yaml(run_dir.resolved_workload)).tasks


def promote_sweeps(run_dir: RunDir) -> list[SweepResult]:
    """Every sweep of the run in ``run_dir`` with its winner promoted (:func:`promote_winner`); its results."""
    results = sweep_results(run_dir, run_tasks(run_dir))
    for result in results:
        promote_winner(run_dir.adapters, result)
    return results


def promote_winner(adapters: Path, result: SweepResult) -> bool:
    """The module doc, for one sweep; False (nothing written) when it has no winner or the winner's export is gone
    (promoted already, its members removed)."""
    top = adapters / result.name
    source = top / MEMBERS_DIR / (result.winner or "")
    if result.winner is None or not source.is_dir():
        return False
    for file in sorted(source.iterdir()):
        if file.is_file() and file.name != CARD:
            staged = top / f".{file.name}.partial"
            shutil.copy2(file, staged)
            staged.replace(top / file.name)
    if (source / LAST_DIR).is_dir():
        with staged_directory(top / LAST_DIR) as staging:
            for file in sorted((source / LAST_DIR).iterdir()):
                shutil.copy2(file, staging / file.name)
    own = (source / CARD).read_text(encoding="utf-8") if (source / CARD).is_file() else ""
    write_text_atomic(top / CARD, sweep_card(own, result))
    save_results(top / SWEEP_FILE, [result])
    if not result.keep_members:
        shutil.rmtree(top / MEMBERS_DIR)
    return True


def sweep_card(own: str, result: SweepResult) -> str:
    """The winner's model card ``own`` made the sweep's: titled by the sweep, naming the winning values, with the
    members' table appended."""
    assert result.winner is not None
    values = ", ".join(f"`{k}` = {value_label(v)}" for k, v in result.member(result.winner).values)
    head = f"# {result.name}"
    lines = own.splitlines()
    title = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
    intro = [head, "", f"The winner of the sweep `{result.name}`: member `{result.winner}`, with {values}."]
    body = lines[:title] + intro + lines[title + 1 :] if title is not None else [*intro, *lines]
    members = "kept under `members/`" if result.keep_members else "not kept (`keep_members: false`)"
    body += ["", "## The sweep", "", f"{len(result.members)} members, their adapters {members}.", "",
             result.markdown(), ""]  # fmt: skip
    return "\n".join(body)
