"""Lesson 03's experiments (``course/03_zero2.py``): stage 2, P_os+g, measured.

``stage1_gradients`` (section 1) the gradient bytes stage 1 holds, and those its optimizer reads;
``bucket_peaks`` (section 3) the full bucket buffers stage 2 keeps alive in backward, per cap;
``reduce_scatter_memory`` (section 3) what the backend holds for one in-place reduce-scatter;
``reduce_scatters_in_backward`` (section 5) volume per op, and how many reduce-scatters start
in backward;
``accumulation_volume`` (section 6) what one step over k micro-batches moves, with and without
``no_sync()``;
``shard_norms`` (section 7) each rank's norm of its gradient shards against one process's.
Sections 3-4 also use :mod:`minizero.course.labs.common` (``model_states``, ``memory_per_step``).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import MemoryMeter, model_state_bytes
from minizero.collectives import all_reduce, mark, reduce_scatter
from minizero.course import hint
from minizero.course.checks import lesson03
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.common import GPT, PSI, adam, gpt_batch
from minizero.course.labs.common import model_states as model_states  # section 3
from minizero.course.labs.common import plot_memory_per_step as plot_memory_per_step
from minizero.course.labs.common import show_model_states as show_model_states
from minizero.course.labs.lesson02 import memory_per_step as memory_per_step  # section 4
from minizero.course.plots import GLOO_RS_BUFFER
from minizero.models import TinyGPT, synthetic_batch
from minizero.precision import divides_before_sum
from minizero.zero2 import ZeRO2

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "PSI", "ZeRO2", "all_reduce"]
__all__ += ["divides_before_sum", "lesson03"]

MEMORY_CATS = ("params", "grads", "optimizer", "comm", "activations")  # section 4's stack


def _stage1_gradients() -> dict:
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(GPT), 1, adam, precision="bf16")
    model(*gpt_batch()).backward()
    held = model_state_bytes(model, opt)["grads"]
    chunks = model.finish_grad_sync()  # (shard,) per bucket: what the optimizer steps with
    return dict(held=held, read=sum(c.numel() * c.element_size() for c in chunks), info=run_info())


def stage1_gradients(nprocs: int) -> dict:
    """Section 1: one bf16 backward of TinyGPT under stage 1, rank 0: ``held``, the gradient
    bytes it holds, and ``read``, the bytes of the (shard,) chunks its optimizer then reads."""
    return minizero.launch(_stage1_gradients, nprocs, verbose=False)[0]


def show_stage1_gradients(g: dict, formula: dict[str, float], psi: int = PSI) -> None:
    """``formula``: the paper's ``held`` and ``read`` bytes / Ψ."""
    print(
        f"stage 1, after backward: holds {g['held'] / psi:.2f}Ψ bytes of gradients (formula "
        f"{formula['held']:.2f}Ψ), the optimizer reads {g['read'] / psi:.2f}Ψ of them (formula "
        f"{formula['read']:.2f}Ψ)  ({describe(g['info'])})"
    )


def _bucket_peak(cap: float) -> dict:
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(GPT), 2, adam, precision="bf16", bucket_cap_mb=cap)
    peak = 0

    def after_hook(p):  # registered after ZeRO2's own hook on p: runs after it
        nonlocal peak
        peak = max(peak, model_state_bytes(model, include_comm=True)["comm"])

    for p in model.params:
        p.register_post_accumulate_grad_hook(after_hook)
    model(*gpt_batch()).backward()
    kept = model_state_bytes(model, opt)["grads"]
    return dict(cap=cap, buckets=len(model.buckets), peak=peak, kept=kept)


def _bucket_peaks(caps: list[float]) -> dict:
    return dict(rows=[_bucket_peak(cap) for cap in caps], info=run_info())


def bucket_peaks(nprocs: int, caps: list[float]) -> dict:
    """Section 3: one bf16 backward of TinyGPT under stage 2 per ``bucket_cap_mb`` in ``caps``,
    rank 0: ``peak``, the most bytes of full bucket buffers (filling or in flight) alive after
    any gradient hook, and ``kept``, the bytes of ``grad_shards`` at the end."""
    return minizero.launch(_bucket_peaks, nprocs, caps, verbose=False)[0]


def _buckets(n: int) -> str:
    return f"{n} bucket" + "s" * (n != 1)


