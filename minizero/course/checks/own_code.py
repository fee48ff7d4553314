"""Your own code, not the library's: while grading checks an exercise, each part a student writes
(``MyZeRO2.post_accumulate_grad_hook``, ``estimate_loss``) must not hand its work to minizero's own
implementation of the same name. Used by :mod:`minizero.course.grading` around a check and, for
the ranks the check starts, by :func:`.common.launch_check`.

* **static** (:func:`static_findings`): the part is minizero's own object (a method left out, so
  the base class's runs; ``post_accumulate_grad_hook = ZeRO2.post_accumulate_grad_hook``; a
  function that is minizero's),
  or a function reads minizero's function of the same name through a global of its own
  (``from minizero.tools.train import estimate_loss as lib``);
* **at run time** (:func:`wired`): minizero's method of the same name is wrapped on its class
  (``super().m()``, ``ZeRO2.m(self)``, ``getattr(...)`` all reach it) and records a call made on
  an instance of the student's class; minizero's function of the same name is wrapped in every
  module that binds it and records a call made while the student's function is on the stack.
  The check's own reference runs (a plain ``ZeRO2``; the check calling ``estimate_loss`` itself)
  are not the student's and are never recorded.

A part whose kit solution itself calls the library's method of that name (the lesson's way) is
left out (``kit.Exercise.delegates``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

TRIPS: list[str] = []  # what the wires recorded in this process since the last reset
ACTIVE: list[Wire] | None = None  # the wires of the check being graded (read by launch_check)
RANK_TAMPERED: list[str] = []  # names the ranks saw rebound while they ran


def _library(obj: object) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return (mod == "minizero" or mod.startswith("minizero.")) and not mod.startswith(
        "minizero.course"
    )


def _unwrap(fn):
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def _same(a, b) -> bool:
    a, b = _unwrap(a), _unwrap(b)
    return a is b or getattr(a, "__code__", None) is getattr(b, "__code__", 1)


@dataclass
class Wire:
    """One library object to wrap while ``student`` is checked, and what a call to it means."""

    owner: object  # the class (a method) or module (a function) that binds it
    attr: str
    student: object  # the student's class or function
    message: str


def _message(part: str, lib: str) -> str:
    return f"{part} calls minizero's {lib}: write it yourself"


def _library_functions(name: str) -> list[object]:
    """minizero's functions called ``name`` (outside minizero.course), wherever they are bound."""
    out = []
    for modname, m in list(sys.modules.items()):
        f = getattr(m, name, None) if modname.startswith("minizero.") else None
        if inspect.isfunction(_unwrap(f)) and _library(f) and all(f is not g for g in out):
            out.append(f)
    return out


def _lib_bases(cls: type, method: str) -> list[type]:
    return [b for b in cls.__mro__[1:] if _library(b) and method in vars(b)]


def plan(parts: list[str], delegates: list[str], ns: dict) -> tuple[list[Wire], list[str]]:
    """The wires for the exercise's ``parts`` (``"Cls.m"`` or ``"f"``) whose objects are in
    ``ns``, and the static findings (one message per offending part)."""
    wires: list[Wire] = []
    found: list[str] = []
    for part in parts:
        if part in delegates:
            continue
        head, _, method = part.partition(".")
        obj = ns.get(head)
        if method:
            if not inspect.isclass(obj):
                continue
            bases = _lib_bases(obj, method)
            if not bases:
                continue
            mine = next((c for c in obj.__mro__ if method in vars(c)), None)
            theirs = f"{bases[0].__name__}.{method}"
            if mine is not None and _library(mine):
                found.append(f"{part} is not written: the class inherits minizero's {theirs}")
            elif any(_same(vars(obj).get(method), vars(b)[method]) for b in bases):
                found.append(f"{part} is minizero's {theirs}: write it yourself")
            for b in bases:
                if inspect.isfunction(vars(b)[method]):
                    msg = _message(part, f"{b.__name__}.{method}")
                    wires.append(Wire(b, method, obj, msg))
        elif callable(obj):
            for lib in _library_functions(head):
                where = f"{head} ({lib.__module__})"
                if _same(obj, lib):
                    found.append(f"{part} is minizero's {where}: write it yourself")
                elif _reads_global(obj, lib):
                    found.append(_message(part, where))
                for m in list(sys.modules.values()):
                    modname = getattr(m, "__name__", None) or ""
                    if modname.startswith("minizero.") and vars(m).get(head) is lib:
                        wires.append(Wire(m, head, obj, _message(part, where)))
    return wires, list(dict.fromkeys(found))


