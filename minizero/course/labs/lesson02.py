"""Lesson 02's experiments (``course/02_zero1.py``): stage 1, P_os, measured.

``adam_in_pieces`` (section 1) the lesson's own: Adam on a tensor against Adam on its halves;
``bucket_ownership`` (section 2) which elements of which parameter each rank owns;
``fp16_gradients`` (section 7) a backward in fp16 at several loss scales against fp32;
``step_volume`` (section 8) what one step sends, per op;
``optimizer_share`` (section 9) each rank's share of Adam's states, two layouts.
Sections 4-5 use :mod:`minizero.course.labs.common` (``model_states``, ``states_over_world``);
section 6 the lesson's own ``one_step_memory``, which ``memory_per_step`` runs for lesson 03.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import PAPER_TABLE1, TABLE1_PSI, model_state_bytes, table1_gb
from minizero.analysis.memory import MemoryMeter as MemoryMeter  # section 6
from minizero.bucket import make_buckets, trainable_parameters
from minizero.collectives import all_gather, all_reduce, reduce_scatter
from minizero.course import hint
from minizero.course.checks import lesson02
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.common import GPT, PSI, adam, gpt_batch
from minizero.course.labs.common import model_states as model_states  # section 4
from minizero.course.labs.common import plot_memory_per_step as plot_memory_per_step
from minizero.course.labs.common import plot_states_over_world as plot_states_over_world
from minizero.course.labs.common import show_after_step as show_after_step
from minizero.course.labs.common import show_model_states as show_model_states
from minizero.course.labs.common import states_over_world as states_over_world  # section 5
from minizero.course.labs.saved import adam_in_pieces as adam_in_pieces  # section 1
from minizero.course.labs.saved import one_step_memory
from minizero.models import MLP, TinyGPT, count_params, synthetic_batch
from minizero.precision import divides_before_sum
from minizero.zero1 import ZeRO1

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "MLP", "PSI", "ZeRO1", "all_gather"]
__all__ += ["all_reduce", "dist", "divides_before_sum", "lesson02", "reduce_scatter"]
__all__ += ["GPT", "MemoryMeter", "TinyGPT", "adam", "gpt_batch", "run_info"]


def show_adam_in_pieces(r: dict) -> None:
    print(f"max |whole - halves| after {r['steps']} Adam steps: {r['diff']:g}")
    print("states: whole", r["whole"], "| each half", r["half"])


def bucket_ownership(model: torch.nn.Module, bucket_cap_mb: float, world: int) -> list[dict]:
    """Section 2: ``model``'s buckets for ``world`` ranks, and for each rank the element range of
    each parameter it owns: ``{"index", "numel", "padded", "shard", "owned": [[(name, lo, hi),
    ...] per rank], "padding": [n per rank]}``."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for b in make_buckets(trainable_parameters(model), bucket_cap_mb=bucket_cap_mb, world=world):
        owned, padding = [], []
        for r in range(world):
            lo, hi = r * b.shard, (r + 1) * b.shard  # rank r owns [lo, hi) of the flat buffer
            owned.append(
                [
                    (names[id(p)], max(lo, o) - o, min(hi, o + p.numel()) - o)
                    for p, o in zip(b.params, b.offsets, strict=True)
                    if o < hi and o + p.numel() > lo
                ]
            )
            padding.append(max(0, hi - max(lo, b.numel)))
        out.append(
            dict(
                index=b.index,
                numel=b.numel,
                padded=b.padded,
                shard=b.shard,
                owned=owned,
                padding=padding,
            )
        )
    return out


def show_bucket_ownership(buckets: list[dict]) -> None:
    for b in buckets:
        world = len(b["owned"])
        print(
            f"bucket {b['index']}: {b['numel']} elements, padded to {b['padded']} = "
            f"{world} chunks of {b['shard']}"
        )
        for r, (owned, pad) in enumerate(zip(b["owned"], b["padding"], strict=True)):
            parts = ", ".join(f"{name}[{lo}:{hi}]" for name, lo, hi in owned)
            print(f"   rank {r} owns {parts}" + (f" + {pad} padding" if pad else ""))


def _train_step(model, opt, step: int = 0, group=None) -> None:
    model(*gpt_batch(step, group)).backward()
    opt.step()
    opt.zero_grad()


def show_table1(model: str, world: int, stages=(1, 2, 3)) -> None:
    """The formula's GB per rank beside the paper's Table 1, for one of its models."""
    for stage in stages:
        print(
            f"{model}, N = {world}, stage {stage}: formula "
            f"{table1_gb(TABLE1_PSI[model], world, stage):7.2f} GB"
            f"   paper's Table 1: {PAPER_TABLE1[model][world][stage - 1]} GB"
        )


