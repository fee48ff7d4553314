"""Benchmarks: ``python -m minizero bench collectives|ddp|stages|checkpoints|zeropp|parts|nanogpt``.
Lessons 00, 01, 05, 07; zeropp (minizero/tools/bench_zeropp.py) for lesson 08; nanogpt
(minizero/tools/bench_nanogpt.py: nanoGPT's train.py beside ``minizero train``) for lesson 09.

Every figure is measured here and printed with the backend, device, world size and torch version it
came from; nothing is compared with a hard-coded hardware peak. Each command shows a progress bar
while the ranks work, prints its table, and writes JSON for plots.

* ``collectives`` (this file): an nccl-tests-like table per collective (size, count, type, time,
  algbw, busbw), run through ``minizero.collectives`` and timed by a ``CommLedger``; the same call
  made on ``torch.distributed`` directly, interleaved call by call, gives the ratio column.
* ``ddp`` and ``stages`` (``minizero/bench_steps.py``): each stage against its PyTorch peer, same
  model, same process group, alternating k steps each; step time and per-rank memory of each.

Times are per-rank medians, then the slowest rank (a step ends when every rank has ended it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.analysis.ledger import BUSBW_FACTOR, LATENCY_BOUND, CommLedger
from minizero.launcher import rank_device as device
from minizero.tools.cli import Parser, add_nprocs, positive_float, positive_int
from minizero.tools.report import (
    COMMANDS,
    header,
    measured_on,
    printer,
    ranks,
    run_ranks,
    sync,
    write_json,
)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------- collectives


def _pair(op: str, count: int, dtype: torch.dtype, dev: torch.device, world: int):
    """(minizero call, torch call) of ``op`` on S = ``count`` elements, on the same buffers."""
    full = torch.zeros(count, dtype=dtype, device=dev)  # (S,) zeros: sums never overflow
    shard = torch.zeros(count // world, dtype=dtype, device=dev)  # (S/n,) one rank's chunk
    if op == "all_reduce":
        return lambda: C.all_reduce(full), lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: C.reduce_scatter(shard, full), lambda: _RS(shard, full)
    if op == "all_gather":
        return lambda: C.all_gather(full, shard), lambda: _AG(full, shard)
    return lambda: C.broadcast(full, src=0), lambda: dist.broadcast(full, src=0)


def _collectives_rank(sizes: list[int], ops: list[str], iters: int, warmup: int, dtype_name: str,
                      progress=None):  # fmt: skip
    dtype, dev, world = getattr(torch, dtype_name), device(), dist.get_world_size()
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for size in sizes:
        count = max(world, size // esize // world * world)  # divisible by n for the sharded ops
        for op in ops:
            ours, theirs = _pair(op, count, dtype, dev, world)
            for _ in range(warmup):
                ours(), theirs()
            torch_s = []
            with CommLedger() as ledger:
                for i in range(iters):
                    if i % 2:  # alternate which goes first
                        ours()
                    sync(dev)
                    t0 = time.perf_counter()
                    theirs()
                    sync(dev)
                    torch_s.append(time.perf_counter() - t0)
                    if not i % 2:
                        ours()
            ours_s = [r.seconds for r in ledger.records]
            rows.append(dict(op=op, count=count, nbytes=count * esize,
                             seconds=statistics.median(ours_s),
                             mean_seconds=statistics.fmean(ours_s),
                             torch_seconds=statistics.median(torch_s)))  # fmt: skip
            if progress is not None:
                progress.tick()
    return dict(where=measured_on(), rows=rows)


def collectives_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_nprocs(p)
    p.add_argument(
        "--min-bytes",
        type=positive_int,
        default=1024,
        help="smallest message, bytes (default 1024)",
    )
    p.add_argument(
        "--max-bytes",
        type=positive_int,
        default=64 * 2**20,
        help="largest message, bytes (default 64 MiB)",
    )
    p.add_argument(
        "--step-factor",
        type=int,
        default=4,
        help="size multiplier between rows, at least 2 (default 4)",
    )
    p.add_argument(
        "--iters", type=positive_int, default=20, help="timed calls per row (default 20)"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per row (default 5)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="element type (default float32)",
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma-separated subset of {','.join(OPS)} (default: all)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600,
        help="seconds the ranks may run (default 600)",
    )
    p.add_argument(
        "--json",
        default="runs/bench_collectives.json",
        help="where to write the results ('' for nowhere)",
    )
    return p  # fmt: skip


def bench_collectives(argv: list[str]) -> int:
    """nccl-tests-like bandwidth table of the four collectives, through minizero and torch."""
    p = collectives_options(
        Parser(prog="minizero bench collectives", description=COMMANDS["collectives"])
    )
    a = p.parse_args(argv)  # fmt: skip
    ops = a.ops.split(",")
    if bad := [o for o in ops if o not in OPS]:
        p.error(f"--ops: unknown op(s) {bad}; choose from {','.join(OPS)}")
    if a.min_bytes > a.max_bytes:
        p.error(f"--min-bytes ({a.min_bytes}) is larger than --max-bytes ({a.max_bytes})")
    if a.step_factor < 2 or a.warmup < 0:
        p.error("--step-factor must be >= 2 and --warmup >= 0")
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= a.step_factor
    n = ranks(a.nprocs)
    print(f"minizero bench collectives: {len(ops)} ops x {len(sizes)} sizes "
          f"({sizes[0]} B .. {sizes[-1]:,} B) on {n} ranks, {a.iters} timed calls each",
          flush=True)  # fmt: skip
    per_rank = run_ranks(_collectives_rank, n, a.timeout, sizes, ops, a.iters, a.warmup, a.dtype,
                         total=len(sizes) * len(ops), desc="collectives")  # fmt: skip
    where, rows = per_rank[0]["where"], per_rank[0]["rows"]
    for i, row in enumerate(rows):  # the slowest rank's median
        row["seconds"] = max(r["rows"][i]["seconds"] for r in per_rank)
        row["torch_seconds"] = max(r["rows"][i]["torch_seconds"] for r in per_rank)
        row["algbw"] = row["nbytes"] / row["seconds"]
        row["busbw"] = row["algbw"] * BUSBW_FACTOR[row["op"]](where["world"])
        row["ratio"] = row["seconds"] / row["torch_seconds"]
    if not printer():
        return 0
    print(header("collectives", where))
    print(f"{a.iters} timed calls per row after {a.warmup} warmup; time = median over calls, "
          f"slowest rank. S = full size (nccl-tests), busbw = algbw x factor(n)")  # fmt: skip
    print("torch(us): the same call on torch.distributed directly, interleaved with minizero's")
    print(f"rows marked ~ are under {LATENCY_BOUND // 2**20} MiB: their time is mostly per-call "
          "latency, so their busbw says little about the link's bandwidth")  # fmt: skip
    for op in ops:
        gloo_rs = op == "reduce_scatter" and where["backend"] == "gloo"
        note = ("   (gloo: minizero's is an all-to-all and a local sum, (n-1)/n of S sent; "
                "torch's, an all-reduce of a clone of S)")  # fmt: skip
        print(f"\n# {op}" + (note if gloo_rs else ""))
        print(f"{'size(B)':>12}{'count':>12}{'type':>10}{'time(us)':>11}{'algbw(GB/s)':>13}"
              f"{'busbw(GB/s)':>13}{'torch(us)':>11}{'minizero/torch':>16}")  # fmt: skip
        for r in (r for r in rows if r["op"] == op):
            tilde = "~" if r["nbytes"] < LATENCY_BOUND else " "
            print(f"{r['nbytes']:>12}{r['count']:>12}{a.dtype:>10}{r['seconds'] * 1e6:>11.1f}"
                  f"{r['algbw'] / 1e9:>13.3f}{tilde}{r['busbw'] / 1e9:>12.3f}"
                  f"{r['torch_seconds'] * 1e6:>11.1f}{r['ratio']:>16.2f}")  # fmt: skip
    ratios = [r["ratio"] for r in rows]
    print(
        f"\nminizero/torch over all rows: median {statistics.median(ratios):.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    )
    if a.json:
        write_json(a.json, dict(where=where, dtype=a.dtype, iters=a.iters, warmup=a.warmup,
                                rows=rows))  # fmt: skip
    return 0


def all_reduce_probe(seconds: float, nbytes: int) -> dict:
    """Inside a rank: all-reduce ``nbytes`` of fp32 for about ``seconds`` (``python -m minizero
    doctor``'s probe); the ledger's median time, the call count and :func:`measured_on`."""
    dev = device()
    buf = torch.zeros(nbytes // 4, device=dev)  # zeros: the sums never overflow
    for _ in range(3):  # warm up (NCCL builds its rings here)
        C.all_reduce(buf)
    with CommLedger() as once:
        C.all_reduce(buf)
    took = torch.tensor([once.records[0].seconds], device=dev)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the same call count on every rank
    calls = max(3, min(10_000, int(seconds / max(took.item(), 1e-6))))
    with CommLedger() as ledger:
        for _ in range(calls):
            C.all_reduce(buf)
    times = [r.seconds for r in ledger.records]
    return dict(where=measured_on(), median=statistics.median(times), calls=calls)


# ---------------------------------------------------------------- the command line


def main(argv: list[str]) -> int:
    """``python -m minizero bench collectives|ddp|stages [options]``."""
    from minizero.tools import bench_parts, bench_steps, bench_zeropp
    from minizero.tools.bench_ckpt import bench_checkpoint

    p = Parser(
        prog="minizero bench",
        description="Benchmarks measured on this machine, each printed with the backend, device "
        "and world size it ran on, and saved as JSON under runs/. "
        "python -m minizero bench WHAT --help lists WHAT's options.",
    )
    sub = p.add_subparsers(dest="what", metavar="WHAT", title="what to measure")
    sub.add_parser("collectives", help="collective bandwidth over message sizes (nccl-tests-like)",
                   description=COMMANDS["collectives"], add_help=False)  # fmt: skip
    sub.add_parser("ddp", help="minizero DDP vs torch DDP: step time and memory",
                   description=COMMANDS["ddp"], add_help=False)  # fmt: skip
    sub.add_parser("stages", help="stages 0-3 vs their PyTorch peers: step time and memory",
                   description=COMMANDS["stages"], add_help=False)  # fmt: skip
    sub.add_parser("checkpoints", help="save/load time and bytes per rank per stage",
                   description=COMMANDS["checkpoints"], add_help=False)  # fmt: skip
    bench_zeropp.add_parser(sub)
    bench_parts.add_parser(sub)
    sub.add_parser("nanogpt", help="nanoGPT's train.py beside minizero train: val loss, wall "
                   "time, memory", add_help=False)  # fmt: skip
    a, rest = p.parse_known_args(argv[:1])
    if a.what is None:
        p.error("say what to measure: collectives, ddp, stages, checkpoints, zeropp, parts or "
                "nanogpt; e.g. python -m minizero bench collectives")  # fmt: skip
    if a.what == "zeropp":
        return bench_zeropp.main(argv[1:])
    if a.what == "parts":
        return bench_parts.bench_parts(argv[1:])
    if a.what == "nanogpt":
        from minizero.tools import bench_nanogpt

        return bench_nanogpt.main(argv[1:])
    if a.what == "checkpoints":
        bench_checkpoint(argv[1:])
        return 0
    run = {"collectives": bench_collectives, "ddp": bench_steps.bench_ddp,
           "stages": bench_steps.bench_stages}[a.what]  # fmt: skip
    return run(argv[1:])
