"""The course machinery: one source per lesson -> ``lessons/`` and ``solutions/``; the grader.

``python -m minizero lessons [--check]``, ``python -m minizero start [FOLDER]`` and
``python -m minizero grade [NOTEBOOK_OR_FOLDER ...]``.

A lesson source is a percent-format Python file ``course/NN_name.py``, read with jupytext (so an
instructor can open it in JupyterLab as a notebook and save it back). Cells start with a header:

* ``# %% [markdown]`` a markdown cell; each line is ``# text`` (or a bare ``#`` for a blank line);
* ``# %%`` a code cell;
* ``# %% check="name"`` the check cell of exercise ``name``: it must fail in ``lessons/`` (the
  exercise is unsolved there) and pass in ``solutions/``. Stored as the cell tag ``check`` and the
  metadata ``{"minizero": {"check": "name"}}``.

Inside a function or method of a code cell, the lines between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` are the exercise. Comment lines ``# TODO: ...`` right after ``# BEGIN SOLUTION``
are hints: ``lessons/`` gets the hints and ``raise NotImplementedError("TODO: ...")`` in place of
the block; ``solutions/`` gets the code without the hints. A cell holding an exercise is tagged
``exercise``. Generation is deterministic (cell ids from lesson and position, sorted JSON keys,
no outputs), so CI can regenerate and fail when a committed notebook differs from its source.

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
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("lessons", "solutions")
STUDENT_DIR = Path("my-lessons")  # where `start` copies the lessons and `grade` looks by default
_HEADER = re.compile(r"^#\s*%%")
_BEGIN, _END, _HINT = "# BEGIN SOLUTION", "# END SOLUTION", "# TODO:"
_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# Cell metadata jupytext itself writes to keep a file's layout (blank lines, markers): not ours.
_LAYOUT_KEYS = {"lines_to_next_cell", "lines_to_end_of_cell_marker", "cell_marker", "region_name",
                "skipline", "noskipline"}  # fmt: skip


class SourceError(ValueError):
    """A lesson source that cannot be turned into notebooks; the message names file and line."""


@dataclass
class Cell:
    kind: str  # "markdown" | "code"
    lines: list[str]  # source lines, header excluded, no trailing newlines
    line: int  # 1-based line of the header in the source file
    check: str | None = None  # exercise name, for check cells
    tags: list[str] = field(default_factory=list)
    body: int = 0  # 1-based line of lines[0] in the source file (0: the line after the header)


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
            if any(s.strip() == _BEGIN for s in cell.lines):
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
            waiting = None
    if waiting is not None:
        raise SourceError(f"{name}:{waiting.line}: exercise cell has no check cell after it")


def render_code(cell: Cell, variant: str, name: str = "<source>") -> str:
    """The code of ``cell`` as it appears in ``lessons`` or ``solutions``."""
    out: list[str] = []
    block: list[str] | None = None  # lines of the open solution block
    indent, func = "", ""
    for k, s in enumerate(cell.lines):
        line = (cell.body or cell.line + 1) + k
        if s.strip() == _BEGIN:
            if block is not None:
                raise SourceError(f"{name}:{line}: nested '{_BEGIN}'")
            indent = s[: len(s) - len(s.lstrip())]
            if not indent:
                raise SourceError(
                    f"{name}:{line}: '{_BEGIN}' at top level: the lesson's stub "
                    "would raise when the cell runs; put the block inside a function"
                )
            func = _enclosing_def(out, indent) or "this exercise"
            block = []
        elif s.strip() == _END:
            if block is None:
                raise SourceError(f"{name}:{line}: '{_END}' without '{_BEGIN}'")
            hints = [h for h in block if h.strip().startswith(_HINT)]
            code = block[len(hints) :]
            if any(h.strip().startswith(_HINT) for h in code):
                raise SourceError(f"{name}:{line}: '{_HINT}' hints must come first in the block")
            if variant == "solutions":
                out += code
            else:
                out += hints + [f'{indent}raise NotImplementedError("TODO: write {func}")']
            block = None
        elif block is not None:
            block.append(s)
        else:
            out.append(s)
    if block is not None:
        raise SourceError(f"{name}:{cell.line}: '{_BEGIN}' without '{_END}'")
    text = "\n".join(out)
    try:
        compile(text, f"{name} (cell at line {cell.line}, {variant})", "exec")
    except SyntaxError as e:
        raise SourceError(f"{name}:{cell.line}: cell does not compile in {variant}: {e}") from e
    return text


def _enclosing_def(lines: list[str], indent: str) -> str | None:
    """Name of the innermost ``def`` (with its class, if any) that encloses ``indent``."""
    names: list[str] = []
    depth = len(indent)
    for s in reversed(lines):
        m = re.match(r"^(\s*)(?:async\s+)?(def|class)\s+(\w+)", s)
        if m and len(m[1]) < depth:
            names.append(f"{m[3]}()" if m[2] == "def" else m[3])
            depth = len(m[1])
            if depth == 0:
                break
    return ".".join(reversed(names)) or None


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
            return 1 if bad else 0
        files = generate(args.root)
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
    return 0


# -- the student's own copies -------------------------------------------------------------------
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


# -- grading --------------------------------------------------------------------------------------
@dataclass
class CellRun:
    index: int  # position among all cells of the notebook
    check: str | None  # exercise name for check cells
    error: str | None  # "ExcName: message" when the cell raised, else None
    seconds: float  # wall time of the cell, from the kernel's timestamps


def execute(path: Path, timeout: int = 600) -> list[CellRun]:
    """Run every code cell of ``path`` in a fresh kernel (cwd: its folder), errors allowed."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    client.execute(stderr=subprocess.DEVNULL)  # the kernel's own log; cell output is kept
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
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = p.parse_args(argv)
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
        runs = execute(path, args.timeout)
        for r in runs:
            if r.check:
                total += 1
                passed += r.error is None
                status = "PASS" if r.error is None else "FAIL"
                print(
                    f"  {status}  {r.check}" + (f"\n        {_indent(r.error)}" if r.error else "")
                )
            elif r.error:
                total += 1
                print(f"  ERROR cell {r.index} (not a check): {_indent(r.error)}")
        print(f"  ({time.perf_counter() - t0:.0f} s)")
    print(f"{passed}/{total} passed")
    return 0 if passed == total else 1


def _indent(s: str) -> str:
    return s.replace("\n", "\n        ")
