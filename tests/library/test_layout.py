"""The package's layout shows the course: the library in ``minizero/``, the course machinery in
``minizero/course/`` with the checks of lesson NN in ``checks/lessonNN.py``; no file a reader cannot
hold in their head; no module reaching into another's private names; every ``minizero`` name a
lesson source uses exists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from minizero.course import build
from minizero.data_parallel import DataParallel

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("closure", ROOT / "tools" / "closure.py")
CLOSURE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CLOSURE)  # tools/closure.py: the line counts of the issue-33 targets
PACKAGE = ROOT / "minizero"
SOURCES = sorted((ROOT / "course").glob("[0-9][0-9]_*.py"))
MAX_LINES = 400


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
                if a.name == "*":  # a lesson's lab: the minizero modules its __all__ names
                    module = importlib.import_module(node.module)
                    for name in module.__all__:
                        value = getattr(module, name)
                        if inspect.ismodule(value) and value.__name__.startswith("minizero"):
                            bound[name] = value.__name__
                elif is_module(f"{node.module}.{a.name}"):
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


# The layers, lowest first; a module may import its own layer and those below, never above.
# minizero/__init__.py's docstring states the same order (tested below).
LAYERS = ["core", "habits", "parallelize", "analysis", "package", "tools", "course", "cli"]


def layer(module: str) -> str:
    """core: the top files (but parallelize), launcher/, checkpoint/; then habits/ (composed around
    the core through extension.Extension); parallelize (which composes them); analysis/ (the
    ledger, meters, simulate); the package root (``import minizero``: the names of all those);
    tools/; course/; the command line."""
    if module == "minizero":
        return "package"
    if module == "minizero.__main__":
        return "cli"
    if module == "minizero.parallelize":
        return "parallelize"
    for name in ("habits", "analysis", "tools", "course"):
        if module.startswith(f"minizero.{name}"):
            return name
    return "core"


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return [
        f"{m} ({layer(m)}) imports {d} ({layer(d)})"
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if rank[layer(d)] > rank[layer(m)]
    ]


def import_graph() -> dict[str, set[str]]:
    return CLOSURE.import_graph()  # tools/closure.py's, lazy imports and the command table too


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_lazy_imports_included():
    graph = import_graph()
    assert not cycles(graph), f"import cycles: {cycles(graph)}"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_point_one_way_as_the_package_docstring_says():
    """The import graph (AST imports, lazy ones too) has no arrow running back up the layers and
    no cycle, and minizero/__init__.py's docstring states the layers in the same order."""
    import minizero

    graph = import_graph()
    bad = arrows_back_up(graph)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)
    assert not cycles(graph), f"import cycles: {cycles(graph)}"
    stated = re.search(r"Layers, lowest first: ([^.]+)\.", " ".join(minizero.__doc__.split()))
    assert stated, "minizero/__init__.py's docstring must state the layers, lowest first"
    assert [x.strip() for x in stated.group(1).split("<-")] == LAYERS, stated.group(1)
    toy = {"minizero.ddp": {"minizero.analysis.ledger"}, "minizero.analysis.ledger": set()}
    back = ["minizero.ddp (core) imports minizero.analysis.ledger (analysis)"]
    assert arrows_back_up(toy) == back


def test_the_top_of_the_package_is_the_library_a_student_reads():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    # one concept a file: the chain, what it shares, naive DDP, its bucket, collectives, units,
    # precision, HSDP and ZeRO++ beside the stages, parallelize, the models, the stage's seams
    # (its face, its extension); the optimizer and its state between layouts: optimizer/
    assert len(top) <= 16, f"{len(top)} modules at the top of minizero/: {top}"
    for stage in ("ddp", "zero1", "zero2", "zero3", "data_parallel", "collectives", "bucket"):
        assert stage in top, stage
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    want = ["analysis", "checkpoint", "course", "habits", "launcher", "optimizer", "tools"]
    assert subpackages == want, subpackages


# the core: every module below the habits, and parallelize, which composes them
CORE = sorted(m for m in import_graph() if layer(m) == "core") + ["minizero.parallelize"]


def module_path(module: str) -> Path:
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.exists() else path.with_suffix("") / "__init__.py"


