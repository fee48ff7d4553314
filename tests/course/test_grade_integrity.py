"""A grade means the student wrote it (issue 31): `grade` and `gradebook` run the kit's own check
cells, with the grader's own references, whatever the notebook did to its check cells or to the
functions a check relies on, and report what they put back. Each cheat below passed before.
The cheating notebooks are in tests/cheats.py."""

from __future__ import annotations

import nbformat
from cheats import L00, L08, ROOT, cell_of, cut, structural_cheats, write

from minizero.course import grade, kit, restore


# -- the plan: what is put back, without a kernel ----------------------------------------------
def test_the_plan_names_each_check_put_back_and_runs_every_exercises_check():
    nb = structural_cheats()
    plan = restore.plan(nb, kit.lesson(L08), "t0", "/dev/null")
    assert [s.check for s in plan.steps if s.check] == [
        "hsdp_reduce", "quantize", "predict_step_time", "choose"
    ]  # fmt: skip
    assert plan.notes == {
        "hsdp_reduce": ["the check cell lost its tag (metadata.minizero.check): graded with the "
                        "kit's check cell"],
        "quantize": ["the check cell was edited: graded with the kit's check cell"],
        "predict_step_time": ["the check cell was deleted: graded with the kit's check cell"],
    }  # fmt: skip
    ran = "".join(s.cell.source for s in plan.steps)
    assert 'print("PASS  quantize")' not in ran and "lesson08.check_choose = lambda" in ran


def test_a_moved_check_runs_in_its_place_and_an_edited_given_cell_runs_the_kits_after():
    nb = cut(L00, "solutions")
    check = cell_of(nb, check="all_reduce_via_rs_ag")
    nb.cells.remove(check)
    nb.cells.insert(0, check)  # before the function it checks
    nb.cells[1].source += "\nNPROCS = 1"  # the given cell the check reads NPROCS from
    plan = restore.plan(nb, kit.lesson(L00), "t0", "/dev/null")
    assert plan.notes["all_reduce_via_rs_ag"] == [
        "the check cell was moved: graded with the kit's check cell",
        "you edited given cell 1 (the check reads NPROCS from it): the kit's version ran after "
        "yours",
    ]
    order = [s.check or s.label or s.origin for s in plan.steps]
    assert order == ["the grader's preparation", 1, "the kit's given cell 1", 1, 2,
                     "all_reduce_via_rs_ag"]  # fmt: skip


def test_a_check_module_from_a_lessons_star_import_is_the_graders_own():
    """Every lesson opens with ``from minizero.course.labs.lessonNN import *``: the names its
    ``__all__`` lists (``lesson08``, the check module) are imports the grader makes itself."""
    for stem in (L00, L08):
        lesson = kit.lesson(stem)
        assert lesson.imports == f"from minizero.course.labs.lesson{stem[:2]} import *"
        assert {n for e in lesson.exercises for n in e.imports} == {f"lesson{stem[:2]}"}
    assert kit._star_names("minizero.course.labs.lesson08")[:3] == ["hint", "lab", "minizero"]
    assert kit._star_names("os") == []  # only minizero's modules are read


def test_the_solutions_restore_nothing():
    for stem in kit.stems():
        nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
        plan = restore.plan(nb, kit.lesson(stem), "t0", "/dev/null")
        assert plan.notes == {}, stem
        assert len([s for s in plan.steps if s.check]) == len(kit.lesson(stem).exercises)


# -- what grade prints (the kernel runs are in test_gradebook and test_notebooks) ---------------
def test_grade_prints_every_exercise_with_what_was_put_back_and_exits_non_zero(
    tmp_path, monkeypatch, capsys
):
    runs = [grade.CellRun(3, "a", None, 1.0), grade.CellRun(5, "b", "CheckFailed: no", 1.0)]
    notes = {"a": ["the check cell was edited: graded with the kit's check cell"]}
    monkeypatch.setattr(grade, "run", lambda path, timeout: grade.Run(runs, L00, notes))
    write(cut(L00, "lessons"), tmp_path / f"{L00}.ipynb")
    assert grade.grade_main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "  PASS  a\n        note: the check cell was edited: graded with the kit's check " in out
    assert "  FAIL  b\n        CheckFailed: no\n" in out and "1/2 passed" in out
    runs[1].error = None
    assert grade.grade_main([str(tmp_path)]) == 0  # every exercise passed
