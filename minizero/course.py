"""The course machinery: one source per lesson -> ``lessons/`` and ``solutions/``; the grader.

``python -m minizero lessons [--check]`` and ``python -m minizero grade [NOTEBOOK ...]``.

A lesson source is a percent-format Python file ``course/NN_name.py``. Cells start with a header:

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
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("lessons", "solutions")
_HEADER = re.compile(r"^# %%(?P<md> \[markdown\])?(?P<meta>.*)$")
_META = re.compile(r'\s+(\w+)="([^"]*)"')
_BEGIN, _END, _HINT = "# BEGIN SOLUTION", "# END SOLUTION", "# TODO:"
_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class SourceError(ValueError):
    """A lesson source that cannot be turned into notebooks; the message names file and line."""


@dataclass
class Cell:
    kind: str  # "markdown" | "code"
    lines: list[str]  # source lines, header excluded, no trailing newlines
    line: int  # 1-based line of the header in the source file
    check: str | None = None  # exercise name, for check cells
    tags: list[str] = field(default_factory=list)


def parse(text: str, name: str = "<source>") -> list[Cell]:
    """Split a percent-format source into cells (leading/trailing blank lines dropped)."""
    cells: list[Cell] = []
    for i, raw in enumerate(text.splitlines(), start=1):
        m = _HEADER.match(raw)
        if m:
            meta = dict(_META.findall(m["meta"]))
            rest = _META.sub("", m["meta"]).strip()
            if rest or set(meta) - {"check"}:
                raise SourceError(
                    f"{name}:{i}: cannot read cell header {raw!r}; use '# %%', "
                    "'# %% [markdown]' or '# %% check=\"exercise_name\"'"
                )
            kind = "markdown" if m["md"] else "code"
            cell = Cell(kind, [], i, check=meta.get("check"))
            if cell.check is not None:
                if kind == "markdown":
                    raise SourceError(f"{name}:{i}: a check cell must be a code cell")
                cell.tags.append("check")
            cells.append(cell)
        elif cells:
            if cells[-1].kind == "markdown" and raw.strip() and not (raw == "#" or raw[:2] == "# "):
                raise SourceError(f"{name}:{i}: a markdown line must start with '# ': {raw!r}")
            cells[-1].lines.append(raw)
        elif raw.strip():
            raise SourceError(f"{name}:{i}: text before the first '# %%' cell header")
    for c in cells:
        while c.lines and not c.lines[-1].strip():
            c.lines.pop()
        while c.lines and not c.lines[0].strip():
            c.lines.pop(0)
        if c.kind == "markdown":
            c.lines = [s[2:] for s in c.lines]  # "# text" -> "text", "#" -> ""
        elif any(s.strip() == _BEGIN for s in c.lines):
            c.tags.append("exercise")
        if c.kind == "code":
            for variant in VARIANTS:  # markers balanced, code compiles in both variants
                render_code(c, variant, name)
    _validate(cells, name)
    return cells


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
        line = cell.line + 1 + k
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
            "note": "generated: edit the source, then run `python -m minizero lessons`",
        },
    }
    return {"cells": nb_cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


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


def stale(root: Path = ROOT) -> list[str]:
    """Generated files that differ from (or are missing next to) their sources, and orphans."""
    want = generate(root)
    bad = [
        f"{p.as_posix()} (differs from its source)"
        if (root / p).exists()
        else f"{p.as_posix()} (missing)"
        for p, text in want.items()
        if not (root / p).exists() or (root / p).read_text() != text
    ]
    for variant in VARIANTS:
        for nb in sorted((root / variant).glob("*.ipynb")):
            if nb.relative_to(root) not in want:
                bad.append(f"{nb.relative_to(root).as_posix()} (no source course/{nb.stem}.py)")
    return bad


def lessons_main(argv: list[str]) -> int:
    """``python -m minizero lessons [--check]``: write lessons/ and solutions/, or check them."""
    p = argparse.ArgumentParser(prog="minizero lessons", description=__doc__.split("\n")[0])
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
            if bad:
                print("regenerate with `python -m minizero lessons` and commit", file=sys.stderr)
            return 1 if bad else 0
        files = generate(args.root)
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for rel, text in files.items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {rel.as_posix()}")
    return 0


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


def grade_main(argv: list[str]) -> int:
    """``python -m minizero grade [NOTEBOOK ...]``: run notebooks, PASS/FAIL per exercise."""
    p = argparse.ArgumentParser(
        prog="minizero grade",
        description="Run your lesson notebooks top to bottom in a fresh kernel (your file is not "
        "modified) and report PASS/FAIL for every exercise, with the check's message.",
    )
    p.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in lessons/")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "lessons").glob("*.ipynb"))
    if not paths:
        print("no notebooks to grade: pass a path, e.g. lessons/00_collectives.ipynb")
        return 2
    passed = total = 0
    for path in paths:
        if not path.exists():
            print(f"{path}: no such notebook")
            return 2
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
