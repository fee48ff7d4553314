"""How much code a reader follows: the call closure of training steps and a file's import closure.

    python tools/closure.py            # every stage's call closure, zero2.py's import closure

Call closure of a stage: on 2 gloo ranks, ``parallelize(MLP(), stage, optimizer=AdamW)`` then 2
steps (forward, backward, ``step()``, ``zero_grad()``), traced on rank 0 with ``sys.setprofile``
from the ``parallelize`` call on. Every function of ``minizero/`` that ran counts with its whole
line span (decorators and docstring included), and every class whose methods ran with its header
(``class`` line to first statement); the habits that run in the step (``minizero/habits/``,
composed around the core through ``Extension``) count, as every line a step runs does; models.py
(the model, not the library) and the launcher (which runs the ranks) are left out. Import closure
of a module: every ``minizero`` module it imports, transitively (AST imports, lazy ones too),
whole files, itself included.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minizero"
LEFT_OUT = ("models.py", "launcher/")


def spans(path: Path) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """(function first line -> its span, method first line -> its class's header span)."""
    tree = ast.parse(path.read_text())
    funcs, header_of = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            body = [n for n in node.body if not (isinstance(n, ast.Expr) and n is node.body[0])]
            first = node.body[0]
            end = first_line(body[0]) - 1 if body else node.end_lineno
            head = (min([node.lineno] + [d.lineno for d in node.decorator_list]), end)
            if isinstance(first, ast.Expr):  # the docstring is part of the header
                head = (head[0], max(head[1], first.end_lineno))
            for n in node.body:
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                    header_of[n.lineno] = header_of[first_line(n)] = head
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            start = first_line(node)
            funcs[node.lineno] = funcs[start] = (start, node.end_lineno)  # (a decorated function's
            # code object starts at its first decorator)
    return funcs, header_of


def first_line(node: ast.AST) -> int:
    """A statement's first line: its first decorator's, where it has one."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def counted(filename: str) -> Path | None:
    path = Path(filename).resolve()
    if not path.is_relative_to(PACKAGE):
        return None
    rel = path.relative_to(PACKAGE).as_posix()
    return None if rel.startswith(LEFT_OUT) else path


def trace_steps(stage: int) -> set[tuple[str, int]]:
    """(file, first line) of every counted function that ran on this rank."""
    import torch
    import torch._dynamo  # noqa: F401  (AdamW's constructor imports it: outside the profile)

    from minizero.models import MLP, synthetic_batch
    from minizero.parallelize import parallelize

    torch.manual_seed(0)
    ran: set[tuple[str, int]] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            if counted(code.co_filename) is not None:
                ran.add((str(Path(code.co_filename).resolve()), code.co_firstlineno))

    sys.setprofile(profile)
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False) if hasattr(
        torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"
    ) else None
    threading_profile(profile)
    try:
        net = MLP()
        model, opt = parallelize(net, stage, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3))
        for step in range(2):
            x, y = synthetic_batch("mlp", 4, step, rank=model.rank, world=model.world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        sys.setprofile(None)
        threading_profile(None)
    return ran


def threading_profile(fn) -> None:
    """Autograd's hooks run on the thread that called backward (CPU), so the main thread's
    profile sees them; set it for new threads too, in case."""
    import threading

    threading.setprofile(fn)


def lines_of(ran: set[tuple[str, int]]) -> tuple[int, dict[str, int]]:
    """Total lines and lines per file: each function's span, each class header once."""
    per_file: dict[str, set[int]] = {}
    for filename, first in ran:
        funcs, header_of = spans(Path(filename))
        span = funcs.get(first)
        if span is None:
            continue
        lines = per_file.setdefault(filename, set())
        lines |= set(range(span[0], span[1] + 1))
        if first in header_of:
            h = header_of[first]
            lines |= set(range(h[0], h[1] + 1))
    by_file = {str(Path(f).relative_to(ROOT)): len(s) for f, s in sorted(per_file.items())}
    return sum(by_file.values()), by_file


def _rank(stage: int):
    return lines_of(trace_steps(stage))


def call_closure(stage: int) -> tuple[int, dict[str, int]]:
    """Lines of the call closure of 2 steps at ``stage`` (rank 0 of 2, gloo)."""
    import minizero

    return minizero.launch(_rank, 2, stage, backend="gloo", timeout=300, verbose=False)[0]


def import_graph() -> dict[str, set[str]]:
    """module -> the minizero modules it imports, wherever the import sits (lazy ones too:
    inside functions, ``import_module("minizero.x")``, and the command line's table)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.split(".")[0] == "minizero"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minizero"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    out.add(full if full in modules else node.module)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
                arg = node.args[0]
                if isinstance(arg, ast.Constant):
                    out.add(arg.value)
                else:  # only the command line builds the name: from its table of commands
                    assert name == "minizero.__main__", f"{name}: import_module({ast.unparse(arg)})"
                    table = importlib.import_module(name).PASS_THROUGH
                    out |= {"minizero." + v[0].split(":")[0] for v in table.values()}
        out.discard(name)
        graph[name] = {m for m in out if m.startswith("minizero")}
    return graph


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_closure_lines(module: str) -> tuple[int, list[str]]:
    """Lines of ``module`` and every minizero module it imports, transitively (whole files)."""
    graph = import_graph()
    seen, todo = {module}, [module]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d != "minizero" and d not in seen:
                seen.add(d)
                todo.append(d)
    files = [ROOT / (m.replace(".", "/") + ".py") for m in seen]
    files = [f if f.exists() else f.with_suffix("") / "__init__.py" for f in files]
    return sum(len(f.read_text().splitlines()) for f in files), sorted(seen)


def main() -> None:
    for stage in (0, 1, 2, 3):
        total, by_file = call_closure(stage)
        print(f"stage {stage} call closure: {total} lines  {by_file}")
    total, mods = import_closure_lines("minizero.zero2")
    print(f"zero2.py import closure: {total} lines  {mods}")


if __name__ == "__main__":
    main()
