"""``# @save`` (minizero/course/save.py): a definition a lesson shows in the open is the code its
lab runs, copied by ``python -m minizero lessons`` into minizero/course/labs/saved.py, not by
hand; and the build refuses a marked statement the saved module could not run."""

import inspect
import json
from pathlib import Path

import pytest

from minizero.course import build, save
from minizero.course.exercise import SourceError
from minizero.course.labs import lesson00 as lab00
from minizero.course.labs import lesson01 as lab01
from minizero.course.labs import lesson02 as lab02
from minizero.course.labs import saved

ROOT = Path(__file__).resolve().parents[2]


def test_the_saved_module_is_the_sources():
    assert (ROOT / save.SAVED).read_text() == save.saved_text(ROOT, build.parse), (
        "run `python -m minizero lessons` and commit minizero/course/labs/saved.py"
    )


def test_each_saved_definition_is_the_lessons_cell_byte_for_byte():
    found, _ = save.collect(ROOT, build.parse)
    assert {n for s in found for n in s.names} >= {
        "one_of_each", "time_collective", "local_gradients", "gradient_mean", "adam_in_pieces",
        "one_step_memory",
    }  # fmt: skip
    for s in found:
        lines = (ROOT / s.source).read_text().splitlines()
        assert save.MARK.match(lines[s.line - 2]), f"{s.source}:{s.line}: no '# @save' above"
        assert "\n".join(lines[s.line - 1 :]).startswith(s.text)
        for name in s.names:
            obj = getattr(saved, name)
            if inspect.isfunction(obj):
                assert inspect.getsource(obj).rstrip("\n") == s.text, name


def test_the_labs_run_the_saved_definitions():
    assert lab00.bandwidth.__defaults__ == (saved.time_collective,)
    assert lab00.volumes.__globals__["one_of_each"] is saved.one_of_each
    assert lab01.gradient_mean is saved.gradient_mean
    assert lab02.adam_in_pieces is saved.adam_in_pieces
    assert lab02.memory_per_step.__globals__["one_step_memory"] is saved.one_step_memory
    assert "one_step_memory" in inspect.getsource(lab02.memory_per_step)


def test_the_lab_runs_what_the_lesson_passes_it():
    calls = []

    def mine(op, nbytes):  # a student's own timing loop, run on the ranks
        calls.append((op, nbytes))
        return dict(op=op, nbytes=nbytes)

    rows = lab00.bandwidth(2, ["all_reduce"], [4096, 8192], mine)
    assert rows == [dict(op="all_reduce", nbytes=4096), dict(op="all_reduce", nbytes=8192)]


def test_the_marker_is_one_comment_line_in_the_notebooks():
    """What the student sees of the mechanism: the line ``# @save`` above the definition."""
    notebooks = build.generate(ROOT)
    for s in save.collect(ROOT, build.parse)[0]:
        for variant in build.VARIANTS:
            nb = json.loads(notebooks[Path(variant) / f"{Path(s.source).stem}.ipynb"])
            (cell,) = [c for c in nb["cells"] if c["id"] == s.cell]
            assert f"# @save\n{s.text}\n" in "".join(cell["source"]) + "\n"


LESSON = """# %% [markdown]
# # A lesson

# %%
from minizero.course.labs.lesson00 import *  # torch, dist, minizero, C, hint, lab, lesson00

NPROCS, INFO = setup()

# %%
{cell}
"""


def _collect(tmp_path: Path, cell: str):
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "00_x.py").write_text(LESSON.format(cell=cell))
    return save.collect(tmp_path, build.parse)


def test_a_saved_definition_gets_the_imports_the_lab_gives_it(tmp_path: Path):
    cell = "# @save\ndef f(n):\n    return torch.ones(n, device=rank_device()) * len(C.__name__)\n"
    found, imports = _collect(tmp_path, cell)
    assert [(s.names, s.line, s.cell) for s in found] == [(["f"], 11, "00_x-002")]
    assert save.import_lines(imports) == [
        "import torch",
        "",
        "from minizero import collectives as C",
        "from minizero.course.labs import rank_device",
    ]


@pytest.mark.parametrize(
    "cell, message",
    [
        ("# @save\nprint(1)\n", "00_x.py:10: the statement under '# @save' defines nothing"),
        ("x = 1\n# @save\n", "00_x.py:11: '# @save' must be the line right above"),
        (
            "# @save\ndef f():\n    return NPROCS\n",
            "reads 'NPROCS': only the notebook binds it (cell at line 4)",
        ),
        (
            "# @save\ndef f():\n    return lab\n",
            "reads 'lab': minizero.course.labs.lesson00 defines",
        ),
        (
            "# @save\ndef f():\n    return nowhere\n",
            "reads 'nowhere': minizero.course.labs.lesson00's",
        ),
        ("# @save\ndef f():\n    pass\n\n\n# @save\ndef f():\n    pass\n", "'f' is saved again"),
        (
            "# @save\ndef f():\n    # BEGIN SOLUTION\n    # TODO: x\n    pass\n    # END SOLUTION\n"
            '\n\n# %% check="f"\nf()\n',
            "00_x.py:10: '# @save' in an exercise cell",
        ),
    ],
)
def test_the_build_refuses_what_the_saved_module_could_not_run(tmp_path, cell, message):
    with pytest.raises(SourceError, match=None) as e:
        _collect(tmp_path, cell)
    assert message in str(e.value)


def test_lessons_writes_the_saved_module_and_check_sees_it_stale(tmp_path, capsys):
    (tmp_path / "course").mkdir()
    src = tmp_path / "course" / "00_x.py"
    src.write_text(LESSON.format(cell="# @save\ndef f():\n    return 1\n"))
    assert build.lessons_main(["--root", str(tmp_path)]) == 0
    assert "def f():\n    return 1\n" in (tmp_path / save.SAVED).read_text()
    src.write_text(LESSON.format(cell="# @save\ndef f():\n    return 2\n"))
    capsys.readouterr()
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 1
    assert "minizero/course/labs/saved.py (differs from the '# @save'" in capsys.readouterr().err
