"""Grading: ``python -m minizero grade [NOTEBOOK_OR_FOLDER ...]``.

Each notebook runs top to bottom in a fresh kernel (nbclient; the student's file is read, never
written) with errors allowed; every check cell (``metadata.minizero.check``, see
:mod:`minizero.course.build`) reports PASS or FAIL with its check's message, and any other cell
that raised is reported as an ERROR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import dataclass
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


_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


def outcomes(runs: list[CellRun]) -> list[Outcome]:
    """What grading reports, one point per line. A cell that raised after the previous check and
    before a check that then failed is that exercise's failure, reported once with its own error
    (a syntax error named as such): the check's NameError only echoes it. Cells that raised
    before a check that passed, or after the last check, are ERRORs of their own."""
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


def execute(path: Path, timeout: float = 600) -> list[CellRun]:
    """Run every code cell of ``path`` in a fresh kernel (cwd: its folder), errors allowed.
    Raises :class:`Unreadable` for a file that is not a notebook."""
    from nbclient import NotebookClient

    nb = read_notebook(path)
    client = NotebookClient(
        nb,
        timeout=int(-(-timeout // 1)),
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    # The kernel's own log goes; cell output is kept. MINIZERO_WIDGETS=0: the lessons' widget
    # cells build no widget (see minizero.course.plots.widgets_available: with one, nbclient can
    # miss a cell's reply and wait out the whole --timeout, jupyter/nbclient#312).
    env = dict(os.environ, MINIZERO_WIDGETS="0")
    client.execute(stderr=subprocess.DEVNULL, env=env)
    runs = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        err = next((o for o in cell.outputs if o.output_type == "error"), None)
        msg = f"{err.ename}: {err.evalue}" if err else None
        runs.append(CellRun(i, cell.metadata.get("minizero", {}).get("check"), msg, _seconds(cell)))
    return runs


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
    if args.check_timeout:
        os.environ[TIMEOUT_ENV] = f"{args.check_timeout:g}"  # the kernels inherit it
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
            runs = execute(path, args.timeout)
        except Unreadable as e:
            total += 1
            print(f"  ERROR {path}: {e}")
            continue
        for o in outcomes(runs):
            total += 1
            passed += o.status == "PASS"
            if o.status == "ERROR":
                print(f"  ERROR {o.label}: {_indent(o.message)}")
            else:
                why = f"\n        {_indent(o.message)}" if o.message else ""
                print(f"  {o.status}  {o.label}{why}")
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    print(f"{passed}/{total} passed")
    return 0 if passed == total else 1


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
