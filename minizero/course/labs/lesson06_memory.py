"""Lesson 06's memory experiments (``course/06_myths.py``, myths 6, 8 and 9), beside
:mod:`minizero.course.labs.lesson06`, which brings them into the lesson.

``activations_by_stage`` (myth 6) what forward leaves alive, per stage; ``stage2_vs_stage3``
(myth 8) the peak against the model's depth (its number of units); ``stage3_by_n`` (myth 9)
the floor.
"""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt
import torch.distributed as dist

import minizero
from minizero.analysis.memory import format_bytes
from minizero.course import plots
from minizero.course.labs import describe, run_info
from minizero.course.labs.saved import on_first, step_memory


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


def _stage2_vs_stage3(fn, cfgs) -> dict:
    rows = [dict(fn(s, cfg, 1), L=cfg.n_layer, stage=s) for cfg in cfgs for s in (2, 3)]
    return dict(rows=rows, info=run_info())


def stage2_vs_stage3(nprocs: int, cfgs, fn=step_memory) -> dict:
    """Myth 8: ``fn(stage, cfg, 1)`` (the lesson's ``step_memory``, one row of ``cfg.block_size``
    tokens per rank, bf16) for each TinyGPT config at stages 2 and 3: rank 0's peaks."""
    return minizero.launch(_stage2_vs_stage3, nprocs, fn, list(cfgs), verbose=False)[0]


def show_stage2_vs_stage3(sweep: dict) -> None:
    print(f"peak per rank, rank 0 of {describe(sweep['info'])}")
    for L in sorted({r["L"] for r in sweep["rows"]}):
        p2, p3 = (next(r for r in sweep["rows"] if (r["L"], r["stage"]) == (L, s)) for s in (2, 3))
        print(
            f"L = {L} ({L + 1} units with the root), Ψ = {p2['psi']:>7,}; stage 2 "
            f"{format_bytes(p2['peak']):>10}, stage 3 {format_bytes(p3['peak']):>10} "
            f"({p3['peak'] / p2['peak'] - 1:+.1%})"
        )
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for stage in (2, 3):
        mine = [r for r in sweep["rows"] if r["stage"] == stage]
        xs = [r["L"] for r in mine]
        ax.plot(
            xs,
            [r["peak"] / r["psi"] for r in mine],
            "o-",
            label=f"stage {stage}: {plots.STAGE_NAMES[stage]}",
        )
    ax.set_xlabel("blocks L (stage 3's units, besides the root's)")
    ax.set_ylabel("peak bytes per rank / Ψ")
    gloo = sweep["info"]["backend"] == "gloo"
    where = describe(sweep["info"]) + (f"\n{plots.GLOO_MEMORY_NOTE}" if gloo else "")
    ax.set_title(f"TinyGPT V=64 h=64, bf16, 16 tokens per rank; {where}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plt.show()


def _stage3_by_n(on_first, fn, worlds) -> dict:
    rows = []
    for n in worlds:
        rows.append(on_first(n, fn, 3))  # stage 3 on the group of the first n ranks
        dist.barrier()  # the ranks outside the group wait for its members
    ns = [n for n, r in zip(worlds, rows) if r is not None]
    return dict(info=run_info(), rows=[dict(r, n=n) for n, r in zip(ns, filter(None, rows))])


def stage3_by_n(worlds, on_first=on_first, fn=step_memory) -> dict:
    """Myth 9: ``on_first(n, fn, 3)`` (the lesson's: ``step_memory`` at stage 3 on the group of the
    first n ranks) for each n of ``worlds`` on max(worlds) gloo ranks: rank 0's model states and
    peak of stage 3's second bf16 step of TinyGPT (L=2 h=64 s=128 b=2)."""
    n, args = max(worlds), (on_first, fn, list(worlds))
    return minizero.launch(_stage3_by_n, n, *args, backend="gloo", verbose=False)[0]


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
