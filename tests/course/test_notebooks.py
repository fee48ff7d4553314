"""The course: notebooks match their sources, solutions pass under nbval (soak tier; the lessons'
own runs are test_lesson_runs.py), the grader reports PASS/FAIL, and checks say what differs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from minizero.bucket import make_buckets
from minizero.collectives import all_gather, all_reduce, mark, reduce_scatter
from minizero.course import build, checks, grade
from minizero.course.checks import lesson00, lesson01
from minizero.course.margins import KERNELS

ROOT = Path(__file__).resolve().parents[2]
STEMS = sorted(p.stem for p in (ROOT / "course").glob("[0-9][0-9]_*.py"))


# -- generation ------------------------------------------------------------------------------------
def test_committed_notebooks_match_their_sources():
    assert build.stale(ROOT) == [], (
        "run `python -m minizero lessons` and commit the notebooks (it refuses to overwrite a "
        "notebook edited by hand: move that one out of lessons/ or solutions/ first)"
    )


def test_every_lesson_has_both_notebooks_and_a_check_per_exercise():
    assert STEMS, "no lesson sources in course/"
    for stem in STEMS:
        cells = build.parse((ROOT / "course" / f"{stem}.py").read_text(), stem)
        assert any(c.check for c in cells), f"{stem} has no check cell"
        for variant in build.VARIANTS:
            assert (ROOT / variant / f"{stem}.ipynb").exists()


def test_generation_is_deterministic_valid_and_without_outputs():
    first, second = build.generate(ROOT), build.generate(ROOT)
    assert first == second
    for rel, text in first.items():
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        ids = [c.id for c in nb.cells]
        assert len(set(ids)) == len(ids) and ids[0] == f"{rel.stem}-000"
        for c in nb.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, rel


def test_lessons_hide_the_solutions_and_solutions_hide_the_hints():
    notebooks = build.generate(ROOT)  # every notebook, once (0.4 s a call)
    for stem in STEMS:
        lesson = json.loads(notebooks[Path("lessons") / f"{stem}.ipynb"])
        solution = json.loads(notebooks[Path("solutions") / f"{stem}.ipynb"])
        for lc, sc in zip(lesson["cells"], solution["cells"], strict=True):
            ltext, stext = "".join(lc["source"]), "".join(sc["source"])
            assert lc["metadata"] == sc["metadata"]
            assert "# HINT:" not in ltext + stext  # hints come on demand: hint("name")
            if "exercise" in lc["metadata"].get("tags", []):
                assert 'raise NotImplementedError("TODO: write' in ltext
                assert "# TODO:" in ltext and "# TODO:" not in stext
                assert "# stuck? hint(" in ltext and "hint(" not in stext
                assert "NotImplementedError" not in stext
                assert "BEGIN SOLUTION" not in ltext + stext
            else:
                assert ltext == stext


SOURCE = '''# %% [markdown]
# # Title
#
# text

# %%
import math


def f(x):
    """doc"""
    y = 1
    # BEGIN SOLUTION
    # TODO: return x plus y
    return x + y
    # END SOLUTION


# %% check="f"
assert f(1) == 2
'''


def test_a_small_source_renders_to_both_variants():
    cells = build.parse(SOURCE, "x.py")
    assert [c.kind for c in cells] == ["markdown", "code", "code"]
    assert cells[0].lines == ["# Title", "", "text"]
    assert cells[1].tags == ["exercise"] and cells[2].tags == ["check"] and cells[2].check == "f"
    lesson = build.render_code(cells[1], "lessons")
    solution = build.render_code(cells[1], "solutions")
    assert lesson.endswith(
        '    # TODO: return x plus y\n    raise NotImplementedError("TODO: write f()")'
    )
    assert solution.endswith("    y = 1\n    return x + y")
    nb = build.notebook(cells, "99_x", "lessons", "course/99_x.py")
    assert nb["cells"][2]["metadata"] == {"tags": ["check"], "minizero": {"check": "f"}}


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '# %%\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n# %% check="x"\n',
            "x.py:2: '# BEGIN SOLUTION' at top level",
        ),
        ("# %%\ndef f():\n    # BEGIN SOLUTION\n    pass\n", "x.py:1: '# BEGIN SOLUTION' without"),
        (
            "# %%\ndef f():\n    # BEGIN SOLUTION\n    # TODO: f returns\n    pass\n"
            "    # END SOLUTION\n",
            "x.py:1: exercise cell has no check cell after it",
        ),
        (
            "# %%\ndef f():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n",
            "x.py:4: an exercise starts with one '# TODO: ...' line that states the result",
        ),
        (
            "# %%\ndef f():\n    # BEGIN SOLUTION\n    # TODO: a\n    # TODO: b\n    pass\n"
            "    # END SOLUTION\n",
            "x.py:5: one '# TODO:' line per exercise block, first",
        ),
        (
            "# %%\ndef f():\n    # BEGIN SOLUTION\n    # TODO: a\n    pass\n    # HINT: b\n"
            "    # END SOLUTION\n",
            "x.py:6: '# HINT:' lines come right after the '# TODO:' line",
        ),
        ('# %% tags=["x"]\n', "x.py:1: cannot read cell header"),
        ("# %% [raw]\n# x\n", "x.py:1: cannot read cell header"),
        ('# %% [markdown] check="x"\n# x\n', "x.py:1: a check cell must be a code cell"),
        ('# %%\ns = """\n# %% not a header\n"""\n', "x.py: jupytext reads 1 cells but 2 lines"),
        ("# ---\n# jupyter:\n# %%\n", "x.py:1: jupytext header '# ---' is not closed"),
        ("x = 1\n", "x.py:1: text before the first"),
        ("# %% [markdown]\nnot a comment\n", "x.py:2: a markdown line must start with '# '"),
    ],
)
def test_source_errors_name_file_and_line(text, message):
    with pytest.raises(build.SourceError, match="^" + re.escape(message)):
        build.parse(text, "x.py")


