"""Hints on demand: every exercise states its result in one ``# TODO:`` line (no code) and gives
its steps through ``hint("name")``, one per call; the hints come from the lesson sources only
(``# HINT:`` lines), reach a notebook anywhere through the package's ``hints.json``, and appear
in no generated notebook."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minizero.course import build, hint, hints

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "course").glob("[0-9][0-9]_*.py"))
EXERCISES = build.exercise_hints(ROOT)

TWO_PARTS = [
    {
        "name": "MyThing",
        "lesson": "09_x",
        "parts": [
            {"part": "MyThing.first()", "todo": "a", "hints": ["idea", "closer"]},
            {"part": "MyThing.second()", "todo": "b", "hints": ["near-code"]},
        ],
    },
    {
        "name": "other",
        "lesson": "10_y",
        "parts": [{"part": "other()", "todo": "c", "hints": ["one", "two", "three"]}],
    },
]


# -- hint(): one per call ----------------------------------------------------------------------
def test_hint_shows_the_next_hint_at_each_call_then_says_there_are_no_more():
    h = hints.Hints(TWO_PARTS)
    first = h.text("MyThing")
    assert first.splitlines() == ["MyThing, hint 1 of 3 (MyThing.first()):", "    idea"]
    assert h.text("MyThing").splitlines()[1] == "    closer"
    last = h.text("MyThing")
    assert last.startswith("MyThing, hint 3 of 3 (MyThing.second()):\n    near-code\n")
    assert "That was the last hint; the worked code is in solutions/09_x.ipynb" in last
    done = h.text("MyThing")
    assert done.startswith("No more hints for MyThing: all 3 shown")
    assert "solutions/09_x.ipynb" in done and 'hint("MyThing", 1) starts over' in done
    assert h.text("MyThing") == done  # and stays so
    assert h.text("other").splitlines() == ["other, hint 1 of 3:", "    one"]  # its own count


def test_hint_n_shows_that_hint_and_the_next_call_goes_on_from_it():
    h = hints.Hints(TWO_PARTS)
    assert h.text("MyThing", 3).splitlines()[1] == "    near-code"
    assert h.text("MyThing", 1).splitlines()[1] == "    idea"
    assert h.text("MyThing").splitlines()[1] == "    closer"
    for bad in (0, 4, -1, "2"):
        with pytest.raises(ValueError, match=r'MyThing has hints 1 to 3: hint\("MyThing", n\)'):
            h.text("MyThing", bad)


def test_an_unknown_name_says_which_names_exist():
    h = hints.Hints(TWO_PARTS)
    with pytest.raises(ValueError) as e:
        h.text("MyThin")
    msg = str(e.value)
    assert msg.startswith("no exercise called 'MyThin'; did you mean 'MyThing'?")
    assert "the exercises with hints: MyThing, other (hint() lists them by lesson)" in msg
    with pytest.raises(ValueError, match="no exercise called 'zzz'; the exercises"):
        h.text("zzz")
    assert h.text("mything").startswith("MyThing, hint 1 of 3")  # case aside


def test_hint_without_a_name_lists_the_exercises_by_lesson():
    lines = hints.Hints(TWO_PARTS).text().splitlines()
    assert lines[0].startswith('Hints on demand: hint("name") shows the next hint')
    assert lines[1].split() == [
        "09_x",
        "MyThing",
        "3",
        "hints",
        "(first()",
        "1-2,",
        "second()",
        "3)",
    ]
    assert lines[2].split() == ["10_y", "other", "3", "hints"]


def test_hint_prints(capsys):
    hints.Hints(TWO_PARTS)("other")
    assert capsys.readouterr().out == "other, hint 1 of 3:\n    one\n"


def test_a_missing_hints_file_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `python -m minizero lessons`"):
        hints.Hints(path=tmp_path / "hints.json").text()


def test_the_notebooks_hint_reads_the_shipped_file_from_any_folder(tmp_path):
    """A lesson copied anywhere (``start``'s my-lessons/) imports it as its first cell does."""
    code = "from minizero.course import checks, hint\nhint('MyZeRO2'); hint('MyZeRO2'); hint()\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's minizero, wherever cwd is
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "MyZeRO2, hint 1 of" in out.stdout and "MyZeRO2, hint 2 of" in out.stdout
    assert "03_zero2" in out.stdout and "all_reduce_via_rs_ag" in out.stdout


def test_the_package_ships_the_hints():
    """A non-editable install has no course/: hints.json must be package data."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "hints.json" in conf["tool"]["setuptools"]["package-data"]["minizero.course"]
    assert hints.DATA == ROOT / build.HINTS
    assert hint.exercises == {e["name"]: e for e in EXERCISES}


# -- the sources: one TODO (the result, no code), hints ----------------------------------------
# what code looks like, and a TODO line must not: the old TODO lines were made of these
CODE = {
    "a call": r"[A-Za-z_][\w.]*\(",
    "an assignment": r"(?<![=!<>])=(?!=)",
    "a comparison or an augmented assignment": r"==|!=|[-+*/]=",
    "indexing": r"\w\[",
}


def code_in(text: str) -> list[str]:
    return [what for what, pattern in CODE.items() if re.search(pattern, text)]


def test_the_code_detector_sees_the_old_todo_lines():
    old = [
        "world = dist.get_world_size(group); shard = ceil(t.numel() / world)",
        "for every parameter with a gradient: all_reduce(p.grad, group=group), then divide",
        "b = self.bucket_of[param]; copy param.grad into b.view(self.flat[b.index], param)",
        "self.pending[b.index] == -1",
        "then broadcast each parameter's data from its owner: minizero.broadcast(t, src=owner)",
        "coef = clamp(max_norm / (norm + 1e-6), max=1.0); every shard *= coef (in place)",
    ]
    for line in old:
        assert code_in(line), line
    assert code_in("every p.grad becomes the average of that gradient over the group's ranks") == []


def todo_lines(source: Path) -> list[list[tuple[int, str]]]:
    """The ``# TODO:`` lines of each solution block, read from the text (not with build)."""
    blocks, current = [], None
    for n, line in enumerate(source.read_text().splitlines(), 1):
        s = line.strip()
        if s == "# BEGIN SOLUTION":
            current = []
        elif s == "# END SOLUTION":
            blocks.append(current)
            current = None
        elif current is not None and s.startswith("# TODO:"):
            current.append((n, s[len("# TODO:") :].strip()))
    return blocks


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_exercise_states_its_result_in_one_todo_line_without_code(source):
    blocks = todo_lines(source)
    assert blocks, f"{source.name} has no exercise"
    for todos in blocks:
        assert len(todos) == 1, f"{source.name}: one TODO line per exercise block, got {todos}"
        ((n, text),) = todos
        assert not code_in(text), f"{source.name}:{n}: the TODO holds code ({code_in(text)})"


def test_every_exercise_has_hints_from_the_idea_to_near_code():
    assert len(EXERCISES) >= len(SOURCES)
    for ex in EXERCISES:
        total = sum(len(p["hints"]) for p in ex["parts"])
        assert total >= 3, f"{ex['name']} ({ex['lesson']}): {total} hints, want at least 3"
        for p in ex["parts"]:
            assert p["hints"], f"{ex['name']}: {p['part']} has no hint"
            assert all(h.strip() for h in p["hints"]), ex["name"]
    lessons = {ex["lesson"] for ex in EXERCISES}
    assert lessons == {s.stem for s in SOURCES}, "a lesson without hints"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_lesson_imports_hint_and_names_its_exercises_under_the_todo(source):
    cells = build.parse(source.read_text(), source.name)
    first = "\n".join(next(c for c in cells if c.kind == "code").lines)
    lab = re.search(r"^from (minizero\.course\.labs\.lesson\d\d) import \*", first, re.M)
    if lab:  # the lesson's one import line: its lab's __all__ brings hint
        module = importlib.import_module(lab[1])
        assert "hint" in module.__all__ and module.hint is hint, f"{lab[1]} does not bring hint"
    else:
        assert re.search(r"^from minizero\.course import .*\bhint\b", first, re.M)
    for cell in cells:
        if cell.exercise:
            lesson = build.render_code(cell, "lessons", source.name)
            assert f'# stuck? hint("{cell.exercise}")' in lesson, cell.exercise


def test_exercise_names_are_unique_across_lessons(tmp_path):
    (tmp_path / "course").mkdir()
    text = (
        "# %%\ndef f():\n    # BEGIN SOLUTION\n    # TODO: one\n    # HINT: a\n"
        "    #   b\n    # HINT: for x in y:\n    #           pass\n    return 1\n"
        '    # END SOLUTION\n\n\n# %% check="f"\nassert f() == 1\n'
    )
    (tmp_path / "course" / "01_a.py").write_text(text)
    assert build.exercise_hints(tmp_path)[0]["parts"] == [
        # '#' + 2 or more spaces: the hint goes on, on a line of its own, code indented
        {"part": "f()", "todo": "one", "hints": ["a\nb", "for x in y:\n    pass"]}
    ]
    (tmp_path / "course" / "02_b.py").write_text(text)
    with pytest.raises(build.SourceError, match="course/02_b.py:1: exercise 'f' is also in "
                       "course/01_a.py: hint\\(\\) finds exercises by name"):  # fmt: skip
        build.exercise_hints(tmp_path)


# -- one source: the committed hints.json follows course/ ---------------------------------------
def test_the_committed_hints_are_the_sources_hints():
    assert (ROOT / build.HINTS).read_text() == build.hints_text(ROOT)
    data = json.loads((ROOT / build.HINTS).read_text())
    assert [e["name"] for e in data["exercises"]] == [e["name"] for e in EXERCISES]


def test_lessons_writes_the_hints_and_check_sees_them_stale(tmp_path, capsys):
    shutil.copytree(ROOT / "course", tmp_path / "course")
    assert build.lessons_main(["--root", str(tmp_path)]) == 0
    assert "wrote minizero/course/hints.json" in capsys.readouterr().out
    assert (tmp_path / build.HINTS).read_text() == (ROOT / build.HINTS).read_text()
    src = tmp_path / "course" / f"{SOURCES[0].stem}.py"
    src.write_text(src.read_text().replace("# HINT: ", "# HINT: (edited) ", 1))
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: minizero/course/hints.json (differs from the '# HINT:' lines of course/)" in err
    assert "stale: lessons/" not in err  # the notebooks carry no hints: they did not change
    assert build.lessons_main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "wrote minizero/course/hints.json"
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 0
    assert "(edited)" in (tmp_path / build.HINTS).read_text()
