"""What the kit itself says a lesson is, read from its source ``course/NN_name.py``: what grading
restores and runs (:mod:`minizero.course.grade`).

For every exercise of a lesson: the text of its check cell as the kit wrote it, the parts a student
writes (``MyZeRO2.post_accumulate_grad_hook()``, from the solution blocks), and the names the
check cell reads, each with where the kit binds it last before the check:

* an ``import`` of a given cell: the grader imports it itself before any student code runs
  (``imports``), so a rebound ``lesson00`` or ``check_predict_peak`` is never what the check calls;
* a given cell's other code (``NPROCS``, ``CASES``): that cell is put back as the kit wrote it and
  the value is taken right after it ran (``captures``: given cell -> names);
* an exercise cell (the student's code): read from the kernel when the check runs.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

from minizero.course import build


@dataclass
class KitCell:
    index: int  # position in the generated notebook
    id: str  # the generated cell id: "00_collectives-007"
    kind: str  # "markdown" | "code"
    source: str  # as in lessons/ (the exercise's stub for exercise cells)
    check: str | None = None
    exercise: str | None = None  # an exercise cell: the name of its check


@dataclass
class Exercise:
    name: str
    check: int  # index of the check cell
    parts: list[
        str
    ]  # "MyZeRO2.post_accumulate_grad_hook", "estimate_loss": what the student writes
    delegates: list[str] = field(default_factory=list)  # parts whose kit solution calls the
    # library's method or function of the same name: the lesson's own way, never flagged
    imports: list[str] = field(default_factory=list)  # check names bound by a given import
    captures: dict[int, list[str]] = field(default_factory=dict)  # given cell -> names


@dataclass
class Lesson:
    stem: str
    cells: list[KitCell]
    exercises: list[Exercise]
    imports: str  # the given import statements that bind a name some check cell reads
    preload: str  # every given import of a minizero module: loaded before the seal is taken

    def exercise(self, name: str) -> Exercise:
        return next(e for e in self.exercises if e.name == name)


def stems(root: Path = build.ROOT) -> list[str]:
    return sorted(p.stem for p in (root / "course").glob("[0-9][0-9]_*.py"))


@functools.lru_cache(maxsize=32)
def lesson(stem: str, root: Path = build.ROOT) -> Lesson:
    """The kit's lesson ``stem``, from ``root/course/{stem}.py``."""
    rel = f"course/{stem}.py"
    cells = build.parse((root / rel).read_text(), rel)
    nb = build.notebook(cells, stem, "lessons", rel)
    kit = [
        KitCell(i, c["id"], c["cell_type"], "".join(c["source"]), src.check, src.exercise)
        for i, (c, src) in enumerate(zip(nb["cells"], cells))
    ]
    bound = [_binds(k.source) if k.kind == "code" else {} for k in kit]
    exercises, imports = [], []
    for k in kit:
        if not k.check:
            continue
        ex_cell = next(c for c in cells if c.exercise == k.check) if any(
            c.exercise == k.check for c in cells) else None  # fmt: skip
        parts, delegates = _parts(ex_cell, rel) if ex_cell else ([], [])
        e = Exercise(k.check, k.index, parts, delegates)
        for name in sorted(_reads(k.source)):
            where = next((j for j in range(k.index - 1, -1, -1) if name in bound[j]), None)
            if where is None or kit[where].exercise or kit[where].check:
                continue  # the student's (or a builtin): read from the kernel at check time
            node = bound[where][name]
            if isinstance(node, ast.Import | ast.ImportFrom):
                e.imports.append(name)
                text = ast.unparse(node)
                if text not in imports:
                    imports.append(text)
            else:
                e.captures.setdefault(where, []).append(name)
        exercises.append(e)
    preload = [
        ast.unparse(node)
        for b in bound
        for node in dict.fromkeys(b.values())
        if isinstance(node, ast.Import | ast.ImportFrom) and _minizero(node)
    ]
    return Lesson(stem, kit, exercises, "\n".join(imports), "\n".join(dict.fromkeys(preload)))


