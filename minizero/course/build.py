"""One source per lesson -> ``lessons/`` and ``solutions/``: ``python -m minizero lessons``.

A lesson source is a percent-format Python file ``course/NN_name.py``, read with jupytext (so an
instructor can open it in JupyterLab as a notebook and save it back). Cells start with a header:

* ``# %% [markdown]`` a markdown cell; each line is ``# text`` (or a bare ``#`` for a blank line);
* ``# %%`` a code cell;
* ``# %% check="name"`` the check cell of exercise ``name``: it must fail in ``lessons/`` (the
  exercise is unsolved there) and pass in ``solutions/``. Stored as the cell tag ``check`` and the
  metadata ``{"minizero": {"check": "name"}}``.

Inside a function or method of a code cell, the lines between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` are the exercise. It starts with one ``# TODO: ...`` line that states the result
the code must produce (the contract, not the code), then ``# HINT: ...`` lines, each one hint, from
the idea down to near-code (a comment line with two or more spaces after ``#`` is the hint's next
line, code indented as written), then the code. ``lessons/`` gets the TODO line, a pointer to
``hint("name")`` and ``raise NotImplementedError("TODO: ...")`` in place of the block;
``solutions/`` gets the code.
The hints go to neither notebook: ``lessons`` collects them, per exercise (named by its check
cell) into ``minizero/course/hints.json``, which the package ships and ``hint()`` reads
(:mod:`minizero.course.hints`); :mod:`minizero.course.exercise` reads the blocks. A cell holding an
exercise is tagged ``exercise``. Generation is deterministic (cell ids from lesson and position,
sorted JSON keys, no outputs), so CI can regenerate and fail when a committed notebook differs
from its source, or ``hints.json`` from the hints.

A line ``# @save`` above a top-level definition of a code cell copies that definition into
``minizero/course/labs/saved.py``, which the labs import (:mod:`minizero.course.save`): the code a
lesson shows in the open is the code its lab, and later lessons, run.

Every generated notebook carries the SHA-256 of its own content (``metadata.minizero.sha256``):
a file whose content no longer matches was edited, run or saved by a person, and neither
``lessons`` nor ``start`` ever overwrites it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from minizero.course.exercise import (
    BEGIN,
    HINT,
    TODO,
    Block,
    SourceError,
    ask_for_hints,
    split_blocks,
)
from minizero.course.save import SAVED, saved_text

ROOT = Path(__file__).resolve().parents[2]  # the kit: course/, lessons/, solutions/
VARIANTS = ("lessons", "solutions")
_HEADER = re.compile(r"^#\s*%%")
HINTS = Path("minizero/course/hints.json")  # under the kit's root: what hint() reads
_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# Cell metadata jupytext itself writes to keep a file's layout (blank lines, markers): not ours.
_LAYOUT_KEYS = {"lines_to_next_cell", "lines_to_end_of_cell_marker", "cell_marker", "region_name",
                "skipline", "noskipline"}  # fmt: skip


@dataclass
class Cell:
    kind: str  # "markdown" | "code"
    lines: list[str]  # source lines, header excluded, no trailing newlines
    line: int  # 1-based line of the header in the source file
    check: str | None = None  # exercise name, for check cells
    tags: list[str] = field(default_factory=list)
    body: int = 0  # 1-based line of lines[0] in the source file (0: the line after the header)
    exercise: str | None = None  # an exercise cell: the name of the check cell after it


def parse(text: str, name: str = "<source>") -> list[Cell]:
    """Read a percent-format source with jupytext and check the course's conventions on its cells
    (kinds, ``check=`` metadata, solution blocks); leading/trailing blank lines are dropped."""
    import jupytext

    raw = text.splitlines()
    headers = [i for i, s in enumerate(raw) if _HEADER.match(s)]  # 0-based
    _before_first_cell(raw, headers[0] if headers else len(raw), name)
    try:
        nb = jupytext.reads(text, fmt="py:percent")
    except Exception as e:  # jupytext's own errors name no line: say which file at least
        raise SourceError(f"{name}: jupytext cannot read it: {e}") from e
    if len(nb.cells) != len(headers):
        raise SourceError(
            f"{name}: jupytext reads {len(nb.cells)} cells but {len(headers)} lines start with "
            "'# %%'; only cell headers may start with '# %%' (not lines inside a string)"
        )
    cells: list[Cell] = []
    for k, (nbc, h) in enumerate(zip(nb.cells, headers)):
        end = headers[k + 1] if k + 1 < len(headers) else len(raw)
        meta = {key: v for key, v in nbc.metadata.items() if key not in _LAYOUT_KEYS}
        check = meta.pop("check", None)
        if nbc.cell_type not in ("markdown", "code") or meta or not isinstance(check, str | None):
            raise SourceError(
                f"{name}:{h + 1}: cannot read cell header {raw[h]!r}; use '# %%', "
                "'# %% [markdown]' or '# %% check=\"exercise_name\"'"
            )
        body = next((i for i in range(h + 1, end) if raw[i].strip()), h + 1)
        cell = Cell(nbc.cell_type, nbc.source.splitlines(), h + 1, check=check, body=body + 1)
        if cell.kind == "markdown":
            if check is not None:
                raise SourceError(f"{name}:{h + 1}: a check cell must be a code cell")
            for i in range(h + 1, end):  # jupytext would keep an uncommented line silently
                s = raw[i]
                if s.strip() and not (s == "#" or s[:2] == "# "):
                    raise SourceError(
                        f"{name}:{i + 1}: a markdown line must start with '# ': {s!r}"
                    )
        else:
            if check is not None:
                cell.tags.append("check")
            if any(s.strip() == BEGIN for s in cell.lines):
                cell.tags.append("exercise")
            for variant in VARIANTS:  # markers balanced, code compiles in both variants
                render_code(cell, variant, name)
        cells.append(cell)
    _validate(cells, name)
    return cells


def _before_first_cell(raw: list[str], first: int, name: str) -> None:
    """Only blank lines and jupytext's ``# ---`` YAML header may come before the first cell."""
    i = 0
    if raw and raw[0].rstrip() == "# ---":
        close = next((j for j in range(1, first) if raw[j].rstrip() == "# ---"), None)
        if close is None:
            raise SourceError(f"{name}:1: jupytext header '# ---' is not closed by '# ---'")
        i = close + 1
    for j in range(i, first):
        if raw[j].strip():
            raise SourceError(f"{name}:{j + 1}: text before the first '# %%' cell header")


