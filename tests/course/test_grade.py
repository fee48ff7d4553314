"""`grade` survives bad files and says where a hung check's ranks were; a check's timeout can be
raised by an option or an environment variable."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

from minizero.course import grade
from minizero.course.checks import common


def tiny(path: Path, ok: bool) -> None:
    """A two-cell notebook whose one check passes when ``ok``."""
    check = nbformat.v4.new_code_cell("assert x == 2, 'x should be 2'")
    check.metadata = {"tags": ["check"], "minizero": {"check": "x_is_two"}}
    cells = [nbformat.v4.new_code_cell(f"x = {2 if ok else 3}"), check]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


BROKEN = {
    "a_not_json.ipynb": "this is not JSON",
    "b_half.ipynb": '{"cells": [{"cell_type": "code", "sou',
    "c_empty_object.ipynb": "{}",
    "d_empty.ipynb": "",
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_read_notebook_says_in_one_line_why_a_file_is_not_a_notebook(tmp_path, name):
    path = tmp_path / name
    path.write_text(BROKEN[name])
    with pytest.raises(grade.Unreadable) as e:
        grade.read_notebook(path)
    assert "\n" not in str(e.value) and str(e.value)


@pytest.mark.timeout(120)
def test_grade_reports_every_unreadable_notebook_and_goes_on(tmp_path, capsys):
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    tiny(tmp_path / "z_good.ipynb", ok=True)
    (tmp_path / "script.py").write_text("print('hi')\n")
    (tmp_path / "README").write_text("# my notes\n")
    args = [str(tmp_path), str(tmp_path / "script.py"), str(tmp_path / "README")]
    assert grade.grade_main(["--timeout", "60", *args]) == 1
    out = capsys.readouterr().out
    for name in [*BROKEN, "script.py", "README"]:
        line = next(ln for ln in out.splitlines() if ln.startswith(f"  ERROR {tmp_path / name}: "))
        assert "Traceback" not in line
    assert "Traceback" not in out
    assert "PASS  x_is_two" in out and "1/7 passed" in out


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan"])
@pytest.mark.parametrize("option", ["--timeout", "--check-timeout"])
def test_grade_refuses_a_timeout_that_is_not_positive(capsys, option, value):
    with pytest.raises(SystemExit) as e:
        grade.grade_main([option, value, "x.ipynb"])
    assert e.value.code == 2
    assert f"argument {option}: '{value}': give a number of seconds > 0" in capsys.readouterr().err


def test_check_timeout_comes_from_the_environment(monkeypatch):
    assert grade.TIMEOUT_ENV == common.TIMEOUT_ENV == "MINIZERO_CHECK_TIMEOUT"
    monkeypatch.delenv(common.TIMEOUT_ENV, raising=False)
    assert common.check_timeout(180.0) == 180.0
    monkeypatch.setenv(common.TIMEOUT_ENV, "600")
    assert common.check_timeout(180.0) == 600.0
    monkeypatch.setenv(common.TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="MINIZERO_CHECK_TIMEOUT='0': give a number of seconds"):
        common.check_timeout()


def test_grade_check_timeout_option_reaches_the_kernels_and_no_further(monkeypatch, tmp_path):
    """The kernels grade starts see --check-timeout; the process that called grade_main (a test,
    a notebook) keeps its own afterwards, so its later checks keep their timeouts."""
    import os

    seen = []

    def run(path, timeout):  # in place of a kernel: what one would inherit
        seen.append(os.environ.get(common.TIMEOUT_ENV))
        return grade.Run([], None)

    monkeypatch.setattr(grade, "run", run)
    tiny(tmp_path / "a.ipynb", ok=True)
    monkeypatch.delenv(common.TIMEOUT_ENV, raising=False)
    grade.grade_main(["--check-timeout", "450", str(tmp_path)])
    assert seen == ["450"] and common.TIMEOUT_ENV not in os.environ
    monkeypatch.setenv(common.TIMEOUT_ENV, "99")
    grade.grade_main(["--check-timeout", "450", str(tmp_path)])
    assert seen == ["450", "450"] and os.environ[common.TIMEOUT_ENV] == "99"


def _stuck_rank() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # ranks 1 and 2 never join it
    else:
        time.sleep(600)


@pytest.mark.timeout(120)
def test_a_hung_check_shows_where_each_rank_was(monkeypatch):
    monkeypatch.setenv(common.TIMEOUT_ENV, "4")
    with pytest.raises(common.CheckFailed) as e:
        common.launch_check(_stuck_rank, 2)
    msg = str(e.value)
    assert "ranks [0, 1, 2] had not finished after 4 s" in msg
    where = msg.split("Where they were:", 1)[1]
    assert "rank 0:" in where and "rank 2:" in where and "all_reduce" in where
    assert where.count("_stuck_rank") == 3  # each rank's own stack (a check runs 3 ranks)
    assert "--check-timeout 600" in msg


# -- an error before a check: one failure of that exercise, named ---------------------------------
def test_a_syntax_error_in_an_exercise_is_one_failure_named_as_such(tmp_path, capsys):
    check = nbformat.v4.new_code_cell("assert f() == 2, 'f() should be 2'")
    check.metadata = {"tags": ["check"], "minizero": {"check": "my_f"}}
    cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("def f(:\n  return 2"),
             check]  # fmt: skip
    path = tmp_path / "one_exercise.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert grade.grade_main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  my_f\n        a syntax error in your code for my_f (cell 1): SyntaxError" in out
    assert "not a check" not in out and "NameError" not in out
    assert "0/1 passed" in out


def _run(index, check=None, error=None):
    return grade.CellRun(index, check, error, 0.0)


def test_outcomes_attribute_errors_to_the_next_failed_check_only():
    runs = [
        _run(0, error="RuntimeError: a plot failed"),  # before a check that passes: an ERROR
        _run(1, "a"),
        _run(2, error="NameError: name 'torch' is not defined"),
        _run(3, "b", "NameError: name 'MyZeRO1' is not defined"),
        _run(4, error="ValueError: after the last check"),
    ]
    got = [(o.status, o.label, (o.message or "")[:40]) for o in grade.outcomes(runs)]
    assert got == [
        ("ERROR", "cell 0 (not a check)", "RuntimeError: a plot failed"),
        ("PASS", "a", ""),
        ("FAIL", "b", "cell 2, before the check, raised NameErr"),
        ("ERROR", "cell 4 (not a check)", "ValueError: after the last check"),
    ]


# -- widget cells: built only where a front end shows them (jupyter/nbclient#312) ---------------
WIDGET_CELL = """\
from minizero.course import plots
shown = []
if plots.widgets_available():
    import ipywidgets
    ipywidgets.interact(lambda cap: shown.append(cap), cap=ipywidgets.Dropdown(options=[1, 2]))