def _minizero(node: ast.Import | ast.ImportFrom) -> bool:
    names = (
        [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    )
    return all(n == "minizero" or n.startswith("minizero.") for n in names)


def spec(lesson: Lesson) -> dict:
    """What the kernel's side of grading needs (:func:`minizero.course.grading.begin`)."""
    return {
        "imports": lesson.imports,
        "preload": lesson.preload,
        "exercises": {
            e.name: {
                "source": lesson.cells[e.check].source,
                "parts": e.parts,
                "delegates": e.delegates,
                "names": e.imports,
            }
            for e in lesson.exercises
        },
    }


def _binds(source: str) -> dict[str, ast.AST]:
    """Top-level names a cell binds (not inside functions or classes): name -> the statement."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    out: dict[str, ast.AST] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.ImportFrom) and [a.name for a in s.names] == ["*"]:
                out.update(dict.fromkeys(_star_names(s.module or ""), s))  # a lesson's lab
            elif isinstance(s, ast.Import | ast.ImportFrom):
                for a in s.names:
                    out[a.asname or a.name.split(".")[0]] = s
            elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out[s.name] = s
            else:
                for n in ast.walk(s):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        out[n.id] = s
                for body in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(s, body, None)
                    if isinstance(inner, list):
                        visit([x for x in inner if isinstance(x, ast.stmt)])

    visit(tree.body)
    return out


def _star_names(module: str) -> list[str]:
    """The names ``from module import *`` binds, for a minizero module (a lesson's lab): its
    ``__all__``, read from its source (``__all__ = [...]`` and ``__all__ += [...]``), nothing
    imported; other modules: none known."""
    spec = importlib.util.find_spec(module) if module.startswith("minizero.") else None
    if spec is None or not spec.origin:
        return []
    names: list[str] = []
    for node in ast.parse(Path(spec.origin).read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            names += ast.literal_eval(node.value)
    return names


def _reads(source: str) -> set[str]:
    return {
        n.id
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _parts(cell: build.Cell, rel: str) -> tuple[list[str], list[str]]:
    """The exercise's parts, ``Class.method`` or ``function``, and those whose kit solution calls
    something of the same name through an attribute (``super().m(...)``, ``train.f(...)``)."""
    parts = []
    for b in build.blocks(cell, rel):
        if isinstance(b, build.Block):
            name = re.sub(r"\(\)", "", b.func)
            if name not in parts:
                parts.append(name)
    tree = ast.parse(build.render_code(cell, "solutions", rel))
    delegates = []
    for part in parts:
        fn = _find(tree.body, part.split("."))
        if fn is not None and any(_same_name_call(n, part) for n in ast.walk(fn)):
            delegates.append(part)
    return parts, delegates


def _same_name_call(node: ast.AST, part: str) -> bool:
    """``super().m(...)`` or ``Base.m(...)`` in method ``part`` = ``Cls.m``; ``module.f(...)`` in
    function ``part`` = ``f``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    owner, leaf = node.func.value, part.split(".")[-1]
    if node.func.attr != leaf:
        return False
    if "." not in part:
        return isinstance(owner, ast.Name | ast.Attribute)
    if isinstance(owner, ast.Call):
        return isinstance(owner.func, ast.Name) and owner.func.id == "super"
    return isinstance(owner, ast.Name) and owner.id[:1].isupper()


def _find(stmts: list[ast.stmt], path: list[str]) -> ast.AST | None:
    for s in stmts:
        if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if s.name == path[0]:
                return s if len(path) == 1 else _find(s.body, path[1:])
    return None


def identify(nb, path: Path, root: Path = build.ROOT) -> str | None:
    """The kit's lesson a notebook is: by its file name (``00_collectives.ipynb``), else by the
    source the generator recorded in it, else by its cell ids, else by a lesson's name inside its
    file name (``mine-00_collectives.ipynb``); None for a notebook that is none of the kit's."""
    known = stems(root)
    if path.stem in known:
        return path.stem
    src = str(nb.get("metadata", {}).get("minizero", {}).get("source", ""))
    if Path(src).stem in known:
        return Path(src).stem
    ids = [str(c.get("id", "")).rpartition("-")[0] for c in nb.get("cells", [])]
    found = [s for s in known if ids.count(s) >= max(1, len(ids) // 2)]
    if found:
        return found[0]
    inside = [s for s in known if s in path.stem]
    return inside[0] if inside else None
