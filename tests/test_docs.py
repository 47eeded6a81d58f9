"""The package's own map stays true: ARCHITECTURE.md, README.md's module table and the package docstrings name
the modules there are, and only names and paths there are.

Each check reads the files as text and the code by its syntax (nothing is imported), and its failure lists
everything missing or stale at once:

- every module file of ``lorafleet/`` is named in ARCHITECTURE.md, by its path or by its file name in a row
  (or section) of its package; every package and top-level module is in README.md's module table, whose rows
  follow the layers, highest first;
- every ``x.py`` path and ``pkg/`` named in ARCHITECTURE.md and README.md's module table exists;
- every subpackage's ``__init__`` docstring names each of its modules (and subpackages);
- ARCHITECTURE.md's layer diagram is pyproject.toml's import-linter ``layers`` contract, and each other
  contract has its bullet, naming the modules the contract lists;
- a name the documents give in backticks as code (``Trainer._change``, ``live.kept_change``, ``RunDir``) is
  defined in the package: a class's member, a module's name, or, in the map documents, a name defined
  somewhere (:data:`NOT_OURS` lists the few names of other software they give).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.helpers.repo import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PACKAGE = REPO / "lorafleet"
ARCHITECTURE = REPO / "ARCHITECTURE.md"
README = REPO / "README.md"

NOT_OURS = {
    "acyclic_siblings": "import-linter's contract type",
    "DataCollatorForSeq2Seq": "transformers' collator",
    "L40S": "a GPU preset's name",
    "data.path": "a workload task's key",
    "lengths.dataset.path": "a workload task's key",
    "set_defaults": "argparse's",
    "predicted_busy_s": "a metrics.jsonl key",
    "model_busy_s": "a metrics.jsonl key",
}
"""Code-like names the map documents and package docstrings give that are not lorafleet's, and what each is."""

EXTERNAL_HEADS = {"torch", "triton", "peft", "transformers", "numpy", "np", "scipy", "pulp", "highspy", "os"}
"""Dotted names starting with these are another package's (``torch.distributed.run`` is not
``executor.torch``'s)."""

FILE_SUFFIXES = (
    ".py",
    ".json",
    ".jsonl",
    ".yaml",
    ".yml",
    ".csv",
    ".md",
    ".txt",
    ".toml",
    ".npz",
    ".safetensors",
    ".reason",
)
CODE_SPAN = re.compile(r"(`+)([^`\n]+?)\1")
ROLE = re.compile(r":\w+:`~?\.?([^`]+)`")


# -- the package, read by its syntax ------------------------------------------------------------------------


def module_files() -> list[str]:
    """Every module file under ``lorafleet/`` but ``__init__.py`` and ``__main__.py``, as its path there."""
    return sorted(
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )


def subpackages() -> list[str]:
    """Every package under ``lorafleet/`` (not ``lorafleet`` itself), as its path there (``train/queue``)."""
    return sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*/__init__.py"))


