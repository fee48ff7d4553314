"""How far every check is from failing a right answer, and from passing a wrong one:
``python -m minizero margins`` (run it in the kit's clone: it runs the tests of ``tests/course``).

Every tolerance comparison a check makes goes through :func:`~.checks.common.within`, which, under
``$MINIZERO_MARGINS``, records ``(what, err, tol)``. This command runs

* the solutions' check tests (``*solution*``, ``*passes*``) under each perturbation a right answer
  meets on a student's machine: four CPU-kernel settings (:data:`KERNELS`), 4 and 5 ranks, two
  more data seeds, 2 threads per rank; their largest ``err / tol`` is the right side;
* the plausible wrong answers (``tests/course/test_checks_reject*.py``) once; the smallest
  ``err / tol`` among the comparisons that failed them is the wrong side (a wrong answer refused
  by a check that is not a tolerance, such as the ledger's ops or an exception, has no ratio);

and prints, per comparison, both ratios and the margins ``tol / right`` and ``wrong / tol`` (the
course asks >= 100x on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from minizero.course.build import ROOT

# The CPU-kernel settings a right answer must pass under (oneDNN's ISA cap, MKL's, ATen's own).
KERNELS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "portable": {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ATEN_CPU_CAPABILITY": "default",
    },
}
PERTURBATIONS = {
    "default": {},
    **{f"kernels-{k}": v for k, v in KERNELS.items()},
    "ranks-4": {"MINIZERO_CHECK_WORLD": "4"},
    "ranks-5": {"MINIZERO_CHECK_WORLD": "5"},
    "seed-1": {"MINIZERO_CHECK_SEED": "1"},
    "seed-2": {"MINIZERO_CHECK_SEED": "2"},
    "threads-2": {"MINIZERO_CHECK_THREADS": "2"},
}
RIGHT = "solution or passes"  # pytest -k: the tests that run a check on its lesson's solution
TESTS = ["tests/course/test_checks_reject*.py", "tests/course/test_checks_budget.py"]


def _pytest(folder: Path, env: dict, select: str) -> int:
    files = sorted(str(p.relative_to(ROOT)) for pat in TESTS for p in ROOT.glob(pat))
    # --soak: the right answers' tests are in the soak tier (the fast tier grades the solutions)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--soak", "-k", select,
           *files]  # fmt: skip
    full = dict(os.environ, MINIZERO_MARGINS_DIR=str(folder), **env)
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True).returncode


def _records(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            out.append(json.loads(line) | {"test": f.stem})
    return out


def _ratio(r: dict) -> float:
    if r["tol"] > 0:
        return r["err"] / r["tol"]
    return 0.0 if r["err"] == 0 else 1e30


def tabulate(right: dict[str, list[dict]], wrong: list[dict]) -> dict[str, dict]:
    """Per comparison ``what``: the largest ``err/tol`` of the right answers' records (``right``:
    perturbation -> records) and under which perturbation; the smallest of the wrong answers'
    records that failed (a wrong answer's comparisons that passed, before the one that failed it,
    are not its margin) and in which test."""
    table: dict[str, dict] = {}
    for name, records in right.items():
        for r in records:
            row = table.setdefault(r["what"], {"right": 0.0, "wrong": None})
            if row["right"] is None or _ratio(r) > row["right"] or "right_at" not in row:
                row["right"], row["right_at"] = _ratio(r), name
    for r in wrong:
        if _ratio(r) <= 1:
            continue
        row = table.setdefault(r["what"], {"right": None, "wrong": None})
        if row["wrong"] is None or _ratio(r) < row["wrong"]:
            row["wrong"], row["wrong_at"] = _ratio(r), r["test"]
    return table


def measure(perturbations: dict[str, dict], log=print) -> dict[str, dict]:
    """Run the solutions' check tests under each perturbation and the wrong answers once; the
    :func:`tabulate` of what their comparisons recorded."""
    right = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, env) in enumerate(perturbations.items()):
            folder = Path(tmp) / f"right-{k}"
            folder.mkdir()
            code = _pytest(folder, env, RIGHT)
            log(f"{name:>18}: solutions' check tests {'passed' if code == 0 else 'FAILED'}")
            right[name] = _records(folder)
        folder = Path(tmp) / "wrong"
        folder.mkdir()
        _pytest(folder, {}, "rejects")
        return tabulate(right, _records(folder))


def _g(v: float | None) -> str:
    return "-" if v is None else ("inf" if v >= 1e30 else f"{v:.3g}")


def render(table: dict[str, dict]) -> str:
    """One line per comparison: right err/tol, its margin (tol/err), wrong err/tol (= margin)."""
    head = f"{'comparison':<44} {'right':>9} {'margin':>9} {'wrong':>9}  worst right under"
    lines = [head, "-" * len(head)]
    for what in sorted(table):
        row = table[what]
        right = row["right"]
        margin = None if right is None else (1e30 if right == 0 else 1 / right)
        lines.append(
            f"{what:<44} {_g(right):>9} {_g(margin):>9} {_g(row['wrong']):>9}  "
            f"{row.get('right_at', '') if right else '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minizero margins",
        description="Each check's margin on both sides: the solutions under perturbations (CPU "
        "kernels, ranks, seeds, threads), the plausible wrong answers of tests/course.",
    )
    names = ", ".join(PERTURBATIONS)
    p.add_argument("--only", nargs="*", choices=sorted(PERTURBATIONS), metavar="NAME",
                   help=f"run only these perturbations (of: {names})")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = p.parse_args(argv)
    if not (ROOT / "tests" / "course").is_dir():
        p.error(f"no tests/course under {ROOT}: run it in the kit's clone (git clone ...)")
    chosen = {k: PERTURBATIONS[k] for k in (args.only or PERTURBATIONS)}
    table = measure(chosen)
    print(render(table))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1, sort_keys=True))
    low = [w for w, r in table.items() if (r["right"] or 0) > 0.01 or (r["wrong"] or 1e30) < 100]
    print(f"\n{len(table) - len(low)} of {len(table)} comparisons hold 100x on both sides" +
          (f"; below: {', '.join(low)}" if low else ""))  # fmt: skip
    return 0