def plot_bucket_peaks(peaks: dict, kept: float, stage1: float, psi: int = PSI) -> None:
    """The temporaries under the kept shards, per cap; ``kept`` and ``stage1``: the formula's
    gradient bytes / Ψ that stage 2 keeps and that stage 1 holds."""
    rows = peaks["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    temp = [r["peak"] / psi for r in rows]
    ax.bar(xs, temp, color="tab:orange", label="temporary, at most: buckets filling or in flight")
    shards = [r["kept"] / psi for r in rows]
    ax.bar(
        xs, shards, bottom=temp, color="tab:blue", label=f"grad_shards (kept); formula {kept:g}Ψ"
    )
    ax.axhline(stage1, color="k", ls="--", lw=1, label=f"stage 1: the whole gradient, {stage1:g}Ψ")
    ax.set_xticks(list(xs), [f"{r['cap']} MiB\n{_buckets(r['buckets'])}" for r in rows], fontsize=8)
    ax.set_ylim(0, 1.15 * max(stage1, *(t + s for t, s in zip(temp, shards, strict=True))))
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("gradient bytes on rank 0 / Ψ (bf16)")
    ax.legend(fontsize=8, loc="upper left")
    where = describe(peaks["info"])
    gloo = peaks["info"]["backend"] == "gloo"
    note = f"\nthe stage's buffers only, not the backend's\n({GLOO_RS_BUFFER})" if gloo else ""
    ax.set_title(f"TinyGPT, ZeRO stage 2, one backward: {where}{note}", fontsize=9)
    plt.show()
    for r in rows:
        print(
            f"{r['cap']:>5} MiB, {_buckets(r['buckets']):>9}: at most {r['peak'] / psi:.2f}Ψ in "
            f"buckets + {r['kept'] / psi:.2f}Ψ kept (formula {kept:g}Ψ)"
        )


def _reduce_scatter_memory(mib: int) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    n = mib * 2**20 // 4 // world * world  # float32 elements, a multiple of N
    with MemoryMeter(device=dev) as meter:  # on CPUs it sees the storages ops create or touch
        buf = torch.ones(n, device=dev)  # (N * shard,) the bucket
        out = buf[rank * (n // world) : (rank + 1) * (n // world)]  # (shard,) chunk r, in place
        before = meter.mark("before")
        work = reduce_scatter(out, buf, async_op=True)
        work.wait()
        del work
        after = meter.mark("after wait")
    return dict(before=before["total"], peak=after["peak"], after=after["total"], info=run_info())


def reduce_scatter_memory(nprocs: int, mib: int = 4) -> dict:
    """Section 3: one in-place reduce-scatter of a ``mib`` MiB fp32 bucket under ``MemoryMeter``,
    rank 0: the bytes ``before`` it, its ``peak`` and ``after`` ``wait()``."""
    return minizero.launch(_reduce_scatter_memory, nprocs, mib, verbose=False)[0]


def show_reduce_scatter_memory(m: dict) -> None:
    mib = lambda b: f"{b / 2**20:.3g} MiB"
    print(
        f"in-place reduce-scatter of {mib(m['before'])} on {describe(m['info'])}: held "
        f"{mib(m['before'])} before, peak {mib(m['peak'])}, {mib(m['after'])} after wait(): the "
        f"backend held {(m['peak'] - m['before']) / m['before']:.2f}x the buffer on top of it"
    )
    if m["info"]["backend"] == "gloo":
        print(f"({GLOO_RS_BUFFER}; NCCL's holds nothing more)")


def show_grads_after_backward(runs: dict[int, dict], formula: dict[int, float], psi=PSI) -> None:
    """From ``memory_per_step``: each stage's gradient bytes after backward, beside ``formula``
    (``{stage: bytes / Ψ}``)."""
    for stage, run in runs.items():
        grads = next(m["grads"] for m in run["marks"] if m["label"] == "after backward")
        print(
            f"stage {stage}: gradients held after backward {grads / psi:.2f}Ψ "
            f"(formula {formula[stage]:.2f}Ψ)"
        )


def _reduce_scatters_in_backward(stages, bucket_cap_mb: float) -> dict:
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam, bucket_cap_mb=bucket_cap_mb)
        with minizero.CommLedger() as ledger:
            model(*gpt_batch()).backward()
            mark("step")
            opt.step()
        step_at = next(i for i, label in ledger.marks if label == "step")
        rs = [r for r in ledger.records if r.op == "reduce_scatter"]
        early = sum(r.index < step_at for r in rs)
        out[stage] = dict(by_op=ledger.by_op(), early=early, reduce_scatters=len(rs))
    return dict(stages=out, info=run_info())


def reduce_scatters_in_backward(nprocs: int, stages=(1, 2), bucket_cap_mb: float = 0.03) -> dict:
    """Section 5: one fp32 step of TinyGPT per stage, rank 0's ledger: the volume per op
    (``by_op``), and how many of its ``reduce_scatters`` were issued before ``step()``
    (``early``)."""
    args = (stages, bucket_cap_mb)
    return minizero.launch(_reduce_scatters_in_backward, nprocs, *args, verbose=False)[0]


def show_reduce_scatters_in_backward(r: dict, paper: dict[int, float], psi: int = PSI) -> None:
    """``paper``: the formula's volume per step / Ψ, per stage."""
    for stage, s in r["stages"].items():
        parts = ", ".join(f"{op} {v / psi:.3f}Ψ" for op, v in s["by_op"].items())
        print(
            f"stage {stage}: {parts} (paper {paper[stage]:g}Ψ); {s['early']} of "
            f"{s['reduce_scatters']} reduce-scatters issued during backward"
        )
    print(describe(r["info"]))


def _accumulation_volume(runs: list[tuple[int, bool]], micro: int) -> dict:
    out = {}
    for stage, no_sync in runs:
        torch.manual_seed(0)
        model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam)
        x, y = gpt_batch()
        with minizero.CommLedger() as ledger:
            for i, (xi, yi) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                last = i == micro - 1  # the backward that synchronises, in no_sync runs
                with model.no_sync() if no_sync and not last else nullcontext():
                    (model(xi, yi) / micro).backward()
            opt.step()
        out[stage, no_sync] = ledger.volume_elements
    return dict(volumes=out, micro=micro, info=run_info())


def accumulation_volume(nprocs: int, runs: list[tuple[int, bool]], micro: int = 4) -> dict:
    """Section 6: one fp32 step of TinyGPT over ``micro`` micro-batches per ``(stage, no_sync)``
    of ``runs`` (``no_sync``: every backward but the last in ``no_sync()``): rank 0's volume in
    elements, ``{"volumes": {(stage, no_sync): elements}, ...}``."""
    return minizero.launch(_accumulation_volume, nprocs, runs, micro, verbose=False)[0]


def show_accumulation_volume(a: dict, formula: dict[tuple[int, bool], float], psi=PSI) -> None:
    """``formula``: the volume / Ψ of each run."""
    for (stage, no_sync), v in a["volumes"].items():
        how = f", the first {a['micro'] - 1} in no_sync()" if no_sync else ""
        print(
            f"stage {stage}, {a['micro']} backwards{how} + 1 step: {v / psi:.3f}Ψ moved "
            f"(formula {formula[stage, no_sync]:g}Ψ)"
        )
    print(describe(a["info"]))


def _shard_squares() -> dict:
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(GPT), 2, adam)  # fp32
    model(*gpt_batch()).backward()
    squares = sum(float(g.float().pow(2).sum()) for g in model.grad_shards)  # this rank's
    return dict(squares=squares, info=run_info())


def shard_norms(nprocs: int) -> dict:
    """Section 7: one fp32 backward of TinyGPT under stage 2: every rank's sum of squares of its
    gradient shards (``squares``), and the norm of the gradient one process computes on the
    whole batch (``whole``)."""
    per_rank = minizero.launch(_shard_squares, nprocs, verbose=False)
    torch.manual_seed(0)
    one = TinyGPT(GPT)
    one(*synthetic_batch("gpt", 8 * nprocs, 0)).backward()  # one process, the whole batch
    whole = torch.cat([p.grad.reshape(-1) for p in one.parameters()]).norm().item()
    return dict(squares=[r["squares"] for r in per_rank], whole=whole, info=per_rank[0]["info"])


def show_shard_norms(n: dict) -> None:
    for r, sq in enumerate(n["squares"]):
        print(f"rank {r}: norm of its own gradient chunks {sq**0.5:.6f}")
    print(
        f"sqrt(sum over ranks of their squares) {sum(n['squares']) ** 0.5:.6f}; one process: "
        f"{n['whole']:.6f} ({describe(n['info'])})"
    )
