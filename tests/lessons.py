"""One execution of each lesson per pytest run, shared by every test of it.

:func:`executed` runs ``solutions/NN.ipynb`` (or ``lessons/NN.ipynb``) once, the way ``grade``
does (``grade.run``: the kit's checks and the grader's verdicts), under the portable CPU kernels
for the solutions (ATen's and oneDNN's plainest code, so that a check whose tolerance suits one
machine's kernels fails here rather than on a student's machine). The result, cells with their
outputs, goes to a folder that every xdist worker of this run shares, under a lock per notebook:
the first test that asks runs it, the others (on any worker) read it.

:func:`needs_exercises` says which given cells of an unsolved lesson use an exercise's name: only
those lessons run unsolved in the fast tier, and only their :func:`stub_cells` (docs/testing.md),
unless the stub is only handed to a lab function that falls back to minizero's own code
(:func:`falls_back`), which a test of that lab runs on a stub.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import pickle
from pathlib import Path

from minizero.course import grade
from minizero.course.margins import KERNELS

ROOT = Path(__file__).resolve().parents[1]
STEMS = sorted(p.stem for p in (ROOT / "course").glob("[0-9][0-9]_*.py"))


def shared_dir(tmp_path_factory) -> Path:
    """A folder of this pytest run that all its xdist workers share (the workers' base
    temporary folders are siblings in it; without xdist, the run's own)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "lesson-runs"
    folder.mkdir(exist_ok=True)
    return folder


def executed(tmp_path_factory, variant: str, stem: str, stubs_only: bool = False) -> grade.Run:
    """``variant/stem.ipynb`` run once in this pytest run (see the module's docstring);
    ``stubs_only``: only its :func:`stub_cells`, a notebook of its own."""
    folder = shared_dir(tmp_path_factory)
    name = f"{variant}-{stem}" + ("-stubs" if stubs_only else "")
    done = folder / f"{name}.pickle"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second asker waits here for the first one's run
        if not done.exists():
            env = KERNELS["portable"] if variant == "solutions" else {}
            path = ROOT / variant / f"{stem}.ipynb"
            if stubs_only:  # the cut notebook in the lessons' folder's place (the kernel's cwd)
                nb = json.loads(path.read_text())
                nb["cells"] = [nb["cells"][i] for i in stub_cells(nb["cells"])]
                path = folder / variant / f"{stem}.ipynb"
                path.parent.mkdir(exist_ok=True)
                path.write_text(json.dumps(nb))
            run = grade.run(path, timeout=900, env=env)
            done.write_bytes(pickle.dumps(run))
        return pickle.loads(done.read_bytes())


def exercise_names(cells: list[dict]) -> set[str]:
    """The top-level names that a notebook's exercise cells define (functions, classes, names)."""
    names: set[str] = set()
    for c in cells:
        if c["cell_type"] == "code" and "exercise" in c["metadata"].get("tags", []):
            for node in ast.parse("".join(c["source"])).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                for target in getattr(node, "targets", []):
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def needs_exercises(cells: list[dict]) -> dict[int, list[str]]:
    """Given code cells (neither an exercise nor a check) that use a name an exercise defines:
    cell index -> those names. In an unsolved lesson these are the given cells that meet a
    ``NotImplementedError``; every other given cell runs as it does in the solution."""
    names, uses = exercise_names(cells), {}
    for i, c in enumerate(cells):
        tags = c["metadata"].get("tags", [])
        if c["cell_type"] != "code" or "exercise" in tags or "check" in tags:
            continue
        used = {n.id for n in ast.walk(ast.parse("".join(c["source"]))) if isinstance(n, ast.Name)}
        if used & names:
            uses[i] = sorted(used & names)
    return uses


def _bound(tree: ast.AST) -> set[str]:
    """Names a cell binds or changes at its top level: assignments (``X =``, ``X.a = ``,
    ``X[k] = ``, ``X += ``), definitions, imports, loop and ``with`` targets."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        targets += [item.optional_vars for item in getattr(node, "items", [])]
        for target in filter(None, targets):
            while isinstance(target, ast.Attribute | ast.Subscript | ast.Starred):
                target = target.value
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def stub_cells(cells: list[dict]) -> list[int]:
    """The code cells of an unsolved lesson that its stubs can change, and what they need: the
    first code cell, the exercises, the checks, the given cells that use an exercise's name
    (:func:`needs_exercises`) or a name such a cell made, and every earlier cell that binds or
    changes a name one of these reads, transitively. Every other code cell is given, identical to
    the solution's (test_notebooks.py), never meets a stub, and ran in the solution's run."""
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    trees = {i: ast.parse("".join(cells[i]["source"])) for i in code}
    tags = {i: cells[i]["metadata"].get("tags", []) for i in code}
    keep = {code[0], *needs_exercises(cells)}
    keep |= {i for i in code if {"exercise", "check"} & set(tags[i])}
    tainted = set().union(*(_bound(trees[i]) for i in keep if i != code[0]))
    reads = {i: {n.id for n in ast.walk(trees[i]) if isinstance(n, ast.Name)} for i in code}
    for i in code:  # and the cells that read what those made (lesson 09's RUNS, from train)
        if i not in keep and reads[i] & tainted:
            keep.add(i)
            tainted |= _bound(trees[i])
    return needed_by(cells, keep)


def needed_by(cells: list[dict], seeds) -> list[int]:
    """``seeds`` (code cell indices), the first code cell, and every earlier code cell that binds
    or changes a name one of these reads, transitively: what running ``seeds`` needs."""
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    trees = {i: ast.parse("".join(cells[i]["source"])) for i in code}
    reads = {i: {n.id for n in ast.walk(trees[i]) if isinstance(n, ast.Name)} for i in code}
    keep = {code[0], *seeds}
    todo = sorted(keep)
    while todo:
        i = todo.pop()
        for j in code:
            if j < i and j not in keep and reads[i] & _bound(trees[j]):
                keep.add(j)
                todo.append(j)
    return sorted(keep)


def lesson_cells(stem: str, variant: str = "lessons") -> list[dict]:
    return json.loads((ROOT / variant / f"{stem}.ipynb").read_text())["cells"]


# Lab functions that run minizero's own code in place of an exercise not yet written, each with
# a test that runs it on a stub and every given cell after it on what it returns:
# lab.train_every_stage (lesson 09): tests/course/test_lab09.py, test_until_train_is_written_...
FALLBACKS = {"lab.train_every_stage"}


def falls_back(cells: list[dict]) -> bool:
    """Whether every given cell that uses an exercise's name (:func:`needs_exercises`) uses it
    only as the first argument of a :data:`FALLBACKS` call (and there is such a cell)."""
    uses, names = needs_exercises(cells), exercise_names(cells)
    for i in uses:
        tree = ast.parse("".join(cells[i]["source"]))
        handed = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in FALLBACKS
        }
        used = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names]
        if any(id(n) not in handed for n in used):
            return False
    return bool(uses)


# The lessons whose unsolved run is in the fast tier: a given cell meets an exercise's stub, other
# than through a FALLBACKS call (lesson 09's train: its fallback is test_lab09.py's).
UNSOLVED_FAST = [
    stem for stem in STEMS
    if needs_exercises(lesson_cells(stem)) and not falls_back(lesson_cells(stem))
]  # fmt: skip
