"""Lesson 06's experiments (``course/06_myths.py``): each myth about ZeRO against a measurement.

What each rank runs is the lesson's, written in the open and saved (``# @save``, in
:mod:`.saved`); this module launches it and shows the results. ``who_computes_what`` (myth 1,
``forward_on_rank``) which units each rank runs, with what present, and its FLOPs;
``synchronous`` (myth 2, ``steps_with_a_slow_rank``) step times with a slow rank, and parameters
against one process; ``step_ledgers`` (myths 3, 5, ``one_step_ledgers``) each rank's collectives
in one step; ``not_a_transformer`` (myth 4, ``train_three_steps``) an MLP and a ConvNet at stages
0 and 3 against one process; ``torch_zero_vs_stage1`` (myth 7, ``zero_vs_stage1``) torch's
ZeroRedundancyOptimizer beside DDP and stage 1 (in :mod:`.lesson06_torch`, with
``torch_broadcasts_on_ledger``, which puts torch's own broadcasts on the ledger).
Myths 6, 8 and 9 (memory: ``step_memory``, and ``on_first`` for 9) are launched
and shown by :mod:`.lesson06_memory`. Both reach the lesson from here.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.flop_counter import FlopCounterMode

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import MemoryMeter, model_state_bytes
from minizero.course import compare, hint, plots
from minizero.course.checks import lesson06  # and torch._dynamo, once (checks.common)
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.common import GPT
from minizero.course.labs.lesson06_memory import activations_by_stage as activations_by_stage
from minizero.course.labs.lesson06_memory import (
    show_activations_by_stage as show_activations_by_stage,
)
from minizero.course.labs.lesson06_memory import show_stage2_vs_stage3 as show_stage2_vs_stage3
from minizero.course.labs.lesson06_memory import show_stage3_by_n as show_stage3_by_n
from minizero.course.labs.lesson06_memory import stage2_vs_stage3 as stage2_vs_stage3
from minizero.course.labs.lesson06_memory import stage3_by_n as stage3_by_n
from minizero.course.labs.lesson06_torch import (
    show_torch_zero_vs_stage1 as show_torch_zero_vs_stage1,
)
from minizero.course.labs.lesson06_torch import torch_broadcasts_on_ledger
from minizero.course.labs.lesson06_torch import torch_zero_vs_stage1 as torch_zero_vs_stage1
from minizero.course.labs.saved import adamw as adamw
from minizero.course.labs.saved import (
    forward_on_rank,
    one_step_ledgers,
    steps_with_a_slow_rank,
    train_three_steps,
)
from minizero.launcher.progress import launch_with_progress
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.parallelize import full_state_dict, parallelize
from minizero.units import assign_params, select_units

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "GPTConfig", "lesson06", "nn", "dist"]
__all__ += ["time", "CommLedger", "FlopCounterMode", "GPT", "TinyGPT", "MLP", "compare"]
__all__ += ["count_params", "full_state_dict", "parallelize", "rank_device", "synthetic_batch"]
__all__ += ["assign_params", "select_units", "MemoryMeter", "model_state_bytes"]
__all__ += ["partial", "ZeroRedundancyOptimizer", "torch_broadcasts_on_ledger"]


def who_computes_what(nprocs: int, fn=forward_on_rank) -> list[dict]:
    """Myth 1: ``fn`` (the lesson's ``forward_on_rank``) on every rank: per unit, its elements
    present while its module runs and after, the rows seen, the forward's FLOPs (and plain
    TinyGPT's), the elements held at rest and those all-gathered."""
    return minizero.launch(fn, nprocs, verbose=False)


def show_who_computes_what(runs: list[dict]) -> None:
    head = "".join(f"rank {r}: while | after".rjust(24) for r in range(len(runs)))
    print(f"{'unit (module)':22}{'elements':>10}{head}")
    for i, (name, n, *_) in enumerate(runs[0]["ran"]):
        cells = "".join(f"{r['ran'][i][2]:>15,} | {r['ran'][i][3]:>6,}" for r in runs)
        print(f"{name:22}{n:>10,}{cells}")
    for rank, r in enumerate(runs):
        print(
            f"rank {rank}: micro-batch starts with tokens {r['rows']}; ran {len(r['ran'])} units; "
            f"holds {r['held']:,} of Ψ = {r['psi']:,} elements at rest; all-gathered "
            f"{r['gathered']:,} in forward; forward FLOPs {r['flops']:,} (plain TinyGPT on the "
            f"same rows: {r['plain_flops']:,})"
        )


def _run_synchronous(fn, stages, steps: int, delay: float, progress) -> dict:
    out = {}
    for stage in stages:
        out[stage] = fn(stage, steps, delay)
        progress.tick()
    return dict(out, info=run_info())


def synchronous(
    nprocs: int, stages=(0, 1, 2, 3), steps: int = 3, delay: float = 0.3, fn=steps_with_a_slow_rank
) -> list:
    """Myth 2: ``fn`` (the lesson's ``steps_with_a_slow_rank``) at each stage on every rank; per
    rank and stage: step times, full parameters after each step, one process's."""
    return launch_with_progress(
        _run_synchronous,
        nprocs,
        fn,
        stages,
        steps,
        delay,
        total=len(stages),
        desc="stages",
        verbose=False,
    )


def show_synchronous(per_rank: list) -> None:
    r0 = per_rank[0]
    for stage in (s for s in r0 if s != "info"):
        run = r0[stage]
        t = [f"{s * 1e3:.0f}" for s in run["times"]]
        same = all(
            torch.equal(r[stage]["params"][s][k], run["params"][s][k])
            for r in per_rank
            for s in range(len(t))
            for k in r[stage]["params"][s]
        )
        diff = max(
            (p[k] - ref[k]).abs().max().item()
            for p, ref in zip(run["params"], run["ref"])
            for k in p
        )
        print(
            f"stage {stage}: rank 0's step times (ms) {t}; parameters bit-identical on all "
            f"ranks after every step: {same}; max |rank 0 - one process| = {diff:.1e}"
        )
    print(describe(r0["info"]))


def _step_ledgers(fn, stages) -> dict:
    return dict({stage: fn(stage) for stage in stages}, info=run_info())


def step_ledgers(nprocs: int, stages=(0, 1, 2, 3), fn=one_step_ledgers) -> dict:
    """Myths 3 and 5: ``fn`` (the lesson's ``one_step_ledgers``) at each stage on every rank:
    ``{"ledgers": {stage: [ledger per rank]}, "setup": ..., "psi", "info"}``."""
    res = minizero.launch(_step_ledgers, nprocs, fn, stages, verbose=False)
    return dict(
        ledgers={s: [r[s]["step"] for r in res] for s in stages},
        psi=res[0][stages[0]]["psi"],
        setup=res[1][stages[0]]["setup"],
        info=res[0]["info"],
    )


def show_step_ledgers(got: dict) -> None:
    psi = got["psi"]
    for stage, ledgers in got["ledgers"].items():
        calls = [[(r.op, r.numel, r.dtype) for r in L.records] for L in ledgers]
        per_rank = ", ".join(
            f"rank {i}: {len(c)} calls, {L.volume_elements / psi:.2f}Ψ"
            for i, (c, L) in enumerate(zip(calls, ledgers))
        )
        ops = sorted({r.op for L in ledgers for r in L.records})
        same = all(c == calls[0] for c in calls)
        print(f"stage {stage}: {per_rank}; ops {ops}; same calls on every rank: {same}")
    built = [(r.op, r.tag) for r in got["setup"].records]
    print(f"construction (stage 0, rank 1): {len(built)} x {sorted(set(built))}")


def plot_step_ledgers(got: dict) -> None:
    """One bar per stage (rank 0's volume), every rank's own volume as a dot on it."""
    stages, psi = list(got["ledgers"]), got["psi"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(
        stages,
        [got["ledgers"][s][0].volume_elements / psi for s in stages],
        0.6,
        color="tab:blue",
        alpha=0.4,
        label="rank 0",
    )
    for r in range(len(got["ledgers"][stages[0]])):
        ys = [got["ledgers"][s][r].volume_elements / psi for s in stages]
        ax.plot(stages, ys, "k.", ms=9, label="each rank" if r == 0 else None)
    ax.set_xticks(stages, [f"{s}: {plots.STAGE_NAMES[s]}" for s in stages])
    ax.set_ylabel("elements moved per step / Ψ")
    ax.set_ylim(0, 1.2 * max(L.volume_elements for Ls in got["ledgers"].values() for L in Ls) / psi)
    ax.set_title(f"every rank moves the same: MLP, one step, {describe(got['info'])}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()


def show_volumes_by_op(got: dict) -> None:
    """Myth 5: rank 0's volume per op and stage, in Ψ."""
    for stage, ledgers in got["ledgers"].items():
        by_op = {op: v / got["psi"] for op, v in ledgers[0].by_op().items()}
        total = ledgers[0].volume_elements / got["psi"]
        print(f"stage {stage} {plots.STAGE_NAMES[stage]:9}: {total:.3f}Ψ = {by_op}")


class ConvNet(nn.Module):
    """Two convolutions and a linear head on 3 x 16 x 16 images, 10 classes. No BatchNorm: its
    statistics are per rank under any data parallelism, so it would not match one process."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x, y=None):
        h = F.relu(self.conv1(x))  # (B, 8, 16, 16)
        h = F.relu(self.conv2(h))  # (B, 16, 8, 8)
        logits = self.head(h.mean(dim=(2, 3)))  # (B, 10)
        return logits if y is None else F.cross_entropy(logits, y)


def images(global_batch, step, rank=0, world=1, device="cpu"):
    g = torch.Generator().manual_seed(step)  # the same global batch on every rank
    x = torch.randn(global_batch, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (global_batch,), generator=g)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return x[rows].to(device), y[rows].to(device)


def mlp_batch(global_batch, step, rank=0, world=1, device="cpu"):
    return synthetic_batch("mlp", global_batch, step, rank=rank, world=world, device=device)


MODELS = {"MLP": (MLP, mlp_batch), "ConvNet": (ConvNet, images)}


def _not_a_transformer(fn, models, stages) -> dict:
    return {name: {s: fn(*MODELS[name], s) for s in stages} for name in models}


def not_a_transformer(
    nprocs: int, models=("MLP", "ConvNet"), stages=(None, 0, 3), fn=train_three_steps
) -> dict:
    """Myth 4: ``fn`` (the lesson's ``train_three_steps``) on each model at each stage (None: one
    process, the whole batch): rank 0's full parameters after, ``{model: {stage: state dict}}``."""
    return minizero.launch(_not_a_transformer, nprocs, fn, models, stages, verbose=False)[0]


def show_not_a_transformer(res: dict, nprocs: int) -> None:
    for name, by_stage in res.items():
        torch.manual_seed(0)
        start = MODELS[name][0]().state_dict()  # the initial weights: how far training moved
        one = by_stage[None]  # one process, whole batch
        moved = max((one[k] - start[k]).abs().max().item() for k in one)
        diff = {s: max((by_stage[s][k] - one[k]).abs().max().item() for k in one) for s in (0, 3)}
        d03 = max((by_stage[3][k] - by_stage[0][k]).abs().max().item() for k in one)
        print(
            f"{name}: 3 steps moved the parameters by up to {moved:.1e}; max |params - one "
            f"process| = {diff[0]:.1e} for DDP, {diff[3]:.1e} for stage 3 on {nprocs} ranks; "
            f"max |stage 3 - DDP| = {d03:.1e}"
        )
