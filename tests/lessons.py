"""One execution of each lesson per pytest run, shared by every test of it.

:func:`executed` runs ``solutions/NN.ipynb`` (or ``lessons/NN.ipynb``) once, the way ``grade``
does (``grade.run``: the kit's checks and the grader's verdicts), under the portable CPU kernels
for the solutions (ATen's and oneDNN's plainest code, so that a check whose tolerance suits one
machine's kernels fails here rather than on a student's machine). The result, cells with their
outputs, goes to a folder that every xdist worker of this run shares, under a lock per notebook:
the first test that asks runs it, the others (on any worker) read it.

:func:`needs_exercises` says which given cells of an unsolved lesson use an exercise's name: only
those lessons need their unsolved run in the fast tier (docs/testing.md).
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


def executed(tmp_path_factory, variant: str, stem: str) -> grade.Run:
    """``variant/stem.ipynb`` run once in this pytest run (see the module's docstring)."""
    folder = shared_dir(tmp_path_factory)
    done = folder / f"{variant}-{stem}.pickle"
    with open(folder / f"{variant}-{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second asker waits here for the first one's run
        if not done.exists():
            env = KERNELS["portable"] if variant == "solutions" else {}
            run = grade.run(ROOT / variant / f"{stem}.ipynb", timeout=900, env=env)
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


def lesson_cells(stem: str, variant: str = "lessons") -> list[dict]:
    return json.loads((ROOT / variant / f"{stem}.ipynb").read_text())["cells"]


# The lessons whose unsolved run is in the fast tier: a given cell meets an exercise's stub.
UNSOLVED_FAST = [stem for stem in STEMS if needs_exercises(lesson_cells(stem))]
