"""What a check relies on, taken before any student code runs: :class:`Seal`.

A check compares with ``torch.equal`` and ``torch.allclose``, prints with ``print``, launches
ranks with :func:`minizero.launch`, and calls the names of its own module. A student cell can
rebind any of them (``torch.equal = lambda *a: True``, ``lesson00.check_x = ...``). A seal records,
by identity, the functions and classes of ``builtins``, of ``torch``'s comparison and
``torch.distributed``'s modules and of every loaded ``minizero`` module (with the attributes of
their classes), and every module-level value of the check modules (``minizero.course.checks.*``,
lists and dicts also by value): :meth:`changes` names what was rebound since, :meth:`restore` puts
the originals back. Grading seals in the kernel before the notebook's first cell, and in each rank
of a check (:mod:`minizero.course.checks.own_code`).

What it cannot see: a student who rewrites the objects themselves (a function's ``__code__``, a C
extension's memory) or the interpreter; that is the boundary of what grading defends.
"""

from __future__ import annotations

import builtins
import copy
import inspect
import sys
import warnings
from types import ModuleType

_TORCH = ("torch", "torch.Tensor", "torch.distributed", "torch.distributed.distributed_c10d",
          "torch.nn.functional", "torch.testing")  # fmt: skip
CHECKS = "minizero.course.checks"
OWN_CODE = CHECKS + ".own_code"
_KERNEL = {"input", "getpass"}  # builtins ipykernel itself rebinds for every cell it runs
_MISSING = object()


def _watched(value: object) -> bool:
    return inspect.isroutine(value) or inspect.isclass(value)


def _scopes() -> dict[str, dict]:
    """Where names live that checks rely on: name -> the namespace dict (module or class)."""
    out: dict[str, dict] = {"builtins": builtins.__dict__}
    for name in _TORCH:
        mod, _, attr = name.rpartition(".") if name == "torch.Tensor" else (name, "", "")
        m = sys.modules.get(mod)
        if m is not None:
            out[name] = vars(getattr(m, attr)) if attr else vars(m)
    for name, m in list(sys.modules.items()):
        if not isinstance(m, ModuleType) or not (
            name == "minizero" or name.startswith("minizero.")
        ):
            continue
        out[name] = vars(m)
        for attr, value in list(vars(m).items()):
            if inspect.isclass(value) and value.__module__ == name:
                out[f"{name}.{attr}"] = value.__dict__
    return out


class Seal:
    """The objects checks rely on, as they are now."""

    def __init__(self) -> None:
        with warnings.catch_warnings():  # looking at a deprecated name (dist.reduce_op) warns
            warnings.simplefilter("ignore")
            self._take()

    def _take(self) -> None:
        self.scopes = _scopes()
        self.saved: dict[str, dict[str, tuple[object, object]]] = {}
        for where, ns in self.scopes.items():
            checks = where.startswith(CHECKS + ".") and where.count(".") == 3  # a check module
            checks = checks and where != OWN_CODE  # whose lists are the grader's records
            keep = {}
            for k, v in list(ns.items()):
                if where == "builtins" and k in _KERNEL:
                    continue
                if _watched(v):
                    keep[k] = (v, _MISSING)
                elif checks and not k.startswith("__") and not isinstance(v, ModuleType):
                    try:
                        value = copy.deepcopy(v) if isinstance(v, list | dict | set) else _MISSING
                    except Exception:
                        value = _MISSING
                    keep[k] = (v, value)
            self.saved[where] = keep

    def changes(self) -> list[str]:
        """``"torch.equal"``, ``"minizero.course.checks.lesson00.SHAPES"``: every name rebound (or
        deleted, or a check module's list changed) since the seal was taken."""
        out = []
        for where, keep in self.saved.items():
            ns = self.scopes[where]
            for k, (obj, value) in keep.items():
                now = ns.get(k, _MISSING)
                if now is not obj or (value is not _MISSING and _differs(now, value)):
                    out.append(f"{where}.{k}")
        return out

    def restore(self) -> None:
        """Put back every object :meth:`changes` names (a class's attribute by ``setattr``: a
        class's ``__dict__`` cannot be written)."""
        for where, keep in self.saved.items():
            ns = self.scopes[where]
            for k, (obj, value) in keep.items():
                now = ns.get(k, _MISSING)
                if now is obj and (value is _MISSING or not _differs(now, value)):
                    continue
                if isinstance(obj, list | dict | set) and value is not _MISSING:
                    obj.clear()
                    obj.update(value) if not isinstance(obj, list) else obj.extend(value)
                target = _owner(where)
                if target is not None and not isinstance(target, dict):
                    setattr(target, k, obj)
                else:
                    ns[k] = obj


def _differs(now: object, value: object) -> bool:
    try:
        return bool(now != value)
    except Exception:  # tensors in a list: compare nothing more than identity
        return False


def _owner(where: str):
    """The module or class whose namespace is ``where``."""
    if where == "builtins":
        return builtins
    if where in sys.modules:
        return sys.modules[where]
    mod, _, attr = where.rpartition(".")
    m = sys.modules.get(mod)
    return getattr(m, attr, None) if m is not None else None


def describe(names: list[str]) -> str:
    """``"torch.equal, builtins.print"``: at most 6 names, then how many more."""
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")
