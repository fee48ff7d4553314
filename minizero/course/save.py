"""``# @save``: a definition a lesson shows in the open is the one the labs run (d2l's ``#@save``).

In a lesson source's code cell, a line ``# @save`` (alone, at the start of the line) marks the
top-level statement right after it: a ``def`` (decorators included), a ``class``, an assignment or
an import. ``python -m minizero lessons`` copies every marked statement of every lesson, in course
order, into one generated module, ``minizero/course/labs/saved.py``; the labs import from it, so
the code a student read in lesson 00 is, byte for byte, the code lesson 05's lab runs. The notebook
itself keeps its own definition: a student who changes the cell and passes it on
(``lab.bandwidth(NPROCS, OPS, SIZES, time_collective)``) measures their own version.

The module opens with the imports its definitions need, taken from the lab of the lesson that
defines them: a name a marked definition reads must be a builtin, another saved definition, or a
name the lesson's lab imports and exports (its ``__all__``, what the lesson's star import gives).
``lessons`` refuses, naming file and line:

* a ``# @save`` not followed by a top-level statement, or followed by one that binds no name;
* a marked statement inside an exercise cell (a solution must not reach the package);
* a name read that only the notebook binds (``NPROCS``, a variable of another cell), or that the
  lab defines itself (the lab imports the saved module: it cannot be imported back);
* one name saved twice, or bound by two different imports.

Generation is deterministic, so a test (and ``lessons --check``) fails when the module differs
from the sources.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

from minizero.course.exercise import BEGIN, SourceError

SAVED = Path("minizero/course/labs/saved.py")  # under the kit's root
MARK = re.compile(r"^#\s*@save\s*$")
_STAR = re.compile(r"^from (minizero\.course\.labs\.\w+) import \*", re.M)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign,
         ast.Import, ast.ImportFrom)  # fmt: skip
_FIRST_PARTY = {"minizero"}


@dataclass
class Saved:
    """One marked statement of a lesson."""

    source: str  # "course/00_collectives.py"
    line: int  # 1-based line of the statement's first line (a decorator's) in the source
    cell: str  # the notebook cell id: "00_collectives-017"
    text: str  # the statement, as written
    names: list[str]  # the top-level names it binds
    reads: set[str]  # the names it reads from its module: builtins, saved, imported


def _bound(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def free_names(text: str) -> set[str]:
    """The names ``text`` (module-level code) reads from its module's globals and does not bind."""
    top = symtable.symtable(text, "<saved>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:
        t = todo.pop()
        used |= {s.get_name() for s in t.get_symbols() if s.is_global() and s.is_referenced()}
        todo += t.get_children()
    return used - bound


def marked(cells: list, stem: str, rel: str) -> list[Saved]:
    """The ``# @save`` statements of one lesson's cells (read by ``build.parse``)."""
    out: list[Saved] = []
    for i, cell in enumerate(cells):
        if cell.kind != "code":
            continue
        marks = [k for k, s in enumerate(cell.lines) if MARK.match(s)]
        if not marks:
            continue
        first = cell.body or cell.line + 1  # the source line of cell.lines[0]
        if any(s.strip() == BEGIN for s in cell.lines):
            raise SourceError(
                f"{rel}:{first + marks[0]}: '# @save' in an exercise cell: the saved module "
                "would hold the solution; save the given code from a cell of its own"
            )
        body = ast.parse("\n".join(cell.lines)).body
        starts = {min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]): n
                  for n in body}  # fmt: skip
        for k in marks:
            node = starts.get(k + 2)  # the statement on the line after the mark (1-based)
            where = f"{rel}:{first + k}"
            if node is None:
                raise SourceError(
                    f"{where}: '# @save' must be the line right above a top-level def, class, "
                    "assignment or import"
                )
            if not isinstance(node, _DEFS) or not _bound(node):
                raise SourceError(
                    f"{where}: the statement under '# @save' defines nothing; mark a def, a "
                    "class, an assignment or an import"
                )
            text = "\n".join(cell.lines[k + 1 : node.end_lineno])
            out.append(
                Saved(rel, first + k + 1, f"{stem}-{i:03d}", text, _bound(node), free_names(text))
            )
    return out


@dataclass
class _Lab:
    """What a lab module exports (``__all__``), how it imports each name, what it defines."""

    module: str
    exports: set[str]
    imports: dict[str, tuple]  # name -> ("import", module, asname) | ("from", module, name, asname)
    defines: set[str]


def read_lab(module: str) -> _Lab:
    """A lab read without importing it (it imports the saved module, which may not exist yet)."""
    path = Path(importlib.util.find_spec(module).origin)  # imports its package, not the lab
    tree = ast.parse(path.read_text(), str(path))
    exports: set[str] = set()
    imports: dict[str, tuple] = {}
    defines: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                imports[a.asname or a.name.split(".")[0]] = ("import", a.name, a.asname)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            for a in node.names:
                asname = None if a.asname == a.name else a.asname  # `import x as x`: a re-export
                imports[asname or a.name] = ("from", node.module, a.name, asname)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if "__all__" in names and isinstance(node.value, ast.List | ast.Tuple):
                exports |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
            defines |= set(names) - {"__all__"}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defines.add(node.name)
    return _Lab(module, exports, imports, defines)