def habits_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``<x>.extension.<name>`` and ``Habits.<name>`` in ``tree``, and of
    every import from ``minizero.habits`` ("import <module>: <names>")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "extension") or (
                isinstance(v, ast.Name) and v.id == "Habits"
            ):
                out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero.habits"):
            out.append((node.lineno, f"import {node.module}: {[a.name for a in node.names]}"))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name.startswith("minizero.habits")]  # fmt: skip
    return out


def import_time_patches(tree: ast.AST, me: str) -> list[str]:
    """Top-level assignments to an attribute of something imported: importing ``me`` would
    change another module (``DataParallel.extension = Habits``)."""
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    bad = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(t, ast.Attribute) and isinstance(base, ast.Name) and base.id in imported:
                bad.append(f"{me}:{node.lineno} {ast.unparse(t)} = ...")
    return bad


def test_the_core_reaches_the_habits_only_through_extension():
    """The core names no habits attribute that ``Extension`` does not define, imports nothing of
    minizero/habits/ but ``Habits`` (in parallelize, which composes it); every ``Extension``
    method is documented, has a plain default, and is called by the core; ``Habits`` implements
    nothing else; and no module changes another at import time."""
    from minizero.data_parallel import DataParallel
    from minizero.habits import Habits
    from minizero.seams import Extension

    points = {n for n, v in vars(Extension).items() if not n.startswith("_") and callable(
        getattr(Extension, n))} | {"__init__"}  # fmt: skip
    called = set()
    for m in CORE:
        for line, name in habits_uses(ast.parse(module_path(m).read_text())):
            if name.startswith("import"):
                habits = "import minizero.habits: ['Habits']"
                allowed = m == "minizero.parallelize" and name == habits
                assert allowed, f"{m}:{line} {name}: the core composes Habits only in parallelize"
            else:
                assert name in points, f"{m}:{line} .extension.{name}: not a method of Extension"
                called.add(name)
    for name in points - {"__init__"}:
        assert name in called, f"Extension.{name}: no moment of the core calls it"
        assert getattr(Extension, name).__doc__, f"Extension.{name} is not documented"
    extra = {n for n in vars(Habits) if not n.startswith("__")} - points
    assert not extra, f"Habits defines {extra}, which no Extension method names"
    assert "extension" not in vars(DataParallel), "the extension is the constructor's, not a global"
    default = inspect.signature(DataParallel.__init__).parameters["extension"].default
    assert default is Extension
    patches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        patches += import_time_patches(ast.parse(path.read_text()), module_name(path))
    assert not patches, f"importing these changes another module: {patches}"
    leak = ast.parse("self._w.extension.grads.zero_grad_of(ids)\nfrom minizero.habits import x")
    assert sorted(habits_uses(leak)) == [(1, "grads"), (2, "import minizero.habits: ['x']")]
    patch = ast.parse("from minizero.data_parallel import DataParallel\nDataParallel.e = 1\n")
    assert import_time_patches(patch, "m") == ["m:2 DataParallel.e = ..."]