def members(package: str) -> list[str]:
    """A package's modules and subpackages, by name."""
    folder = PACKAGE / package
    modules = [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    return sorted(modules + [p.parent.name for p in folder.glob("*/__init__.py")])


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""


def _body_names(body: list[ast.stmt]) -> dict[str, ast.ClassDef | None]:
    """The names a module (or class) body defines or imports, a class by its node."""
    names: dict[str, ast.ClassDef | None] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update((n.id, None) for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(((a.asname or a.name).split(".")[0], None) for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            names.update(_body_names(node.body))
            names.update(_body_names(node.orelse))
    return names


@cache
def index() -> dict[str, dict[str, ast.ClassDef | None]]:
    """Every module and package (dotted, without ``lorafleet.``) -> the names it defines; a package's include
    its modules."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = _body_names(ast.parse(path.read_text(encoding="utf-8")).body)
    for name in list(out):
        if "." in name:
            parent, _, child = name.rpartition(".")
            out[parent].setdefault(child, None)
        elif name:
            out[""].setdefault(name, None)
    return out


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of the package by name (a name may be several classes)."""
    out: dict[str, list[ast.ClassDef]] = {}
    for names in index().values():
        for name, node in names.items():
            if node is not None and node not in out.setdefault(name, []):
                out[name].append(node)
    return out


@cache
def field_names() -> frozenset[str]:
    """Every name defined in a class body: a field or a method (``plan``, ``model``, ``data``, ...)."""
    return frozenset(n for nodes in classes().values() for node in nodes for n in _body_names(node.body))


@cache
def defined() -> frozenset[str]:
    """Every name the package defines, at a module's top or in a class."""
    return frozenset(n for names in index().values() for n in names) | field_names()


def has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a class ``cls`` of the package has ``member``, itself or by a base; a class with a base from
    another package (pydantic's ``BaseModel``, an ``Enum``) may have it from there."""
    for node in classes()[cls]:
        if member in _body_names(node.body):
            return True
        for base in node.bases:
            name = ast.unparse(base).split("[")[0].rpartition(".")[2]
            if name in ("Protocol", "Generic", "object"):
                continue
            if name not in classes() or (name not in seen and has_member(name, member, seen | {cls})):
                return True
    return False


def modules_named(dotted: str) -> list[str]:
    """The package's modules whose dotted name is ``dotted`` or ends with it (``live``: ``train.live``)."""
    return [m for m in index() if m and (m == dotted or m.endswith("." + dotted))]


def undefined(span: str, anywhere: bool) -> str | None:
    """Why the code span ``span`` names nothing of the package, or None: ``Class.member`` and ``module.name``
    must resolve; with ``anywhere``, a code-like name alone (``snake_case``, ``CamelCase``, ``UPPER``) must be
    defined somewhere."""
    name = re.sub(r"\(.*\)$", "", span.strip())
    if name in NOT_OURS or name.endswith(FILE_SUFFIXES) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        return None
    parts = name.split(".")
    qualified = parts[0] == "lorafleet"
    parts = parts[1:] if qualified else parts
    if not parts or parts[0] in EXTERNAL_HEADS:
        return None
    for k in range(len(parts), 0, -1):
        found = modules_named(".".join(parts[:k]))
        if k == 1 and not qualified and parts[0] in field_names():
            found = []  # ``plan.policy``: a plan's field, not the module commands.plan
        if not found:
            continue
        rest = parts[k:]
        if not rest:
            return None
        for module in found:
            node = index()[module].get(rest[0], False)
            if node is False:
                continue
            if node is None or len(rest) == 1 or has_member(rest[0], rest[1]):
                return None
        return f"{'.'.join(rest)} is not defined in {' or '.join(sorted(found))}"
    if parts[0] in classes():
        if len(parts) == 1 or has_member(parts[0], parts[1]):
            return None
        return f"class {parts[0]} has no {parts[1]}"
    code_like = "_" in name.strip("_") or re.search(r"[a-z][A-Z]", name) or (name.isupper() and len(name) > 2)
    if anywhere and len(parts) == 1 and code_like and name not in defined():
        return "defined nowhere in lorafleet"
    return None


# -- the documents --------------------------------------------------------------------------------------


def spans(text: str) -> list[str]:
    """The code spans of a markdown text, or of a docstring (``x``, ``x``, :role:`x`)."""
    return [m.group(2) for m in CODE_SPAN.finditer(ROLE.sub(r"`\1`", text))]


def blocks(text: str) -> list[str]:
    """A markdown text cut where one place in it names one package: each table row, and each paragraph; a
    paragraph opening with **`pkg/`.** runs to the next heading or such paragraph (its list included)."""
    out: list[str] = []
    section = False
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("|"):
            out += [line for line in paragraph.splitlines() if line.lstrip().startswith("|")]
            section = False
        elif re.match(r"\*\*`[\w/]+/`\.\*\*", paragraph):
            out.append(paragraph)
            section = True
        elif section and not paragraph.startswith("#"):
            out[-1] += "\n\n" + paragraph
        else:
            out.append(paragraph)
            section = False
    return out


def readme_table() -> list[str]:
    """The rows of README.md's module table (under "Where things are")."""
    text = README.read_text(encoding="utf-8").split("## Where things are", 1)[1]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows, "README.md's module table (under 'Where things are') is gone"
    return rows


def folders_in(block: str) -> list[str]:
    """The package folders a block names (``train/``, ``kernels/``)."""
    return [s for s in spans(block) if re.fullmatch(r"[\w/]+/", s)]


def in_folder(folder: str, package: str) -> bool:
    """Whether ``folder`` (as a block names it: ``queue/``, ``train/queue/``) is ``package``'s path or its end."""
    path = package + "/"
    return path.endswith(folder) and (path == folder or path[-len(folder) - 1] == "/")


# -- the checks -----------------------------------------------------------------------------------------


def test_every_module_is_named_in_architecture():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = set(spans(text))
    parts = blocks(text)
    missing = []
    for path in module_files():
        package, _, file = path.rpartition("/")
        if any(s == path or s.endswith("/" + path) for s in named):
            continue
        if not package and file in named:
            continue
        if package and any(
            file in spans(block) and any(in_folder(f, package) for f in folders_in(block)) for block in parts
        ):
            continue
        missing.append(path)
    assert not missing, (
        f"modules ARCHITECTURE.md does not name (by path, or by file name in their package's row): {missing}"
    )


def test_every_package_and_top_level_module_is_in_the_readme_table():
    listed = {s for row in readme_table() for s in spans(row.split("|")[1])}
    wanted = {p.name for p in PACKAGE.glob("*.py")} | {p.parent.name + "/" for p in PACKAGE.glob("*/__init__.py")}
    assert not wanted - listed, f"README.md's module table lacks: {sorted(wanted - listed)}"


def test_the_readme_table_follows_the_layers():
    """The table is "highest layer first": each row's modules are in a layer at or below the row before's."""
    layer_of = {name: k for k, layer in enumerate(pyproject_layers()) for name in re.split(r"\s*[:|]\s*", layer)}
    rows = []
    for row in readme_table():
        layers = [
            layer_of[n] for s in spans(row.split("|")[1]) if (n := s.removesuffix("/").removesuffix(".py")) in layer_of
        ]
        if layers:
            rows.append((max(layers), row.split("|")[1].strip()))
    out_of_order = [f"{b} (layer {lb}) after {a} (layer {la})" for (la, a), (lb, b) in zip(rows, rows[1:]) if lb < la]
    assert not out_of_order, f"README.md's module table is not highest layer first: {out_of_order}"


def _missing_paths(blocks_of: list[str]) -> list[str]:
    missing = []
    for block in blocks_of:
        named = folders_in(block)
        folders = [PACKAGE / f for f in named if (PACKAGE / f).is_dir()]
        folders += [d / f for d in folders for f in named if (d / f).is_dir()]  # `executor/torch/`, `kernels/`
        for span in spans(block):
            if "<" in span or " " in span:
                continue
            if span.endswith(".py"):
                places = [REPO, PACKAGE, *folders]
                if "/" not in span:
                    places += [p.parent for p in PACKAGE.rglob(span)] if not folders else []
                if not any((place / span).is_file() for place in places):
                    missing.append(span)
            elif re.fullmatch(r"[\w/.]+/", span) and not any(
                (place / span).is_dir() for place in [REPO, PACKAGE, *folders]
            ):
                missing.append(span)
    return sorted(set(missing))


def test_every_path_architecture_names_exists():
    run_files = _run_directory_names()
    missing = [p for p in _missing_paths(blocks(ARCHITECTURE.read_text(encoding="utf-8"))) if p not in run_files]
    assert not missing, f"ARCHITECTURE.md names files or packages there are not (in their row's package): {missing}"


def test_every_path_the_readme_table_names_exists():
    missing = _missing_paths(readme_table())
    assert not missing, f"README.md's module table names files or packages there are not: {missing}"


def _run_directory_names() -> set[str]:
    """What a run writes under ``--out`` (``rundir.RUN_FILES``, read by its syntax): folders, not packages."""
    tree = ast.parse((PACKAGE / "rundir.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "RUN_FILES")
    names = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {n + "/" for n in names} | {"queue/", "adapters/<task>/"}


def test_every_package_docstring_names_its_modules():
    missing = {}
    for package in subpackages():
        text = docstring(PACKAGE / package / "__init__.py")
        short = package.rpartition("/")[2]
        lacking = [
            name
            for name in members(package)
            if not re.search(rf"(?<![\w-])(?:{name}\.py|{name}/|\.{name}|{short}\.{name}|`{name}`)(?![\w-])", text)
        ]
        if lacking:
            missing[package] = lacking
    assert not missing, f"package docstrings that do not name these modules of theirs: {missing}"


# -- the layers and the import contracts ----------------------------------------------------------------


@cache
def contracts() -> list[dict]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def pyproject_layers() -> list[str]:
    """The package's layers contract, highest first, each as ``a : b`` or ``a | b`` without ``lorafleet.``."""
    (layers,) = [c for c in contracts() if c["type"] == "layers" and "containers" not in c]
    return [" ".join(layer.replace("lorafleet.", "").split()) for layer in layers["layers"]]


def test_the_layer_diagram_is_the_import_linter_contract():
    text = ARCHITECTURE.read_text(encoding="utf-8").split("## Layers", 1)[1]
    diagram = text.split("```", 2)[1]
    drawn = []
    for line in diagram.splitlines():  # a layer at the margin, its words and the arrows indented
        if line.strip() and len(line) - len(line.lstrip()) <= 2 and not line.strip().startswith("|"):
            drawn.append(" ".join(re.split(r"\s{2,}", line.strip())[0].split()))
    assert drawn == pyproject_layers(), (
        f"ARCHITECTURE.md's layer diagram {drawn} is not pyproject.toml's layers {pyproject_layers()}"
    )


def test_every_import_contract_has_its_bullet():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    others = [c for c in contracts() if not (c["type"] == "layers" and "containers" not in c)]
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
    problems = []
    if f"with {words.get(len(others), len(others))} more contracts" not in text:
        problems.append(f"the count: pyproject.toml has {len(others)} contracts beside the layers")
    items = [b.split("\n\n")[0] for b in re.split(r"\n(?=- \*\*)", text)]
    bullets = {b.split("**")[1]: b for b in items if b.startswith("- **")}
    for contract in others:
        title = re.split(r":| \(", contract["name"])[0]
        bullet = next((b for head, b in bullets.items() if head.rstrip(".").startswith(title)), None)
        if bullet is None:
            problems.append(f"no bullet for {contract['name']!r}")
            continue
        said = set(spans(bullet))
        for module in contract.get("source_modules", []) + contract.get("forbidden_modules", []):
            if not module.startswith("lorafleet."):
                continue  # torch, triton, peft, transformers: named in words
            short = module.removeprefix("lorafleet.")
            forms = {module, short, short.rpartition(".")[2], short.replace(".", "/"), short.replace(".", "/") + "/"}
            if forms & said:
                continue
            if module.startswith("lorafleet.dispatch.") and module in contract.get("forbidden_modules", []):
                continue  # the planner's contract: its bullet names dispatch's inside by example (``...``)
            problems.append(f"{contract['name']!r}: its bullet does not name {short}")
    assert not problems, f"ARCHITECTURE.md's contract bullets against pyproject.toml: {problems}"


# -- names ----------------------------------------------------------------------------------------------


def _stale(text: str, anywhere: bool) -> list[str]:
    return sorted({f"{s}: {why}" for s in spans(text) if (why := undefined(s, anywhere))})


def test_the_map_documents_name_what_is_there():
    stale = {
        doc.name: found
        for doc in (ARCHITECTURE, README)
        if (found := _stale(doc.read_text(encoding="utf-8"), anywhere=True))
    }
    assert not stale, f"names in backticks that lorafleet does not define: {stale}"


def test_docstrings_name_what_is_there():
    """Every package docstring (any code-like name) and module docstring (``Class.member``, ``module.name``)."""
    stale = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = _stale(docstring(path), anywhere=path.name == "__init__.py")
        if found:
            stale[path.relative_to(REPO).as_posix()] = found
    assert not stale, f"names in docstrings that lorafleet does not define: {stale}"