def collect(root: Path, parse) -> tuple[list[Saved], dict[str, tuple]]:
    """Every saved statement of the course, in order, and the import each name they read needs.
    ``parse``: build.py's, source text -> cells (passed in: build.py imports this module)."""
    saved: list[Saved] = []
    needs: list[tuple[Saved, _Lab, dict[str, int]]] = []
    for src in sorted((root / "course").glob("[0-9][0-9]_*.py")):
        rel, text = src.relative_to(root).as_posix(), src.read_text()
        cells = parse(text, rel)
        mine = marked(cells, src.stem, rel)
        if not mine:
            continue
        star = _STAR.findall(text)
        if len(star) != 1:
            raise SourceError(f"{rel}: '# @save' needs the lesson's one star import of its lab")
        notebook: dict[str, int] = {}  # what the lesson's other code binds: name -> line
        for c in cells:
            if c.kind == "code":
                try:
                    body = ast.parse("\n".join(c.lines)).body
                except SyntaxError:
                    continue  # an exercise cell renders in two variants; its names are its own
                for node in body:
                    if isinstance(node, _DEFS):
                        notebook.update(dict.fromkeys(_bound(node), c.line))
        saved += mine
        needs += [(s, read_lab(star[0]), notebook) for s in mine]
    where: dict[str, Saved] = {}
    for s in saved:
        for n in s.names:
            if n in where:
                raise SourceError(
                    f"{s.source}:{s.line}: {n!r} is saved again (first at {where[n].source}:"
                    f"{where[n].line}); one source per name"
                )
            where[n] = s
    imports: dict[str, tuple] = {}
    for s, lab, notebook in needs:
        for n in sorted(s.reads - set(where) - set(dir(builtins))):
            how = lab.imports.get(n) if n in lab.exports else None
            if how is None:
                if n in lab.exports and n in lab.defines:
                    why = f"{lab.module} defines it, and the lab imports the saved module"
                elif n in notebook:
                    why = f"only the notebook binds it (cell at line {notebook[n]})"
                else:
                    why = f"{lab.module}'s __all__ does not give it"
                raise SourceError(
                    f"{s.source}:{s.line}: the '# @save' definition of {', '.join(s.names)} "
                    f"reads {n!r}: {why}. A saved definition reads only builtins, other saved "
                    "definitions and what the lesson's lab imports and exports"
                )
            if imports.setdefault(n, how) != how:
                raise SourceError(
                    f"{s.source}:{s.line}: {n!r} is imported two ways by the labs: "
                    f"{imports[n]} and {how}"
                )
    return saved, imports


def _section(module: str) -> int:
    top = module.split(".")[0]
    return 0 if top in sys.stdlib_module_names else 2 if top in _FIRST_PARTY else 1


def _order(name: str) -> tuple:  # ruff's isort, order-by-type: CONSTANTS, Classes, functions
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name


def import_lines(imports: dict[str, tuple]) -> list[str]:
    """The import statements, grouped and sorted as ruff's isort sorts them."""
    plain: dict[int, set[str]] = {}
    froms: dict[int, dict[str, set[tuple]]] = {}
    for how in imports.values():
        if how[0] == "import":
            _, module, asname = how
            line = f"import {module}" + (f" as {asname}" if asname else "")
            plain.setdefault(_section(module), set()).add(line)
        else:
            _, module, name, asname = how
            froms.setdefault(_section(module), {}).setdefault(module, set()).add((name, asname))
    out: list[str] = []
    for section in sorted(set(plain) | set(froms)):
        if out:
            out.append("")
        out += sorted(plain.get(section, ()), key=lambda s: s.split()[1])
        for module in sorted(froms.get(section, {})):
            names = sorted(froms[section][module], key=lambda n: _order(n[0]))
            for name, asname in (n for n in names if n[1]):  # `as` imports: a line each
                out.append(f"from {module} import {name} as {asname}")
            plain_names = [n for n, a in names if not a]
            if plain_names:
                line = f"from {module} import {', '.join(plain_names)}"
                if len(line) > 100:
                    line = (
                        f"from {module} import (\n"
                        + "".join(f"    {n},\n" for n in plain_names)
                        + ")"
                    )
                out.append(line)
    return out


def saved_text(root: Path, parse) -> str:
    """The text of ``minizero/course/labs/saved.py`` for the sources under ``root`` (``parse``:
    build.py's)."""
    saved, imports = collect(root, parse)
    head = [
        '"""The `# @save` definitions of the lessons, in course order: what the labs run.',
        "",
        "Generated by `python -m minizero lessons` from course/ (docs/writing-lessons.md): edit",
        "the lesson, not this file. Each definition names the source line and the notebook cell",
        'it is copied from."""',
        "",
    ]
    body: list[str] = []
    for s in saved:
        body += ["", "", f"# {s.source}:{s.line} (cell {s.cell})", s.text]
    return "\n".join(head + import_lines(imports) + body) + "\n"
