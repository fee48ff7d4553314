"""A grade means the student wrote it (issue 31): `grade` and `gradebook` run the kit's own check
cells, with the grader's own references, whatever the notebook did to its check cells or to the
functions a check relies on, and report what they put back. Each cheat below passed before.
The cheating notebooks are in tests/cheats.py."""

from __future__ import annotations

import nbformat
import pytest
from cheats import L00, L08, ROOT, cell_of, cut, monkeypatches, structural_cheats, write

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


def test_the_solutions_restore_nothing():
    for stem in kit.stems():
        nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
        plan = restore.plan(nb, kit.lesson(stem), "t0", "/dev/null")
        assert plan.notes == {}, stem
        assert len([s for s in plan.steps if s.check]) == len(kit.lesson(stem).exercises)


# -- in a kernel: grade and gradebook ----------------------------------------------------------
@pytest.mark.timeout(300)
def test_grade_fails_every_cheat_names_it_and_exits_non_zero(tmp_path, capsys):
    cheats = write(monkeypatches(solved=False), tmp_path / f"{L00}.ipynb")
    assert grade.grade_main(["--timeout", "120", str(cheats)]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  all_reduce_via_rs_ag\n        CheckFailed: wrong sum for a tensor of shape (1,)"
        in out
    )
    note = out.split("note: ", 1)[1]
    assert note.startswith("the check cell was edited: graded with the kit's check cell; your "
                           "notebook rebound ")  # fmt: skip
    for name in ("builtins.print", "torch.equal", "torch.allclose", "minizero.launch"):
        assert name in note
    assert "0/1 passed" in out
