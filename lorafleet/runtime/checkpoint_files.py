"""What a committed checkpoint is on disk, and which one a resume may trust; torch-free, so the launcher
verifies checkpoints before it starts a process (``checkpoint.py`` reads and writes their tensors).

A step directory ``step-NNNNNN/`` is committed once it has been renamed into place; its
``manifest.json`` records the SHA-256 of every other file in it. :func:`resumable_checkpoint`
takes the newest directory whose manifest reads and whose files all match (``latest.json`` is
a pointer for people and tools, not trusted), naming every newer one it passed over.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError
from lorafleet.runtime.base_quantization import recorded_base
from lorafleet.specs.data import DataSpec
from lorafleet.specs.io import file_sha256, staged_directory
from lorafleet.specs.workload import TaskSpec

FORMAT_VERSION = 2
"""2 adds ``files``: the SHA-256 of every file of the step directory, verified on resume."""
CHECKPOINT_EVERY = 50
"""A training run's default checkpoint cadence in steps (``lorafleet train --checkpoint-every``); a checkpoint ends a
window, so the arrivals replay cuts its windows there too."""
MANIFEST = "manifest.json"
LATEST = "latest.json"


def step_dir_name(step: int) -> str:
    """The name of the step directory of the checkpoint taken after ``step`` steps: ``step-NNNNNN``."""
    return f"step-{step:06d}"


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` is not an intact committed checkpoint (None when it is): its manifest does
    not read, is of another format, names another step than its directory's name (the manifest is not
    among the files it checksums, so this is its own check: a resume would start from the wrong step and
    fail later on a data cursor or a task's optimizer steps), or a file is missing or differs from its
    recorded SHA-256."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION:
            return f"format {manifest.get('format')!r}, expected {FORMAT_VERSION}"
        step = manifest["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step_dir_name(step) != step_dir.name:
            return f"its manifest says step {step!r}, its directory's name {step_dir.name}"
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest ({type(err).__name__})"
    for name, digest in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run resumes from, and the newer ones that were passed over."""

    step_dir: Path
    step: int
    broken: tuple[str, ...] = ()
    """One line per newer checkpoint that is not intact (``step-000006: adapter_model... checksum``)."""


def resumable_checkpoint(directory: str | Path) -> Resumable | None:
    """The newest intact checkpoint of ``directory`` (module docstring); None when there is no checkpoint.

    Raises:
        InputError: there are checkpoints but none is intact.
    """
    root = Path(directory)
    broken = []
    for step_dir in sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: p.name, reverse=True):
        problem = checkpoint_problem(step_dir)
        if problem is None:
            step = int(json.loads((step_dir / MANIFEST).read_text())["step"])
            return Resumable(step_dir=step_dir, step=step, broken=tuple(broken))
        broken.append(f"{step_dir.name}: {problem}")
    if broken:
        raise InputError(str(root), "", f"no intact checkpoint to resume from ({'; '.join(broken)})")
    return None


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """The manifest of a (verified) step directory."""
    return json.loads((Path(step_dir) / MANIFEST).read_text())


STOPPED_TASKS = "stopped_tasks"
"""The key of a manifest's ``extra`` (the training loop's state) under which it records the tasks stopped for
non-finite updates: task name -> the first step it took no batch in (``lorafleet.train.health``)."""


def stopped_tasks(extra: Mapping[str, Any]) -> dict[str, int]:
    """A checkpoint's stopped tasks (from its manifest's ``extra``): what its data cursors were drawn with."""
    return {str(name): int(step) for name, step in extra.get(STOPPED_TASKS, {}).items()}


FLEET_CHANGED_AT = "fleet_changed_at"
"""The key of a manifest's ``extra`` under which it records the step of the last change of the running fleet applied
before it was taken (``lorafleet.train.changes``): a checkpoint of step ``S`` taken before the change at ``S`` and
one taken after it are told apart by it."""


