"""An exercise in a lesson source: its solution blocks, each a result, hints and code.

Inside a function or method of a lesson's code cell, an exercise is written as::

    # BEGIN SOLUTION
    # TODO: every p.grad becomes the average of that gradient over the group's ranks
    # HINT: an all-reduce leaves the SUM of every rank's tensor on every rank, in place
    # HINT: ... down to near-code; a comment line with two or more spaces after '#'
    #       continues the hint above it, on a line of its own; indented further, code:
    #       for p in model.parameters():
    #           ...
    code
    # END SOLUTION

The ``# TODO:`` line (one, first) states the result the code must produce: the contract a student
meets beside the check. The ``# HINT:`` lines are for ``hint("name")``, one per call
(:mod:`minizero.course.hints`); :mod:`minizero.course.build` renders the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BEGIN, END, TODO, HINT = "# BEGIN SOLUTION", "# END SOLUTION", "# TODO:", "# HINT:"


class SourceError(ValueError):
    """A lesson source that cannot be turned into notebooks; the message names file and line."""


@dataclass
class Block:
    """One ``# BEGIN SOLUTION`` ... ``# END SOLUTION`` block: an exercise's part in one function."""

    func: str  # the function it is in: "MyZeRO2.finish_in_flight()"
    indent: str
    todo: str  # the result the code must produce (the lesson's one '# TODO:' line)
    hints: list[str]  # one string a hint (its lines as written), from the idea to near-code
    code: list[str]


def split_blocks(lines: list[str], first: int, cell: int, name: str) -> list[str | Block]:
    """A code cell's ``lines`` (``lines[0]`` at line ``first`` of ``name``; the cell's header at
    line ``cell``), each solution block read into one :class:`Block`, the other lines as they
    are."""
    out: list[str | Block] = []
    block: list[str] | None = None  # lines of the open solution block
    indent, func, begin = "", "", 0
    for k, s in enumerate(lines):
        line = first + k
        if s.strip() == BEGIN:
            if block is not None:
                raise SourceError(f"{name}:{line}: nested '{BEGIN}'")
            indent = s[: len(s) - len(s.lstrip())]
            if not indent:
                raise SourceError(
                    f"{name}:{line}: '{BEGIN}' at top level: the lesson's stub "
                    "would raise when the cell runs; put the block inside a function"
                )
            plain = [x for x in out if isinstance(x, str)]
            func, begin, block = _enclosing_def(plain, indent) or "this exercise", line, []
        elif s.strip() == END:
            if block is None:
                raise SourceError(f"{name}:{line}: '{END}' without '{BEGIN}'")
            out.append(_read_block(block, indent, func, begin, name))
            block = None
        elif block is not None:
            block.append(s)
        else:
            out.append(s)
    if block is not None:
        raise SourceError(f"{name}:{cell}: '{BEGIN}' without '{END}'")
    return out


def _read_block(lines: list[str], indent: str, func: str, begin: int, name: str) -> Block:
    """``lines``: a block's lines between its markers; ``begin``: the line of ``# BEGIN``."""
    todo = lines[0].strip()[len(TODO) :].strip() if lines else ""
    if not lines or not lines[0].strip().startswith(TODO) or not todo:
        raise SourceError(
            f"{name}:{begin + 1}: an exercise starts with one '{TODO} ...' line that states the "
            "result its code must produce"
        )
    hints: list[str] = []
    k = 1
    for k in range(1, len(lines) + 1):
        s = lines[k].strip() if k < len(lines) else ""
        if s.startswith(HINT):
            hints.append(s[len(HINT) :].strip())
        elif hints and re.match(r"#\s{2,}\S", s):  # '#' and 2+ spaces: the hint goes on,
            hints[-1] += "\n" + re.sub(r"^ {1,7}", "", s[1:])  # indented under its first line
        else:
            break
    for j, s in enumerate(lines[k:]):
        where = f"{name}:{begin + 1 + k + j}"
        if s.strip().startswith(TODO):
            raise SourceError(
                f"{where}: one '{TODO}' line per exercise block, first: the result its code "
                f"must produce; the steps go in '{HINT}' lines after it"
            )
        if s.strip().startswith(HINT):
            raise SourceError(f"{where}: '{HINT}' lines come right after the '{TODO}' line")
    return Block(func, indent, todo, hints, lines[k:])


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


def ask_for_hints(exercise: str, first: int, func: str) -> str:
    """The comment a lesson shows under a block's TODO: how to ask for its hints."""
    if first == 1:
        return f'# stuck? hint("{exercise}") shows a hint, the next one at each call'
    method = func.split(".")[-1]
    return f'# stuck? hint("{exercise}", {first}) shows the first hint for {method}'