def fp16_gradients(log2_scales=(0, 8, 12, 15, 16), rows: int = 8) -> list[dict]:
    """Section 7, one process: TinyGPT's gradient from a backward in fp16 of the loss times
    2^k, unscaled in fp32, against the fp32 gradient: the fractions of elements flushed to 0,
    subnormal and not finite, and the relative error."""
    torch.manual_seed(0)
    ref = TinyGPT(GPT)  # fp32
    x, y = synthetic_batch("gpt", rows, 0)
    ref(x, y).backward()
    g32 = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])  # (Ψ,) the fp32 gradient
    half = TinyGPT(GPT)
    half.load_state_dict(ref.state_dict())
    half.half()  # fp16 parameters, activations and gradients
    out = []
    for log2 in log2_scales:
        half.zero_grad()
        (half(x, y).float() * 2**log2).backward()  # backward in fp16 from loss * scale
        g16 = torch.cat([p.grad.reshape(-1) for p in half.parameters()])  # (Ψ,) fp16, scaled
        g = g16.float() / 2**log2  # unscaled, in fp32, as the optimizer's step sees it
        bad = (~torch.isfinite(g)).float().mean().item()
        out.append(
            dict(
                log2=log2,
                bad=bad,
                flushed=((g16 == 0) & (g32 != 0)).float().mean().item(),
                subnormal=((g16 != 0) & (g16.abs() < 2**-14)).float().mean().item(),
                error=((g - g32).norm() / g32.norm()).item() if bad == 0 else float("nan"),
            )
        )
    return out


def show_fp16_gradients(rows: list[dict]) -> None:
    print("TinyGPT, one batch of 8 rows, backward in fp16 on one process (this notebook, CPU):")
    print(
        f"{'scale':>7}{'flushed to 0':>14}{'subnormal':>11}{'inf or NaN':>12}"
        f"{'|g - g32|/|g32|':>17}"
    )
    for r in rows:
        print(
            f"{'2^' + str(r['log2']):>7}{r['flushed']:14.3%}{r['subnormal']:11.2%}"
            f"{r['bad']:12.1%}{r['error']:17.2e}"
        )


def _step_volume(stage: int) -> dict:
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam)
    _train_step(model, opt, step=0)  # the first step creates the optimizer states
    with minizero.CommLedger() as ledger:
        _train_step(model, opt, step=1)
    return dict(by_op=ledger.by_op(), info=run_info())


def step_volume(nprocs: int, stages=(0, 1)) -> dict:
    """Section 8: the paper's volume of TinyGPT's second step, per op, on rank 0, per stage."""
    runs = {s: minizero.launch(_step_volume, nprocs, s, verbose=False)[0] for s in stages}
    info = next(iter(runs.values()))["info"]
    return dict(volumes={s: r["by_op"] for s, r in runs.items()}, info=info)


def show_step_volume(v: dict, psi: int = PSI) -> None:
    for stage, by_op in v["volumes"].items():
        parts = ", ".join(f"{op} {n / psi:.3f}Ψ" for op, n in by_op.items())
        total = sum(by_op.values()) / psi
        print(f"stage {stage}: {parts}; total {total:.3f}Ψ  ({describe(v['info'])})")


def _optimizer_share() -> tuple:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    x, y = synthetic_batch("mlp", 4 * world, 0, rank=rank, world=world, device=dev)
    torch.manual_seed(0)
    model = MLP().to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    ddp(x, y).backward()
    zro.step()
    owned = [n for n, p in model.named_parameters() if p in zro.optim.state]
    torch.manual_seed(0)
    zero1, opt = minizero.parallelize(MLP(), 1, adam)
    zero1(x, y).backward()
    opt.step()
    full = 8 * count_params(model)  # bytes of fp32 Adam states (two moments) for the whole MLP
    theirs = model_state_bytes(None, zro.optim)["optimizer"] / full  # zro.optim: this rank's Adam
    return theirs, model_state_bytes(zero1, opt)["optimizer"] / full, owned, run_info()


def optimizer_share(nprocs: int) -> list[dict]:
    """Section 9: each rank's share of the MLP's fp32 Adam states after one step, under torch's
    ZeroRedundancyOptimizer (whole tensors: which it owns) and minizero's ZeRO1 (flat chunks)."""
    per_rank = minizero.launch(_optimizer_share, nprocs, verbose=False)
    keys = ("theirs", "ours", "owned", "info")
    return [dict(zip(keys, r, strict=True)) for r in per_rank]


def show_optimizer_share(rows: list[dict]) -> None:
    psi = count_params(MLP())
    print(f"MLP, Ψ = {psi:,}, fp32 Adam, {describe(rows[0]['info'])}: share of the states")
    for r, row in enumerate(rows):
        print(f"rank {r}: ZeroRedundancyOptimizer {row['theirs']:6.1%} ({', '.join(row['owned'])})")
        print(f"        minizero ZeRO1          {row['ours']:6.1%} (chunk {r} of one flat bucket)")


def memory_per_step(
    nprocs: int, stages, precision: str = "bf16", bucket_cap_mb: float | None = None
) -> dict[int, dict]:
    """Lessons 02-03: TinyGPT through one Adam step at each stage (buckets of ``bucket_cap_mb``,
    the default if None; stage 3 cuts units): rank 0's bytes of each category (params, grads,
    optimizer, comm, activations) and the peak so far, at start, after forward, after backward and
    after the step. ``{stage: {"marks": [...], "info": ...}}``: lesson 02's ``one_step_memory``
    on ``nprocs`` ranks, once per stage."""
    args = (precision, bucket_cap_mb)
    return {s: minizero.launch(one_step_memory, nprocs, s, *args, verbose=False)[0] for s in stages}
