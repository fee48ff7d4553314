"""Lesson 06's myth 7 (``course/06_myths.py``): torch's ZeroRedundancyOptimizer beside DDP and
minizero's stage 1, on the ledger. What each rank runs is the lesson's (``zero_vs_stage1``, in
:mod:`.saved`); this module makes torch's own broadcasts visible to a ``CommLedger``, launches the
runs and shows them. :mod:`minizero.course.labs.lesson06` brings it into the lesson.

It does not import :mod:`.saved`, which imports ``torch_broadcasts_on_ledger`` from here: the
lesson passes its function to ``torch_zero_vs_stage1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch.distributed as dist
import torch.distributed.optim.zero_redundancy_optimizer as zro_module

import minizero
from minizero import collectives as C
from minizero.analysis.memory import format_bytes
from minizero.course.labs import describe, run_info
from minizero.models import GPTConfig, TinyGPT, count_params

GPT = GPTConfig.tiny()
# (name, stage, torch_zero): DDP with the optimizer over every tensor; DDP, then torch's
# ZeroRedundancyOptimizer of it (the recipe torch documents); minizero's stage 1
RUNS = (("DDP", 0, False), ("torch", 0, True), ("stage 1", 1, False))


class LedgeredDist:
    """torch.distributed, except that broadcast goes through minizero's ledger."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def broadcast(tensor, src, group=None, async_op=False):
        group_src = dist.get_group_rank(group or dist.group.WORLD, src)  # src: a global rank
        return C.broadcast(tensor, src=group_src, group=group, async_op=async_op, tag="zro")


@contextmanager
def torch_broadcasts_on_ledger() -> Iterator[None]:
    """Inside the block, torch's ZeroRedundancyOptimizer calls ``minizero.broadcast`` where it
    calls ``torch.distributed.broadcast``: a ``CommLedger`` records its traffic."""
    with mock.patch.object(zro_module, "dist", LedgeredDist()):
        yield


def _zero_vs_stage1(fn: Callable, optimizers: dict) -> dict:
    runs = {}
    for name, cls in optimizers.items():
        for how, stage, torch_zero in RUNS:
            try:
                got = fn(stage, cls, torch_zero)
            except TypeError as e:  # minizero's stages 1-3 refuse a non-elementwise optimizer
                runs[f"{how} {name}"] = dict(refused=str(e))
                continue
            params = {k: v.detach().cpu() for k, v in got["params"].items()}
            runs[f"{how} {name}"] = {**got, "params": params}
    return dict(runs=runs, info=run_info())


def torch_zero_vs_stage1(nprocs: int, optimizers: dict, fn: Callable) -> list[dict]:
    """Myth 7: for each optimizer class, ``fn(stage, cls, torch_zero)`` (the lesson's
    ``zero_vs_stage1``) for each of ``RUNS`` on every rank: the last step's volume per op, this
    rank's optimizer bytes, the parameters after; stage 1's refusal where it refuses."""
    return minizero.launch(_zero_vs_stage1, nprocs, fn, optimizers, verbose=False)


def _from_ddp(per_rank: list[dict], key: str, ddp: str) -> float:
    """The largest |difference| between ``key``'s parameters and ``ddp``'s, over every rank."""
    runs = [p["runs"] for p in per_rank]
    return max(
        (r[key]["params"][k] - r[ddp]["params"][k]).abs().max().item()
        for r in runs
        for k in r[ddp]["params"]
    )


def show_torch_zero_vs_stage1(per_rank: list[dict]) -> None:
    psi = count_params(TinyGPT(GPT))
    runs = per_rank[0]["runs"]
    print(f"TinyGPT tiny, Ψ = {psi:,}, fp32, step 3 of 3, {describe(per_rank[0]['info'])}")
    for key, r in runs.items():
        if "refused" in r:
            print(f"{key}: refused: {r['refused'][:130]}...")
            continue
        moved = ", ".join(f"{op} {v / psi:.2f}Ψ" for op, v in r["moved"].items())
        total = sum(r["moved"].values()) / psi
        per = ", ".join(format_bytes(p["runs"][key]["states"]) for p in per_rank)
        ddp = "DDP " + key.split(" ")[-1]
        d = None if key == ddp else _from_ddp(per_rank, key, ddp)
        vs = "" if d is None else f"; parameters vs {ddp}'s, every rank: max |difference| {d:.1e}"
        vs += " (bit-identical)" if d == 0 else ""
        print(f"{key}: moved {total:.2f}Ψ ({moved}); optimizer states per rank: {per}{vs}")
