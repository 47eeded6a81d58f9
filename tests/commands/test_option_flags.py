"""Flags from field tables (``specs.fields``, ``commands._option_flags``): ``train``'s flags are
``TrainOptions``' fields, the re-plan's four flags of ``train`` and ``simulate --arrivals`` are one table's
(``specs.replan.ReplanSettings``), and a bad value is refused once, naming its flag."""

from __future__ import annotations

import math

import pytest

from lorafleet.cli import build_parser, main
from lorafleet.commands._option_flags import REPLAN_DEST, help_of
from lorafleet.commands.train import options_of
from lorafleet.errors import InputError
from lorafleet.specs.device import Device, Precision
from lorafleet.specs.fields import setting_fields
from lorafleet.specs.replan import ReplanObjective, ReplanSettings
from lorafleet.specs.typed import adapter, validate_strict
from lorafleet.train.options import TrainOptions


def _actions(command: str) -> dict[str, object]:
    """The flags of ``command`` by their argparse destination."""
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    return {a.dest: a for a in sub._actions}


def test_train_and_simulate_take_the_replan_flags_of_one_table():
    """Same names, kinds, defaults and help (``simulate``'s says it is for ``--arrivals``), each the field's."""
    train, simulate = _actions("train"), _actions("simulate")
    fields = setting_fields(ReplanSettings)
    flags = ["--migration-s", "--replan-objective", "--replan-horizon", "--replan-after", "--replan-samples"]
    assert [f.flag for f in fields] == flags
    assert any(f.name == "replan" and f.type is ReplanSettings for f in setting_fields(TrainOptions))
    for f in fields:
        ours, theirs = train[REPLAN_DEST + f.name], simulate[REPLAN_DEST + f.name]
        assert ours.option_strings == theirs.option_strings == [f.flag]
        assert ours.default == theirs.default == f.default == getattr(ReplanSettings(), f.name)
        assert (ours.type, ours.metavar, ours.choices) == (theirs.type, theirs.metavar, theirs.choices)
        assert ours.help == help_of(f) and theirs.help == "--arrivals: " + help_of(f)
        assert f.doc and (f.default is None or f"(default {getattr(f.default, 'value', f.default)})" in ours.help)
    assert train[REPLAN_DEST + "objective"].choices == ("makespan", "gpu-s")


def test_every_train_flag_is_a_field_and_the_defaults_are_the_fields(monkeypatch):
    """Each flag of ``train`` but the shared and the policy's is a field of TrainOptions, its help the field's doc
    string; a command line giving only the required flags parses into TrainOptions' defaults."""
    actions = _actions("train")
    for f in setting_fields(TrainOptions):
        if f.flag is None or f.table:
            continue
        action = actions[f.name]
        assert f.flag in action.option_strings or action.dest == f.flag
        if not f.shared:
            assert action.help == help_of(f).replace("%", "%%") and f.doc in action.help
    args = build_parser().parse_args(["train", "w.yaml", "--plan", "p.json"])
    assert options_of(args) == TrainOptions(workload="w.yaml", plan="p.json")
    given = build_parser().parse_args(
        ["train", "w.yaml", "--plan", "p.json", "--no-progress", "--no-stop-checkpoint", "--logger", "wandb",
         "--logger", "wandb", "--queue-data-root", "a", "--queue-data-root", "b", "--inject-slowdown", "1=2.5",
         "--device", "cpu", "--dtype", "bf16", "--replan-objective", "gpu-s", "--replan-after", "0",
         "--migration-s", "3", "--set", "seed=3"]
    )  # fmt: skip
    monkeypatch.setattr("lorafleet.train.options.find_spec", lambda name: object())  # wandb installed or not
    options = options_of(given)
    assert (options.progress, options.checkpoint_on_stop, options.loggers) == (False, False, ("wandb",))
    assert options.queue_data_roots == ("a", "b") and options.slowdown == ((1, 2.5),) and options.sets == ("seed=3",)
    assert options.device is Device.CPU and options.dtype is Precision.BF16
    assert options.replan == ReplanSettings(objective=ReplanObjective.GPU_S, after=0, migration_s=3.0)