def newest_committed_change(directory: str | Path) -> int | None:
    """:func:`fleet_changed_at` of the newest committed checkpoint of ``directory`` (the one this process wrote last:
    a step directory has its name once renamed into place, whole; its files are not hashed again here)."""
    committed = [p for p in Path(directory).glob("step-*") if (p / MANIFEST).is_file()]
    return fleet_changed_at(max(committed, key=lambda p: p.name)) if committed else None


def fleet_changed_at(step_dir: str | Path) -> int | None:
    """The last change of the fleet a checkpoint was taken after (:data:`FLEET_CHANGED_AT`; None: none, or a
    checkpoint taken before the key was recorded)."""
    value = read_manifest(step_dir).get("extra", {}).get(FLEET_CHANGED_AT)
    return None if value is None else int(value)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""A PEFT adapter's files (peft's ``CONFIG_NAME`` and ``SAFETENSORS_WEIGHTS_NAME``), as a checkpoint holds them."""


CARD = "README.md"
"""An exported adapter's model card (:func:`model_card`)."""


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """``tokenizer.save_pretrained`` into ``directory``, unless it holds one already (a resumed run's is the
    same: ``--overwrite`` removes it with the run's other files); written whole (``specs.io.staged_directory``)."""
    if (directory / "tokenizer_config.json").is_file():
        return
    with staged_directory(directory) as staging:
        tokenizer.save_pretrained(str(staging))


BEST_DIR = "best"
"""A task's best-evaluated adapter, inside its directory of a checkpoint (``executor.torch.checkpoint``)."""
EVALUATION_KEY = "evaluation"
"""A checkpoint's ``extra`` key of the tasks' evaluations (``train.evaluation.Evaluations.state_dict``)."""
LAST_DIR = "last"
"""An exported task's last adapter, beside its best one at the top of its directory."""


def export_adapters(
    step_dir: Path,
    names: Sequence[str],
    target: Path,
    *,
    tasks: Sequence[TaskSpec] = (),
    tokenizer: Path | None = None,
    losses: Mapping[str, tuple[int, float]] | None = None,
    changes: Mapping[str, Sequence[str]] | None = None,
    base_weights: str | None = None,
) -> None:
    """Tasks' PEFT adapters, copied out of a committed checkpoint into ``target/<task>`` (a sweep's member into
    ``target/<sweep>/members/<task>``: ``TaskSpec.export_dir``); each task's
    directory appears whole (written beside it, then renamed over the old one: ``specs.io.staged_directory``). A task
    that was evaluated gets its best-evaluated adapter there and its last one in ``target/<task>/last/``.

    With ``tokenizer`` (the run's tokenizer directory, ``rundir.RunDir.tokenizer``), each directory is one a
    tenant can use anywhere: the tokenizer's files (when it was saved there) and a model card ``README.md``
    (:func:`model_card`: the task's spec from ``tasks``, its steps from the checkpoint's manifest, its last
    loss from ``losses``, task -> (step, loss): the caller reads them out of the run's metrics,
    ``lorafleet.metrics.last_losses``, which this package does not import; ``changes``, task -> the
    hyperparameters a resume changed, described: ``lorafleet.train.revisions``; and ``base_weights``, what the
    base's weights were when not the named base's own: ``data.model_source.base_weights_note``)."""
    target.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(step_dir) if tokenizer is not None else {}
    losses = losses or {}
    specs = {t.name: t for t in tasks}
    for name in names:
        with staged_directory(target / (specs[name].export_dir if name in specs else name)) as staging:
            best = step_dir / name / BEST_DIR
            if best.is_dir():  # evaluated: the best adapter is the tenant's, the last one beside it
                (staging / LAST_DIR).mkdir()
                for file in ADAPTER_FILES:
                    shutil.copy2(best / file, staging / file)
                    shutil.copy2(step_dir / name / file, staging / LAST_DIR / file)
            else:
                for file in ADAPTER_FILES:
                    shutil.copy2(step_dir / name / file, staging / file)
            if tokenizer is not None:
                if tokenizer.is_dir():
                    for file in sorted(tokenizer.iterdir()):
                        if file.is_file() and file.name not in ADAPTER_FILES:
                            shutil.copy2(file, staging / file.name)
                config = json.loads((step_dir / name / ADAPTER_FILES[0]).read_text())
                (staging / CARD).write_text(
                    model_card(
                        name,
                        config,
                        specs.get(name),
                        manifest,
                        losses.get(name),
                        (changes or {}).get(name, ()),
                        base_weights,
                    ),
                    encoding="utf-8",
                )