assert not shown, "a graded run built a widget"  # interact() calls it once, at once
"""


LAB = {"JPY_SESSION_NAME": "x"}  # what a Jupyter server gives the kernels it starts


@pytest.mark.parametrize(("env", "want"), [({}, False), (LAB, True),
                                           ({**LAB, "MINIZERO_WIDGETS": "0"}, False),
                                           ({"MINIZERO_WIDGETS": "1"}, True)])  # fmt: skip
def test_widgets_are_built_only_where_a_front_end_shows_them(monkeypatch, env, want):
    from minizero.course import plots

    for k in ("JPY_SESSION_NAME", "MINIZERO_WIDGETS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert plots.widgets_available() is want


def graded_widget_cells(tmp_path: Path, monkeypatch, runs: int) -> None:
    """Even from a JupyterLab terminal (JPY_SESSION_NAME set), graded kernels build no widget, so
    no cell waits for a reply nbclient missed (the cell asserts that it built none): each of
    ``runs`` runs finishes both cells within the 20 s --timeout (a cell past it is an error)."""
    monkeypatch.setenv("JPY_SESSION_NAME", "a-lab-terminal")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(WIDGET_CELL), nbformat.v4.new_code_cell("print('next')")]
    path = tmp_path / "w.ipynb"
    nbformat.write(nb, path)
    for _ in range(runs):
        runs_ = grade.execute(path, timeout=20)
        assert [r.error for r in runs_] == [None, None]
    out = nbformat.read(path, as_version=4)  # grade never writes the notebook it ran
    assert not any(c.get("outputs") for c in out.cells)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grade_never_waits_out_its_timeout_on_a_widget_cell(tmp_path, monkeypatch):
    graded_widget_cells(tmp_path, monkeypatch, 1)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grade_never_waits_out_its_timeout_on_a_widget_cell_run_after_run(tmp_path, monkeypatch):
    """The rate: 8 runs (nbclient missed a reply in some runs, not all)."""
    graded_widget_cells(tmp_path, monkeypatch, 8)