def import_closure(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every minizero module ``module`` imports, transitively (the package root aside)."""
    seen, todo = set(), [module]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d != "minizero" and d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_the_step_path_imports_no_hsdp_zeropp_habits_or_measurement():
    """A reader of a stage opens only the stages before it and what they share (issue 23):
    HSDP is a stage's option (``replicate_group``; hsdp.py makes the groups), ZeRO++ a
    subclass (zeropp.py), the habits are composed around the core (``Extension``), and the
    instruments (the ledger, the ring model) watch the collectives from ``analysis/``
    (``collectives.recorder``); the bucket rebuild (optimizer/state.py) is part of the habits.
    zero2.py's import closure stays what a reader can follow: at most 1,543 lines, counted by
    tools/closure.py (it was 2,666 in 13 files; 1,299 before issue 40 gave the stages a face,
    seams.py's ``Face``, and their methods, 1,447 before HSDP's all-reduce moved into them, 1,485
    before DDP refused a replicate group it would never average over, 1,487 before the renamed
    moments' guard, ``RENAMED`` and ``DataParallel.__init_subclass__``, 1,497 before gloo's
    all-gather by sends and receives, ``collectives._exchange``)."""
    graph = import_graph()
    away = ("minizero.hsdp", "minizero.zeropp", "minizero.habits", "minizero.analysis",
            "minizero.optimizer")  # fmt: skip
    for stage in ("data_parallel", "ddp", "zero1", "zero2", "zero3"):
        closure = import_closure(f"minizero.{stage}", graph)
        bad = sorted(m for m in closure if m.startswith(away))
        assert not bad, f"minizero/{stage}.py imports, through its imports, {bad}"
    lines, closure = CLOSURE.import_closure_lines("minizero.zero2")
    assert set(closure) == import_closure("minizero.zero2", graph) | {"minizero.zero2"}
    assert lines <= 1543, f"zero2.py's import closure is {lines} lines: {closure}"
    assert import_closure(
        "minizero.a", {"minizero.a": {"minizero.b"}, "minizero.b": {"minizero.c"}}
    ) == {"minizero.b", "minizero.c"}


def test_one_step_calls_at_most_860_lines_at_ddp_and_1145_at_stage_2():
    """The call closure of ``parallelize(MLP, stage, AdamW)`` and two steps, on rank 0 of 2 gloo
    ranks (tools/closure.py: every minizero function that ran, whole, and its class's header, the
    habits that run in the step included; the models and the launcher left out): what a reader
    follows through one step. docs/design.md gives the counts (issue 40: DDP 856, stage 2
    1,110; 497 and 708 of them outside the habits; then 858 and 1,112 with DDP's refusal of a
    replicate group, which stage 2's construction runs too; then stage 2 1,145 with gloo's
    all-gather by sends and receives, issue 42)."""
    ddp, by_file = CLOSURE.call_closure(0)
    assert ddp <= 860, f"DDP's call closure is {ddp} lines: {by_file}"
    assert "minizero/optimizer/state.py" in by_file and "minizero/ddp.py" in by_file  # traced
    assert "minizero/habits/guards.py" in by_file  # the habits count
    stage2, by_file = CLOSURE.call_closure(2)
    assert stage2 <= 1145, f"stage 2's call closure is {stage2} lines: {by_file}"
    assert "minizero/zero2.py" in by_file and "minizero/habits/module.py" in by_file


def test_the_stages_are_the_papers_chain():
    """DDP -> ZeRO1 (P_os) -> ZeRO2 (+g) -> ZeRO3 (+p): each stage file holds one class that
    extends the one before, so ``git diff --no-index zero1.py zero2.py`` shows what stage 2 adds;
    each docstring names its partition and its formula."""
    chain = [
        ("ddp", "DDP", "DataParallel", "(2 + 2 + K)Ψ"),
        ("zero1", "ZeRO1", "DDP", "P_os"),
        ("zero2", "ZeRO2", "ZeRO1", "P_os+g"),
        ("zero3", "ZeRO3", "ZeRO2", "P_os+g+p"),
    ]
    for file, cls, base, term in chain:
        tree = ast.parse((PACKAGE / f"{file}.py").read_text())
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        mine = [c for c in classes if c.name == cls]
        assert mine, f"{file}.py defines no {cls}"
        assert [ast.unparse(b) for b in mine[0].bases] == [base], f"{cls} must extend {base}"
        assert term in (ast.get_docstring(mine[0]) or ""), f"{cls}'s docstring must name {term}"
        others = [c.name for c in classes if c.name != cls]
        assert not others, f"{file}.py: one stage per file, found also {others}"
        stage = importlib.import_module(f"minizero.{file}")
        assert issubclass(getattr(stage, cls), DataParallel)
    import minizero

    assert issubclass(minizero.ZeRO3, minizero.ZeRO2)
    assert issubclass(minizero.ZeRO2, minizero.ZeRO1)
    assert issubclass(minizero.ZeRO1, minizero.DDP)


def minizero_classes(tree: ast.AST) -> dict[str, type]:
    """Names a lesson source binds to minizero classes (``from minizero.zero1 import ZeRO1``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero"):
            module = importlib.import_module(node.module)
            for a in node.names:
                obj = getattr(module, a.name, None)
                if isinstance(obj, type):
                    out[a.asname or a.name] = obj
    return out


def lesson_overrides(source: str) -> list[tuple[int, str, type, str]]:
    """(line, class, minizero base, method) for every method a lesson class defines on top of
    a minizero class."""
    tree = ast.parse(source)
    bases = minizero_classes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for b in node.bases:
                if isinstance(b, ast.Name) and b.id in bases:
                    out += [(f.lineno, node.name, bases[b.id], f.name) for f in node.body
                            if isinstance(f, ast.FunctionDef)]  # fmt: skip
    return out


def private_self_uses(source: str) -> list[str]:
    """``self._x`` inside a lesson class built on a minizero class."""
    tree = ast.parse(source)
    bases = minizero_classes(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in bases for b in node.bases
        ):
            bad += [f"{node.name}:{a.lineno} self.{a.attr}" for a in ast.walk(node)
                    if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                    and a.value.id == "self" and private(a.attr)]  # fmt: skip
    return bad


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_lessons_override_only_public_documented_hooks(source):
    """A method a lesson writes on a minizero class is a public hook the base defines and its
    stage's docstring documents ("What lesson NN asks you to write"); no ``self._x``."""
    text = source.read_text()
    for line, cls, base, name in lesson_overrides(text):
        where = f"{source.name}:{line} {cls}.{name}"
        assert not private(name), f"{where} overrides a private name of {base.__name__}"
        assert hasattr(base, name), f"{where} is not a hook of {base.__name__}"
        owner = next(c for c in base.__mro__ if name in c.__dict__)
        doc = owner.__doc__ or ""
        if owner.__module__.startswith("minizero.zero"):  # the stage the lesson teaches
            assert f"What lesson {source.stem[:2]} asks you to write" in doc, where
            assert f"``{name}(" in doc, f"{where}: not documented in {owner.__name__}'s docstring"
    assert not private_self_uses(text), f"{source.name}: {private_self_uses(text)}"


def test_the_override_check_sees_a_private_override():
    text = "from minizero.zero1 import ZeRO1\nclass Mine(ZeRO1):\n    def _reduce(self):\n" \
        "        self._x = 1\n"  # fmt: skip
    assert lesson_overrides(text)[0][1:] == ("Mine", __import__("minizero").ZeRO1, "_reduce")
    assert private_self_uses(text) == ["Mine:4 self._x"]


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
        "minizero.tools.demo:3 imports minizero.launcher._seconds",
        "minizero.tools.demo:5 uses minizero.collectives._sizes",
        "minizero.tools.demo:7 uses minizero.launcher._JOIN",
    ]
    assert private_uses(tree, "minizero.launcher") == [
        "minizero.launcher:5 uses minizero.collectives._sizes"
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
            names = module.__all__ if node.names[0].name == "*" else [a.name for a in node.names]
            for name in names:
                found = hasattr(module, name) or is_module(f"{node.module}.{name}")
                assert found, f"{source.name}:{node.lineno}: {node.module} has no {name}"
    modules = minizero_modules(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                module = importlib.import_module(modules[node.value.id])
                assert hasattr(module, node.attr) or is_module(f"{module.__name__}.{node.attr}"), (
                    f"{source.name}:{node.lineno}: {modules[node.value.id]} has no {node.attr}"
                )


def test_the_design_pages_table_of_concepts_matches_the_tree():
    """Every file the table of docs/design.md names exists, and every library module and
    subpackage has a row (a file named bare, ``x.py``, sits in the folder the row named last)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| concept | file |") :].split("\n\n")[0].splitlines()[2:]
    named = set()
    for row in table:
        folder = None
        for ref in re.findall(r"`([\w/.]+)`", row.split("|")[2]):
            if ref.startswith("minizero/"):
                path = ROOT / ref
                folder = path if ref.endswith("/") else path.parent
            else:
                assert folder is not None, f"{ref!r} in a row that names no folder first: {row}"
                path = folder / ref
            path = path.with_name(path.name.replace("NN", "01"))  # lessonNN.py: each lesson's
            assert path.exists(), f"docs/design.md names {ref}, which does not exist ({path})"
            named.add(path.resolve())
    top = [p for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    subpackages = [p.parent for p in PACKAGE.glob("*/__init__.py") if p.parent.name != "course"]
    seen = lambda p: p.resolve() in named or any(n.is_relative_to(p.resolve()) for n in named)
    missing = [p.relative_to(ROOT).as_posix() for p in top + subpackages if not seen(p)]
    assert not missing, f"no row in docs/design.md's table for {missing}"


def test_the_counter_finds_decorated_functions_by_their_first_decorator(tmp_path):
    """A decorated function's code object starts at its first decorator's line: the counter
    finds its span from there (it once looked only at the ``def`` line and skipped them)."""
    src = tmp_path / "m.py"
    src.write_text(
        "class A:\n    '''doc'''\n\n    @property\n    @lambda f: f\n    def f(self):\n"
        "        return 1\n"
    )
    funcs, header_of = CLOSURE.spans(src)
    assert funcs[4] == (4, 7) and funcs[6] == (4, 7)
    assert header_of[4] == header_of[6] == (1, 3)  # class line to the first decorator
    ns: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    assert ns["A"].f.fget.__code__.co_firstlineno == 4  # what sys.setprofile reports


def foreign_minizero_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, code) of every ``x._minizero... = ...`` and ``setattr(x, "_minizero...", ...)`` where
    ``x`` is not ``self`` or ``cls``: minizero writing its own attribute onto an object it does
    not own (the user's optimizer, model or parameter)."""

    def foreign(target: ast.AST) -> bool:
        return not (isinstance(target, ast.Name) and target.id in ("self", "cls"))

    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for a in ast.walk(t):
                if (
                    isinstance(a, ast.Attribute)
                    and a.attr.startswith("_minizero")
                    and foreign(a.value)
                ):
                    out.append((node.lineno, ast.unparse(node).splitlines()[0]))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_minizero")
            and foreign(node.args[0])
        ):
            out.append((node.lineno, ast.unparse(node)))
    return out


def library_files() -> list[Path]:
    """minizero/'s modules, the course machinery and tools/ aside."""
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in ("course", "tools")]  # fmt: skip


def test_minizero_writes_none_of_its_attributes_on_objects_it_does_not_own():
    """What minizero knows of the user's optimizer, model and parameters lives in its own records
    (optimizer.Adopted, habits/module.WRAPPED, units.WHERE), not in attributes written on them
    (docs/design.md, "What minizero changes on your objects")."""
    bad = [f"{p.relative_to(ROOT)}:{line} {code}" for p in library_files()
           for line, code in foreign_minizero_writes(ast.parse(p.read_text()))]  # fmt: skip
    assert not bad, "minizero attributes written on objects it does not own:\n" + "\n".join(bad)
    caught = ast.parse(
        "opt._minizero_full = None\nsetattr(model, '_minizero_by', w)\np._minizero_x += 1\n"
        "self._minizero_ok = 1\nsetattr(self, '_minizero_ok', 1)\nx._other = 1\n"
    )
    assert sorted(line for line, _ in foreign_minizero_writes(caught)) == [1, 2, 3]


def test_one_predicate_says_which_optimizer_states_are_per_element():
    """One implementation moves optimizer state between layouts (minizero/optimizer/state.py),
    with one predicate: no twin of ``per_element`` (``_elementwise``, ``_per_element``) anywhere
    in the library, and the callers use the one."""
    defined = {}
    for p in library_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef) and re.fullmatch(r"_?(per_element|elementwise)",
                                                                  node.name):  # fmt: skip
                defined.setdefault(node.name, []).append(p.relative_to(ROOT).as_posix())
    assert defined == {"per_element": ["minizero/optimizer/state.py"]}, defined
    assert not (PACKAGE / "rebuild.py").exists(), "the state mover is optimizer/state.py's alone"
    for user in ("checkpoint/layout.py", "optimizer/state.py"):
        assert "per_element(" in (PACKAGE / user).read_text(), user


