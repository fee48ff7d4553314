"""Every lesson executed: each solution once per pytest run (tests/lessons.py), shared by the three
tests of it, which assert what nbval asserted (no cell raises), what grading says (every exercise
PASS) and what a student sees (every figure cell shows an image); each unsolved lesson fails
exactly at its check cells.

A class per lesson: xdist (``--dist loadscope``) hands a lesson's tests to one worker, and
different lessons to different workers. The unsolved lessons' full runs are in the soak tier: their
given cells are the solution's own (test_notebooks.py), and those that meet no exercise's stub,
directly or through what such a cell made, run as the solution's run did. The fast tier runs, for
the lessons with a given cell that meets a stub (``UNSOLVED_FAST``: 05, 08), the cells a stub can
change (``stub_cells``); the check cells' failure on a stub is asserted there, by the browser test
on lesson 00, and by test_checks_reject.py. Lesson 09 meets its stub only through
``lab.train_every_stage(train, ...)``, which runs minizero's own loop until ``train`` is written:
test_lab09.py runs that on a stub, and every given cell's call after it on what it returns."""

from __future__ import annotations

import re

import pytest

from lessons import (
    STEMS,
    UNSOLVED_FAST,
    executed,
    falls_back,
    lesson_cells,
    needs_exercises,
    stub_cells,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# A cell that draws: a lab plot_ call, a figure a show_ call draws ("# and its figure"), plt.show()
FIGURE = re.compile(r"^(\w+\.)?plot_\w+\(|# and its figure|^plt\.show\(\)", re.M)


def _shown_as_text(output) -> str:
    """A stream's text, or a rich output's text/plain where it has no image beside it."""
    data = output.get("data", {})
    return output.get("text", "") + ("" if "image/png" in data else data.get("text/plain", ""))


class LessonRuns:
    """The tests of one lesson; a subclass per lesson names it (``stem``)."""

    stem: str

    def test_solution_runs_without_an_error(self, tmp_path_factory):
        run = executed(tmp_path_factory, "solutions", self.stem)
        errors = {r.index: r.error for r in run.runs if r.error and not r.check}
        assert errors == {}, f"{self.stem}: cells that raised: {errors}"
        assert any(r.check for r in run.runs), f"{self.stem}: no check cell ran"

    def test_solution_passes_every_exercise(self, tmp_path_factory):
        run = executed(tmp_path_factory, "solutions", self.stem)
        checks = {r.check: r.error for r in run.runs if r.check}
        want = {c["metadata"]["minizero"]["check"] for c in lesson_cells(self.stem, "solutions")
                if c["metadata"].get("minizero", {}).get("check")}  # fmt: skip
        assert set(checks) == want, f"{self.stem}: checks graded {sorted(checks)}, not {want}"
        assert {k: v for k, v in checks.items() if v} == {}, f"{self.stem}: FAIL"
        assert all(not v for v in run.fails.values()) and not any(run.notes.values()), run

    def test_solution_shows_every_figure_as_an_image(self, tmp_path_factory):
        run = executed(tmp_path_factory, "solutions", self.stem)
        cells = [c for c in run.notebook.cells if c.cell_type == "code"]
        drawn = 0
        for i, cell in enumerate(cells):
            # what shows as text: streams, and the text of an output with no image beside it
            text = "".join(_shown_as_text(o) for o in cell.outputs)
            where = f"{self.stem}, code cell {i}:\n{cell.source[:300]}"
            assert not re.search(r"<Figure size \d+x\d+", text), f"{where}\na figure as text"
            pngs = sum("image/png" in o.get("data", {}) for o in cell.outputs)
            if FIGURE.search(cell.source):
                assert pngs, f"{where}\ndrew no image: {text[:300]!r}"
            drawn += pngs
        assert drawn, f"{self.stem}: no figure at all"

    @pytest.mark.soak
    def test_unsolved_fails_exactly_at_the_check_cells(self, tmp_path_factory):
        assert_fails_at_checks(executed(tmp_path_factory, "lessons", self.stem).runs)

    def test_unsolved_cells_that_meet_a_stub_fail_exactly_at_the_check_cells(
        self, tmp_path_factory
    ):
        """The unsolved lesson's :func:`stub_cells` only: the other cells are the solution's."""
        runs = executed(tmp_path_factory, "lessons", self.stem, stubs_only=True).runs
        assert_fails_at_checks(runs)


def assert_fails_at_checks(runs) -> None:
    """Every cell that raised is a check cell and every check cell raised, naming its TODO."""
    failed = {r.index: r.error for r in runs if r.error}
    check_cells = {r.index for r in runs if r.check}
    assert set(failed) == check_cells, failed
    for i in check_cells:  # the TODO named, and nothing else (no guess at what went wrong)
        assert "CheckFailed" in failed[i] and "NotImplementedError: TODO: write" in failed[i]
        said = failed[i].split("NotImplementedError: TODO: write", 1)[1].splitlines()[0]
        assert re.fullmatch(r" [\w.]+(\(\))?( \(at line \d+: .*\))?\.?", said), failed[i]
        assert "ranks" not in said and "assumed 2" not in failed[i], failed[i]


for _stem in STEMS:
    _attrs = {"stem": _stem, "__module__": __name__}
    if _stem not in UNSOLVED_FAST:  # no given cell meets a stub: the soak tier's full run only
        _attrs["test_unsolved_cells_that_meet_a_stub_fail_exactly_at_the_check_cells"] = None
    globals()[f"TestLesson{_stem[:2]}"] = type(f"TestLesson{_stem[:2]}", (LessonRuns,), _attrs)


def test_the_fast_tier_runs_every_unsolved_lesson_that_meets_a_stub():
    """The condition that puts the other unsolved runs in the soak tier, checked on every run:
    the fast set is exactly the lessons with a given cell that uses an exercise's name other than
    by handing it to a lab function that falls back (lesson 09's), and the analysis finds such a
    use (lesson 05's budget calls predict_peak)."""
    uses = {stem: needs_exercises(lesson_cells(stem)) for stem in STEMS}
    assert UNSOLVED_FAST == [s for s in STEMS if uses[s] and not falls_back(lesson_cells(s))]
    assert any("predict_peak" in names for names in uses["05_all_stages"].values()), uses
    # lesson 09 meets its stub only in lab.train_every_stage(train, ...): test_lab09.py's
    assert uses["09_capstone"] and falls_back(lesson_cells("09_capstone"))
    assert not falls_back(lesson_cells("05_all_stages"))
    assert UNSOLVED_FAST == ["05_all_stages", "08_beyond_one_node"]
    probe = [
        {"cell_type": "code", "metadata": {"tags": ["exercise"]}, "source": "def f():\n    pass"},
        {"cell_type": "code", "metadata": {}, "source": "x = [f() for _ in range(2)]"},
        {"cell_type": "code", "metadata": {"tags": ["check"]}, "source": "check(f)"},
        {"cell_type": "code", "metadata": {}, "source": "g = 1"},
    ]
    assert needs_exercises(probe) == {1: ["f"]}
    probe += [  # what the stub made, read later; a cell that mutates what a kept cell reads
        {"cell_type": "code", "metadata": {}, "source": "print(x)"},
        {"cell_type": "code", "metadata": {}, "source": "h = g + 1"},
    ]
    probe.insert(1, {"cell_type": "code", "metadata": {}, "source": "import os\nos.n = 1"})
    probe.insert(0, {"cell_type": "code", "metadata": {}, "source": "import sys"})
    probe[3]["source"] = "x = [f() for _ in range(os.n)]"  # reads what cell 2 changed
    assert stub_cells(probe) == [0, 1, 2, 3, 4, 6]  # not g = 1, not h = g + 1
    assert not falls_back(probe)
    fallback = [
        {"cell_type": "code", "metadata": {"tags": ["exercise"]}, "source": "def f():\n    pass"},
        {"cell_type": "code", "metadata": {}, "source": "R = lab.train_every_stage(f, 1)"},
    ]
    assert falls_back(fallback)
    fallback[1]["source"] += "\nf()"  # the stub called outside the fallback
    assert not falls_back(fallback)
    cut = {s: len(stub_cells(lesson_cells(s))) for s in STEMS if needs_exercises(lesson_cells(s))}
    assert cut == {"05_all_stages": 11, "08_beyond_one_node": 11, "09_capstone": 7}, cut