def evaluation_lines(evaluated: Mapping[str, Any] | None, step: int | None) -> list[str]:
    """The model card's lines on a task's evaluations (``train.evaluation.TaskEvaluations.to_json``; none when it
    was not evaluated): its best evaluation, which this adapter is, its last adapter's (``last/``) and an early
    stop. ``step``: the checkpoint's, where the last adapter is from."""
    if not evaluated or not evaluated.get("history"):
        return []
    stopping, history = evaluated["stopping"], evaluated["history"]
    if stopping["best_step"] is None:
        lines = [f"- {len(history)} evaluations on held-out rows, none finite: this is the last adapter"]
    else:
        lines = [
            f"- Best evaluation (this adapter): eval loss {stopping['best_loss']:.4f} at step "
            f"{stopping['best_step']}, of {len(history)} evaluations on held-out rows"
        ]
    last_step, last_loss, last_accuracy = history[-1]
    when = "" if last_step == step else f" (at step {last_step}; it trained on to step {step})"
    lines.append(f"- Last adapter (`{LAST_DIR}/`): eval loss {last_loss:.4f}, token accuracy {last_accuracy:.3f}{when}")
    if evaluated.get("stopped_at") is not None:
        stop = evaluated["stopped_at"]
        lines.append(f"- Stopped early at step {stop}: {stopping['bad']} evaluations without a new best")
    return lines


def _data_facts(data: DataSpec) -> tuple[int, str] | None:
    """Rows of a task's data (any container, its split: ``data.readers``) and its format (``auto`` resolved as
    training resolved it: by the first row, after the column map); None when it cannot be read now."""
    from lorafleet.data.formats import map_columns, resolve_format
    from lorafleet.data.readers import read_container

    try:
        rows = read_container(data.path, data.split).rows
        if not rows:
            return 0, data.format.value
        first = map_columns(rows[0], data.columns, (data.path, "row 1"))
        return len(rows), resolve_format(first, data.format, (data.path, "row 1")).value
    except InputError:
        return None


def seen_words(examples: int, cursor: int) -> str:
    """What a task's adapter saw of its ``examples`` training rows after drawing ``cursor`` samples (every epoch a
    new order of all of them: ``data_stream.TaskStream``): ``48 to train on, 20 seen (0.42 epochs)``."""
    seen = min(cursor, examples)
    return f"{examples} to train on, {seen} seen ({cursor / examples:.3g} epochs)" if examples else "none to train on"


def adapter_line(config: Mapping[str, Any]) -> str:
    """The card's line for the adapter PEFT's ``config`` (adapter_config.json) describes: a VeRA adapter's rank,
    ``d_initial``, projection key and dropout (it has no alpha); a LoRA's rank, alpha, dropout, rsLoRA and DoRA."""
    targets = ", ".join(sorted(config.get("target_modules") or ()))
    if config.get("peft_type") == "VERA":
        return (
            f"- VeRA: rank {config.get('r')}, d_initial {config.get('d_initial')}, projection key "
            f"{config.get('projection_prng_key')}, dropout {config.get('vera_dropout')}; targets {targets}"
        )
    return (
        f"- LoRA: rank {config.get('r')}, alpha {config.get('lora_alpha')}, dropout {config.get('lora_dropout')}"
        f"{', rsLoRA' if config.get('use_rslora') else ''}{', DoRA' if config.get('use_dora') else ''}"
        f"; targets {targets}"
    )