# -- a stage's face: what is read of a wrapper outside the stage files -----------------------------
# The stage files: the base, the chain, stage 3's units, the naive DDP, and parallelize, which
# composes them; everything else reads a wrapper through minizero.seams.Face (docs/design.md,
# "A stage's face").
STAGE_FILES = ("data_parallel", "ddp", "zero1", "zero2", "zero3", "units", "naive_ddp",
               "parallelize")  # fmt: skip
CHAIN = ("DataParallel", "DDP", "ZeRO1", "ZeRO2", "ZeRO3")
# a wrapper, where the code outside the stage files holds one: its names for it
WRAPPER = re.compile(r"(w|wrapper|model|wrapped|(.+\.)?_?wrapper)")


def face_names() -> set[str]:
    from minizero.seams import Face

    return {n for n in vars(Face) if not n.startswith("_")} | set(Face.__annotations__)


def stage_names() -> set[str]:
    """Every attribute and method the chain's classes define (nn.Module's aside)."""
    names = set()
    for file in ("data_parallel", "ddp", "zero1", "zero2", "zero3"):
        tree = ast.parse((PACKAGE / f"{file}.py").read_text())
        for c in [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CHAIN]:
            for n in c.body:
                if isinstance(n, ast.FunctionDef):
                    names.add(n.name)
                elif isinstance(n, ast.Assign):
                    names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            names |= {a.attr for a in ast.walk(c) if isinstance(a, ast.Attribute)
                      and ast.unparse(a.value) == "self"
                      and isinstance(a.ctx, ast.Store)}  # fmt: skip
    return names - set(dir(torch.nn.Module))


