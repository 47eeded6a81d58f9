"""The documented config (issue #17): ``lorafleet schema``, docs/workload.md and its example, errors that
name the expected keys, and ``--set KEY=VALUE`` overrides on every command that reads a workload."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lorafleet.cli import build_parser, main
from lorafleet.commands.schema import workload_json_schema
from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.specs.cluster import ClusterSpec, PoolSpec
from lorafleet.specs.evaluation import EarlyStoppingSpec, EvalSpec
from lorafleet.specs.lora import LoraSpec, OptimizerSpec
from lorafleet.specs.workload import DataSpec, LengthSpec, TaskSpec, WorkloadSpec
from lorafleet.workload import apply_overrides, load_workload
from tests.helpers.repo import EXAMPLES, REPO

DOC = REPO / "docs" / "workload.md"
SHIPPED = sorted(EXAMPLES.glob("*.yaml")) + [
    EXAMPLES / "demo" / "workload.yaml",
    EXAMPLES / "arrivals" / "workload.yaml",
]
WORKLOAD_COMMANDS = ("validate", "plan", "simulate", "whatif", "dispatch", "train")


def write(tmp_path, data, name="w.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- lorafleet schema -------------------------------------------------------------------------------


def schema_from_cli(capsys) -> dict:
    assert main(["schema"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("{\n  ")  # indented
    return json.loads(out)


def test_schema_is_the_models_and_has_the_workload_keys(capsys):
    schema = schema_from_cli(capsys)
    assert schema == workload_json_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    assert {"tasks", "model", "cluster", "defaults", "recompute", "seed"} <= set(schema["properties"])
    assert schema["required"] == ["tasks"]
    task = schema["$defs"]["TaskSpec"]
    assert {"name", "batch_size", "context_length", "data", "lengths", "lora", "optimizer"} <= set(task["properties"])
    assert task["required"] == ["name"]  # batch_size/context_length may come from a preset or the defaults
    assert set(schema["$defs"]["DataSpec"]["properties"]) == set(DataSpec.model_fields)
    assert set(schema["$defs"]["LoraSpec"]["properties"]) == set(LoraSpec.model_fields)


def test_schema_validates_the_shipped_examples_and_rejects_a_wrong_shape(capsys):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(schema_from_cli(capsys))
    for path in SHIPPED:
        validator.validate(yaml.safe_load(path.read_text()))
    bad = {"tasks": [{"name": "a", "data": "x.jsonl", "batch_size": 1, "context_length": 8}]}
    assert not validator.is_valid(bad)
    assert not validator.is_valid({"tasks": [{"name": "a", "preset": "dolly", "lora": {"rank": 0}}]})
    assert not validator.is_valid({"defaults": {"lora": {"rnk": 8}}, "tasks": [{"name": "a", "preset": "dolly"}]})


def test_schema_output_file(tmp_path, capsys):
    target = tmp_path / "out" / "workload.schema.json"
    assert main(["schema", "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == workload_json_schema()


# --- docs/workload.md -------------------------------------------------------------------------------


def doc_example() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## A complete example", 1)[1]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "the complete example is the section's one yaml block"
    return blocks[0]


def test_doc_example_validates(tmp_path, capsys):
    raw = yaml.safe_load(doc_example())
    for task in raw["tasks"]:  # the example is written as if in the repository root
        if "data" in task:
            data = REPO / task["data"]["path"]
            assert data.is_file(), data
            task["data"]["path"] = str(data)
    path = write(tmp_path, raw)
    assert main(["validate", str(path)]) == 0
    workload = load_workload(path)
    assert [t.name for t in workload.tasks] == ["dolly", "chat", "docsum", "moddoc"]
    chat = workload.task("chat").spec
    assert (chat.lora.rank, chat.lora.alpha, chat.lora.dropout) == (8, 32, 0.05)  # defaults merged
    assert workload.task("dolly").batch_size == 64


def test_doc_example_matches_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(workload_json_schema()).validate(yaml.safe_load(doc_example()))


@pytest.mark.parametrize(
    "model",
    [WorkloadSpec, ClusterSpec, PoolSpec, TaskSpec, DataSpec, LoraSpec, OptimizerSpec, EvalSpec, EarlyStoppingSpec],
    ids=lambda m: m.__name__,
)
def test_doc_tabulates_every_field(model):
    text = DOC.read_text(encoding="utf-8")
    prefix = {EvalSpec: "eval.", EarlyStoppingSpec: "early_stopping."}.get(model, "")
    missing = [name for name in model.model_fields if f"| `{prefix}{name}` |" not in text]
    assert not missing, f"docs/workload.md has no table row for {model.__name__}: {missing}"


def test_doc_names_every_length_mode_key():
    text = DOC.read_text(encoding="utf-8")
    assert all(f"`{name}" in text for name in LengthSpec.model_fields)


# --- wrong shapes name the expected keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "raw", "expected"),
    [
        (
            "tasks[0].data",
            {"tasks": [{"name": "a", "data": "x.jsonl", "batch_size": 2, "context_length": 64}]},
            ["path (required)", "format", "got a string 'x.jsonl'"],
        ),
        (
            "tasks[0].lora",
            {"tasks": [{"name": "a", "preset": "dolly", "lora": 8}]},
            ["rank", "alpha", "dropout", "target_modules", "use_rslora", "got an integer 8"],
        ),
        ("cluster", {"cluster": 8, "tasks": [{"name": "a", "preset": "dolly"}]}, ["gpu", "nodes", "gpus_per_node"]),
        ("tasks[0].lengths.dataset", {"tasks": [{"name": "a", "lengths": {"dataset": "x"}}]}, ["path (required)"]),
    ],
)
def test_wrong_shape_names_the_keys(tmp_path, field, raw, expected):
    with pytest.raises(InputError) as info:
        load_workload(write(tmp_path, raw))
    err = info.value
    assert err.field == field
    assert "valid dictionary" not in err.msg and err.msg.startswith("takes a mapping with keys:")
    for part in expected:
        assert part in err.msg


def test_a_list_field_given_a_mapping(tmp_path):
    with pytest.raises(InputError, match=r"tasks: takes a list, got a mapping"):
        load_workload(write(tmp_path, {"tasks": {"name": "a"}}))


# --- apply_overrides ---------------------------------------------------------------------------------

RAW = {
    "cluster": {"gpu": "A100-40GB", "nodes": 2},
    "defaults": {"lora": {"rank": 16}},
    "tasks": [
        {"name": "dolly", "preset": "dolly"},
        {"name": "chat", "lengths": {"histogram": {10: 1, 20: 2}}, "batch_size": 4, "context_length": 64},
    ],
}


def test_override_paths():
    out = apply_overrides(
        RAW,
        [
            "cluster.nodes=1",
            "tasks.dolly.lora.rank=32",  # by name; creates the missing lora mapping
            "tasks.1.batch_size=8",  # by index
            "defaults.lora.rank=8",
            "defaults.optimizer.schedule=cosine",  # a new mapping under defaults
            "tasks.chat.lengths.histogram.20=5",  # a YAML integer key
            "seed=3",
        ],
    )
    assert out["cluster"] == {"gpu": "A100-40GB", "nodes": 1}
    assert out["tasks"][0]["lora"] == {"rank": 32}
    assert out["tasks"][1]["batch_size"] == 8
    assert out["defaults"] == {"lora": {"rank": 8}, "optimizer": {"schedule": "cosine"}}
    assert out["tasks"][1]["lengths"]["histogram"] == {10: 1, 20: 5}
    assert out["seed"] == 3
    assert RAW["cluster"]["nodes"] == 2 and "lora" not in RAW["tasks"][0]  # the input is not changed


@pytest.mark.parametrize(
    ("item", "value"),
    [
        ("seed=32", 32),
        ("recompute=true", True),
        ("tasks.0.lengths.values=[1, 2]", [1, 2]),
        ("tasks.0.optimizer.schedule=cosine", "cosine"),
        ("tasks.0.optimizer.lr=2.0e-4", 2.0e-4),
        ("tasks.0.lora={rank: 8, alpha: 16}", {"rank": 8, "alpha": 16}),
        ("tasks.0.steps=", None),
        ("model=a=b", "a=b"),  # only the first '=' splits
    ],
)
def test_override_values_are_yaml(item, value):
    out = apply_overrides(RAW, [item])
    key = item.partition("=")[0].split(".")
    node = out
    for part in key[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert node[key[-1]] == value


def test_later_overrides_win_and_a_name_before_an_index():
    raw = {"tasks": [{"name": "1", "batch_size": 1}, {"name": "x", "batch_size": 1}]}
    out = apply_overrides(raw, ["tasks.1.batch_size=5", "tasks.x.batch_size=6", "tasks.x.batch_size=7"])
    assert [t["batch_size"] for t in out["tasks"]] == [5, 7]


@pytest.mark.parametrize(
    ("item", "field", "message"),
    [
        (
            "tasks.nope.lora.rank=3",
            "--set tasks.nope.lora.rank",
            "no task named 'nope' in tasks; name one of dolly, chat",
        ),
        ("tasks.5.batch_size=3", "--set tasks.5.batch_size", "index 0..1 only"),
        ("cluster.gpu.kind=x", "--set cluster.gpu.kind", "cluster.gpu is a string 'A100-40GB', not a mapping"),
        ("tasks.0.preset.x=1", "--set tasks.0.preset.x", "tasks.0.preset is a string"),
        ("nokey", "--set", "expected KEY=VALUE"),
        ("=3", "--set", "expected KEY=VALUE"),
        ("tasks..rank=3", "--set tasks..rank", "none empty"),
        ("seed=[1", "--set seed", "is not YAML"),
    ],
)
def test_override_errors(item, field, message):
    with pytest.raises(InputError) as info:
        apply_overrides(RAW, [item])
    assert (info.value.path, info.value.field) == ("<args>", field)
    assert message in info.value.msg
    assert "\n" not in str(info.value)


# --- load_workload(path, overrides) and the errors they cause -------------------------------------------


def test_load_workload_without_overrides_is_unchanged():
    path = EXAMPLES / "lobra-7b.yaml"
    assert load_workload(path).spec == load_workload(path, None).spec == load_workload(path, ()).spec


def test_load_workload_applies_overrides():
    workload = load_workload(
        EXAMPLES / "lobra-7b.yaml",
        ["cluster.nodes=1", "tasks.dolly.lora.rank=32", "tasks.1.batch_size=8", "defaults.optimizer.lr=3e-4"],
    )
    assert workload.cluster.n_gpus == 8
    assert workload.task("dolly").spec.lora.rank == 32 and workload.task("xsum").spec.lora.rank == 16
    assert workload.task("evol-instruct").batch_size == 8
    assert {t.spec.optimizer.lr for t in workload.tasks} == {3e-4}
    assert workload.task("dolly").spec.optimizer.weight_decay == 0.01  # the file's defaults stay merged


def test_demo_data_paths_stay_relative_to_the_file():
    workload = load_workload(EXAMPLES / "demo" / "workload.yaml", ["tasks.chat.batch_size=3"])
    assert workload.task("chat").batch_size == 3
    assert workload.task("chat").spec.data.path == str(EXAMPLES / "demo" / "chat.jsonl")


@pytest.mark.parametrize(
    ("sets", "path", "field", "message"),
    [
        (["tasks.0.batch_size=0"], "<args>", "--set tasks.0.batch_size", "Input should be greater than 0"),
        (["tasks.dolly.lora.rank=-1"], "<args>", "--set tasks.dolly.lora.rank", "greater than 0"),
        (["tasks.dolly.lora={rank: 0}"], "<args>", "--set tasks.dolly.lora.rank", "greater than 0"),
        (["defaults.lora.rank=0"], "<args>", "--set defaults.lora.rank", "greater than 0"),
        (["tasks.1.name=dolly"], "<args>", "--set tasks.1.name", "appears twice"),
        (["cluster=8"], "<args>", "--set cluster", "takes a mapping with keys: gpu, nodes, gpus_per_node"),
        (["model=no-such-model"], "<args>", "--set model", "unknown model 'no-such-model'"),
        (["tasks.0.lengths={mean: 5}"], "<args>", "--set tasks.0.lengths", "need all of mean, skewness and kurtosis"),
        # issue #39's bad eval and early_stopping keys
        (["defaults.eval.split=0.6"], "<args>", "--set defaults.eval.split", "less than or equal to 0.5"),
        (["tasks.dolly.eval={split: 0}"], "<args>", "--set tasks.dolly.eval.split", "greater than 0"),
        (["defaults.eval.every_steps=0"], "<args>", "--set defaults.eval.every_steps", "greater than or equal to 1"),
        (
            ["defaults.eval.split=0.05", "defaults.early_stopping.patience=0"],
            "<args>",
            "--set defaults.early_stopping.patience",
            "greater than or equal to 1",
        ),
        (
            ["defaults.eval.split=0.05", "tasks.dolly.early_stopping.min_delta=-1"],
            "<args>",
            "--set tasks.dolly.early_stopping.min_delta",
            "greater than or equal to 0",
        ),
        (
            ["tasks.dolly.early_stopping={patience: 2}"],
            "<args>",
            "--set tasks.dolly.early_stopping",
            "early stopping needs an eval",
        ),
        (
            ["tasks.0.steps=5", "tasks.0.deadline=3"],
            "FILE",
            "tasks[0]",
            "(with --set tasks.0.steps=5, --set tasks.0.deadline=3)",
        ),
    ],
)
def test_override_errors_name_the_override(sets, path, field, message):
    file = EXAMPLES / "lobra-7b.yaml"
    with pytest.raises(InputError) as info:
        load_workload(file, sets)
    err = info.value
    assert (err.path, err.field) == ((str(file) if path == "FILE" else path), field)
    assert message in err.msg


def test_a_files_own_error_stays_the_files(tmp_path):
    path = write(
        tmp_path, {"tasks": [{"name": "a", "preset": "dolly", "batch_size": 0}, {"name": "b", "preset": "xsum"}]}
    )
    with pytest.raises(InputError) as info:
        load_workload(path, ["tasks.b.lora.rank=8"])
    assert (info.value.path, info.value.field) == (str(path), "tasks[0].batch_size")
    assert load_workload(path, ["tasks.a.batch_size=4"]).task("a").batch_size == 4  # an override may fix it
    with pytest.raises(InputError) as info:  # a task's own key is not the defaults' to blame
        load_workload(
            write(tmp_path, {"tasks": [{"name": "a", "preset": "dolly", "lora": {"rank": 0}}]}),
            ["defaults.lora.rank=8"],
        )
    assert (info.value.path, info.value.field) == (str(tmp_path / "w.yaml"), "tasks[0].lora.rank")


# --- the commands ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", WORKLOAD_COMMANDS)
def test_every_workload_command_takes_set(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    assert "--set" in {o for a in sub._actions for o in a.option_strings}


def test_validate_with_a_bad_set_exits_2_with_one_line(capsys):
    rc = main(["validate", str(EXAMPLES / "lobra-7b.yaml"), "--set", "tasks.0.batch_size=0"])
    assert rc == 2
    assert (
        one_error_line(capsys) == "lorafleet: error: <args>: --set tasks.0.batch_size: Input should be greater than 0"
    )


def test_validate_with_an_unknown_task_exits_2_with_one_line(capsys):
    assert main(["validate", str(EXAMPLES / "lobra-7b.yaml"), "--set", "tasks.nope.batch_size=4"]) == 2
    assert "no task named 'nope'" in one_error_line(capsys)


def test_validate_with_set_summarises_the_override(capsys):
    assert main(["validate", str(EXAMPLES / "lobra-7b.yaml"), "--set", "cluster.gpus_per_node=4"]) == 0
    out, _ = capsys.readouterr()
    assert "8 x A100-40GB" in out


def test_plan_with_set_changes_the_gpu_count(tmp_path, capsys):
    from lorafleet.plans import DeploymentPlan

    workload = str(EXAMPLES / "lobra-7b.yaml")
    gpus = {}
    for name, sets in (("file", []), ("one-node", ["--set", "cluster.nodes=1"])):
        target = tmp_path / f"{name}.json"
        assert main(["plan", workload, "--samples", "0", "--json", str(target), *sets]) == 0
        gpus[name] = DeploymentPlan.load(target).n_gpus
    capsys.readouterr()
    assert gpus == {"file": 16, "one-node": 8}


# --- train: the overrides travel to the workers ------------------------------------------------------------


def test_train_options_carry_sets_through_the_run_file(tmp_path, capsys):
    """The launcher resolves ``--set`` (and the policy flags) once; its workers read the run file it writes."""
    from lorafleet.commands.train import options_of
    from lorafleet.train.preflight import prepare
    from lorafleet.train.run_file import ResolvedRun

    demo, plan = str(EXAMPLES / "demo" / "workload.yaml"), tmp_path / "plan.json"
    assert main(["plan", demo, "--gpus", "1", "--gpu", "cpu", "--samples", "0", "--json", str(plan)]) == 0
    capsys.readouterr()
    argv = ["train", demo, "--plan", str(plan), "--gpus", "1", "--gpu", "cpu", "--out", str(tmp_path / "run")]
    argv += ["--set", "tasks.chat.lora.rank=8", "--set=defaults.optimizer.lr=1e-3", "--buckets", "4", "--steps", "10"]
    options = options_of(build_parser().parse_args(argv))
    assert options.sets == ("tasks.chat.lora.rank=8", "defaults.optimizer.lr=1e-3")
    resolved = ResolvedRun.of(options, prepare(options))
    path = resolved.save(RunDir(tmp_path))
    assert ResolvedRun.load(path) == resolved
    worker = ResolvedRun.load(path).prepared()
    assert worker.workload.task("chat").spec.lora.rank == 8
    assert {t.spec.optimizer.lr for t in worker.workload.tasks} == {1e-3}
    assert worker.run.plan.policy.options.n_buckets == 4 and worker.run.overrides == ()
    import jsonschema

    from lorafleet.commands.schema import SCHEMAS

    jsonschema.Draft202012Validator(SCHEMAS["run"]()).validate(json.loads(path.read_text()))
    jsonschema.Draft202012Validator(SCHEMAS["policy"]()).validate(worker.run.plan.policy.to_json())
    with pytest.raises(InputError, match="run.json: options.steps: must be a whole number"):
        path.write_text(path.read_text().replace('"steps": 10', '"steps": "10"'))
        ResolvedRun.load(path)


def test_the_launchers_checks_and_run_file_are_torch_free(tmp_path):
    """Everything the launcher does before its workers start (checks, the lock, the run file) imports no torch
    (ARCHITECTURE: torch only on a rank; an import-linter contract holds the import graph to it)."""
    import subprocess
    import sys

    demo, plan, out = EXAMPLES / "demo" / "workload.yaml", tmp_path / "plan.json", tmp_path / "run"
    assert main(["plan", str(demo), "--gpus", "1", "--gpu", "cpu", "--samples", "0", "--json", str(plan)]) == 0
    code = (
        "import sys\n"
        "from lorafleet.train.options import TrainOptions\n"
        "from lorafleet.train.preflight import claim, prepare\n"
        "from lorafleet.train.run_file import ResolvedRun\n"
        f"o = TrainOptions(workload={str(demo)!r}, plan={str(plan)!r}, out={str(out)!r}, gpus=1, gpu='cpu')\n"
        "p = prepare(o); claim(o, p).release(); ResolvedRun.of(o, p).save(o.run_dir)\n"
        "print(sorted({'torch', 'triton', 'peft'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]" and (out / "run.json").is_file()


def test_training_workload_applies_sets():
    from lorafleet.train.resume import load_training_workload

    path = str(EXAMPLES / "demo" / "workload.yaml")
    workload = load_training_workload(path, None, ("tasks.chat.lora.rank=4", "defaults.optimizer.lr=1e-3"))
    assert workload.task("chat").spec.lora.rank == 4
    assert {t.spec.optimizer.lr for t in workload.tasks} == {1e-3}
    assert load_training_workload(path).task("chat").spec.lora.rank == 8
