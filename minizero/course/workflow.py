"""The student's own copies of the lessons: ``python -m minizero start [FOLDER]``.

Students never work in the generated ``lessons/`` (``python -m minizero lessons`` rewrites it):
``start`` copies the lessons into a folder of their own (``my-lessons/`` by default), which
``python -m minizero grade`` grades by default and the tests never read. Run again after an update,
it updates the copies nobody touched and keeps, untouched, every copy its owner changed (the
generator's fingerprint says which: :func:`minizero.course.build.hand_edited`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from minizero.course.build import ROOT, VARIANTS, hand_edited

STUDENT_DIR = Path("my-lessons")  # where `start` copies the lessons and `grade` looks by default


def start(folder: Path, root: Path = ROOT) -> int:
    """Copy ``root/lessons/*.ipynb`` into ``folder``. A copy already there is kept when its owner
    changed it (or ran and saved it), updated when it is an untouched older version."""
    lessons = sorted((root / "lessons").glob("*.ipynb"))
    if not lessons:
        print(f"error: no lessons in {root / 'lessons'}: run `python -m minizero lessons` first")
        return 2
    dest = folder.resolve()
    for variant in VARIANTS:
        generated = (root / variant).resolve()
        if dest == generated or generated in dest.parents:
            print(
                f"error: {folder} is inside {variant}/, which `python -m minizero lessons` "
                "rewrites; pick a folder of your own, e.g. `python -m minizero start "
                f"{STUDENT_DIR}`"
            )
            return 2
    if dest.exists() and not dest.is_dir():
        print(f"error: {folder} is a file; pick a folder, e.g. {STUDENT_DIR}")
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    kept = 0
    for src in lessons:
        target, shown, new = dest / src.name, folder / src.name, src.read_bytes()
        if not target.exists():
            target.write_bytes(new)
            print(f"copied  {shown}")
        elif target.read_bytes() == new:
            print(f"same    {shown} (already the current lesson)")
        elif not hand_edited(target):
            target.write_bytes(new)
            print(f"updated {shown} (you had not changed it; now the current lesson)")
        else:
            kept += 1
            print(f"kept    {shown}: you have worked on it, it is left as it is")
    if kept:
        print(
            f"To start a kept lesson over from the current version, rename your file (e.g. "
            f"{folder / ('old-' + lessons[0].name)}) and run this command again."
        )
    grade = "" if folder == STUDENT_DIR else f" {folder}"
    print(
        f"Your lessons are in {folder}/. Work there: `jupyter lab {folder}/`; grade them with "
        f"`python -m minizero grade{grade}`."
    )
    return 0


def start_main(argv: list[str]) -> int:
    """``python -m minizero start [FOLDER]``: your own copies of the lessons."""
    p = argparse.ArgumentParser(
        prog="minizero start",
        description="Copy the lessons into a folder of your own and work there. Run it again "
        "after an update: lessons you have not touched are updated, the ones you changed are "
        "never overwritten. `python -m minizero grade` grades that folder.",
    )
    p.add_argument(
        "folder", nargs="?", type=Path, default=STUDENT_DIR,
        help=f"where your copies go (default: {STUDENT_DIR})",
    )  # fmt: skip
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return start(args.folder, args.root)
