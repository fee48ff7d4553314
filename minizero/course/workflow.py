"""The student's own copies of the lessons: ``python -m minizero start [FOLDER]``.

Students never work in the generated ``lessons/`` (``python -m minizero lessons`` rewrites it):
``start`` copies the lessons into a folder of their own (``my-lessons/`` by default), which
``python -m minizero grade`` grades by default and the tests never read. Run again after an update,
it updates only the copies that are still, byte for byte, what it wrote (it records their
SHA-256 in ``FOLDER/.minizero-start.json``) and keeps, untouched and named, every other file: one
its owner edited, ran and saved, or copied over it (a solution carries the generator's fingerprint
too, so the fingerprint alone cannot tell a blank lesson from a solved one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from minizero.course.build import ROOT, VARIANTS

MANIFEST = ".minizero-start.json"  # {lesson name: [sha256 of every version `start` wrote there]}

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
    written = _read_manifest(dest)
    kept = 0
    for src in lessons:
        target, shown, new = dest / src.name, folder / src.name, src.read_bytes()
        ours = written.setdefault(src.name, [])
        if not target.exists():
            target.write_bytes(new)
            print(f"copied  {shown}")
        elif target.read_bytes() == new:
            print(f"same    {shown} (already the current lesson)")
        elif _sha(target.read_bytes()) in ours:
            target.write_bytes(new)
            print(f"updated {shown} (you had not changed it; now the current lesson)")
        else:
            kept += 1
            print(
                f"kept    {shown}: it is not byte for byte a lesson `start` copied (you worked "
                "on it, or copied another file over it); it is left as it is"
            )
            continue
        if _sha(new) not in ours:
            ours.append(_sha(new))
    (dest / MANIFEST).write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
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


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(dest: Path) -> dict[str, list[str]]:
    """What `start` wrote into ``dest`` before; empty (so every file there is kept) when the
    record is missing or unreadable."""
    try:
        data = json.loads((dest / MANIFEST).read_text())
        return {str(k): [str(h) for h in v] for k, v in data.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


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