# -- jupytext: an instructor edits a lesson as a notebook -------------------------------------
def _jupytext(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "jupytext", "--quiet", *args]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_jupytext_round_trip_leaves_sources_and_notebooks_identical(tmp_path):
    """Every source -> notebook -> source with jupytext's own command line (and the repository's
    jupytext configuration): the source comes back byte for byte, the notebooks are the same."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # its [tool.jupytext] section
    shutil.copytree(ROOT / "course", tmp_path / "course")
    sources = [f"course/{stem}.py" for stem in STEMS]
    _jupytext("--to", "ipynb", *sources, cwd=tmp_path)
    for src in sources:
        (tmp_path / src).unlink()
    _jupytext("--to", "py:percent", *[s.replace(".py", ".ipynb") for s in sources], cwd=tmp_path)
    for src in sources:
        assert (tmp_path / src).read_text() == (ROOT / src).read_text(), src
    assert build.generate(tmp_path) == build.generate(ROOT)


def test_a_lesson_edited_as_a_notebook_regenerates_with_the_edit_only(tmp_path):
    """What JupyterLab does to a lesson opened as a Jupytext Notebook: it runs cells (outputs),
    adds kernel metadata and tags; the instructor adds a markdown cell and edits a check cell.
    Written back, the source regenerates notebooks that differ by exactly those two cells."""
    import jupytext

    stem = STEMS[0]
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "course", tmp_path / "course")
    _jupytext("--to", "ipynb", f"course/{stem}.py", "-o", "nb.ipynb", cwd=tmp_path)
    nb = nbformat.read(tmp_path / "nb.ipynb", as_version=4)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.language_info = {"name": "python", "version": "3.11.2"}
    k = next(i for i, c in enumerate(nb.cells) if c.metadata.get("check"))
    for c in nb.cells:
        if c.cell_type == "code":
            c.execution_count, c.outputs = 1, [nbformat.v4.new_output("stream", text="out\n")]
            c.metadata["tags"] = ["ran"]
    nb.cells[k].source += "\nprint('checked')"
    nb.cells.insert(k, nbformat.v4.new_markdown_cell("A **new** paragraph."))
    nbformat.write(nb, tmp_path / "nb.ipynb")
    _jupytext("--to", "py:percent", "nb.ipynb", "-o", f"course/{stem}.py", cwd=tmp_path)
    text = (tmp_path / "course" / f"{stem}.py").read_text()
    assert "tags" not in text and "kernelspec" not in text and "\nout\n" not in text
    assert jupytext.reads(text, fmt="py:percent").cells[k + 1].metadata["check"]

    new, old = build.generate(tmp_path), build.generate(ROOT)
    for variant in build.VARIANTS:
        a = json.loads(new[Path(variant) / f"{stem}.ipynb"])["cells"]
        b = json.loads(old[Path(variant) / f"{stem}.ipynb"])["cells"]
        assert "".join(a[k]["source"]) == "A **new** paragraph."
        assert "".join(a[k + 1]["source"]) == "".join(b[k]["source"]) + "\nprint('checked')"
        assert a[k + 1]["metadata"] == b[k]["metadata"]  # still the check cell
        strip = lambda cells: [(c["cell_type"], c["source"], c["metadata"]) for c in cells]
        assert strip(a[:k] + a[k + 2 :]) == strip(b[:k] + b[k + 1 :])


def test_a_jupytext_header_before_the_first_cell_is_read():
    header = "# ---\n# jupyter:\n#   jupytext:\n#     formats: py:percent\n# ---\n\n"
    with_header, plain = build.parse(header + SOURCE, "x.py"), build.parse(SOURCE, "x.py")
    assert [c.line - 6 for c in with_header] == [c.line for c in plain] == [1, 6, 19]
    for c in with_header + plain:
        c.line = c.body = 0
    assert with_header == plain


def test_lessons_check_names_the_stale_file(tmp_path, capsys):
    shutil.copytree(ROOT / "course", tmp_path / "course")
    assert build.lessons_main(["--root", str(tmp_path)]) == 0
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 0
    src = tmp_path / "course" / f"{STEMS[0]}.py"
    src.write_text(src.read_text() + "\n# %%\nprint('new cell')\n")
    capsys.readouterr()
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"stale: lessons/{STEMS[0]}.ipynb (differs from its source)" in err
    assert f"stale: solutions/{STEMS[0]}.ipynb (differs from its source)" in err
    (tmp_path / "lessons" / "77_orphan.ipynb").write_text("{}")
    assert build.lessons_main(["--root", str(tmp_path), "--check"]) == 1
    assert "lessons/77_orphan.ipynb (no source course/77_orphan.py)" in capsys.readouterr().err


# -- running the notebooks -----------------------------------------------------------------------
@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_solutions_pass_under_nbval():
    """Under CPU kernels other than this machine's best (no AVX, ATen's portable code), so that a
    check whose tolerance suits one machine's kernels fails here, not on a student's machine.
    Soak tier: the fast tier asserts the same of one shared execution (test_lesson_runs.py);
    this run proves that nbval itself, the graders' tool, runs the solutions as they are."""
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "solutions/",
           "-q", "-p", "no:cacheprovider", "-n", "0"]  # fmt: skip
    env = dict(os.environ, MINIZERO_WIDGETS="0", **KERNELS["portable"])
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.slow
def test_grade_prints_pass_and_fail_per_exercise(tmp_path, tmp_path_factory, capsys, monkeypatch):
    """A solution passes; a wrong answer whose notebook rebound every primitive its check relies
    on, and printed PASS in place of the check, fails with the kit's check, naming all of it.
    The solution's kernel run is the shared one (tests/lessons.py: grade.run on lesson 00's
    solution; the gradebook's test grades a copy end to end); the cheat runs in its own kernel."""
    from cheats import L00, cut, monkeypatches, write

    from lessons import executed

    solved = write(cut(L00, "solutions"), tmp_path / "solved" / f"{L00}.ipynb")
    shared = executed(tmp_path_factory, "solutions", L00)
    with monkeypatch.context() as m:
        m.setattr(grade, "run", lambda path, timeout, **kw: shared)
        assert grade.grade_main([str(solved)]) == 0
    out = capsys.readouterr().out
    assert "PASS  all_reduce_via_rs_ag\n" in out and "1/1 passed" in out and "note" not in out
    cheats = write(monkeypatches(solved=False), tmp_path / "cheats" / f"{L00}.ipynb")
    assert grade.grade_main(["--timeout", "120", str(cheats)]) == 1
    out = capsys.readouterr().out
    said = "FAIL  all_reduce_via_rs_ag\n        CheckFailed: wrong sum for a tensor of shape (1,)"
    assert said in out and "0/1 passed" in out
    note = out.split("note: ", 1)[1]
    assert note.startswith("the check cell was edited: graded with the kit's check cell; your "
                           "notebook rebound ")  # fmt: skip
    for name in ("builtins.print", "torch.equal", "torch.allclose", "minizero.launch"):
        assert name in note


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stem", STEMS)
def test_solutions_run_one_rank_per_gpu_over_nccl(stem):
    runs = grade.execute(ROOT / "solutions" / f"{stem}.ipynb")
    assert [r for r in runs if r.error] == []


