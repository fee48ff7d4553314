"""Command line: ``python -m minizero COMMAND ...`` (also installed as ``minizero``)."""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

# Commands that hand their arguments to a function of their own: name -> (module:function, help)
PASS_THROUGH = {
    "compare": ("plots:main", "instructor demo: every stage measured, one figure"),
    "simulate": ("simulate:main", "ZeRO's Table 1 from the real stage code on meta tensors"),
    "run": ("launch:torchrun_main", "run a script under torchrun (multi-node, one rank per GPU)"),
    "start": ("course:start_main", "copy the lessons into a folder of your own (my-lessons/)"),
    "grade": ("course:grade_main", "grade your lesson notebooks (runs their check cells)"),
    "lessons": ("course:lessons_main", "regenerate lessons/ and solutions/ from course/"),
    "consolidate": ("checkpoint:consolidate_main", "a checkpoint -> one full fp32 state dict file"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="minizero", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="DDP on 2 ranks (gloo) or one rank per GPU (NCCL)")
    d.add_argument("--nprocs", type=int, default=None)
    d.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    b = sub.add_parser("bench", help="benchmarks: collectives, ddp, stages")
    b.add_argument("what", choices=["collectives", "ddp", "stages"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    for name, (_, text) in PASS_THROUGH.items():
        sub.add_parser(name, add_help=False, help=text).add_argument(
            "rest", nargs=argparse.REMAINDER
        )
    # REMAINDER does not take a leading --flag (`lessons --check`): pass unknown flags on too.
    args, extra = p.parse_known_args(argv)
    if extra and not hasattr(args, "rest"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    rest = [*extra, *getattr(args, "rest", [])]
    if args.cmd == "demo":
        from minizero.demo import demo

        return demo(nprocs=args.nprocs, stage=args.stage)
    if args.cmd == "bench":
        from minizero import bench

        return getattr(bench, f"bench_{args.what}")(rest)
    module, function = PASS_THROUGH[args.cmd][0].split(":")
    return getattr(import_module(f"minizero.{module}"), function)(rest)


if __name__ == "__main__":
    sys.exit(main())
