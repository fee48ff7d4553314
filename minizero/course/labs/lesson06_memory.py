"""Lesson 06's memory experiments (``course/06_myths.py``, myths 6, 8 and 9), beside
:mod:`minizero.course.labs.lesson06`, which brings them into the lesson.

``activations_by_stage`` (myth 6) what forward leaves alive, per stage; ``stage2_vs_stage3``
(myth 8) the peak against the embedding's share of Ψ; ``stage3_by_n`` (myth 9) the floor.
"""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import MemoryMeter, format_bytes, model_state_bytes
from minizero.course import plots
from minizero.course.labs import describe, rank_device, run_info
from minizero.course.labs.saved import LONG, fused, step_memory
from minizero.models import GPTConfig, TinyGPT, count_params
from minizero.parallelize import parallelize


def _activations_by_stage(fn, stages) -> dict:
    return dict(stages={stage: fn(stage) for stage in stages}, info=run_info())


def activations_by_stage(nprocs: int, stages=(0, 1, 2, 3), fn=step_memory) -> dict:
    """Myth 6: ``fn`` (the lesson's ``step_memory``: TinyGPT L=2 h=64 s=128 b=2 in bf16) at each
    stage, rank 0's: model states, what forward left alive, the peak."""
    return minizero.launch(_activations_by_stage, nprocs, fn, stages, verbose=False)[0]


def show_activations_by_stage(acts: dict) -> None:
    print(f"TinyGPT, L=2 h=64 s=128 b=2, bf16, rank 0 of {describe(acts['info'])}")
    print(
        f"{'stage':12}{'model states':>14}{'activations, end of forward':>30}{'peak - states':>16}"
    )
    for stage, m in acts["stages"].items():
        fwd = m["fwd"]  # CPU: the split; CUDA: total - model states (the allocator gives no split)
        alive = fwd["activations"] if fwd["at_peak"] is not None else fwd["total"] - m["states"]
        print(
            f"{stage}: {plots.STAGE_NAMES[stage]:9}{format_bytes(m['states']):>14}"
            f"{format_bytes(alive):>30}{format_bytes(m['peak'] - m['states']):>16}"
        )


def _stage2_vs_stage3(vocabs) -> dict:
    dev, out = rank_device(), []
    for V in vocabs:
        cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=6, n_head=4, n_embd=64)
        for stage in (2, 3):
            torch.manual_seed(0)
            cap = None if stage == 3 else 0.05  # stage 3 cuts by units, not buckets
            net, opt = parallelize(TinyGPT(cfg), stage, fused, precision="bf16", bucket_cap_mb=cap)
            x = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
            net(x, x).backward()  # a warm-up step creates the optimizer states
            opt.step()
            opt.zero_grad()
            with MemoryMeter(net, opt, device=dev) as meter:
                meter.reset_peak()
                net(x, x).backward()
                opt.step()
                opt.zero_grad()
                end = meter.mark("step")
            out.append(dict(V=V, stage=stage, peak=end["peak"], psi=count_params(TinyGPT(cfg))))
    return dict(rows=out, info=run_info())


def stage2_vs_stage3(nprocs: int, vocabs) -> dict:
    """Myth 8: TinyGPT (L=6 h=64, 16 tokens per rank) with each vocabulary V, bf16, the peak of
    rank 0's second step at stages 2 and 3."""
    return minizero.launch(_stage2_vs_stage3, nprocs, vocabs, verbose=False)[0]