def model_card(
    name: str,
    config: Mapping[str, Any],
    task: TaskSpec | None,
    manifest: Mapping[str, Any],
    loss: tuple[int, float] | None,
    changes: Sequence[str] = (),
    base_weights: str | None = None,
) -> str:
    """An exported adapter's ``README.md``: YAML front matter for the Hub (``base_model``, ``library_name``,
    ``tags``), then what the adapter was trained on and how: the weights it was trained over when they are not
    the named base's own (``base_weights``: ``data.model_source.base_weights_note``), the quantized base it was
    trained over (the manifest's: ``base_quantization``, also in the usage block's loading), the task, its data (the
    file's name and no directory, which an upload would publish; its rows, and from the checkpoint's data record
    the examples it had to train on and those it saw; its format, ``auto`` resolved), its steps (optimizer updates,
    from the manifest), batch size and learning rate (as in force at the end: ``changes`` lists what a resume
    changed, with its step), its last loss, its LoRA, and the lorafleet version. ``config`` is the adapter's
    ``adapter_config.json``; ``manifest`` the checkpoint's."""
    import yaml

    from lorafleet import __version__

    base = config.get("base_model_name_or_path") or ""
    front = yaml.safe_dump({"base_model": base, "library_name": "peft", "tags": ["lora", "lorafleet"]}, sort_keys=False)
    lines = [f"# {name}", "", f"A LoRA adapter for `{base}`, trained by lorafleet {__version__}.", ""]
    if base_weights is not None:
        lines.append(f"- Base weights: {base_weights}")
    quantized = recorded_base(manifest)
    if quantized is not None:
        lines.append(quantized.card_line())
    if task is not None and task.data is not None:
        data = manifest.get("data", {})
        names = list(data.get("tasks", ()))
        facts = _data_facts(task.data)
        counts = [f"{facts[0]} rows"] if facts is not None else []
        if name in names and len(data.get("cursors", ())) == len(names):  # the rows the adapter saw, not only had
            counts.append(seen_words(data["examples"][names.index(name)], data["cursors"][names.index(name)]))
        where = f" ({'; '.join(counts)})" if counts else ""
        split = f" (split {task.data.split})" if task.data.split is not None else ""
        fmt = task.data.format.value
        if facts is not None and fmt == "auto":
            fmt = f"{facts[1]} (auto)"
        # The file's name only: its directory is the training machine's, which a card uploaded to a hub publishes.
        lines.append(f"- Data: `{Path(task.data.path).name}`{split}{where}, format {fmt}")
        lines.append(f"- Context length: {task.context_length} tokens (longer sequences: {task.overflow.value})")
    steps = {t.get("name"): t.get("optimizer_steps") for t in manifest.get("tasks", ())}
    if steps.get(name) is not None:
        total = f" (of the run's first {manifest['step']})" if "step" in manifest else ""
        lines.append(f"- Steps trained: {steps[name]}{total}")
    if task is not None:
        plus = f" (LoRA+: B at {task.lora.lr_ratio:g} x that)" if task.lora.lr_ratio is not None else ""
        lines.append(f"- Batch size: {task.batch_size} sequences a step; learning rate {task.optimizer.lr:g}{plus}")
    lines += [f"- Changed on resume: {change}" for change in changes]
    if loss is not None:
        lines.append(f"- Final loss: {loss[1]:.4f} (step {loss[0]})")
    lines += evaluation_lines(manifest.get("extra", {}).get(EVALUATION_KEY, {}).get(name), manifest.get("step"))
    lines.append(adapter_line(config))
    imports, config = quantized.load_lines() if quantized is not None else ([], "")
    kwargs = ", quantization_config=quantization" if quantized is not None else ""
    lines += [
        "",
        "## Use",
        "",
        "```python",
        *imports,
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import AutoTokenizer",
        "",
        *([config] if config else []),
        f'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/directory"{kwargs})',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
        "```",
        "",
    ]
    return f"---\n{front}---\n\n" + "\n".join(lines)
