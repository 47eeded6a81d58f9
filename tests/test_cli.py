"""The broken-file property: >= 500 generated broken workloads each end in exactly one line
naming the file (and the field, where one is wrong), exit code 2, no traceback."""

from __future__ import annotations

import copy
import itertools

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorafleet.cli import main

VALID = {
    "model": "llama2-7b",
    "cluster": {"gpu": "A100-40GB", "nodes": 2, "gpus_per_node": 8},
    "tasks": [
        {"name": "chat", "preset": "dolly"},
        {
            "name": "sum",
            "lengths": {"mean": 900, "skewness": 1.0, "kurtosis": 1.5},
            "batch_size": 32,
            "context_length": 4096,
            "lora": {"rank": 8, "alpha": 16, "dropout": 0.05},
            "optimizer": {"lr": 2e-4},
        },
    ],
}

NOT_INT = st.one_of(
    st.text(alphabet="abcxyz", min_size=1, max_size=5), st.just([1, 2]), st.just({"a": 1}), st.just(2.5)
)
NOT_NUMBER = st.one_of(st.text(alphabet="abcxyz", min_size=1, max_size=5), st.just([1, 2]), st.just({"a": 1}))
NEGATIVE = st.integers(max_value=0)
BAD_NAME = st.text(alphabet=" /\\:*?é", min_size=1, max_size=6)
UNKNOWN = st.text(alphabet="qwzkj", min_size=3, max_size=8)


# (field path to expect in the message, mutation of a deep copy of VALID)
def _set(path, value):
    def apply(d):
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return d

    return apply


def _delete(path):
    def apply(d):
        target = d
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return d

    return apply


def field_mutations():
    t = st.sampled_from([0, 1])
    return st.one_of(
        st.tuples(st.just("tasks"), st.just(_delete(["tasks"]))),
        st.tuples(st.just("tasks"), st.just(_set(["tasks"], []))),
        st.builds(lambda v: ("tasks[1].batch_size", _set(["tasks", 1, "batch_size"], v)), st.one_of(NOT_INT, NEGATIVE)),
        st.builds(lambda i, v: (f"tasks[{i}].context_length", _set(["tasks", i, "context_length"], v)), t, NEGATIVE),
        st.builds(lambda v: ("tasks[0].preset", _set(["tasks", 0, "preset"], v)), UNKNOWN),
        st.builds(
            lambda i, v: (f"tasks[{i}].lora.rank", _set(["tasks", i, "lora"], {"rank": v})),
            t,
            st.one_of(NOT_INT, NEGATIVE),
        ),
        st.builds(
            lambda v: ("tasks[1].lora.dropout", _set(["tasks", 1, "lora", "dropout"], v)),
            st.one_of(st.floats(min_value=1.0, max_value=1e6), st.floats(max_value=-1e-3, min_value=-1e6)),
        ),
        st.builds(
            lambda v: ("tasks[1].lora.target_modules", _set(["tasks", 1, "lora", "target_modules"], [v])), UNKNOWN
        ),
        st.builds(lambda i, v: (f"tasks[{i}].name", _set(["tasks", i, "name"], v)), t, BAD_NAME),
        st.builds(lambda v: ("model", _set(["model"], v)), UNKNOWN),
        st.builds(lambda v: ("cluster.gpu", _set(["cluster", "gpu"], v)), UNKNOWN),
        st.builds(lambda v: ("cluster.nodes", _set(["cluster", "nodes"], v)), st.one_of(NOT_INT, NEGATIVE)),
        st.builds(lambda v: ("recompute", _set(["recompute"], v)), st.one_of(UNKNOWN, st.just(3), st.just([1]))),
        st.builds(lambda k: (k, _set([k], 1)), UNKNOWN),
        st.builds(lambda i, k: (f"tasks[{i}].{k}", _set(["tasks", i, k], 1)), t, UNKNOWN),
        st.builds(
            lambda v: ("tasks[1].optimizer.lr", _set(["tasks", 1, "optimizer", "lr"], v)),
            st.one_of(NEGATIVE, NOT_NUMBER),
        ),
        st.builds(lambda v: ("tasks[1].overflow", _set(["tasks", 1, "overflow"], v)), UNKNOWN),
        st.builds(
            lambda k: ("tasks[1].lengths", _delete(["tasks", 1, "lengths", k])),
            st.sampled_from(["skewness", "kurtosis"]),
        ),
        st.just(("tasks[1].lengths", _set(["tasks", 1, "lengths", "values"], [1, 2]))),
        st.builds(
            lambda v: ("tasks[1].lengths", _set(["tasks", 1, "lengths"], {"histogram": {100: v}})),
            st.integers(max_value=-1),
        ),
        st.builds(
            lambda v: ("tasks[1].lengths", _set(["tasks", 1, "lengths"], {"values": v})),
            st.lists(st.integers(max_value=0), min_size=1, max_size=3),
        ),
        st.builds(lambda v: ("tasks[1]", _set(["tasks", 1], v)), st.one_of(st.text(max_size=5), st.integers())),
        st.just(("tasks[1].name", _set(["tasks", 1, "name"], "chat"))),
        st.just(("tasks[1]", _delete(["tasks", 1, "lengths"]))),
        st.just(("tasks[0].batch_size", _set(["tasks", 0], {"name": "x", "lengths": {"values": [5]}}))),
    )


