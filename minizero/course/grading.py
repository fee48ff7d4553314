"""The grader's side of the kernel: the cells :mod:`minizero.course.grade` adds to a notebook it
runs, never shown to the student's code as cells of the notebook (no history, no ``In[]``).

* :func:`begin`, before the notebook's first cell: imports what the lesson's check cells import,
  into a namespace of its own, and takes the :class:`~minizero.course.seal.Seal`;
* :meth:`Grading.capture`, right after a given cell a check relies on (put back as the kit wrote
  it): keeps a copy of the names the check reads from it (``NPROCS``, ``CASES``);
* :meth:`Grading.run_check`, in place of each check cell: puts back whatever the student's cells
  rebound (and reports it), runs the kit's check cell with the grader's own imports and copies,
  the student's objects read from the kernel, and the exercise's wires
  (:mod:`~minizero.course.checks.own_code`); then appends its verdict to the grader's verdict file,
  which is what ``grade`` reads (not the cell's output, which the student's code could hide).
"""

from __future__ import annotations

import builtins
import copy
import json
import sys

from minizero.course.checks import own_code
from minizero.course.seal import Seal, describe

_STATES: dict[str, Grading] = {}


def begin(token: str, spec: dict, verdicts: str) -> None:
    """``spec``: ``{"imports": str, "preload": str, "exercises": {name: {...}}}``, from
    :mod:`minizero.course.kit`; ``verdicts``: the file to append verdicts to."""
    _STATES[token] = Grading(spec, verdicts)


def state(token: str) -> Grading:
    return _STATES[token]


def _user_ns() -> dict:
    try:
        return get_ipython().user_ns  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        return vars(sys.modules["__main__"])


def _copy(value):
    try:
        return copy.deepcopy(value)
    except Exception:  # a module, a lock...: the object itself
        return value


class Grading:
    def __init__(self, spec: dict, verdicts: str):
        self.spec, self.verdicts = spec, verdicts
        self.imports: dict = {}
        exec(compile(spec.get("preload", ""), "<grader: preload>", "exec"), {})
        exec(compile(spec["imports"], "<grader: imports>", "exec"), self.imports)
        self.imports.pop("__builtins__", None)
        self.captured: dict = {}
        self.seal = Seal()
        self.write, self.dumps = open, json.dumps  # the grader's own, whatever cells rebind

    def capture(self, names: list[str]) -> None:
        ns = _user_ns()
        for n in names:
            if n in ns:
                self.captured[n] = _copy(ns[n])

    def run_check(self, name: str) -> None:
        ex = self.spec["exercises"][name]
        before = self.seal.changes()
        self.seal.restore()
        ns = dict(_user_ns())
        swapped = [n for n in ex["names"] if n in self.imports and ns.get(n) is not self.imports[n]]
        ns.update({n: _copy(self.captured[n]) for n in self.captured})
        ns.update(self.imports)
        ns["__builtins__"] = builtins
        notes, fails = [], []
        if before or swapped:
            notes.append(
                f"your notebook rebound {describe(swapped + before)}: the check ran with the "
                "originals"
            )
        error, found = None, []
        try:
            with own_code.graded(ex["parts"], ex["delegates"], ns) as found:
                exec(compile(ex["source"], f"<the kit's check of {name}>", "exec"), ns)
        except BaseException as e:  # noqa: BLE001  the check's verdict, whatever it raised
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            fails += found
            after = self.seal.changes()
            self.seal.restore()
            during = list(dict.fromkeys(after + own_code.RANK_TAMPERED))
            if during:
                fails.append(
                    f"your code rebound {describe(during)} while the check ran: a check can only "
                    "grade code that leaves the kit's functions alone"
                )
            record = {"exercise": name, "error": error, "notes": notes, "fails": fails}
            with self.write(self.verdicts, "a") as f:
                f.write(self.dumps(record) + "\n")