def _codes(fn) -> list:
    """``fn``'s code and every code object nested in it."""
    code = getattr(_unwrap(fn), "__code__", None) if not isinstance(fn, property) else None
    out, todo = [], [code] if code is not None else []
    while todo:
        c = todo.pop()
        out.append(c)
        todo += [k for k in c.co_consts if inspect.iscode(k)]
    return out


def _reads_global(fn, lib) -> bool:
    g = getattr(_unwrap(fn), "__globals__", {})
    names = {n for c in _codes(fn) for n in c.co_names}
    return any(_same(g[n], lib) for n in names if n in g and callable(g[n]))


def _student_codes(student) -> set:
    """The code a student wrote: a function's, or every method's of a class and of its bases that
    are not minizero's."""
    if not inspect.isclass(student):
        return set(_codes(student))
    out = set()
    for c in student.__mro__:
        if c is object or _library(c):
            continue
        for v in vars(c).values():
            v = getattr(v, "__func__", v)  # staticmethod, classmethod
            out.update(_codes(v) if callable(v) else [])
    return out


def _wrap(w: Wire, original):
    """``original`` that records ``w.message`` when called with the student's code on the stack
    (for a method: on an instance of the student's class), e.g. not when the check calls it."""
    student, codes = w.student, _student_codes(w.student)

    def wired(*args, **kwargs):
        if not inspect.isclass(student) or (args and isinstance(args[0], student)):
            f = sys._getframe(1)
            while f is not None:
                if f.f_code in codes:
                    if w.message not in TRIPS:
                        TRIPS.append(w.message)
                    break
                f = f.f_back
        return original(*args, **kwargs)

    wired.__wrapped_by_grader__ = original
    return wired


@contextlib.contextmanager
def wired(wires: list[Wire]):
    """The wires installed (once: forked ranks inherit them), removed afterwards."""
    done = []
    try:
        for w in wires:
            original = vars(w.owner).get(w.attr)
            if original is None or hasattr(original, "__wrapped_by_grader__"):
                continue
            setattr(w.owner, w.attr, _wrap(w, original))
            done.append((w, original))
        yield
    finally:
        for w, original in reversed(done):
            setattr(w.owner, w.attr, original)


@contextlib.contextmanager
def graded(parts: list[str], delegates: list[str], ns: dict):
    """While a check of the exercise whose ``parts`` are in ``ns`` runs (in this process and in the
    ranks it launches): yields the list of findings, filled in as the check ends (static ones
    first, then each call recorded, then, as ``"rebound ..."``, what the ranks saw rebound)."""
    global ACTIVE
    wires, found = plan(parts, delegates, ns)
    del TRIPS[:], RANK_TAMPERED[:]
    ACTIVE = wires
    try:
        with wired(wires):
            yield found
    finally:
        ACTIVE = None
        for t in TRIPS:  # one finding per part: the first
            if not any(f.split(" ", 1)[0] == t.split(" ", 1)[0] for f in found):
                found.append(t)


def in_rank(wires: list[Wire], fn, *args):
    """A check's rank function under grading: wires installed (a rank started by torchrun has
    none), this rank's own seal, then ``fn(*args)``; returns :class:`RankReport`."""
    from minizero.course.seal import Seal

    del TRIPS[:]  # a forked rank inherits its parent's list
    with wired(wires):
        seal = Seal()
        result = fn(*args)
        changed = seal.changes()
    return RankReport(result, list(TRIPS), changed)


@dataclass
class RankReport:
    result: object
    trips: list[str]
    tampered: list[str]  # names the student's code rebound while the rank ran
