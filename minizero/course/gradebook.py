"""A class's grades: ``python -m minizero gradebook SUBMISSIONS/ --out grades.csv``.

``SUBMISSIONS/`` holds one folder per student (nbgrader's ``submitted/<student>/`` layout, with or
without an assignment folder level: every ``*.ipynb`` under the student's folder is graded, its
lesson named by its file name). Each notebook is copied into a temporary folder of its own and
run there (:func:`minizero.course.grade.execute`, a fresh kernel, errors allowed), so nothing is
ever written into a student's folder and two notebooks never share files. Each check has its
timeout (``--check-timeout``, else the check's own): a hung check's ranks are stopped by the
launcher and the row says where they were; each cell has ``--timeout`` seconds.

The CSV has one row per student, lesson and exercise (columns :data:`COLUMNS`); ``status`` is
``passed``, ``failed`` (the check raised: its message), or ``error`` (the notebook could not be
read or run, or a cell that is not a check raised; ``exercise`` then names the cell). A lesson of
the kit gets a row for every one of its exercises, graded with the kit's own check cells
(:mod:`minizero.course.grade`); what grading put back (an edited, moved, deleted or untagged check
cell, a rebound function) follows the message as ``note: ...``, whatever the status.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import astuple, dataclass, fields
from multiprocessing import get_context
from pathlib import Path

from minizero.course.grade import (
    NO_CHECKS,
    Unreadable,
    check_timeout_env,
    outcomes,
    positive_seconds,
    run,
)
from minizero.tools.cli import Parser, positive_int


@dataclass(frozen=True)
class Row:
    student: str
    lesson: str  # the notebook's file name without .ipynb, e.g. 01_ddp
    exercise: str  # the check's exercise name; "cell N" for another cell; "" for the notebook
    status: str  # passed | failed | error
    message: str  # the check's or the error's message; "" when passed


COLUMNS = [f.name for f in fields(Row)]


def notebooks_of(student: Path) -> list[Path]:
    """Every notebook a student submitted (Jupyter's checkpoint copies left out)."""
    found = student.rglob("*.ipynb")
    return sorted(p for p in found if ".ipynb_checkpoints" not in p.parts and p.is_file())


def grade_notebook(student: str, path: Path, timeout: float) -> list[Row]:
    """Grade one notebook on a copy in a temporary folder; never raises for the notebook's sake."""
    lesson = path.stem
    with tempfile.TemporaryDirectory(prefix="minizero-gradebook-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        try:
            ran = run(copy, timeout)
        except Unreadable as e:
            return [Row(student, lesson, "", "error", str(e))]
        except Exception as e:  # a cell past --timeout, a kernel that died: the notebook's fault
            first = (str(e).strip().splitlines() or [""])[0]
            return [Row(student, lesson, "", "error", f"{type(e).__name__}: {first}"[:500])]
    lesson = ran.lesson or lesson
    rows = []
    status = {"PASS": "passed", "FAIL": "failed", "ERROR": "error"}
    for o in outcomes(ran.runs, ran.notes):  # as `grade` scores
        label = o.label.removesuffix(" (not a check)")
        note = o.note if ran.lesson else "not one of the kit's lessons: its cells ran as written"
        message = " | ".join(m for m in (o.message, note and f"note: {note}") if m)
        rows.append(Row(student, lesson, label, status[o.status], message))
    if not rows:
        rows.append(Row(student, lesson, "", "error", NO_CHECKS))
    return rows


def grade_student(student: Path, timeout: float) -> list[Row]:
    """Every notebook of one student, in order; a folder with none gets one error row."""
    books = notebooks_of(student)
    if not books:
        return [Row(student.name, "", "", "error", "no notebooks (*.ipynb) in this folder")]
    return [row for nb in books for row in grade_notebook(student.name, nb, timeout)]


def gradebook(
    submissions: Path, timeout: float = 600, jobs: int | None = None, log=print
) -> list[Row]:
    """Grade every student folder of ``submissions``, ``jobs`` students at a time (default: half
    the cores, at least 1: each check runs its own ranks)."""
    students = sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    jobs = max(1, min(jobs or default_jobs(), len(students) or 1))
    rows: list[Row] = []
    if jobs == 1:
        for s in students:
            log(f"grading {s.name} ...")
            rows += grade_student(s, timeout)
        return rows
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        futures = [(s, pool.submit(grade_student, s, timeout)) for s in students]
        for s, f in futures:
            rows += f.result()
            log(f"graded {s.name}")
    return rows


def default_jobs() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def write_csv(rows: list[Row], out: Path) -> None:
    """Written to a temporary file then moved: a reader never sees half a gradebook."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerows(astuple(r) for r in rows)
    tmp.replace(out)


def summary(rows: list[Row]) -> str:
    """One line per student: passed / failed / error counts and the lessons with a problem."""
    students = sorted({r.student for r in rows})
    width = max([len("student"), *map(len, students)])
    lines = [f"{'student':<{width}}  passed  failed  error  lessons to look at"]
    for s in students:
        mine = [r for r in rows if r.student == s]
        count = {k: sum(r.status == k for r in mine) for k in ("passed", "failed", "error")}
        bad = sorted({r.lesson or "-" for r in mine if r.status != "passed"})
        lines.append(
            f"{s:<{width}}  {count['passed']:>6}  {count['failed']:>6}  {count['error']:>5}  "
            + (", ".join(bad) or "-")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero gradebook SUBMISSIONS/ --out grades.csv``."""
    p = Parser(
        prog="minizero gradebook",
        description="Grade a class: every notebook of every student folder in SUBMISSIONS, each "
        "run on a copy in a temporary folder (nothing is written into the students' folders). "
        "Writes a CSV with one row per student, lesson and exercise (student, lesson, exercise, "
        "status = passed/failed/error, message) and prints a summary.",
    )
    p.add_argument("submissions", type=Path, help="a folder with one folder per student")
    p.add_argument(
        "--out", type=Path, default=Path("grades.csv"), help="the CSV to write (default grades.csv)"
    )
    p.add_argument(
        "--timeout", type=positive_seconds, default=600, help="seconds per cell (default 600)"
    )
    p.add_argument(
        "--check-timeout", type=positive_seconds, metavar="S",
        help="seconds each check's ranks get before they are stopped as hung (default: the "
        "check's own, 120 to 180)",
    )  # fmt: skip
    p.add_argument(
        "--jobs", type=positive_int, default=None,
        help=f"students graded at once (default: half the cores, here {default_jobs()})",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not args.submissions.is_dir():
        p.error(f"{args.submissions}: no such folder (one folder per student inside)")
    inside = args.out.resolve()
    if args.submissions.resolve() in inside.parents:
        p.error(f"--out {args.out} is inside {args.submissions}: write the gradebook elsewhere")
    with check_timeout_env(args.check_timeout):  # the kernels (and pool) inherit it
        rows = gradebook(args.submissions, args.timeout, args.jobs)
    if not rows:
        print(f"error: {args.submissions} holds no student folders", file=sys.stderr)
        return 2
    write_csv(rows, args.out)
    print(summary(rows))
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0
