"""The notebook grading runs: the student's, with the kit's check cells put back (nbgrader restores
its test cells the same way), as :mod:`minizero.course.grade` executes it.

Each kit cell is found in the student's notebook by its cell id (``start`` copies them), else by
its exact text. Then, for each exercise of the kit's lesson (:mod:`minizero.course.kit`):

* its check cell runs as the kit wrote it, through :meth:`~minizero.course.grading.Grading.
  run_check`, at the student's check cell when that one is in its place, else where the kit has
  it (before the kit's next cell); the student's check cell never runs. A check cell that is
  missing (**deleted**), lost its tag (**untagged**), was **edited** or **moved** (no longer
  between the exercise's cell and the kit's next cell) is reported with the exercise;
* each given cell its check reads a name from (``NPROCS``) runs as the kit wrote it: after the
  student's version when that one differs (so the student's own additions still run, and the
  kit's values win), where the kit has it when it is gone; the name is captured right after.

A student's other cells run as they are, in their order; a copy of a check cell elsewhere runs as a
plain cell.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import nbformat

from minizero.course import kit

GRADER = "minizero_grader"  # metadata of the cells grading adds: run without history


@dataclass
class Step:
    cell: object  # the nbformat cell to run
    origin: int  # the student's cell it stands for (its index), or where it was inserted
    check: str | None = None  # a check run: the exercise
    label: str | None = None  # how to name it when it raises (a given cell put back)


@dataclass
class Plan:
    steps: list[Step]
    notes: dict[str, list[str]] = field(default_factory=dict)  # exercise -> what was put back


def _hidden(code: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(code, metadata={GRADER: True})


def _grader(token: str, call: str) -> str:
    return f"__import__('minizero.course.grading', fromlist=['state']).state({token!r}).{call}"


def _match(cells: list, lesson: kit.Lesson) -> dict[int, int]:
    """Kit cell index -> the student's cell index: by id, then by exact text (same kind)."""
    ids = {c.get("id"): i for i, c in enumerate(cells)}
    out: dict[int, int] = {}
    for k in lesson.cells:
        if k.id in ids and cells[ids[k.id]].cell_type == k.kind:
            out[k.index] = ids[k.id]
    taken = set(out.values())
    for k in lesson.cells:
        if k.index in out or not k.source.strip():
            continue
        same = next(
            (i for i, c in enumerate(cells)
             if i not in taken and c.cell_type == k.kind and c.source.strip() == k.source.strip()),
            None,
        )  # fmt: skip
        if same is not None:
            out[k.index] = same
            taken.add(same)
    return out


def _next_place(lesson: kit.Lesson, index: int, where: dict[int, int], n: int) -> int:
    """The student's index of the first kit cell after ``index`` that they still have."""
    return next((where[j] for j in range(index + 1, len(lesson.cells)) if j in where), n)


def plan(nb, lesson: kit.Lesson, token: str, verdicts: str) -> Plan:
    cells = list(nb.cells)
    n = len(cells)
    where = _match(cells, lesson)
    before: dict[int, list[Step]] = {}  # student index -> steps to run before that cell
    after: dict[int, list[Step]] = {}  # student index -> steps to run right after it
    replaced: dict[int, Step] = {}  # student index -> the step that runs in its place
    notes: dict[str, list[str]] = {}
    dropped: set[int] = set()
    spec = json.dumps(kit.spec(lesson))
    prelude = (
        f"__import__('minizero.course.grading', fromlist=['begin']).begin({token!r}, "
        f"__import__('json').loads({spec!r}), {verdicts!r})"
    )
    captures: dict[int, list[str]] = {}
    for e in lesson.exercises:
        for g, names in e.captures.items():
            captures.setdefault(g, [])
            captures[g] += [x for x in names if x not in captures[g]]
    for g, names in sorted(captures.items()):
        k = lesson.cells[g]
        capture = Step(_hidden(_grader(token, f"capture({names!r})")), where.get(g, -1))
        kit_cell = Step(_hidden(k.source), where.get(g, -1), label=f"the kit's given cell {g}")
        users = [e.name for e in lesson.exercises if g in e.captures]
        if g in where and cells[where[g]].source.strip() == k.source.strip():
            after.setdefault(where[g], []).append(capture)
            continue
        if g in where:
            after.setdefault(where[g], []).extend([kit_cell, capture])
            what = f"you edited given cell {where[g]} (the check reads {', '.join(names)} from it)"
            ran = "the kit's version ran after yours"
        else:
            place = _next_place(lesson, g, where, n)
            kit_cell.origin = capture.origin = place
            before.setdefault(place, []).extend([kit_cell, capture])
            what = f"a given cell the check reads {', '.join(names)} from was deleted"
            ran = "the kit's version ran in its place"
        for u in users:
            notes.setdefault(u, []).append(f"{what}: {ran}")
    for e in lesson.exercises:
        k = lesson.cells[e.check]
        tagged = [i for i, c in enumerate(cells) if check_of(c) == e.name]
        mine = tagged[0] if tagged else where.get(e.check)
        prev = max((where[j] for j in range(e.check) if j in where and
                    lesson.cells[j].kind == "code"), default=-1)  # fmt: skip
        nxt = _next_place(lesson, e.check, where, n)
        step = Step(_hidden(_grader(token, f"run_check({e.name!r})")), -1, check=e.name)
        found = []
        if mine is None:
            found.append("the check cell was deleted")
        else:
            if check_of(cells[mine]) != e.name:
                found.append("the check cell lost its tag (metadata.minizero.check)")
            if cells[mine].source.strip() != k.source.strip():
                found.append("the check cell was edited")
            if not prev < mine < nxt:
                found.append("the check cell was moved")
        if found:
            notes.setdefault(e.name, []).insert(
                0, f"{'; '.join(found)}: graded with the kit's check cell"
            )
        if mine is not None and prev < mine < nxt:
            step.origin = mine
            replaced[mine] = step
        else:
            step.origin = nxt
            before.setdefault(nxt, []).append(step)
            if mine is not None:
                dropped.add(mine)
    steps = [Step(_hidden(prelude), -1, label="the grader's preparation")]
    for i, c in enumerate(cells):
        steps += before.get(i, [])
        if i in replaced:
            steps.append(replaced[i])
        elif i not in dropped:
            if check_of(c) is not None:  # a copy of a check: a plain cell now
                c = nbformat.from_dict(dict(c, metadata={}))
            steps.append(Step(c, i))
        steps += after.get(i, [])
    steps += before.get(n, [])
    return Plan(steps, notes)


def check_of(cell) -> str | None:
    return cell.get("metadata", {}).get("minizero", {}).get("check")
