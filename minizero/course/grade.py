"""Grading: ``python -m minizero grade [NOTEBOOK_OR_FOLDER ...]``.

Each notebook runs top to bottom in a fresh kernel (nbclient; the student's file is read, never
written) with errors allowed. A notebook of one of the kit's lessons (:mod:`minizero.course.kit`)
runs with the kit's own check cells and the given cells they rely on put back
(:mod:`minizero.course.restore`), each check with the grader's own references
(:mod:`minizero.course.grading`): every exercise of the lesson reports PASS or FAIL with its
check's message, and a note naming what was put back (an edited, moved, deleted or untagged check
cell; a function a check relies on that the notebook rebound). An exercise whose code hands its
work to minizero's own implementation fails (:mod:`minizero.course.checks.own_code`). Any other
cell that raised is reported as an ERROR. A notebook that is none of the kit's lessons runs as
written: its check cells (``metadata.minizero.check``) report PASS or FAIL. ``grade`` exits 0 only
when every exercise of every notebook passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minizero.course.build import ROOT
from minizero.course.workflow import STUDENT_DIR

TIMEOUT_ENV = "MINIZERO_CHECK_TIMEOUT"  # read by checks.common.check_timeout inside the kernel


@dataclass
class CellRun:
    index: int  # position among all cells of the notebook
    check: str | None  # exercise name for check cells
    error: str | None  # "ExcName: message" when the cell raised, else None
    seconds: float  # wall time of the cell, from the kernel's timestamps


@dataclass
class Outcome:
    """One graded line: an exercise's PASS or FAIL, or an ERROR of a cell that is not a check."""

    status: str  # "PASS" | "FAIL" | "ERROR"
    label: str  # the exercise's name, or "cell N (not a check)"
    message: str | None  # why it failed, None for a PASS
    note: str | None = None  # what grading put back or found (the verdict is the kit's check's)


_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


def outcomes(runs: list[CellRun], notes: dict[str, list[str]] | None = None) -> list[Outcome]:
    """What grading reports, one point per line. A cell that raised after the previous check and
    before a check that then failed is that exercise's failure, reported once with its own error
    (a syntax error named as such): the check's NameError only echoes it. Cells that raised
    before a check that passed, or after the last check, are ERRORs of their own. ``notes``:
    exercise -> what grading put back for it (:class:`Run`), joined into its line's note."""
    out: list[Outcome] = []
    before: list[CellRun] = []  # cells that raised since the previous check cell
    for r in runs:
        if not r.check:
            if r.error:
                before.append(r)
            continue
        if r.error is not None and before:
            first = before[0]
            if first.error.startswith(_SYNTAX):
                why = (
                    f"a syntax error in your code for {r.check} (cell {first.index}): "
                    f"{first.error}. Fix it and run that cell again: the check never saw your code."
                )
            else:
                why = (
                    f"cell {first.index}, before the check, raised {first.error}; then the "
                    f"check: {r.error}"
                )
            out.append(Outcome("FAIL", r.check, why))
        else:
            out += [Outcome("ERROR", f"cell {b.index} (not a check)", b.error) for b in before]
            out.append(Outcome("PASS" if r.error is None else "FAIL", r.check, r.error))
        out[-1].note = "; ".join((notes or {}).get(r.check, [])) or None
        before = []
    out += [Outcome("ERROR", f"cell {b.index} (not a check)", b.error) for b in before]
    return out


class Unreadable(ValueError):
    """A file that is not a notebook nbformat can run; the message is one line saying why."""


def read_notebook(path: Path):
    """``path`` as a validated nbformat v4 notebook, or :class:`Unreadable` saying why not."""
    import nbformat

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Unreadable(f"cannot read it ({type(e).__name__}: {e})") from e
    if not text.strip():
        raise Unreadable("it is empty (half-written? save it again from Jupyter)")
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise Unreadable(f"not a notebook: not JSON ({e}; half-written?)") from e
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        raise Unreadable("not a notebook: JSON without the 'cells' and 'nbformat' keys")
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except Exception as e:  # NotJSONError, ValidationError, KeyError... all mean the same here
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise Unreadable(f"not a valid notebook ({type(e).__name__}: {first})") from e
    if not nb.cells:
        raise Unreadable("a notebook with no cells: nothing to grade")
    return nb


@dataclass
class Run:
    """What running one notebook gave: its cells' runs, and how it was graded."""

    runs: list[CellRun]
    lesson: str | None  # the kit's lesson it was graded as; None: not one, its cells ran as written
    notes: dict[str, list[str]] = field(default_factory=dict)  # exercise -> what was put back
    fails: dict[str, list[str]] = field(default_factory=dict)  # exercise -> why it fails anyway
    notebook: object = None  # the cells as they ran, with their outputs (nbformat); never saved


