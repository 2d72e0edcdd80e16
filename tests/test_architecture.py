"""The import graph shows the data flow: every arrow runs one way, and no precprof import hides in a function.

drivers (cli, training, compare, integrations) -> pipeline -> report -> analysis -> schema and formats;
capture -> stats -> formats; capture -> export -> tables. Read from the source with ``ast``, so the test sees
what a reader sees.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "precprof"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(path: Path, names: set[str]) -> tuple[set[str], list[str]]:
    """(precprof modules imported at module level, precprof imports inside functions or classes)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: list[str] = []

    def targets(node: ast.AST) -> set[str]:
        found: set[str] = set()
        if isinstance(node, ast.Import):
            found = {a.name for a in node.names if a.name.split(".")[0] == "precprof"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "precprof":
            for a in node.names:  # `from precprof import stats` imports the module precprof.stats
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in names else node.module)
        return found

    def visit(node: ast.AST, depth: int) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if depth == 0:
                    top.update(targets(child))
                elif targets(child):
                    nested.append(f"{path.relative_to(ROOT).as_posix()}:{child.lineno}")
            inner = depth + isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if not isinstance(child, ast.If) or not _is_type_checking(child):
                visit(child, inner)

    visit(tree, 0)
    return top, nested


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    names = set(mods)
    return {name: imports(path, names)[0] - {name} for name, path in mods.items()}


def reaches(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    """Modules starting with ``prefix`` that ``start`` imports, directly or not (never through the facade)."""
    seen, stack, hits = {start}, [start], []
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt == "precprof" or nxt in seen:
                continue
            seen.add(nxt)
            stack.append(nxt)
            if nxt == prefix or nxt.startswith(prefix + "."):
                hits.append(nxt)
    return hits


# imports that must wait until they are used, and why (one reason per import)
LAZY: dict[str, tuple[str, ...]] = {
    "stats/triton_engine.py": (
        "precprof.stats.triton_kernels imports triton (seconds), needed only by the Triton engine",
    ),
    "stats/triton_block.py": (
        "precprof.stats.triton_block_kernels imports triton, needed only by the block kernels",
    ),
    "stats/triton_updates.py": (
        "precprof.stats.triton_update_kernels imports triton, needed only where the weight-update samples run "
        "in Triton",
    ),
    "__init__.py": (
        "precprof.Profiler (precprof.capture) imports torch, which reading a run directory never needs",
        "recommend and Recommendation (precprof.pipeline) import pandas, Arrow and the report: `import precprof` "
        "stays light, so that the command line loads them under its Ctrl-C handler",
    ),
    "__main__.py": (
        "the command line's modules load under its Ctrl-C handler: Ctrl-C in the first second is one line",
    ),
    "_run_finisher.py": (
        "precprof.pipeline registers the run finisher when imported: the first run that ends loads it when "
        "nothing did before (import precprof no longer does)",
    ),
    "hardware.py": ("precprof.stats imports torch: only `precprof env` reads the CPU kernel's cache",),
    "training/__init__.py": (
        "the loop imports torch; the CLI reads only TrainConfig to declare its options",
    ),
    "cli.py": ("precprof.stats imports torch: `precprof report` and `precprof export` never need it",),
}


def test_no_precprof_import_inside_a_function() -> None:
    names = set(modules())
    nested = [hit for path in modules().values() for hit in imports(path, names)[1]]
    assert [hit for hit in nested if hit.split(":")[0] not in LAZY] == []
    for path, reasons in LAZY.items():  # as many as there are reasons, no more
        assert len([hit for hit in nested if hit.split(":")[0] == path]) == len(reasons), path


@pytest.mark.parametrize(
    "downstream",
    ["precprof.report", "precprof.analysis", "precprof.pipeline", "precprof.hardware"],
)
def test_capture_depends_on_nothing_downstream(graph: dict[str, set[str]], downstream: str) -> None:
    assert reaches(graph, "precprof.capture", downstream) == []


@pytest.mark.parametrize(
    "downstream", ["precprof.capture", "precprof.report", "precprof.analysis", "precprof.pipeline"]
)
def test_the_dashboards_read_tables_only(graph: dict[str, set[str]], downstream: str) -> None:
    """capture -> export -> tables: the live dashboards and ``precprof export`` write what the tables hold."""
    for name in graph:
        if name.startswith("precprof.export"):
            assert reaches(graph, name, downstream) == [], name


def test_report_never_runs_the_advisor(graph: dict[str, set[str]]) -> None:
    for name in graph:
        if name.startswith("precprof.report"):
            assert reaches(graph, name, "precprof.analysis.advisor") == [], name
            assert reaches(graph, name, "precprof.pipeline") == [], name


def test_the_core_never_imports_a_driver(graph: dict[str, set[str]]) -> None:
    core = [
        n
        for n in graph
        if n.split(".")[1:2] and n.split(".")[1] in {"capture", "stats", "report", "analysis", "pipeline"}
    ]
    for name in core:
        for driver in ("precprof.cli", "precprof.training", "precprof.compare", "precprof.integrations"):
            assert reaches(graph, name, driver) == [], (name, driver)


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    for name in graph:
        if name == "precprof":
            continue
        assert name not in reaches(graph, name, name), f"{name} imports itself through a cycle"


def test_the_hot_path_reads_as_what_it_is() -> None:
    """No module of ``capture/`` or ``stats/`` over 600 lines (issue 33's goal 9): a class that grew past it
    is split by what changes together (``grad_reads.py`` beside ``hooks.py``, ``memory_saved.py`` beside
    ``memory_tracker.py``, ``model_facts.py`` beside ``results.py``)."""
    long = {
        str(p.relative_to(ROOT)): n
        for package in ("capture", "stats")
        for p in sorted((ROOT / package).glob("*.py"))
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


REPO = ROOT.parent
_TOKEN = re.compile(r"`([^`]+)`")
_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def layout_rows(doc: str, header: str) -> list[tuple[list[str], list[str]]]:
    """(places, names in the description) of each row of the table under ``header`` in ``doc``."""
    lines = (REPO / doc).read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        place, what = line.strip("|").split(" | ", 1)
        rows.append((_TOKEN.findall(place), _TOKEN.findall(what)))
    return rows


@pytest.mark.parametrize(
    ("doc", "header"),
    [("docs/design.md", "| place | responsibility |"), ("README.md", "| place | what it does |")],
)
def test_the_layout_tables_name_every_module_and_only_modules(doc: str, header: str) -> None:
    """design.md's layout and the README's "How it works" name every top-level module and package (``export/``
    and ten modules were in neither); a place names a file or folder that exists, and a bare name in a package's
    row is a module of that package or a top-level one (the README's ``columns`` of ``capture/`` was neither)."""
    rows = layout_rows(doc, header)
    places = [p for row_places, _ in rows for p in row_places]
    top = {p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    top |= {f"{p.name}/" for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert sorted(top - set(places)) == [], f"{doc}: modules its layout table does not name"
    assert [p for p in places if not ((ROOT / p).exists() or (REPO / p).exists())] == []
    modules = {p.stem for p in ROOT.glob("*.py")} | {p.rstrip("/") for p in top if p.endswith("/")}
    for row_places, names in rows:
        packages = [ROOT / p for p in row_places if p.endswith("/") and (ROOT / p).is_dir()]
        known = modules | {m.stem for d in packages for m in d.glob("*.py")} | {d.name for d in packages}
        known |= {m.name for d in packages for m in d.iterdir() if (m / "__init__.py").exists()}
        assert [n for n in names if _NAME.fullmatch(n) and n not in known] == [], (doc, row_places)