def _validate(cells: list[Cell], name: str) -> None:
    checks = [c.check for c in cells if c.check]
    dup = {c for c in checks if checks.count(c) > 1}
    if dup:
        raise SourceError(f"{name}: check names must be unique, repeated: {sorted(dup)}")
    waiting: Cell | None = None  # the last exercise cell not yet followed by a check cell
    for c in cells:
        if "exercise" in c.tags:
            if waiting is not None:
                raise SourceError(
                    f"{name}:{waiting.line}: exercise cell has no check cell "
                    "after it (add '# %% check=\"name\"' before the next exercise)"
                )
            waiting = c
        if c.check and waiting is not None:
            waiting.exercise, waiting = c.check, None
    if waiting is not None:
        raise SourceError(f"{name}:{waiting.line}: exercise cell has no check cell after it")


def blocks(cell: Cell, name: str = "<source>") -> list[str | Block]:
    """The cell's lines, each solution block read into one :class:`Block`."""
    return split_blocks(cell.lines, cell.body or cell.line + 1, cell.line, name)


def render_code(cell: Cell, variant: str, name: str = "<source>") -> str:
    """The code of ``cell`` as it appears in ``lessons`` or ``solutions``."""
    out: list[str] = []
    first = 1  # the number of the block's first hint, over the whole exercise
    for part in blocks(cell, name):
        if isinstance(part, str):
            out.append(part)
        elif variant == "solutions":
            out += part.code
        else:
            out.append(f"{part.indent}{TODO} {part.todo}")
            if cell.exercise and part.hints:
                out.append(part.indent + ask_for_hints(cell.exercise, first, part.func))
            out.append(f'{part.indent}raise NotImplementedError("TODO: write {part.func}")')
        if isinstance(part, Block):
            first += len(part.hints)
    text = "\n".join(out)
    try:
        compile(text, f"{name} (cell at line {cell.line}, {variant})", "exec")
    except SyntaxError as e:
        raise SourceError(f"{name}:{cell.line}: cell does not compile in {variant}: {e}") from e
    return text


