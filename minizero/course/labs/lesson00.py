"""Lesson 00's experiments (``course/00_collectives.py``): what a collective moves and costs.

``volumes`` (section 3) the paper's volume of each collective: the lesson's ``one_of_each``;
``ledger_cost`` (section 3) what the ledger's own timing costs per call;
``bandwidth`` (section 4) the lesson's ``time_collective`` over ops and message sizes;
``rs_against_torch`` (section 4) minizero's reduce-scatter beside torch's own and its all-reduce;
``show_fit`` / ``plot_fit`` (section 5) those rows beside the α-β model fitted to them.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero import collectives as C
from minizero.analysis import cost
from minizero.analysis.ledger import CommLedger
from minizero.collectives import all_gather, reduce_scatter
from minizero.course import hint
from minizero.course.checks import lesson00
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.saved import one_of_each, time_collective
from minizero.launcher.progress import launch_with_progress

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "C", "all_gather", "cost", "dist"]
__all__ += ["CommLedger", "lesson00", "rank_device", "reduce_scatter", "run_info"]


def volumes(nprocs: int, elements: int = 1200) -> CommLedger:
    """Lesson 00, section 3: the lesson's ``one_of_each`` (one all-reduce, then one reduce-scatter
    and one all-gather of ``elements`` float32, a multiple of ``nprocs``, under a ledger) on
    ``nprocs`` ranks; rank 0's ledger."""
    if elements % nprocs:
        raise ValueError(f"elements={elements} must divide by nprocs={nprocs}")
    return minizero.launch(one_of_each, nprocs, elements, verbose=False)[0]


def show_volumes(ledger: CommLedger) -> None:
    print(ledger.table())
    print("volume (elements):", ledger.by_op())


@dataclass
class LedgerCost:
    """Medians over the calls, on rank 0, in seconds."""

    caller: float  # time.perf_counter() around the call
    recorded: float  # what the ledger recorded
    extra: float  # the difference: the ledger's own bookkeeping
    info: dict


def _ledger_cost(calls: int) -> LedgerCost:
    dev = rank_device()
    x = torch.zeros(1024, device=dev)  # (1024,) float32: 4 KiB, where a fixed cost shows most
    caller = []
    with CommLedger() as ledger:
        for _ in range(calls):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            C.all_reduce(x)  # blocking: the ledger times issue -> return
            caller.append(time.perf_counter() - t0)
    seen = [r.seconds for r in ledger.records]
    medians = [statistics.median(v) for v in (caller, seen, [c - s for c, s in zip(caller, seen)])]
    return LedgerCost(*medians, info=run_info())


def ledger_cost(nprocs: int, calls: int = 200) -> LedgerCost:
    """Lesson 00, section 3: ``calls`` blocking 4 KiB all-reduces, timed by the caller and by the
    ledger at once."""
    return minizero.launch(_ledger_cost, nprocs, calls, verbose=False)[0]


def show_ledger_cost(c: LedgerCost) -> None:
    print(
        f"4 KiB all-reduce on {describe(c.info)}, median on rank 0: caller sees "
        f"{c.caller * 1e6:.1f} µs, the ledger records {c.recorded * 1e6:.1f} µs; bookkeeping "
        f"{c.extra * 1e6:.1f} µs per call ({c.extra / c.caller:.0%})"
    )


def default_sizes(info: dict) -> list[int]:
    """4 KiB to 16 MiB on CPUs, to 256 MiB on GPUs, in steps of 4x."""
    top = 24 if info["device"].startswith("cpu") else 28
    return [2**k for k in range(12, top + 1, 2)]


def _each(ops: list[str], sizes: list[int], time_one, progress) -> list[dict]:
    rows = []
    for op in ops:
        for nbytes in sizes:
            rows.append(time_one(op, nbytes))
            progress.tick()
    return rows


def bandwidth(nprocs: int, ops: list[str], sizes: list[int], time_one=time_collective) -> list:
    """Lesson 00, section 4: ``time_one(op, nbytes)`` (the lesson's ``time_collective``: warm-up,
    repeats, the median call) at each op and size, on ``nprocs`` ranks, with a progress bar; rank
    0's rows: ``op, nbytes, seconds, algbw, busbw`` (nccl-tests' definitions), ``info``."""
    total = len(ops) * len(sizes)
    return launch_with_progress(
        _each, nprocs, ops, sizes, time_one, total=total, desc="collectives", verbose=False
    )[0]


def _gloo_note(rows: list[dict]) -> str:
    gloo = rows[0]["info"]["backend"] == "gloo"
    return " (gloo: minizero's reduce_scatter = all-to-all + local sum)" if gloo else ""