def execute(path: Path, timeout: float = 600, root: Path = ROOT) -> list[CellRun]:
    """Run ``path`` in a fresh kernel (cwd: its folder), errors allowed; see :func:`run`."""
    return run(path, timeout, root).runs


def run(
    path: Path, timeout: float = 600, root: Path = ROOT, env: dict[str, str] | None = None
) -> Run:
    """Run ``path`` in a fresh kernel (cwd: its folder), errors allowed. A notebook of one of the
    kit's lessons runs with the kit's check cells and the given cells they rely on put back
    (:mod:`minizero.course.restore`); its checks' verdicts come from the grader's own file. Any
    other notebook runs as written. ``env``: more environment for the kernel (the tests run the
    solutions under other CPU kernels this way). Raises :class:`Unreadable` for a file that is
    not a notebook."""
    import nbformat

    from minizero.course import kit, restore

    nb = read_notebook(path)
    stem = kit.identify(nb, path, root)
    with tempfile.TemporaryDirectory(prefix="minizero-grade-") as tmp:
        verdicts = Path(tmp) / "verdicts.jsonl"
        if stem is None:
            steps = [restore.Step(c, i, check=restore.check_of(c)) for i, c in enumerate(nb.cells)]
            plan = restore.Plan(steps)
        else:
            plan = restore.plan(nb, kit.lesson(stem, root), secrets.token_hex(8), str(verdicts))
        ran = nbformat.v4.new_notebook(cells=[s.cell for s in plan.steps], metadata=nb.metadata)
        crash = None
        try:
            _execute(ran, path, timeout, env)
        except Exception as e:  # a cell past --timeout, a kernel that died
            if stem is None:
                raise
            crash = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
        found = [json.loads(ln) for ln in verdicts.read_text().splitlines()] if (
            verdicts.exists()) else []  # fmt: skip
    verdict = {v["exercise"]: v for v in found}
    for name in {v["exercise"] for v in found}:  # run_check writes one per exercise, no more
        if sum(v["exercise"] == name for v in found) > 1:
            verdict[name] = dict(
                verdict[name], fails=["the notebook wrote to the grader's verdicts"]
            )
    result = Run([], stem, plan.notes, notebook=ran)
    for step, cell in zip(plan.steps, ran.cells):
        if cell.cell_type != "code":
            continue
        err = next((o for o in cell.outputs if o.output_type == "error"), None)
        msg = f"{err.ename}: {err.evalue}" if err else None
        if step.check is not None and stem is not None:  # a kit lesson: the grader's verdict
            v = verdict.get(step.check)
            if v is None:
                msg = f"the check did not finish: {msg or crash or 'no verdict'}"
            else:
                result.fails[step.check] = v["fails"]
                result.notes.setdefault(step.check, []).extend(v["notes"])
                msg = "; ".join(v["fails"] + ([f"the check: {v['error']}"] if v["error"] else []))
                msg = (msg if v["fails"] else v["error"]) or None
        elif msg and step.label:
            msg = f"{step.label} raised {msg}"
        if step.check is None and cell.metadata.get(restore.GRADER) and not msg:
            continue
        result.runs.append(CellRun(step.origin, step.check, msg, _seconds(cell)))
    return result


class _Client:
    """nbclient's NotebookClient, running the grader's own cells without kernel history."""

    def __new__(cls, *args, **kwargs):
        from nbclient import NotebookClient

        from minizero.course.restore import GRADER

        class Client(NotebookClient):
            async def async_execute_cell(self, cell, cell_index, execution_count=None,
                                         store_history=True):  # fmt: skip
                hidden = bool(cell.metadata.get(GRADER))
                return await super().async_execute_cell(
                    cell, cell_index, execution_count, store_history and not hidden
                )

        return Client(*args, **kwargs)


