"""``lorafleet profile`` options: --device, --dtype, --gpu and the memory budget, validated before any
process starts. CUDA machines are faked here (device count, name, memory): the check needs no GPU."""

from __future__ import annotations

import pytest
import torch

import lorafleet.profiling.device as device_module
from lorafleet.cli import build_parser, main
from lorafleet.commands.profile import _settings
from lorafleet.executor.torch.precision import Precision
from lorafleet.profiling.device import DeviceKind

MIB = 1 << 20
H200_MIB = 143771  # the device machine's H200, as nvidia-smi reports it


def _args(*extra: str):
    return build_parser().parse_args(
        ["profile", "--model", "tiny-llama", "--configs", "1x1,1x2", "--out", "p.json", *extra]
    )


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n, name, mib)``: this process sees ``n`` CUDA devices of that name and memory."""

    def fake(n: int, name: str = "NVIDIA H200", mib: int = H200_MIB) -> None:
        monkeypatch.setattr(device_module, "cuda_device_count", lambda: n)
        monkeypatch.setattr(device_module, "cuda_memory_bytes", lambda index=0: mib * MIB)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)

    return fake


def test_cpu_defaults_are_unchanged():
    s = _settings(_args())
    assert (s.device, s.precision, s.gpu, s.memory_budget_bytes) == (DeviceKind.CPU, Precision.FP32, "cpu", 48 * MIB)
    assert s.transfers and s.world == 2


def test_one_gpu_is_a_world_of_one_in_bf16_with_the_gpus_memory(gpus):
    gpus(1)
    s = _settings(_args("--device", "cuda", "--dtype", "bf16"))
    assert (s.device, s.precision, s.gpu) == (DeviceKind.CUDA, Precision.BF16, "H200-141GB")
    assert s.world == 1 and not s.transfers  # TP1 only; no peer for p2p and all-reduce records
    assert s.memory_budget_bytes == H200_MIB * MIB
    assert _settings(_args("--device", "cuda", "--memory-budget-mib", "4096")).memory_budget_bytes == 4096 * MIB


def test_two_gpus_time_transfers(gpus):
    gpus(2)
    s = _settings(_args("--device", "cuda", "--configs", "1x1,2x1"))
    assert s.world == 2 and s.transfers


@pytest.mark.parametrize(
    "n_gpus,extra,message",
    [
        (1, ["--configs", "1x1,2x1"], "--configs: tp=2 needs 2 processes of one GPU each; this machine has 1 GPU"),
        (0, [], "--device: cuda: no CUDA device is visible"),
        (1, ["--gpu", "B200"], "--gpu: unknown GPU 'B200'"),
    ],
)
def test_bad_cuda_choices_are_one_line_and_exit_2(gpus, capsys, n_gpus, extra, message):
    gpus(n_gpus)
    assert (
        main(["profile", "--model", "tiny-llama", "--configs", "1x1", "--out", "p.json", "--device", "cuda", *extra])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_an_unknown_gpu_must_be_named(gpus, capsys):
    gpus(1, "NVIDIA GeForce RTX 4090", 24564)
    assert main(["profile", "--model", "tiny-llama", "--configs", "1x1", "--out", "p.json", "--device", "cuda"]) == 2
    assert "no GPU preset matches 'NVIDIA GeForce RTX 4090'" in capsys.readouterr().err
    assert _settings(_args("--device", "cuda", "--gpu", "a6000-48gb")).gpu == "A6000-48GB"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_here(capsys):
    assert main(["profile", "--model", "tiny-llama", "--configs", "1x1", "--out", "p.json", "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_device_and_dtype_choices():
    for flag, value in (("--device", "tpu"), ("--dtype", "fp16")):
        with pytest.raises(SystemExit):
            _args(flag, value)


@pytest.mark.parametrize("where", ["read-only folder", "a directory", "under a file", "in place, read-only folder"])
def test_fit_checks_its_output_before_fitting(tmp_path, capsys, where):
    """``fit`` whose output cannot be written: one line, exit 2, nothing printed (the fit prints its quality
    lines: it did not run) and nothing written (#25). The code runs unprivileged: root writes anywhere."""
    import shutil

    from tests.helpers.permissions import read_only, unprivileged
    from tests.helpers.repo import REPO

    profile = tmp_path / "p.json"
    shutil.copy(REPO / "profiles" / "tiny-llama-cpu.json", profile)
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "ro").mkdir()
    shutil.copy(profile, tmp_path / "ro" / "p.json")
    read_only(tmp_path / "ro")
    argv = {
        "read-only folder": [str(profile), "--out", str(tmp_path / "ro" / "fitted.json")],
        "a directory": [str(profile), "--out", str(tmp_path / "dir")],
        "under a file": [str(profile), "--out", str(tmp_path / "file" / "fitted.json")],
        "in place, read-only folder": [str(tmp_path / "ro" / "p.json")],
    }[where]
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with unprivileged():
        code = main(["fit", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "cannot write here" in err or "is a directory, expected a file" in err, err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize(
    "command", [["profile", "--model", "tiny-llama", "--configs", "1x1"], ["costmodel", "predict"]]
)
def test_profile_and_predict_check_their_output_before_the_work(tmp_path, capsys, command):
    from tests.helpers.permissions import read_only, unprivileged

    out_path = read_only(tmp_path / "ro") / "out.json"
    if command[0] == "costmodel":
        (tmp_path / "rows.csv").write_text("tp,seq_len,mbs\n1,128,2\n")
        command = [*command, "--model", "tiny-llama", "--gpu", "cpu", "--csv", str(tmp_path / "rows.csv")]
    with unprivileged():
        code = main([*command, "--out", str(out_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "cannot write here" in err, err
    assert not list((tmp_path / "ro").iterdir())


@pytest.mark.parametrize("command", ["profile", "fit"])
def test_an_output_that_cannot_be_created_is_refused_before_the_work_as_root_too(
    tmp_path, capsys, monkeypatch, command
):
    """#38: ``profile --out /proc/nope/x.json`` was refused only after 164 s of measurements: the permission check
    asks ``os.access``, which lets root write anywhere, ``/proc`` included. The output's folder is tried now
    (created where missing, and a file made there), as the code runs: here without dropping root's rights.
    Nothing is measured or fitted, and a folder that can be made is left as it was."""
    import shutil

    import lorafleet.costmodel.fitted as fitted
    import lorafleet.profiling.run as profiling
    from tests.helpers.repo import REPO

    def work(*args: object, **kw: object) -> None:
        raise AssertionError("the work ran")

    monkeypatch.setattr(profiling, "measure_profile", work)
    monkeypatch.setattr(fitted, "fit_profile", work)
    profile = tmp_path / "p.json"
    shutil.copy(REPO / "profiles" / "tiny-llama-cpu.json", profile)
    argv = {
        "profile": ["profile", "--model", "tiny-llama", "--configs", "1x1"],
        "fit": ["fit", str(profile)],
    }[command]
    code = main([*argv, "--out", "/proc/nope/x.json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "/proc/nope/x.json: cannot write here" in err, err
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(AssertionError, match="the work ran"):  # a folder it can make: the work starts
        main([*argv, "--out", str(tmp_path / "new" / "deeper" / "x.json")])
    assert sorted(tmp_path.rglob("*")) == before  # and the check left nothing behind
