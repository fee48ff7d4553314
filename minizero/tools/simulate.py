"""``python -m minizero simulate``: ZeRO's Table 1 from the real stage code on meta tensors.

The simulation itself is :mod:`minizero.analysis.simulate` (lesson 05); this is its command line.
"""

from __future__ import annotations

from minizero.analysis.simulate import TABLE1_DP, print_table1
from minizero.tools.cli import Parser


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero simulate [--stages 0 1 2 3] [--worlds 1 4 ...] [--psis 7.5e9 ...]``."""
    p = Parser(
        prog="minizero simulate",
        description="Per-rank model states (parameters, gradients, optimizer states) of a model "
        "with PSI parameters trained on N_d ranks, measured by running minizero's real stage "
        "code on meta tensors (no memory) under a fake process group: the ZeRO paper's Table 1 "
        "by default, with the paper's printed value beside each cell it has.",
    )
    p.add_argument(
        "--stages",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        choices=[0, 1, 2, 3],
        help="stages to show: 0 DDP, 1 P_os, 2 P_os+g, 3 P_os+g+p (default: all)",
    )
    p.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=list(TABLE1_DP),
        metavar="N_D",
        help="data-parallel ranks N_d (default: the paper's 1 4 16 64 256 1024)",
    )
    p.add_argument(
        "--psis",
        type=float,
        nargs="+",
        default=[7.5e9, 128e9, 1e12],
        metavar="PSI",
        help="parameter counts, e.g. 1.3e9 (default: the paper's 7.5e9 128e9 1e12)",
    )
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="bf16/fp16: mixed-precision Adam, K = 12 (the paper's); fp32: K = 8 "
                   "(default bf16)")  # fmt: skip
    a = p.parse_args(argv)
    if bad := [w for w in a.worlds if w < 1]:
        p.error(f"--worlds must be >= 1, got {bad[0]}")
    if bad := [x for x in a.psis if not 4 <= x < 1e16]:
        p.error(f"--psis must be between 4 and 1e16 parameters, got {bad[0]:g}")
    stages = sorted(set(a.stages))
    worlds, psis = list(dict.fromkeys(a.worlds)), list(dict.fromkeys(a.psis))
    print_table1(stages=stages, worlds=worlds, psis=psis, precision=a.precision)
    return 0