def _execute(nb, path: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    client = _Client(
        nb,
        timeout=int(-(-timeout // 1)),
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    # The kernel's own log goes; cell output is kept. MINIZERO_WIDGETS=0: the lessons' widget
    # cells build no widget (see minizero.course.plots.widgets_available: with one, nbclient can
    # miss a cell's reply and wait out the whole --timeout, jupyter/nbclient#312).
    client.execute(
        stderr=subprocess.DEVNULL, env={**os.environ, **(env or {}), "MINIZERO_WIDGETS": "0"}
    )


def _seconds(cell) -> float:
    from datetime import datetime

    t = cell.metadata.get("execution", {})
    try:
        start, end = t["iopub.execute_input"], t["shell.execute_reply"]
    except KeyError:
        return float("nan")
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))
    return (parse(end) - parse(start)).total_seconds()


def grade_paths(args: list[Path], root: Path = ROOT) -> list[Path]:
    """The notebooks to grade: each path named (a folder stands for its notebooks), by default
    those in ``my-lessons/`` (made by ``start``). Raises ``FileNotFoundError`` saying what to do."""
    if not args:
        if not STUDENT_DIR.is_dir():
            raise FileNotFoundError(
                f"no {STUDENT_DIR}/ folder here: run `python -m minizero start` to copy the "
                "lessons into it (your own folder), or name what to grade, e.g. "
                f"`python -m minizero grade {STUDENT_DIR / '01_ddp.ipynb'}`"
            )
        args = [STUDENT_DIR]
    paths: list[Path] = []
    for a in args:
        if a.is_dir():
            found = sorted(a.glob("*.ipynb"))
            if not found:
                raise FileNotFoundError(f"{a}/ holds no notebooks (*.ipynb) to grade")
            paths += found
        elif a.is_file():
            paths.append(a)
        else:
            raise FileNotFoundError(f"{a}: no such notebook or folder")
    return paths


def grade_main(argv: list[str]) -> int:
    """``python -m minizero grade [NOTEBOOK_OR_FOLDER ...]``: PASS/FAIL per exercise."""
    p = argparse.ArgumentParser(
        prog="minizero grade",
        description="Run your lesson notebooks top to bottom in a fresh kernel (your file is not "
        "modified) and report PASS/FAIL for every exercise, with the check's message.",
    )
    p.add_argument(
        "notebooks", nargs="*", type=Path,
        help=f"notebooks or folders (default: every notebook in {STUDENT_DIR}/, made by `start`)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=positive_seconds, default=600, help="seconds per cell (default 600)"
    )
    p.add_argument(
        "--check-timeout", type=positive_seconds, metavar="S",
        help=f"seconds each check's ranks get before they count as hung (default: the check's "
        f"own, 120 to 180; or ${TIMEOUT_ENV}); raise it on a slow machine",
    )  # fmt: skip
    args = p.parse_args(argv)
    with check_timeout_env(args.check_timeout):  # the kernels inherit it
        return _grade(args)


def _grade(args: argparse.Namespace) -> int:
    try:
        paths = grade_paths(args.notebooks)
    except FileNotFoundError as e:
        print(f"error: {e}")
        return 2
    generated = (ROOT / "lessons").resolve()
    if any(generated in path.resolve().parents for path in paths):
        print(
            "note: lessons/ holds the generated lessons, not your work; work on your own copies "
            f"(`python -m minizero start` puts them in {STUDENT_DIR}/)"
        )
    passed = total = 0
    for path in paths:
        t0 = time.perf_counter()
        print(f"{path}: running ...", flush=True)
        try:
            ran = run(path, args.timeout)
        except Unreadable as e:
            total += 1
            print(f"  ERROR {path}: {e}")
            continue
        if ran.lesson is None:
            print("  (not one of the kit's lessons: its cells ran as written)")
        found = outcomes(ran.runs, ran.notes)
        if not found:
            found = [Outcome("ERROR", str(path), NO_CHECKS)]
        for o in found:
            total += 1
            passed += o.status == "PASS"
            if o.status == "ERROR":
                print(f"  ERROR {o.label}: {_indent(o.message)}")
            else:
                why = f"\n        {_indent(o.message)}" if o.message else ""
                note = f"\n        note: {_indent(o.note)}" if o.note else ""
                print(f"  {o.status}  {o.label}{why}{note}")
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    print(f"{passed}/{total} passed")
    return 0 if passed == total else 1


NO_CHECKS = "no check cells: not a lesson notebook (nothing graded)"


@contextlib.contextmanager
def check_timeout_env(seconds: float | None):
    """``$MINIZERO_CHECK_TIMEOUT`` set to ``seconds`` (when given) for the kernels started inside
    the block, and put back after it: ``grade_main`` and ``gradebook.main`` may run in a process
    that goes on (a test, a notebook), whose later checks must keep their own timeouts."""
    before = os.environ.get(TIMEOUT_ENV)
    if seconds:
        os.environ[TIMEOUT_ENV] = f"{seconds:g}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = before


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds > 0, e.g. 600")
    return value


def _indent(s: str) -> str:
    return s.replace("\n", "\n        ")
