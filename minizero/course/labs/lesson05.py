"""Lesson 05's experiments (``course/05_all_stages.py``): every stage's memory and traffic, and
the measurements the 6.7B budget is built on.

``profile_stages`` (sections 1, 5, 9) every stage of TinyGPT and an MLP, profiled on real ranks;
``simulated_states`` (section 2) the stage code's model states on meta tensors at 6.7B;
``layer_activations`` (section 3) what one transformer layer keeps, per kernel and length;
``micro_volumes`` (section 9) one optimizer step's traffic after k micro-batches.
The budget's formulas and predictions are the lesson's own; the ``show_*`` here print them.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections import Counter

import matplotlib.pyplot as plt
import torch

# torch.optim imports torch's compiler on first use (~10 s per process). The ranks of a CPU launch
# are forked from this kernel: importing it once here saves every launch below that time.
import torch._dynamo  # noqa: F401

import minizero
from minizero.analysis import budget
from minizero.analysis.memory import format_bytes, paper_model_state_bytes
from minizero.analysis.simulate import FlatModel, format_table1, simulate, table1
from minizero.course import compare, hint, plots, plots_budget
from minizero.course.checks.lesson05 import PeakCase, check_predict_peak, on_gpus, peak_cases
from minizero.course.labs import describe, launch_with_progress, run_info, setup
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "GPTConfig", "dataclasses", "PeakCase"]
__all__ += ["budget", "check_predict_peak", "on_gpus", "paper_model_state_bytes", "peak_cases"]
__all__ += ["table1", "compare", "plots_budget"]  # the modules the lesson names for instructors
GB = 1e9  # the paper's GB


def profile_stages(nprocs: int, models=("gpt", "mlp"), stages=(0, 1, 2, 3), steps: int = 5) -> dict:
    """Sections 1, 5 and 9: every stage of each model in bf16 with fused AdamW, ``steps`` steps
    (``minizero.course.compare.profile_stage`` on each rank): rank 0's profiles, ``{model:
    [one per stage]}``, and ``"info"``."""
    res = launch_with_progress(
        compare.profile_stages,
        nprocs,
        models=models,
        stages=stages,
        precision="bf16",
        steps=steps,
        total=len(models) * len(stages),
        desc="stages (bf16)",
        verbose=False,
    )[0]
    out = {m: [p for p in res["profiles"] if p["model"] == m] for m in models}
    return dict(out, info=res["info"])


def show_states(profiles: list[dict]) -> None:
    """Model states per stage, measured [the paper's formula]."""
    print(f"TinyGPT: Ψ = {profiles[0]['psi']:,}")
    print(f"{'bf16, TinyGPT':24}" + "".join(f"{c:>26}" for c in plots.CATS))
    for p in profiles:
        paper = paper_model_state_bytes(p["psi"], p["world"], p["stage"], "bf16")
        cells = [f"{format_bytes(p['states'][c])} [{format_bytes(paper[c])}]" for c in plots.CATS]
        name = plots.STAGE_NAMES[p["stage"]]
        print(f"stage {p['stage']} {name:16}" + "".join(f"{s:>26}" for s in cells))
    print("measured [paper's formula]")


def plot_memory(profiles: list[dict], info: dict) -> None:
    plots.memory_figure(profiles, info)
    plt.show()


def show_peak(profiles: list[dict]) -> None:
    """What each stage's peak held beyond its model states (CPU: split at the peak)."""
    for p in profiles:
        rest = p["peak"] - sum(p["states"].values())
        line = f"stage {p['stage']}: peak {format_bytes(p['peak'])}, {format_bytes(rest)} beyond"
        line += " states"
        if p["at_peak"] is not None:  # CPU: the split at the moment of the peak
            comm = p["at_peak"]["comm"]
            other = format_bytes(rest - comm)
            line += f" = comm buffers {format_bytes(comm)} + activations and temporaries {other}"
        print(line)


def simulated_states(psi: int, world: int, stages=(0, 1, 2, 3)) -> dict[int, float]:
    """Section 2: the stage code's model states per rank for a model of ``psi`` parameters on
    ``world`` ranks, one bf16 AdamW step on meta tensors (no memory: the sizes the code asks)."""
    return {s: sum(simulate(lambda: FlatModel(psi), s, world, "bf16").values()) for s in stages}


def show_simulated(got: dict[int, float], formula: dict[int, float], psi: int, world: int) -> None:
    print(f"model states per rank, Ψ = {psi / 1e9:.2f}B, N = {world}, bf16 AdamW (K = 12), GB")
    print(f"{'stage':16}{'simulate (meta)':>18}{'formula':>10}")
    for s, b in got.items():
        print(f"{s}: {plots.STAGE_NAMES[s]:13}{b / GB:18.2f}{formula[s] / GB:10.2f}")


def show_table1(rows: list[dict], profiles: list[dict], world: int) -> None:
    """The paper's Table 1 from meta tensors; then bytes per parameter at N = ``world``: real
    ranks (``profiles``), meta tensors at 7.5B, the formula."""
    print(format_table1(rows))
    print(f"\nbytes per parameter per rank at N = {world}, bf16 AdamW:")
    print(f"{'stage':16}{'TinyGPT, real ranks':>22}{'7.5B, meta tensors':>20}{'formula':>10}")
    meta = simulated_states(7_500_000_000, world, [p["stage"] for p in profiles])
    for p in profiles:
        s = p["stage"]
        paper = sum(paper_model_state_bytes(1, world, s, "bf16").values())
        real = sum(p["states"].values()) / p["psi"]
        print(f"{s}: {plots.STAGE_NAMES[s]:13}{real:22.3f}{meta[s] / 7.5e9:20.3f}{paper:10.3f}")
    plots.table1_figure(rows)
    plt.show()


def layer_activations(cfg: GPTConfig, micro_batch: int, lengths, kernels) -> dict:
    """Section 3: ``budget.measure_activations`` (MemTracker, this process) for each sequence
    length and attention kernel ("default" or "math"): ``{(s, kernel): measurement}``."""
    return {
        (s, k): budget.measure_activations(cfg, micro_batch, seq_len=s, math_attention=k == "math")
        for s in lengths
        for k in kernels
    }


def show_layer_activations(acts: dict, cfg: GPTConfig, micro_batch: int, formula) -> None:
    """Bytes a layer keeps / (s·b·h), measured, beside ``formula(s, kernel)`` (the same unit)."""
    h = cfg.n_embd
    print("bytes one transformer layer keeps, / (s·b·h); bf16, one process on the CPU, MemTracker")
    print(f"{'kernel':10}{'s':>5}{'measured':>10}{'formula (no dropout)':>28}")
    for (s, kernel), m in acts.items():
        measured = m["layers"][0] / (s * micro_batch * h)
        f = formula(s, kernel)
        name = "32 (flash)" if kernel == "default" else f"32 + 2as/h = {f:g}"
        print(f"{kernel:10}{s:5}{measured:10.2f}{name:>28}")


def show_checkpointing(runs: dict[str, dict], sbh: float) -> None:
    """Per layer kept, at the end of forward and at the peak, / sbh, for each named run."""
    print(f"{'':24}{'kept per layer':>16}{'end of forward':>16}{'peak':>10}   (/ sbh)")
    for name, m in runs.items():
        kept, fwd, peak = m["layers"][0] / sbh, m["forward"] / sbh, m["peak"] / sbh
        print(f"{name:24}{kept:16.2f}{fwd:16.2f}{peak:10.2f}")


def show_comm_at_peak(profiles: list[dict]) -> None:
    for p in profiles:
        at = p["at_peak"]  # None under the CUDA allocator: only the total is known
        comm = "n/a (CUDA)" if at is None else format_bytes(at["comm"])
        print(f"stage {p['stage']}: communication buffers at the peak {comm}")


def show_answer(peaks: dict, capacity_gb: float, world: int) -> None:
    """``peaks``: ``{label: (model states, the rest, stage 3's working set)}`` in bytes."""
    print(f"{'':22}{'model states':>14}{'the rest':>10}{'peak':>8}   GB per rank, N = {world}")
    for label, (states, rest, extra) in peaks.items():
        total = (states + rest + extra) / GB
        fits = "fits" if total <= capacity_gb else "does not fit"
        note = " (with stage 3's working set)" if extra else ""
        print(f"{label:22}{states / GB:14.1f}{rest / GB:10.1f}{total:8.1f}   {fits}{note}")


def plot_budget(cfg: GPTConfig, world: int, micro_batch: int, capacity_gb: float, logit_bytes):
    where = "this process, CPU, bf16 (MemTracker)"
    plots_budget.budget_figure(
        cfg,
        world,
        micro_batch=micro_batch,
        capacity_gb=capacity_gb,
        logit_bytes=logit_bytes,
        where=where,
    )
    plt.show()


def calculator(cfg: GPTConfig, world: int, micro_batch: int, capacity_gb: float) -> None:
    """Section 8: sliders over the budget figure, where a widget front end is there (never in a
    graded run)."""
    if plots.widgets_available():
        from IPython.display import display

        display(plots_budget.calculator(cfg, world, micro_batch, capacity_gb))


def show_volumes(profiles: dict) -> None:
    """Section 9: each stage's volume and calls per step, per model; how often stage 3 moved each
    unit."""
    models = [m for m in profiles if m != "info"]
    print(
        f"{'':22}"
        + "".join(f"{plots.MODELS[m]} (Ψ = {profiles[m][0]['psi']:,})".rjust(30) for m in models)
    )
    for i, s in enumerate(plots.STAGE_NAMES):
        cells = [
            f"{p['volume'] / p['psi']:.4f}Ψ in {len(p['records'])} calls"
            for p in (profiles[m][i] for m in models)
        ]
        print(f"stage {s} {plots.STAGE_NAMES[s]:14}" + "".join(f"{c:>30}" for c in cells))
    for m in models:  # stage 3: how often was each unit (a module's parameters) moved?
        records = profiles[m][3]["records"]
        counts = {
            op: Counter(Counter(r["tag"] for r in records if r["op"] == op).values())
            for op in ("all_gather", "reduce_scatter")
        }
        parts = "; ".join(
            f"{op}: " + ", ".join(f"{u} units x{n}" for n, u in sorted(c.items()))
            for op, c in counts.items()
        )
        print(f"{plots.MODELS[m]}, stage 3: {parts}")


def plot_comm(profiles: dict) -> None:
    """Volume, bus bandwidth and step time per stage, and the median step of each."""
    plots.comm_figure({"mlp": profiles["mlp"], "gpt": profiles["gpt"]}, profiles["info"])
    plt.show()
    print(describe(profiles["info"]))
    for m in ("mlp", "gpt"):
        steps = ", ".join(
            f"{statistics.median(p['step_s']) * 1e3:.1f} [{len(p['records'])}]" for p in profiles[m]
        )
        print(f"{plots.MODELS[m]}, per stage: median step (ms) [collectives per step]: {steps}")


def _micro_volumes(stages, micros, rows_per_rank: int) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        for k in micros:
            torch.manual_seed(0)
            model = TinyGPT(GPTConfig.tiny())
            psi = count_params(model)
            net, opt = minizero.parallelize(model, stage, lambda p: torch.optim.AdamW(p, lr=1e-3))
            for step in range(2):  # the first step's zero_grad() cuts the buckets again
                x, y = synthetic_batch("gpt", rows_per_rank * world, step, rank=rank, world=world)
                with minizero.CommLedger() as ledger:
                    for xi, yi in zip(x.chunk(k), y.chunk(k), strict=True):  # k micro-batches
                        (net(xi, yi) / k).backward()
                    opt.step()
                    opt.zero_grad()
            out[stage, k] = (ledger.volume_elements / psi, sum(r.nbytes for r in ledger.records))
    return dict(volumes=out, info=run_info())


def micro_volumes(nprocs: int, stages=(1, 2, 3), micros=(1, 4), rows_per_rank: int = 4) -> dict:
    """Section 9: rank 0's ledger of one optimizer step of TinyGPT tiny after k micro-batches
    (the rank's ``rows_per_rank`` rows cut in k), the second step: the first's ``zero_grad()``
    cuts stages 1-2's buckets again and moves their masters and moments once. Per stage:
    ``{"volumes": {(stage, k): (Ψ moved, bytes)}, "info": ...}``."""
    return minizero.launch(_micro_volumes, nprocs, stages, micros, rows_per_rank, verbose=False)[0]


def show_micro_volumes(micro: dict) -> None:
    vol = micro["volumes"]
    stages, micros = sorted({s for s, _ in vol}), sorted({k for _, k in vol})
    print(f"one optimizer step, TinyGPT tiny, {describe(micro['info'])}, rank 0's ledger:")
    heads = [f"{k} micro-batch" + "es" * (k > 1) for k in micros]
    print(f"{'':10}" + "".join(f"{h:>24}" for h in heads))
    for s in stages:
        row = "".join(f"{vol[s, k][0]:9.3f}Ψ {format_bytes(vol[s, k][1]):>12}" for k in micros)
        print(f"stage {s}  {row}")
