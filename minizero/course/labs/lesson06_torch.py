"""Lesson 06's myth 7 (``course/06_myths.py``): torch's ZeroRedundancyOptimizer beside
minizero's stage 1, on the ledger; :mod:`minizero.course.labs.lesson06` brings it into the lesson.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.optim.zero_redundancy_optimizer as zro_module

import minizero
from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import format_bytes, model_state_bytes
from minizero.course.labs import describe, rank_device, run_info
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.parallelize import parallelize

GPT = GPTConfig.tiny()


class LedgeredDist:
    """torch.distributed, except that broadcast goes through minizero's ledger."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def broadcast(tensor, src, group=None, async_op=False):
        group_src = dist.get_group_rank(group or dist.group.WORLD, src)  # src: a global rank
        return C.broadcast(tensor, src=group_src, group=group, async_op=async_op, tag="zro")


def _torch_zero(opt_class, dev, rank: int, world: int) -> dict:
    """3 steps of TinyGPT: DDP's all-reduce, then torch's ZeroRedundancyOptimizer, whose
    broadcasts go through the ledger; against one process on the whole batch."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = TinyGPT(GPT).to(dev)
    torch.manual_seed(0)
    ref = TinyGPT(GPT).to(dev)  # one process, the whole batch
    zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_class, lr=1e-2)
    ref_opt = opt_class(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, device=dev)
        model(x, y).backward()
        with CommLedger() as ledger, mock.patch.object(zro_module, "dist", LedgeredDist()):
            for p in model.parameters():  # DDP: the average gradient on every rank
                C.all_reduce(p.grad, tag="ddp")
                p.grad /= world
            zro.step()
        zro.zero_grad()
        ref(*synthetic_batch("gpt", 4 * world, step, device=dev)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    opt_bytes = model_state_bytes(None, zro.optim)["optimizer"]  # zro.optim: this rank's
    return dict(by_op=ledger.by_op(), opt=opt_bytes, diff=diff)


def _stage1(opt_class, dev, rank: int, world: int) -> dict:
    try:
        net, opt = parallelize(TinyGPT(GPT), 1, lambda p, cls=opt_class: cls(p, lr=1e-2))
    except TypeError as e:
        return dict(refused=str(e))
    for step in range(2):
        x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, device=dev)
        with CommLedger() as ledger:
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    return dict(by_op=ledger.by_op(), opt=model_state_bytes(net, opt)["optimizer"])


def _torch_zero_vs_stage1(optimizers) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    out = {}
    for name, cls in optimizers.items():
        out[f"torch {name}"] = _torch_zero(cls, dev, rank, world)
        out[f"stage 1 {name}"] = _stage1(cls, dev, rank, world)
    return dict(runs=out, info=run_info())


def torch_zero_vs_stage1(nprocs: int, optimizers: dict) -> list[dict]:
    """Myth 7: for each optimizer class, torch's ZeroRedundancyOptimizer (after DDP's all-reduce)
    and minizero's stage 1 on TinyGPT in fp32: volume per op, optimizer bytes per rank, torch's
    distance from one process after 3 steps; stage 1's refusal where it refuses."""
    return minizero.launch(_torch_zero_vs_stage1, nprocs, optimizers, verbose=False)


def show_torch_zero_vs_stage1(per_rank: list[dict]) -> None:
    psi = count_params(TinyGPT(GPT))
    runs = per_rank[0]["runs"]
    print(f"TinyGPT tiny, Ψ = {psi:,}, fp32, one step, {describe(per_rank[0]['info'])}")
    for key, r in runs.items():
        if "refused" in r:
            print(f"{key}: refused: {r['refused'][:130]}...")
            continue
        moved = {op: f"{v / psi:.2f}Ψ" for op, v in r["by_op"].items()}
        total = sum(r["by_op"].values()) / psi
        per = ", ".join(format_bytes(p["runs"][key]["opt"]) for p in per_rank)
        d = r.get("diff")  # torch's: against one process after 3 steps
        diff = "" if d is None else f"; max |params - one process| after 3 steps {d:.1e}"
        print(f"{key}: moved {total:.2f}Ψ {moved}; optimizer states per rank: {per}{diff}")
