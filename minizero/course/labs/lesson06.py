"""Lesson 06's experiments (``course/06_myths.py``): each myth about ZeRO against a measurement.

``who_computes_what`` (myth 1) which units each rank runs, with what present, and its FLOPs;
``synchronous`` (myth 2) step times with a slow rank, and parameters against one process;
``step_ledgers`` (myths 3, 5) each rank's collectives in one step; ``not_a_transformer`` (myth 4)
an MLP and a ConvNet at stages 0 and 3 against one process; ``torch_zero_vs_stage1`` (myth 7)
torch's ZeroRedundancyOptimizer beside stage 1 (in :mod:`.lesson06_torch`). Myths 6, 8 and 9
(memory) are measured in :mod:`.lesson06_memory`. Both reach the lesson from here.
"""

from __future__ import annotations

import sys
import time

import matplotlib.pyplot as plt
import torch

# torch.optim imports torch's compiler on first use (~10 s per process). The ranks of a CPU launch
# are forked from this kernel: importing it once here saves every launch below that time.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.course import compare, hint, plots
from minizero.course.checks import lesson06
from minizero.course.labs import describe, rank_device, run_info, setup
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
from minizero.course.labs.lesson06_torch import torch_zero_vs_stage1 as torch_zero_vs_stage1
from minizero.launcher.progress import launch_with_progress
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.parallelize import full_state_dict, parallelize
from minizero.units import assign_params, select_units

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "GPTConfig", "lesson06", "nn"]

GPT = GPTConfig.tiny()
adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)


def _who_computes_what() -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    torch.manual_seed(0)
    plain = TinyGPT(GPT).to(dev)  # the whole model, no ZeRO: the reference
    torch.manual_seed(0)
    net, _ = parallelize(TinyGPT(GPT), 3, adamw)
    groups, owners, _ = assign_params(net.module, select_units(net.module))  # ZeRO-3's units
    names = {m: name or "(root)" for name, m in net.module.named_modules()}
    ran = []  # per unit, as its module starts: [name, elements, present while it runs, after]
    present = lambda ps: sum(p.numel() for p in ps if p.untyped_storage().nbytes())  # with data

    def before(m, args, name, params):
        ran.append([name, sum(p.numel() for p in params), present(params)])

    def after(m, args, out, name, params):
        next(row for row in ran if row[0] == name).append(present(params))

    for params, m in zip(groups, owners, strict=True):  # these run after ZeRO-3's gather / free
        m.register_forward_pre_hook(lambda m, a, n=names[m], ps=params: before(m, a, n, ps))
        m.register_forward_hook(lambda m, a, out, n=names[m], ps=params: after(m, a, out, n, ps))
    x, y = synthetic_batch("gpt", 4 * world, 0, rank=rank, world=world, device=dev)  # (4, T)
    with CommLedger() as ledger, FlopCounterMode(display=False) as flops:
        net(x, y)
    with FlopCounterMode(display=False) as plain_flops:
        plain(x, y)
    gathered = sum(r.numel for r in ledger.records if r.op == "all_gather")
    return dict(
        ran=ran,
        rows=x[:, 0].tolist(),
        flops=flops.get_total_flops(),
        plain_flops=plain_flops.get_total_flops(),
        psi=count_params(plain),
        held=sum(s.numel() for s in net.param_shards),
        gathered=gathered,
    )


def who_computes_what(nprocs: int) -> list[dict]:
    """Myth 1: one stage-3 forward of TinyGPT; per rank, each unit's elements present while its
    module runs and after, the rows it saw, its forward FLOPs (and plain TinyGPT's on the same
    rows), the elements it holds at rest and those it all-gathered."""
    return minizero.launch(_who_computes_what, nprocs, verbose=False)


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


def _synchronous(stage: int, steps: int, delay: float) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    model, batch = compare.workload("mlp", 4, dev)  # this rank's 4 rows of each step
    ref, _ = compare.workload("mlp", 4 * world, dev)  # one process, the whole global batch
    ref.to(dev)
    ref_opt = adamw(ref.parameters())
    net, opt = parallelize(model, stage, adamw)
    times, params, ref_params = [], [], []
    for step in range(steps):
        dist.barrier()  # everyone starts the step together
        t0 = time.perf_counter()
        if rank == world - 1 and step == 2:
            time.sleep(delay)  # a slow rank
        net(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        params.append({k: v.cpu() for k, v in full_state_dict(net).items()})
        whole = synthetic_batch("mlp", 4 * world, step, device=dev, in_features=32, out_features=16)
        ref(*whole).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_params.append({k: v.detach().cpu().clone() for k, v in ref.state_dict().items()})
    return dict(times=times, params=params, ref=ref_params)


def _run_synchronous(stages, steps: int, delay: float, progress) -> dict:
    out = {}
    for stage in stages:
        out[stage] = _synchronous(stage, steps, delay)
        progress.tick()
    return dict(out, info=run_info())


def synchronous(nprocs: int, stages=(0, 1, 2, 3), steps: int = 3, delay: float = 0.3) -> list:
    """Myth 2: the MLP, ``steps`` AdamW steps at each stage, the last rank ``delay`` seconds late
    in step 2; per rank and stage: step times, full parameters after each step, one process's."""
    return launch_with_progress(
        _run_synchronous,
        nprocs,
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


def _step_ledgers(stages) -> dict:
    dev = rank_device()
    out = {}
    for stage in stages:
        model, batch = compare.workload("mlp", 4, dev)
        psi = count_params(model)
        with CommLedger() as built:
            net, opt = parallelize(model, stage, adamw)
        for step in range(2):  # step 0 warms up; step 1 is recorded
            with CommLedger() as ledger:
                net(*batch(step)).backward()
                opt.step()
                opt.zero_grad()
        out[stage] = dict(psi=psi, setup=built, step=ledger)
    return dict(out, info=run_info())


def step_ledgers(nprocs: int, stages=(0, 1, 2, 3)) -> dict:
    """Myths 3 and 5: the MLP at each stage; every rank's ledger of its construction and of its
    second step: ``{"ledgers": {stage: [ledger per rank]}, "setup": ..., "psi", "info"}``."""
    res = minizero.launch(_step_ledgers, nprocs, stages, verbose=False)
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


def _train(make, data, stage):
    """3 AdamW steps; ``stage=None``: one process on the whole batch. Full fp32 params after."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    torch.manual_seed(0)
    model = make()
    if stage is None:
        model, opt, rank, world = model.to(dev), adamw(model.parameters()), 0, 1
    else:
        model, opt = parallelize(model, stage, adamw)
    for step in range(3):
        model(*data(8, step, rank=rank, world=world, device=dev)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in full_state_dict(model).items()}


def _not_a_transformer(models, stages) -> dict:
    return {name: {s: _train(*MODELS[name], s) for s in stages} for name in models}


def not_a_transformer(nprocs: int, models=("MLP", "ConvNet"), stages=(None, 0, 3)) -> dict:
    """Myth 4: each model, 3 AdamW steps at each stage (None: one process, the whole batch):
    rank 0's full parameters after, ``{model: {stage: state dict}}``."""
    return minizero.launch(_not_a_transformer, nprocs, models, stages, verbose=False)[0]


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