_TORCH_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rs_against_torch(sizes: list[int], repeats: int) -> dict:
    world, dev, rows = dist.get_world_size(), rank_device(), []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)  # float32 elements, a multiple of N
        full = torch.zeros(n, device=dev)  # (S,) zeros: the all-reduces leave it 0
        shard = torch.empty(n // world, device=dev)  # (S/N,)
        calls = {"minizero": lambda: C.reduce_scatter(shard, full),  # noqa: B023
                 "torch": lambda: _TORCH_RS(shard, full),  # noqa: B023
                 "torch all_reduce": lambda: dist.all_reduce(full)}  # noqa: B023  # fmt: skip
        times = {k: [] for k in calls}
        for i in range(repeats + 1):  # interleaved, call by call; the first round warms up
            for name, call in calls.items():
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                call()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:
                    times[name].append(time.perf_counter() - t0)
        rows.append(dict(nbytes=4 * n, **{k: statistics.median(v) for k, v in times.items()}))
    return dict(rows=rows, info=run_info())


def rs_against_torch(nprocs: int, sizes: list[int], repeats: int = 9) -> dict:
    """Section 4: at each size (bytes, fp32) the median of ``repeats`` calls of minizero's
    reduce-scatter, of torch's ``reduce_scatter_tensor`` and of torch's ``all_reduce`` on the same
    buffers, interleaved call by call; rank 0's rows and ``info``."""
    return minizero.launch(_rs_against_torch, nprocs, sizes, repeats, verbose=False)[0]


def show_rs_against_torch(r: dict) -> None:
    gloo = r["info"]["backend"] == "gloo"
    how = "an all-to-all and a local sum" if gloo else "torch's own call: the columns are one call"
    print(
        f"reduce-scatter on {describe(r['info'])}, median µs per call, rank 0 (minizero's: {how})"
    )
    print(f"{'S (bytes)':>11}{'minizero':>10}{'torch':>10}{'torch AR':>10}"
          f"{'torch / minizero':>18}{'torch / torch AR':>18}")  # fmt: skip
    for row in r["rows"]:
        mz, rs, ar = (row[k] * 1e6 for k in ("minizero", "torch", "torch all_reduce"))
        print(
            f"{row['nbytes']:>11}{mz:>10.0f}{rs:>10.0f}{ar:>10.0f}{rs / mz:>18.2f}{rs / ar:>18.2f}"
        )


def plot_bandwidth(rows: list[dict]) -> None:
    """busbw and time per call over the message size, one line per op."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        sizes = [r["nbytes"] for r in mine]
        ax1.plot(sizes, [r["busbw"] / 1e9 for r in mine], "o-", label=op)
        ax2.plot(sizes, [r["seconds"] * 1e6 for r in mine], "o-", label=op)
    for ax, ylabel in ((ax1, "busbw (GB/s)"), (ax2, "time per call (µs)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S: message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    ax2.set_yscale("log")
    fig.suptitle(f"Collectives measured on {describe(rows[0]['info'])}{_gloo_note(rows)}")
    fig.tight_layout()
    plt.show()


def show_ratios(rows: list[dict]) -> None:
    """At the largest size: each half's time over the all-reduce's."""
    largest = max(r["nbytes"] for r in rows)
    t = {r["op"]: r["seconds"] for r in rows if r["nbytes"] == largest}
    rs, ag, ar = t["reduce_scatter"], t["all_gather"], t["all_reduce"]
    print(f"at S = {largest / 2**20:.0f} MiB on {describe(rows[0]['info'])}:")
    print(f"  time(reduce_scatter) / time(all_reduce) = {rs / ar:.2f}")
    print(f"  time(all_gather)     / time(all_reduce) = {ag / ar:.2f}")
    print(f"  time(reduce_scatter + all_gather) / time(all_reduce) = {(rs + ag) / ar:.2f}")


def show_fit(rows: list[dict], link: cost.Link, model: dict[str, float]) -> None:
    """Each measured row beside the model's time for it (``model``: seconds per row index)."""
    gloo = rows[0]["info"]["backend"] == "gloo"
    print(
        f"fitted on {describe(rows[0]['info'])}: α = {link.alpha * 1e6:.1f} µs per round, "
        f"β = {link.beta / 1e9:.3f} GB/s" + ("  (gloo: minizero's reduce_scatter)" * gloo)
    )
    print(f"{'op':<16}{'S (bytes)':>11}{'measured µs':>13}{'model µs':>10}{'error':>8}")
    for r, m in zip(rows, model):
        print(
            f"{r['op']:<16}{r['nbytes']:>11}{r['seconds'] * 1e6:>13.1f}{m * 1e6:>10.1f}"
            f"{m / r['seconds'] - 1:>+8.0%}"
        )


def plot_fit(rows: list[dict], link: cost.Link, model: list[float]) -> None:
    """Measured times (dots) and the α-β model (lines), per op, on log axes."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [(r, m) for r, m in zip(rows, model) if r["op"] == op]
        sizes = [r["nbytes"] for r, _ in mine]
        (line,) = ax.plot(sizes, [r["seconds"] * 1e6 for r, _ in mine], "o", label=f"{op} measured")
        ax.plot(
            sizes, [m * 1e6 for _, m in mine], "-", color=line.get_color(), label=f"{op} α-β model"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("S: message size (bytes)")
    ax.set_ylabel("time per call (µs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    where = describe(rows[0]["info"])
    ax.set_title(
        f"α = {link.alpha * 1e6:.0f} µs, β = {link.beta / 1e9:.2f} GB/s on {where}", fontsize=9
    )
    fig.tight_layout()
    plt.show()
