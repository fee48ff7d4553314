"""Command line: ``python -m minizero {demo,bench,compare,simulate,run,grade,lessons} ...``."""

from __future__ import annotations

import argparse
import sys


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
    r = sub.add_parser(
        "run", add_help=False, help="run a script under torchrun (multi-node, one rank per GPU)"
    )
    r.add_argument("rest", nargs=argparse.REMAINDER)
    c = sub.add_parser(
        "compare", add_help=False, help="instructor demo: every stage measured, one figure"
    )
    c.add_argument("rest", nargs=argparse.REMAINDER)
    s = sub.add_parser(
        "simulate", add_help=False, help="ZeRO's Table 1 from the real stage code on meta tensors"
    )
    s.add_argument("rest", nargs=argparse.REMAINDER)
    g = sub.add_parser(
        "grade", add_help=False, help="grade your lesson notebooks (runs their check cells)"
    )
    g.add_argument("rest", nargs=argparse.REMAINDER)
    m = sub.add_parser(
        "lessons", add_help=False, help="regenerate lessons/ and solutions/ from course/"
    )
    m.add_argument("rest", nargs=argparse.REMAINDER)
    # REMAINDER does not take a leading --flag (`lessons --check`): pass unknown flags on too.
    args, extra = p.parse_known_args(argv)
    if extra and not hasattr(args, "rest"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.rest = [*extra, *args.rest]
    if args.cmd == "demo":
        from minizero.demo import demo

        return demo(nprocs=args.nprocs, stage=args.stage)
    if args.cmd == "bench":
        from minizero import bench

        return getattr(bench, f"bench_{args.what}")(args.rest)
    if args.cmd == "compare":
        from minizero.plots import main as compare_main

        return compare_main(args.rest)
    if args.cmd == "simulate":
        from minizero.simulate import main as simulate_main

        return simulate_main(args.rest)
    if args.cmd in ("grade", "lessons"):
        from minizero import course

        return getattr(course, f"{args.cmd}_main")(args.rest)
    from minizero.launch import torchrun_main

    return torchrun_main(args.rest)


if __name__ == "__main__":
    sys.exit(main())