# -- what the checks say ------------------------------------------------------------------------
def _no_padding(t, group=None):
    world = dist.get_world_size(group)
    flat = t.reshape(-1).clone()
    chunk = torch.empty(t.numel() // world)
    reduce_scatter(chunk, flat[: chunk.numel() * world], group=group)
    all_gather(flat[: chunk.numel() * world], chunk, group=group)
    t.copy_(flat.view_as(t))
    return t


def _plain_all_reduce(t, group=None):
    all_reduce(t, group=group)
    return t


def test_check_all_reduce_via_rs_ag_names_shape_element_and_padding():
    with pytest.raises(checks.CheckFailed) as e:
        lesson00.check_all_reduce_via_rs_ag(_no_padding, 2)
    assert str(e.value).startswith("wrong sum for a tensor of shape (1,) on rank 0 (world size 3)")
    assert "pad the flat tensor to a multiple of the world size (3)" in str(e.value)
    with pytest.raises(checks.CheckFailed, match=r"issued \['all_reduce'\]"):
        lesson00.check_all_reduce_via_rs_ag(_plain_all_reduce, 2)


def _summed_not_averaged(model, group=None):
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(p.grad, group=group)


def test_check_naive_ddp_names_step_parameter_and_factor():
    with pytest.raises(checks.CheckFailed) as e:
        lesson01.check_allreduce_gradients(_summed_not_averaged, 2)
    msg = str(e.value)
    assert msg.startswith("step 0, rank 0, gradient of 'gain': max |yours - one process")
    assert "Yours is 3.00x the reference" in msg


class _HookArgumentAsGradient(torch.nn.Module):
    """The famous bug: all-reduces the hook's argument (the parameter) as if it were the grad."""

    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__()
        self.module, self.world = module, dist.get_world_size(group)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args):
        return self.module(*args)

    def _hook(self, grad):  # wrong: the argument is the parameter
        all_reduce(grad)
        grad.div_(self.world)


class _AllAtTheEnd(torch.nn.Module):
    """Correct buckets, but every all-reduce starts after backward: no overlap."""

    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__()
        self.module, self.world = module, dist.get_world_size(group)
        self.buckets = make_buckets(list(module.parameters()), bucket_cap_mb)
        self.queued = False
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args):
        return self.module(*args)

    def _hook(self, p):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self):
        self.queued = False
        mark("backward end")
        for b in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in b.params])
            all_reduce(flat, async_op=True).wait()
            flat /= self.world
            for p in b.params:
                p.grad.copy_(b.view(flat, p))


def test_check_bucketed_ddp_explains_the_hook_argument_and_missing_overlap():
    with pytest.raises(checks.CheckFailed) as e:
        lesson01.check_bucketed_ddp(_HookArgumentAsGradient, 2)
    # on 3 ranks, averaging 3 equal weights rounds: the weights move during backward
    assert "changed during backward" in str(e.value)
    assert "the hook's argument is the parameter itself" in str(e.value)
    with pytest.raises(checks.CheckFailed, match="none overlaps backward"):
        lesson01.check_bucketed_ddp(_AllAtTheEnd, 2)