MALFORMED = st.one_of(
    st.builds(lambda s: "tasks: [\n  - " + s, st.text(alphabet="abc: ", max_size=10)),
    st.builds(lambda s: "tasks:\n\t- name: " + s, st.text(alphabet="abc", max_size=5)),
    st.builds(lambda s: "a: b: c " + s, st.text(alphabet="xyz", max_size=5)),
    st.builds(lambda s: "tasks: {" + s, st.text(alphabet="abc,", max_size=8)),
    st.builds(lambda s: "- " + s, st.text(alphabet="abc", max_size=5)),  # a list, not a mapping
    st.builds(str, st.integers()),  # a scalar
    st.just(""),  # empty file
    st.just("key: 'unterminated"),
)

_counter = itertools.count()


def _check(capsys, path, rc, expected_field=None):
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lorafleet: error: {path}"), err
    assert "Traceback" not in err and out == ""
    if expected_field is not None:
        assert f": {expected_field}" in lines[0], (expected_field, lines[0])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=field_mutations())
def test_broken_fields(tmp_path, capsys, mutation):
    field, apply = mutation
    path = tmp_path / f"w{next(_counter)}.yaml"
    path.write_text(yaml.safe_dump(apply(copy.deepcopy(VALID))))
    _check(capsys, path, main(["validate", str(path)]), field)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MALFORMED)
def test_malformed_yaml(tmp_path, capsys, text):
    path = tmp_path / f"m{next(_counter)}.yaml"
    path.write_text(text)
    _check(capsys, path, main(["validate", str(path)]))