def notebook(cells: list[Cell], stem: str, variant: str, source: str) -> dict:
    """An nbformat v4.5 notebook (a plain dict) with stable cell ids and no outputs."""
    nb_cells = []
    for i, c in enumerate(cells):
        text = "\n".join(c.lines) if c.kind == "markdown" else render_code(c, variant, source)
        meta: dict = {}
        if c.tags:
            meta["tags"] = list(c.tags)
        if c.check:
            meta["minizero"] = {"check": c.check}
        cell = {
            "cell_type": c.kind,
            "id": f"{stem}-{i:03d}",
            "metadata": meta,
            "source": text.splitlines(keepends=True),
        }
        if c.kind == "code":
            cell.update(execution_count=None, outputs=[])
        nb_cells.append(cell)
    meta = {
        "kernelspec": _KERNELSPEC,
        "language_info": {"name": "python"},
        "minizero": {
            "source": source,
            "variant": variant,
            "note": "generated from the source by `python -m minizero lessons`: edit the source; "
            "students work on their own copy (`python -m minizero start`)",
        },
    }
    nb = {"cells": nb_cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}
    meta["minizero"]["sha256"] = fingerprint(nb)
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def fingerprint(nb: dict) -> str:
    """SHA-256 of the notebook's canonical JSON without its own ``metadata.minizero.sha256``."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).get("minizero", {}).pop("sha256", None)
    return hashlib.sha256(dumps(nb).encode()).hexdigest()


def hand_edited(path: Path) -> str | None:
    """None when ``path`` holds exactly what the generator wrote (any version of any lesson): its
    content still matches the fingerprint stored in it. Otherwise why not: edited, or run and
    saved, by a person; or no fingerprint (written by hand or by an older generator)."""
    try:
        nb = json.loads(path.read_bytes())
        recorded = nb["metadata"]["minizero"]["sha256"]
    except (ValueError, KeyError, TypeError):  # not JSON, not UTF-8, no fingerprint
        return "it has no generator fingerprint (metadata.minizero.sha256)"
    if recorded != fingerprint(nb):
        return "it was edited (or run and saved) after `minizero lessons` wrote it"
    return None


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file (path relative to ``root``) and its exact text."""
    out: dict[Path, str] = {}
    for src in sorted((root / "course").glob("[0-9][0-9]_*.py")):
        rel = src.relative_to(root).as_posix()
        cells = parse(src.read_text(), rel)
        for variant in VARIANTS:
            out[Path(variant) / f"{src.stem}.ipynb"] = dumps(
                notebook(cells, src.stem, variant, rel)
            )
    return out


def exercise_hints(root: Path = ROOT) -> list[dict]:
    """Every exercise of every lesson, in course order, with its hints: what ``hint()`` reads.
    ``{"name": check name, "lesson": stem, "parts": [{"part": function, "todo", "hints"}]}``."""
    out: list[dict] = []
    where: dict[str, str] = {}  # exercise name -> the source that has it
    for src in sorted((root / "course").glob("[0-9][0-9]_*.py")):
        rel = src.relative_to(root).as_posix()
        for cell in parse(src.read_text(), rel):
            if cell.exercise is None:
                continue
            if cell.exercise in where:
                raise SourceError(
                    f"{rel}:{cell.line}: exercise {cell.exercise!r} is also in "
                    f"{where[cell.exercise]}: hint() finds exercises by name, rename one check"
                )
            where[cell.exercise] = rel
            parts = [b for b in blocks(cell, rel) if isinstance(b, Block)]
            parts = [dict(part=b.func, todo=b.todo, hints=b.hints) for b in parts]
            out.append(dict(name=cell.exercise, lesson=src.stem, parts=parts))
    return out