def subclass_surfaces() -> dict[str, tuple[set[str], set[str]]]:
    """Chain class -> (the moments a subclass outside the stage files may override, the fields
    it may read beside the face): what the class declares, ``subclass_moments`` and
    ``subclass_reads`` (zero3.py's, for ZeRO++), nothing where it declares none."""
    from minizero.ddp import DDP
    from minizero.zero1 import ZeRO1
    from minizero.zero2 import ZeRO2
    from minizero.zero3 import ZeRO3

    return {c.__name__: (set(vars(c).get("subclass_moments", ())),
                         set(vars(c).get("subclass_reads", ())))
            for c in (DataParallel, DDP, ZeRO1, ZeRO2, ZeRO3)}  # fmt: skip


def face_crossings(
    tree: ast.AST,
    private: set[str],
    me: str,
    surfaces: dict[str, tuple[set[str], set[str]]] | None = None,
    chain: set[str] = frozenset(),
) -> list[str]:
    """Where ``tree`` reads a wrapper attribute in ``private`` (``w.grad_shards``), switches on a
    stage's number (``w.stage > 0``, ``type(w).stage == 3``) or probes a wrapper with
    ``hasattr``/``getattr`` (``hasattr(w, "param_shards")``). ``self`` is a wrapper inside a class
    that extends one of the chain (ZeRO++): there it may read what its base's surface
    (``surfaces``: base -> (moments, reads)) adds to the face, and it may override a method of
    the chain (``chain``) only where the base names it a moment."""
    surfaces, extra, out = surfaces or {}, {}, []
    for c in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        bases = [ast.unparse(b) for b in c.bases if ast.unparse(b) in CHAIN]
        if not bases:
            continue
        moments = set().union(*(surfaces.get(b, ((), ()))[0] for b in bases))
        reads = set().union(*(surfaces.get(b, ((), ()))[1] for b in bases))
        extra |= {id(n): reads for n in ast.walk(c)}
        out += [f"{me}:{f.lineno} overrides {c.name}.{f.name}, not a moment its base names"
                for f in c.body if isinstance(f, ast.FunctionDef)
                and f.name in (chain | private) - moments - {"__init__"}]  # fmt: skip

    def wrapper(node: ast.AST) -> bool:
        held = ast.unparse(node)
        return bool(WRAPPER.fullmatch(held)) or (held == "self" and id(node) in extra)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and wrapper(node.value) and node.attr in private:
            if node.attr not in extra.get(id(node), ()) or ast.unparse(node.value) != "self":
                out.append(f"{me}:{node.lineno} reads {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):  # (the cost model's own Config has a stage number)
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "stage" and (wrapper(s.value) or
                   ast.unparse(s.value).startswith("type(")) for s in sides):  # fmt: skip
                out.append(f"{me}:{node.lineno} switches on a stage number: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") in ("hasattr", "getattr")
            and node.args
            and WRAPPER.fullmatch(ast.unparse(node.args[0]))
        ):
            out.append(f"{me}:{node.lineno} probes a wrapper: {ast.unparse(node)}")
    return sorted(out, key=lambda c: int(c.split(":")[1].split()[0]))