def test_valid_file_passes(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(VALID))
    assert main(["validate", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "chat" in out and "total" in out


@pytest.mark.parametrize("argv", [["validate", "/nonexistent.yaml"], ["validate", "/"]])
def test_missing_or_directory(capsys, argv):
    _check(capsys, argv[1], main(argv))


def _one_line(capsys, words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused(tmp_path, capsys, value):
    data = copy.deepcopy(VALID)
    data["tasks"][1]["lora"]["alpha"] = "ALPHA"
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data).replace("ALPHA", value))
    assert main(["validate", str(path)]) == 2
    _one_line(capsys, "tasks[1].lora.alpha: Input should be a finite number")


def test_a_symlink_loop_is_one_line(tmp_path, capsys):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(tmp_path / "loop.yaml")
    assert main(["validate", str(loop)]) == 2
    _one_line(capsys, "loop.yaml: cannot read")


@pytest.mark.parametrize(
    "command,flag", [("plan", "--json"), ("plan", "--plot"), ("simulate", "--report"), ("whatif", "--out")]
)
def test_an_unwritable_output_is_refused_before_the_work(tmp_path, capsys, command, flag):
    from tests.helpers.repo import EXAMPLES

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = blocker if flag in ("--report", "--out") else blocker / "out.json"
    argv = [command, str(EXAMPLES / "lobra-7b.yaml"), flag, str(target)]
    if command == "whatif":
        argv += ["--vary", "gpus=16"]
    assert main(argv) == 2
    _one_line(capsys, str(blocker))
    assert blocker.read_text() == "x"


def test_joint_minlp_without_pyscipopt_is_one_line(monkeypatch, capsys):
    import importlib.util

    from tests.helpers.repo import EXAMPLES

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyscipopt" else real(name, *a))
    assert main(["plan", str(EXAMPLES / "lobra-7b.yaml"), "--mode", "joint-minlp"]) == 2
    _one_line(capsys, "--mode: joint-minlp solves LobRA's MINLP with SCIP, which needs PySCIPOpt")


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--noise", "nan"], "--noise: must be a finite number"),
        (["--straggler", "0=inf"], "--straggler: must be a finite number"),
        (["--straggler", "9=2"], "--straggler/--fail: replica 9 does not exist"),
        (["--fail", "1:7"], "--straggler/--fail: replica 7 does not exist"),
    ],
)
def test_simulate_refuses_non_finite_and_unknown_replicas(capsys, argv, words):
    from tests.helpers.repo import EXAMPLES

    assert main(["simulate", str(EXAMPLES / "lobra-7b.yaml"), "--steps", "1", *argv]) == 2
    _one_line(capsys, words)


@pytest.mark.parametrize("extra", [[], ["--gpus", "16"]])
def test_an_unknown_gpu_flag_names_the_choices_not_a_help_url(tmp_path, capsys, extra):
    """``--gpu B200`` gets the message the same typo gets in a workload file (issue #17)."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(VALID))
    assert main(["plan", str(path), "--gpu", "B200", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown GPU 'B200'; choose from" in err and "pydantic.dev" not in err, err


BLOCKER = """import importlib.abc, sys
class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Hidden())
"""


@pytest.mark.parametrize(
    "hidden,argv",
    [("pulp", ["plan", "two-tenants.yaml"]), ("yaml", ["validate", "two-tenants.yaml"]), ("pydantic", ["--help"])],
)
def test_a_missing_hard_dependency_is_one_line_naming_how_to_install_it(tmp_path, hidden, argv):
    """The CLI in a process where ``hidden`` cannot be imported (a sitecustomize on a path of the test's own:
    a finder first on ``sys.meta_path`` that raises what a missing package raises), not uninstalled: one line
    naming the package and its ``pip install``, exit 2. ``pulp`` is first imported by a command, ``yaml`` and
    ``pydantic`` while the parser is built."""
    import os
    import subprocess
    import sys

    from tests.helpers.repo import EXAMPLES, REPO

    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(hidden=hidden))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet", *argv], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    install = "pyyaml" if hidden == "yaml" else hidden
    assert f"the package {hidden} that lorafleet needs is not installed (pip install '{install}" in done.stderr


def test_every_hard_dependency_has_its_line():
    """Every package of pyproject's ``dependencies`` is known by its import name (``pyyaml`` as ``yaml``), and a
    module that is not one keeps its traceback."""
    import tomllib

    from lorafleet.errors import hard_requirements, missing_dependency
    from tests.helpers.repo import REPO

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    hard = hard_requirements()
    assert len(hard) == len(declared) and {"pulp", "yaml", "torch", "pydantic", "pyscipopt"} <= set(hard)
    for name in hard:
        line = missing_dependency(ModuleNotFoundError(name=f"{name}.sub"))
        assert line is not None and f"the package {name} " in line and "pip install" in line
    assert missing_dependency(ModuleNotFoundError(name="lorafleet.nothing")) is None
    assert missing_dependency(ModuleNotFoundError(name="sympy")) is None
