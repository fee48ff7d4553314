"""Notebooks that cheat (issue 31), for the grading tests: the kit's lessons cut down to the
cells grading needs (the first code cell, the exercises, the checks): a kernel each runs in
seconds, not a whole lesson's minutes."""

from __future__ import annotations

from pathlib import Path

import nbformat

from minizero.course import kit

ROOT = Path(__file__).resolve().parents[1]
L00, L08 = "00_collectives", "08_beyond_one_node"


def cut(stem: str, variant: str) -> nbformat.NotebookNode:
    """The kit's notebook with only its first code cell, exercises and checks."""
    nb = nbformat.read(ROOT / variant / f"{stem}.ipynb", as_version=4)
    lesson = kit.lesson(stem)
    first = next(c.index for c in lesson.cells if c.kind == "code")
    keep = {first} | {c.index for c in lesson.cells if c.check or c.exercise}
    nb.cells = [c for i, c in enumerate(nb.cells) if i in keep]
    return nb


def cell_of(nb, check: str | None = None, exercise: str | None = None):
    lesson = kit.lesson(Path(nb.metadata.minizero.source).stem)
    index = next(c.index for c in lesson.cells if c.check == check and c.exercise == exercise)
    return next(c for c in nb.cells if c.id == lesson.cells[index].id)


def structural_cheats() -> nbformat.NotebookNode:
    """Lesson 08 unsolved, one cheat per exercise: the issue's table, rows 1 to 3."""
    nb = cut(L08, "lessons")
    cell_of(nb, check="quantize").source = 'print("PASS  quantize")'  # row 1
    cell_of(nb, exercise="choose").source += (  # row 2: the check rebound from the exercise,
        "\nlesson08.check_choose = lambda fn: print('PASS  choose')"  # and the module the check
        "\nimport types\nlesson08 = types.SimpleNamespace(check_choose=print)"  # cell names
    )
    nb.cells.remove(cell_of(nb, check="predict_step_time"))  # row 3: deleted
    cell_of(nb, check="hsdp_reduce").metadata = {}  # row 3: untagged
    return nb


PATCHES = """
import builtins
import torch
import minizero
import minizero.launcher
from minizero.course.checks import common, lesson00

def fake_launch(fn, n, *args, **kwargs):
    return [{"info": {"backend": "gloo", "device": "cpu", "world": 3}, "cases": []}] * 3

torch.equal = lambda a, b: True
torch.allclose = lambda *a, **k: True
minizero.launch = minizero.launcher.launch = common.launch = fake_launch
builtins.print = lambda *a, **k: None
get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)  # errors shown as nothing
"""

NO_PADDING = """
def all_reduce_via_rs_ag(t, group=None):  # wrong: no padding (rank 0 of (1,) keeps its t)
    world = dist.get_world_size(group)
    flat = t.reshape(-1).clone()
    chunk = torch.empty(t.numel() // world)
    reduce_scatter(chunk, flat[: chunk.numel() * world], group=group)
    all_gather(flat[: chunk.numel() * world], chunk, group=group)
    t.copy_(flat.view_as(t))
    return t
"""


def monkeypatches(solved: bool) -> nbformat.NotebookNode:
    """Lesson 00 with every primitive the check relies on rebound, the check cell printing PASS."""
    nb = cut(L00, "solutions" if solved else "lessons")
    if not solved:
        cell_of(nb, exercise="all_reduce_via_rs_ag").source = NO_PADDING
    cell_of(nb, check="all_reduce_via_rs_ag").source = 'print("PASS  all_reduce_via_rs_ag")'
    nb.cells.insert(1, nbformat.v4.new_code_cell(PATCHES))
    return nb


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def solution(stem: str, exercise: str) -> dict:
    """The namespace the kit's solution of ``exercise`` defines (its lesson's imports first):
    always the current solution, whatever the lesson became."""
    import ast

    lesson = kit.lesson(stem)
    cell = next(c for c in lesson.cells if c.exercise == exercise)
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    ns: dict = {}
    for c in lesson.cells[: cell.index]:
        if c.kind == "code":
            tree = ast.parse(c.source)
            imports = [s for s in tree.body if isinstance(s, ast.Import | ast.ImportFrom)]
            exec(compile(ast.Module(imports, []), c.id, "exec"), ns)
    exec(compile(nb.cells[cell.index].source, cell.id, "exec"), ns)
    return ns