def test_outside_the_stage_files_a_wrapper_is_read_only_through_its_face():
    """The habits, optimizer/, checkpoint/, analysis/, HSDP and ZeRO++ read of a wrapper only
    what ``minizero.seams.Face`` names (nn.Module's own aside): no other attribute of the chain's
    classes, no switch on a stage's number, no ``hasattr`` probe. A subclass of a stage (ZeRO++)
    reads besides only the fields its base declares (``subclass_reads``) and overrides only the
    moments it declares (``subclass_moments``). The stage files and parallelize (which composes
    them) are the chain's inside."""
    face, chain = face_names(), stage_names()
    private, surfaces = chain - face, subclass_surfaces()
    assert {"sharded", "fragments", "step_grads", "held_tensors", "fragment_values"} <= face
    assert {"grad_shards", "flat_params", "averaged", "in_flight", "grad_buffers"} <= private
    assert surfaces["ZeRO3"][1] <= private and surfaces["ZeRO3"][0] <= chain, surfaces["ZeRO3"]
    bad = []
    for path in library_files():
        if path.parent == PACKAGE and path.stem in STAGE_FILES:
            continue
        tree = ast.parse(path.read_text())
        bad += face_crossings(tree, private, module_name(path), surfaces, chain)
    assert not bad, "read outside the stage files, not through the face:\n" + "\n".join(bad)
    caught = ast.parse(
        "w.grad_shards\nw.fragments\nself.wrapper.averaged\nif w.stage > 0: pass\n"
        "hasattr(model, 'param_shards')\nC.reduce_scatter\nclass H(ZeRO2):\n"
        "    x = self.in_flight\ncfg.stage == 3\nclass P(ZeRO3):\n"
        "    def start_gather(self, i):\n        return self.param_shards[i], self.in_flight\n"
        "    def finish_in_flight(self):\n        self.wrapper.param_shards\n"
        "class Q(ZeRO2):\n    def start_gather(self, i):\n        return self.param_shards\n"
    )
    names = {"grad_shards", "averaged", "in_flight", "reduce_scatter", "param_shards",
             "start_gather", "finish_in_flight"}  # fmt: skip
    surface = {"ZeRO3": ({"start_gather"}, {"param_shards"})}
    found = face_crossings(caught, names, "m", surface, names)
    lines = ["m:1", "m:3", "m:4", "m:5", "m:8", "m:12", "m:13", "m:14", "m:16", "m:17"]
    assert [c.split(" ", 1)[0] for c in found] == lines, found