def show_stage2_vs_stage3(sweep: dict) -> None:
    print(f"peak per rank, rank 0 of {describe(sweep['info'])}")
    for V in sorted({r["V"] for r in sweep["rows"]}):
        p2, p3 = (next(r for r in sweep["rows"] if (r["V"], r["stage"]) == (V, s)) for s in (2, 3))
        share = V * 64 / p2["psi"]  # the embedding's share of Ψ
        print(
            f"V = {V:6}: embedding {share:4.0%} of Ψ = {p2['psi']:>9,}; stage 2 "
            f"{format_bytes(p2['peak']):>10}, stage 3 {format_bytes(p3['peak']):>10} "
            f"({p3['peak'] / p2['peak'] - 1:+.1%})"
        )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for stage in (2, 3):
        mine = [r for r in sweep["rows"] if r["stage"] == stage]
        xs = [r["V"] * 64 / r["psi"] for r in mine]
        ax.plot(
            xs,
            [r["peak"] / r["psi"] for r in mine],
            "o-",
            label=f"stage {stage}: {plots.STAGE_NAMES[stage]}",
        )
    ax.set_xlabel("the embedding's share of Ψ (V × h, in the root's unit)")
    ax.set_ylabel("peak bytes per rank / Ψ")
    gloo = sweep["info"]["backend"] == "gloo"
    where = describe(sweep["info"]) + (f"\n{plots.GLOO_MEMORY_NOTE}" if gloo else "")
    ax.set_title(f"TinyGPT L=6 h=64, bf16, 16 tokens per rank; {where}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.show()


def _stage3_by_n(worlds) -> dict:
    rank, dev, out = dist.get_rank(), rank_device(), []
    for n in worlds:
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank < n:
            torch.manual_seed(0)
            net, opt = parallelize(TinyGPT(LONG), 3, fused, precision="bf16", process_group=group)
            x = torch.randint(0, LONG.vocab_size, (2, LONG.block_size)).to(dev)  # (b, s)
            net(x, x).backward()  # a warm-up step creates the optimizer states
            opt.step()
            opt.zero_grad()
            with MemoryMeter(net, opt, device=dev) as meter:
                meter.reset_peak()
                net(x, x).backward()
                states = sum(model_state_bytes(net, opt).values())
                opt.step()
                opt.zero_grad()
                end = meter.mark("step")
            out.append(dict(n=n, states=states, peak=end["peak"], psi=count_params(TinyGPT(LONG))))
        dist.barrier()
    return dict(info=run_info(), rows=out)


def stage3_by_n(worlds) -> dict:
    """Myth 9: stage 3 on groups of the first N of max(worlds) gloo ranks: rank 0's model states
    and peak of its second bf16 step of TinyGPT (L=2 h=64 s=128 b=2)."""
    return minizero.launch(_stage3_by_n, max(worlds), list(worlds), backend="gloo", verbose=False)[
        0
    ]


def show_stage3_by_n(floor: dict, formula_ns=(64, 1024)) -> None:
    """Measured N; then each N of ``formula_ns``: 16Ψ/N by the formula plus the measured rest."""
    rows = floor["rows"]
    for r in rows:
        print(
            f"N = {r['n']}: peak {format_bytes(r['peak'])} = model states "
            f"{format_bytes(r['states'])} + the rest {format_bytes(r['peak'] - r['states'])}"
        )
    psi, rest = rows[0]["psi"], statistics.fmean(r["peak"] - r["states"] for r in rows)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ns = [str(r["n"]) for r in rows]
    states = [r["states"] / 2**20 for r in rows]
    ax.bar(ns, states, label="model states (16Ψ/N)")
    ax.bar(
        ns,
        [(r["peak"] - r["states"]) / 2**20 for r in rows],
        bottom=states,
        label="the rest of the peak",
        hatch="//",
        color="#DDDDDD",
    )
    for n in formula_ns:  # the formula's model states, the measured rest
        label = "16Ψ/N by formula + the measured rest" if n == formula_ns[0] else None
        ax.bar(f"{n}\n(formula)", (16 * psi / n + rest) / 2**20, color="#BBBBBB", label=label)
    ax.set_ylabel("peak per rank (MiB)")
    ax.set_xlabel("N: ranks in the process group")
    i = floor["info"]
    ax.set_title(
        f"stage 3, TinyGPT L=2 h=64 s=128 b=2, bf16; {i['backend']} · {i['device']}, "
        f"groups of the first N of {i['world']} ranks\n{plots.GLOO_MEMORY_NOTE}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
