"""The student's workflow cannot lose work: `start` copies the lessons into a folder of the
student's own and never overwrites a copy they changed; `lessons` never overwrites a generated
notebook someone edited; `grade` grades the student's folder by default.

XX
lessons/, solutions/ or a student's my-lessons/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from minizero.__main__ import main
from minizero.course import build, grade, workflow

ROOT = Path(__file__).resolve().parents[2]
STEM = sorted(p.stem for p in (ROOT / "course").glob("[0-9][0-9]_*.py"))[0]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkout of the course in ``tmp_path/kit``: sources and freshly generated notebooks."""
    kit = tmp_path / "kit"
    shutil.copytree(ROOT / "course", kit / "course")
    assert build.lessons_main(["--root", str(kit)]) == 0
    return kit


def student_edit(path: Path) -> bytes:
    """What JupyterLab saves after a student wrote code in the first exercise cell and ran it."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "exercise" in c.metadata.get("tags", []))
    cell.source = cell.source.replace('raise NotImplementedError("TODO', "pass  # mine (TODO")
    cell.execution_count = 1
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="my output\n")]
    nb.metadata.kernelspec.display_name = "Python 3"
    nbformat.write(nb, path)
    return path.read_bytes()


def change_source(root: Path) -> None:
    src = root / "course" / f"{STEM}.py"
    src.write_text(src.read_text() + "\n# %%\nprint('a cell the instructor added')\n")


# -- the fingerprint ----------------------------------------------------------------------------
def test_every_committed_notebook_carries_its_fingerprint():
    for variant in build.VARIANTS:
        for nb in sorted((ROOT / variant).glob("*.ipynb")):
            assert build.hand_edited(nb) is None, nb


def test_the_fingerprint_sees_an_edit_but_not_a_reformatting(root):
    path = root / "lessons" / f"{STEM}.ipynb"
    nb = json.loads(path.read_text())
    path.write_text(json.dumps(nb, indent=4))  # same notebook, other JSON layout
    assert build.hand_edited(path) is None
    nb["cells"][0]["source"].append("one more line")
    path.write_text(json.dumps(nb))
    assert "was edited (or run and saved)" in build.hand_edited(path)
    del nb["metadata"]["minizero"]["sha256"]
    path.write_text(json.dumps(nb))
    assert "no generator fingerprint" in build.hand_edited(path)
    path.write_text("not json")
    assert "no generator fingerprint" in build.hand_edited(path)


# -- `lessons` never overwrites an edited notebook ----------------------------------------------
@pytest.mark.parametrize("source_changed", [False, True])
def test_lessons_refuses_to_overwrite_a_notebook_someone_edited(root, capsys, source_changed):
    lesson = root / "lessons" / f"{STEM}.ipynb"
    solution = root / "solutions" / f"{STEM}.ipynb"
    mine = student_edit(lesson)
    before = solution.read_bytes()
    if source_changed:
        change_source(root)
    capsys.readouterr()
    assert build.lessons_main(["--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert (
        f"error: not overwriting lessons/{STEM}.ipynb: it was edited (or run and saved) after "
        "`minizero lessons` wrote it" in err
    )
    assert "Nothing was written. Move each file named above out of lessons/" in err
    assert lesson.read_bytes() == mine  # the student's work survives, byte for byte
    assert solution.read_bytes() == before  # and nothing else was written either
    # --check names it too, and says why
    assert build.lessons_main(["--root", str(root), "--check"]) == 1
    assert f"stale: lessons/{STEM}.ipynb (edited by hand)" in capsys.readouterr().err
    # once the student's file is moved away, regeneration goes through
    lesson.rename(root / "mine.ipynb")
    assert build.lessons_main(["--root", str(root)]) == 0
    assert build.lessons_main(["--root", str(root), "--check"]) == 0
    assert (root / "mine.ipynb").read_bytes() == mine


def test_lessons_rewrites_an_untouched_notebook_when_its_source_changes(root, capsys):
    change_source(root)
    capsys.readouterr()
    assert build.lessons_main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    n = len(build.generate(root))
    assert out.splitlines() == [
        f"wrote lessons/{STEM}.ipynb",
        f"wrote solutions/{STEM}.ipynb",
        f"2 notebooks written, {n - 2} already up to date, in lessons/ and solutions/",
    ]
    text = (root / "lessons" / f"{STEM}.ipynb").read_text()
    assert "a cell the instructor added" in text
    assert build.lessons_main(["--root", str(root), "--check"]) == 0
    assert capsys.readouterr().out == (
        f"lessons/ and solutions/ are up to date with course/ ({n} notebooks)\n"
    )
    assert build.lessons_main(["--root", str(root)]) == 0
    assert capsys.readouterr().out == (
        f"0 notebooks written, {n} already up to date, in lessons/ and solutions/\n"
    )


def test_lessons_refuses_a_notebook_without_fingerprint(root, capsys):
    path = root / "solutions" / f"{STEM}.ipynb"
    nb = json.loads(path.read_text())
    del nb["metadata"]["minizero"]["sha256"]
    path.write_text(json.dumps(nb))
    capsys.readouterr()
    assert build.lessons_main(["--root", str(root)]) == 1
    assert (
        f"error: not overwriting solutions/{STEM}.ipynb: it has no generator fingerprint"
        in capsys.readouterr().err
    )
    assert json.loads(path.read_text()) == nb


# -- `start`: the student's own copies -----------------------------------------------------------
def test_start_copies_every_lesson_then_keeps_what_the_student_changed(root, tmp_path, capsys):
    mine = tmp_path / "mine"
    capsys.readouterr()
    assert main(["start", str(mine), "--root", str(root)]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in (root / "lessons").glob("*.ipynb"))
    assert sorted(p.name for p in mine.glob("*.ipynb")) == names
    for name in names:
        assert (mine / name).read_bytes() == (root / "lessons" / name).read_bytes()
        assert f"copied  {mine / name}" in out
    assert f"grade them with `python -m minizero grade {mine}`" in out

    edited = student_edit(mine / f"{STEM}.ipynb")
    untouched = mine / names[-1]
    change_source(root)  # a new version of the first lesson...
    last = root / "course" / f"{Path(names[-1]).stem}.py"
    last.write_text(last.read_text() + "\n# %%\nprint('new')\n")  # ...and of the last one
    assert build.lessons_main(["--root", str(root)]) == 0
    capsys.readouterr()
    assert workflow.start(mine, root) == 0
    out = capsys.readouterr().out
    assert (mine / f"{STEM}.ipynb").read_bytes() == edited
    assert f"kept    {mine / STEM}.ipynb: it is not byte for byte a lesson `start` copied" in out
    assert untouched.read_bytes() == (root / "lessons" / names[-1]).read_bytes()
    assert f"updated {untouched} (you had not changed it; now the current lesson)" in out
    assert f"same    {mine / names[1]} (already the current lesson)" in out
    assert "To start a kept lesson over from the current version, rename your file" in out


def test_start_keeps_a_solution_copied_over_a_lesson(root, tmp_path, capsys):
    """A solution carries the generator's fingerprint too: only the bytes `start` wrote count."""
    mine = tmp_path / "mine"
    assert workflow.start(mine, root) == 0
    solved = (root / "solutions" / f"{STEM}.ipynb").read_bytes()
    (mine / f"{STEM}.ipynb").write_bytes(solved)
    assert build.hand_edited(mine / f"{STEM}.ipynb") is None  # the fingerprint cannot tell
    change_source(root)
    assert build.lessons_main(["--root", str(root)]) == 0
    capsys.readouterr()
    assert workflow.start(mine, root) == 0
    out = capsys.readouterr().out
    assert (mine / f"{STEM}.ipynb").read_bytes() == solved
    assert f"kept    {mine / STEM}.ipynb: it is not byte for byte a lesson `start` copied" in out