def hints_text(root: Path = ROOT) -> str:
    """The text of ``minizero/course/hints.json`` for the sources under ``root``."""
    from minizero.course import hints

    return hints.dumps(exercise_hints(root))


def _differs(path: Path, text: str) -> bool:
    return not path.exists() or path.read_bytes() != text.encode()


def stale(root: Path = ROOT) -> list[str]:
    """Generated files that differ from (or are missing next to) their sources, and orphans."""
    bad, want = [], generate(root)
    for p, text in want.items():
        if not (root / p).exists():
            bad.append(f"{p.as_posix()} (missing)")
        elif _differs(root / p, text):
            why = "edited by hand" if hand_edited(root / p) else "differs from its source"
            bad.append(f"{p.as_posix()} ({why})")
    for variant in VARIANTS:
        for nb in sorted((root / variant).glob("*.ipynb")):
            if nb.relative_to(root) not in want:
                bad.append(f"{nb.relative_to(root).as_posix()} (no source course/{nb.stem}.py)")
    if not (root / HINTS).exists():
        bad.append(f"{HINTS.as_posix()} (missing)")
    elif _differs(root / HINTS, hints_text(root)):
        bad.append(f"{HINTS.as_posix()} (differs from the '{HINT}' lines of course/)")
    if not (root / SAVED).exists():
        bad.append(f"{SAVED.as_posix()} (missing)")
    elif _differs(root / SAVED, saved_text(root, parse)):
        bad.append(f"{SAVED.as_posix()} (differs from the '# @save' definitions of course/)")
    return bad


_MOVE_IT = (
    "Nothing was written. Move each file named above out of lessons/ and solutions/ (students: "
    "your own copies belong in a folder made by `python -m minizero start`, e.g. "
    "`mv lessons/01_ddp.ipynb my-lessons/mine-01_ddp.ipynb`), then run `python -m minizero "
    "lessons` again."
)


def lessons_main(argv: list[str]) -> int:
    """``python -m minizero lessons [--check]``: write lessons/ and solutions/, or check them."""
    p = argparse.ArgumentParser(
        prog="minizero lessons",
        description="Regenerate lessons/ and solutions/ from the sources in course/. A notebook "
        "someone edited (or ran and saved) since it was generated is never overwritten: the "
        "command then writes nothing and names it.",
    )
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 and name every stale notebook"
    )
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        if args.check:
            bad = stale(args.root)
            for b in bad:
                print(f"stale: {b}", file=sys.stderr)
            if any(b.endswith("(edited by hand)") for b in bad):
                print("move the notebooks edited by hand out first:", _MOVE_IT, file=sys.stderr)
            if bad:
                print("regenerate with `python -m minizero lessons` and commit", file=sys.stderr)
            if not bad:
                n = len(generate(args.root))
                print(f"lessons/ and solutions/ are up to date with course/ ({n} notebooks)")
            return 1 if bad else 0
        files, hints = generate(args.root), hints_text(args.root)
        saved = saved_text(args.root, parse)
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = {rel: text for rel, text in files.items() if _differs(args.root / rel, text)}
    found = {rel: hand_edited(args.root / rel) for rel in todo if (args.root / rel).exists()}
    edited = {rel: why for rel, why in found.items() if why}
    for rel, why in edited.items():
        print(f"error: not overwriting {rel.as_posix()}: {why}", file=sys.stderr)
    if edited:
        print(_MOVE_IT, file=sys.stderr)
        return 1
    for rel, text in todo.items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {rel.as_posix()}")
    if _differs(args.root / HINTS, hints):  # generated, never a person's: always rewritten
        (args.root / HINTS).parent.mkdir(parents=True, exist_ok=True)
        (args.root / HINTS).write_text(hints)
        print(f"wrote {HINTS.as_posix()}")
    if _differs(args.root / SAVED, saved):  # generated, like hints.json: always rewritten
        (args.root / SAVED).parent.mkdir(parents=True, exist_ok=True)
        (args.root / SAVED).write_text(saved)
        print(f"wrote {SAVED.as_posix()}")
    same = len(files) - len(todo)
    print(f"{len(todo)} notebooks written, {same} already up to date, in lessons/ and solutions/")
    return 0