@pytest.mark.parametrize(
    ("argv", "flag", "message"),
    [
        (["--replan-horizon", "0"], "--replan-horizon", "must be >= 1, got 0"),
        (["--replan-after", "-1"], "--replan-after", "must be >= 0, got -1"),
        (["--migration-s", "-1"], "--migration-s", "must be a finite number >= 0, got -1.0"),
        (["--migration-s", "nan"], "--migration-s", "must be a finite number >= 0, got nan"),
    ],
)
@pytest.mark.parametrize("command", ["train", "simulate"])
def test_a_bad_replan_value_names_its_flag_once(tmp_path, capsys, command, argv, flag, message):
    """Refused before any file is read, one line, exit 2, the flag named once (in train as in simulate)."""
    extra = ["--plan", "p.json"] if command == "train" else ["--arrivals", str(tmp_path / "trace.yaml")]
    assert main([command, str(tmp_path / "w.yaml"), *extra, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"<args>: {flag}: {message}" in err and err.count(flag) == 1, err


@pytest.mark.parametrize(
    ("argv", "flag", "message"),
    [
        (["--steps", "0"], "--steps", "must be >= 1, got 0"),
        (["--checkpoint-every", "0"], "--checkpoint-every", "must be >= 1, got 0"),
        (["--max-restarts", "-1"], "--max-restarts", "must be >= 0, got -1"),
        (["--nonfinite-patience", "0"], "--nonfinite-patience", "must be >= 1, got 0"),
        (["--inject-slowdown", "1=0.5"], "--inject-slowdown", "the factor must be a finite number >= 1"),
    ],
)
def test_a_bad_train_value_names_its_flag_once(tmp_path, capsys, argv, flag, message):
    assert main(["train", str(tmp_path / "w.yaml"), "--plan", "p.json", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"<args>: {flag}: {message}" in err and err.count(flag) == 1, err


def test_the_settings_check_their_values_once_as_they_are_built():
    """Strings become the enums; a bad value is an InputError naming its flag (Python callers get the same)."""
    assert ReplanSettings(objective="gpu-s").objective is ReplanObjective.GPU_S
    options = TrainOptions(workload="w", plan="p", device="cuda", dtype="bf16")
    assert options.device is Device.CUDA and options.dtype is Precision.BF16
    for build, where, words in (
        (lambda: ReplanSettings(objective="fast"), "--replan-objective", "expected makespan or gpu-s, got 'fast'"),
        (lambda: ReplanSettings(migration_s=math.inf), "--migration-s", "must be a finite number >= 0, got inf"),
        (lambda: ReplanSettings(horizon=0), "--replan-horizon", "must be >= 1, got 0"),
        (lambda: ReplanSettings(samples=-1), "--replan-samples", "must be >= 0, got -1"),
        (lambda: TrainOptions(workload="w", plan="p", device="tpu"), "--device", "expected auto, cpu or cuda"),
        (lambda: TrainOptions(workload="w", plan="p", dtype="fp16"), "--dtype", "expected fp32 or bf16, got 'fp16'"),
    ):
        with pytest.raises(InputError) as caught:
            build()
        assert (caught.value.path, caught.value.field) == ("<args>", where) and words in caught.value.msg


def test_the_run_file_holds_the_options_as_plain_json():
    """TrainOptions through its pydantic adapter (the run file's ``options``): the enums as their names, the
    re-plan's settings as an object, read back strictly to the same options; an unknown key is refused."""
    options = TrainOptions(
        workload="w", plan="p", device="cpu", dtype="bf16", replan=ReplanSettings(objective="gpu-s", migration_s=2)
    )
    data = adapter(TrainOptions).dump_python(options, mode="json")
    assert (data["device"], data["dtype"]) == ("cpu", "bf16")
    assert data["replan"] == {"migration_s": 2, "objective": "gpu-s", "horizon": 200, "after": 1, "samples": 0}
    assert validate_strict(TrainOptions, data, "run.json", "options") == options
    with pytest.raises(InputError, match="options.replan.horizon_steps: unknown field"):
        validate_strict(TrainOptions, {**data, "replan": {"horizon_steps": 3}}, "run.json", "options")
    with pytest.raises(InputError, match="run.json: options.device"):
        validate_strict(TrainOptions, {**data, "device": "tpu"}, "run.json", "options")


def test_the_planner_re_exports_the_objective_and_holds_the_settings():
    from lorafleet.planner import ReplanObjective as Exported
    from lorafleet.planner import ReplanOptions

    assert Exported is ReplanObjective
    replan = ReplanOptions(ReplanSettings(migration_s=5.0))
    assert replan.pricing.seconds == 5.0 and ReplanOptions().pricing == ReplanOptions().migration