def classes_made_at_run_time(tree: ast.AST) -> list[int]:
    """Lines of every ``type(name, bases, namespace)`` call: a class made at run time."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", "") == "type" and len(n.args) == 3]  # fmt: skip


# The classes minizero makes at run time, each around a class of the user's (docs/design.md, "What
# minizero changes on your objects"); none around a stage.
USER_CLASSES = {
    "minizero/optimizer/__init__.py": "StageStep before the user's optimizer class (attach)",
    "minizero/units.py": "the guarded subclass of a parameter's class (stage 3, set_guard)",
}


def test_nothing_is_inherited_by_accident():
    """Stages 2-3 never make DDP's ``grad_buffers``: no method they inherit from DDP or ZeRO1
    reads them (DDP's ``accumulate`` once did: it is the bucket's ``hold_grad`` now). HSDP is
    data, as FSDP2 keeps it: a stage's ``replicate_group`` option, not a class placed before the
    stage's at run time (``hsdp.hybrid`` once made one, and carried a copy of ZeRO2's
    ``finish_in_flight``): no library module makes a class with ``type(name, bases, ns)`` but
    around a class of the user's (``USER_CLASSES``)."""
    from minizero.ddp import DDP
    from minizero.zero1 import ZeRO1
    from minizero.zero2 import ZeRO2
    from minizero.zero3 import ZeRO3

    for cls in (ZeRO2, ZeRO3):
        for name in dir(cls):
            owner = next((c for c in cls.__mro__ if name in vars(c)), None)
            value = vars(owner)[name] if owner is not None else None
            if owner in (DDP, ZeRO1) and inspect.isfunction(value):
                read = "grad_buffers" in inspect.getsource(value)
                assert not read, f"{cls.__name__} inherits {owner.__name__}.{name}"
    made = {p.relative_to(ROOT).as_posix() for p in library_files()
            if classes_made_at_run_time(ast.parse(p.read_text()))}  # fmt: skip
    assert made == set(USER_CLASSES), f"classes made at run time: {made}"
    hsdp = ast.parse((PACKAGE / "hsdp.py").read_text())
    assert not [n.name for n in hsdp.body if isinstance(n, ast.ClassDef)], "HSDP is data"
    toy = ast.parse("H = type(f'HSDP{s.__name__}', (HSDP, s), {})\ntype(x)\n")
    assert classes_made_at_run_time(toy) == [1]