def test_start_keeps_every_file_of_a_folder_it_has_no_record_of(root, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    old = (root / "lessons" / f"{STEM}.ipynb").read_bytes()
    (mine / f"{STEM}.ipynb").write_bytes(old)
    change_source(root)
    assert build.lessons_main(["--root", str(root)]) == 0
    capsys.readouterr()
    assert workflow.start(mine, root) == 0
    assert (mine / f"{STEM}.ipynb").read_bytes() == old
    assert f"kept    {mine / STEM}.ipynb" in capsys.readouterr().out


@pytest.mark.parametrize("inside", ["lessons", "solutions", "lessons/sub"])
def test_start_refuses_a_folder_inside_the_generated_ones(root, capsys, inside):
    before = sorted(p.name for p in (root / "lessons").iterdir())
    assert workflow.start(root / inside, root) == 2
    assert f"is inside {inside.split('/')[0]}/, which `python -m minizero lessons` rewrites" in (
        capsys.readouterr().out
    )
    assert sorted(p.name for p in (root / "lessons").iterdir()) == before


def test_start_refuses_a_file_and_names_the_default(root, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert workflow.start(tmp_path / "f", root) == 2
    assert f"{tmp_path / 'f'} is a file; pick a folder, e.g. my-lessons" in capsys.readouterr().out
    assert (tmp_path / "f").read_text() == "x"


def test_start_defaults_to_my_lessons_in_the_current_folder(root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert workflow.start_main(["--root", str(root)]) == 0
    assert (tmp_path / "my-lessons" / f"{STEM}.ipynb").exists()
    assert "grade them with `python -m minizero grade`." in capsys.readouterr().out


# -- `grade` grades the student's folder by default ---------------------------------------------
def test_grade_without_my_lessons_says_to_run_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert grade.grade_main([]) == 2
    assert capsys.readouterr().out.startswith(
        "error: no my-lessons/ folder here: run `python -m minizero start`"
    )
    (tmp_path / "empty").mkdir()
    assert grade.grade_main(["empty"]) == 2
    assert "error: empty/ holds no notebooks (*.ipynb) to grade" in capsys.readouterr().out
    assert grade.grade_main(["nope.ipynb"]) == 2
    assert "error: nope.ipynb: no such notebook or folder" in capsys.readouterr().out


def _tiny(path: Path, ok: bool) -> None:
    check = nbformat.v4.new_code_cell("assert x == 2, 'x should be 2'")
    check.metadata = {"tags": ["check"], "minizero": {"check": "x_is_two"}}
    cells = [nbformat.v4.new_code_cell(f"x = {2 if ok else 3}"), check]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)


@pytest.mark.timeout(120)
def test_grade_runs_the_notebooks_in_my_lessons_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-lessons").mkdir()
    _tiny(tmp_path / "my-lessons" / "a.ipynb", ok=True)
    _tiny(tmp_path / "my-lessons" / "b.ipynb", ok=False)
    before = (tmp_path / "my-lessons" / "b.ipynb").read_bytes()
    assert grade.grade_main(["--timeout", "60"]) == 1
    out = capsys.readouterr().out
    assert "my-lessons/a.ipynb: running" in out and "my-lessons/b.ipynb: running" in out
    assert "PASS  x_is_two" in out and "FAIL  x_is_two" in out
    assert "AssertionError: x should be 2" in out and "1/2 passed" in out
    assert "note: lessons/" not in out
    assert (tmp_path / "my-lessons" / "b.ipynb").read_bytes() == before  # grading never writes


@pytest.mark.timeout(120)
def test_start_into_a_closed_pipe_ends_without_a_traceback(root, tmp_path):
    """`python -m minizero start | head -3`: the reader leaves before start has printed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "minizero", "start", str(tmp_path / "mine"), "--root", str(root)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # like `head` after its lines: every write from now on hits a closed pipe
    err = p.stderr.read().decode()
    assert p.wait() == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert (tmp_path / "mine" / f"{STEM}.ipynb").exists()  # start did its work all the same
