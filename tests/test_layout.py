"""The package's layout shows the course: the library in ``minizero/``, the course machinery in
``minizero/course/`` with the checks of lesson NN in ``checks/lessonNN.py``; no file a reader cannot
hold in their head; no module reaching into another's private names; every ``minizero`` name a
lesson source uses exists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from minizero.course import build

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minizero"
SOURCES = sorted((ROOT / "course").glob("[0-9][0-9]_*.py"))
MAX_LINES = 400
# Commands that are tools, not library: they may use the course's helpers (progress bars, the
# lessons' rank count); the library itself never imports minizero.course.
TOOLS = re.compile(r"^(bench.*|demo|doctor|cli|__main__)$")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def minizero_modules(tree: ast.AST) -> dict[str, str]:
    """Local names bound to minizero modules: ``from minizero import collectives as C``,
    ``import minizero.x as y``, ``L = importlib.import_module("minizero.launcher")``."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "minizero":
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else "minizero"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minizero":
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "attr", "") == "import_module"
            and isinstance(node.value.args[0], ast.Constant)
            and str(node.value.args[0].value).startswith("minizero")
        ):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    bound[t.id] = node.value.args[0].value
    return bound


def test_no_file_in_the_package_is_over_400_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines, split by concept: {long}"


def test_the_course_machinery_lives_in_minizero_course():
    course = PACKAGE / "course"
    for name in ("build", "workflow", "grade", "plots", "plots_budget", "compare"):
        assert (course / f"{name}.py").is_file(), name
    assert (course / "checks" / "common.py").is_file()
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    stray = [n for n in top if re.match(r"(checks|plots|course)\b", n)]
    assert not stray, f"course machinery outside minizero/course/: {stray}"


def test_the_library_never_imports_the_course():
    for path in sorted(PACKAGE.glob("*.py")):
        if TOOLS.match(path.stem):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad = [n for n in names if n.startswith("minizero.course")]
            assert not bad, f"{path.name}:{node.lineno} imports {bad[0]} (library -> course)"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_each_lessons_checks_are_in_its_own_file(source):
    """Every ``check_*`` a check cell calls is defined in ``checks/lessonNN.py`` of that lesson."""
    nn = source.stem[:2]
    own = importlib.import_module(f"minizero.course.checks.lesson{nn}")
    cells = [c for c in build.parse(source.read_text(), source.name) if c.check]
    assert cells, f"{source.name} has no check cell"
    for cell in cells:
        tree = ast.parse(build.render_code(cell, "solutions"))
        called = [
            n.func for n in ast.walk(tree) if isinstance(n, ast.Call)
            if getattr(n.func, "attr", getattr(n.func, "id", "")).startswith("check_")
        ]  # fmt: skip
        assert called, f"{source.name}:{cell.line}: the check cell calls no check_* function"
        for f in called:
            name = f.attr if isinstance(f, ast.Attribute) else f.id
            where = f"{source.name}:{cell.line}: {name}"
            assert hasattr(own, name), f"{where} is not in minizero/course/checks/lesson{nn}.py"
            if isinstance(f, ast.Attribute):
                assert ast.unparse(f.value) == f"lesson{nn}", f"{where}: call it as lesson{nn}.X"


def private_uses(tree: ast.AST, me: str) -> list[str]:
    """Where module ``me`` imports another minizero module's private name, or reads one off it."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero"):
            if node.module != me:
                bad += [f"{me}:{node.lineno} imports {node.module}.{a.name}"
                        for a in node.names if private(a.name)]  # fmt: skip
    modules = minizero_modules(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and modules.get(node.value.id, me) != me
            and private(node.attr)
        ):
            bad.append(f"{me}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return sorted(bad, key=lambda b: int(b.split(":")[1].split()[0]))


def test_no_module_uses_another_modules_private_names():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += private_uses(ast.parse(path.read_text()), module_name(path))
    assert not bad, "private names used across modules (make them public or move them):\n" + (
        "\n".join(bad)
    )


def test_the_private_name_check_sees_both_forms():
    tree = ast.parse(
        "import importlib\nfrom minizero import collectives as C\n"
        "from minizero.launcher import _seconds, launch\n"
        "L = importlib.import_module('minizero.launcher')\n"
        "C._sizes(1)\nC.all_reduce\nL._JOIN\nself._x\n"
    )
    assert private_uses(tree, "minizero.tools.demo") == [
        "minizero.tools.demo:3 imports minizero.launch._seconds",
        "minizero.tools.demo:5 uses minizero.collectives._sizes",
        "minizero.tools.demo:7 uses minizero.launch._JOIN",
    ]
    assert private_uses(tree, "minizero.launch") == [
        "minizero.launch:5 uses minizero.collectives._sizes"
    ]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_minizero_name_a_lesson_uses_exists(source):
    """``from minizero.x import y`` and ``module.attr`` on a minizero module, all of them, in the
    source (so in both the lesson and the solution)."""
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("minizero"):
                    importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero"):
            module = importlib.import_module(node.module)
            for a in node.names:
                found = hasattr(module, a.name) or is_module(f"{node.module}.{a.name}")
                assert found, f"{source.name}:{node.lineno}: {node.module} has no {a.name}"
    modules = minizero_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                module = importlib.import_module(modules[node.value.id])
                assert hasattr(module, node.attr) or is_module(f"{module.__name__}.{node.attr}"), (
                    f"{source.name}:{node.lineno}: {modules[node.value.id]} has no {node.attr}"
                )
