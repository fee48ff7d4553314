"""The check cell of lesson 00 (00_collectives): ``check_all_reduce_via_rs_ag``.

The student's ``all_reduce_via_rs_ag(t, group)`` runs on real ranks on tensors of awkward shapes
(one element, a prime count, 2-D) and is compared element by element with ``dist.all_reduce``; a
``CommLedger`` checks that it issued one reduce-scatter and one all-gather through
``minizero.collectives`` and nothing else. The contract of every check: :mod:`.common`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero.analysis.ledger import CommLedger
from minizero.course.checks.common import (
    SUBGROUP,
    CheckFailed,
    describe,
    guard,
    launch_check,
    on_subgroup,
    raised_hint,
    rank_device,
    report_pass,
    run_info,
    strict_ledger,
    subgroup_failure,
    two_ranks_hint,
)

SHAPES = [(1,), (2,), (7,), (12,), (1001,), (3, 5), (4097,)]
SUB_SHAPES = [(7,), (3, 5)]  # on the subgroup: odd counts, so a world-sized shard cannot fit


def _sub_cases(group, fn) -> list[dict]:
    """On the members of the subgroup: ``fn(t, group=group)`` against ``dist.all_reduce``."""
    cases = []
    for i, shape in enumerate(SUB_SHAPES):
        g = torch.Generator().manual_seed(77 + 1000 * i + dist.get_rank())
        t = torch.randint(-50, 50, shape, generator=g).float().to(rank_device())
        want = t.clone()
        dist.all_reduce(want, group=group)
        mine = t.clone()
        with strict_ledger(group):
            _, err = guard(fn, mine, group=group)
        cases.append({"shape": shape, "error": err, "ok": err is None and torch.equal(mine, want)})
        if err is not None:
            break
    return cases


def _rs_ag_rank(fn) -> dict:
    rank, dev = dist.get_rank(), rank_device()
    out = {"info": run_info(), "cases": []}
    for i, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(1000 * i + rank)
        # integer values: every summation order gives the same floats, so equality is exact
        t = torch.randint(-50, 50, shape, generator=g).float().to(dev)
        want = t.clone()
        dist.all_reduce(want)  # the reference: torch.distributed itself
        mine = t.clone()
        with CommLedger() as ledger:
            ret, err = guard(fn, mine, group=None)
        ops = [r.op for r in ledger.records]
        case = {"shape": shape, "error": err, "ops": ops, "volume": ledger.volume_elements}
        if err is None:
            case["same_object"] = ret is None or ret is mine
            case["got"] = mine.cpu()
            case["want"] = want.cpu()
            case["ret_ok"] = ret is not None and torch.equal(ret.cpu(), want.cpu())
        out["cases"].append(case)
        if err is not None:
            break  # the other ranks may now be out of step; stop here on every rank alike
    if all(c["error"] is None for c in out["cases"]):
        out["sub"] = on_subgroup(_sub_cases, fn)
    return out


def check_all_reduce_via_rs_ag(fn, nprocs: int | None = None) -> None:
    """Lesson 00: ``fn(t, group=None)`` must sum ``t`` over the ranks in place, exactly as
    ``dist.all_reduce`` does, with one reduce-scatter and one all-gather (minizero.collectives)."""
    results = launch_check(_rs_ag_rank, nprocs, fn)
    world = len(results)
    name = getattr(fn, "__name__", "your function")
    for rank, res in enumerate(results):
        for case in res["cases"]:
            shape = tuple(case["shape"])
            n = torch.Size(shape).numel()
            where = f"for a tensor of shape {shape} on rank {rank} (world size {world})"
            if case["error"]:
                raise CheckFailed(
                    f"{name} raised {where}: {case['error']}.{raised_hint(world, case['error'])}"
                )
            got, want = case["got"], case["want"]
            if not torch.equal(got, want):
                if case["ret_ok"]:
                    raise CheckFailed(
                        f"{name} returned the right sum {where} but left `t` "
                        "unchanged: like dist.all_reduce, it must update t in place "
                        "(e.g. t.copy_(...))."
                    )
                if got.shape != want.shape:
                    raise CheckFailed(f"{name} changed the shape of t {where}: {tuple(got.shape)}")
                bad = (got != want).reshape(-1).nonzero().reshape(-1)
                k = int(bad[0])
                diff = (got - want).abs().max().item()
                hint = ""
                if torch.allclose(got * world, want):
                    hint = (
                        f" Yours is the average (the sum / {world}): all-reduce SUMS, as "
                        "dist.all_reduce does; do not divide by the world size here."
                    )
                elif world != 2 and torch.allclose(got * 2, want):
                    hint = f" Yours is the sum / 2.{two_ranks_hint(world)}"
                elif n % world:
                    hint = (
                        f" {n} element(s) do not split evenly over {world} ranks: pad the flat "
                        f"tensor to a multiple of the world size ({-(-n // world) * world}), "
                        "then drop the padding."
                    )
                raise CheckFailed(
                    f"wrong sum {where}: element {k} (flat index) is {got.reshape(-1)[k].item():g}"
                    f", dist.all_reduce gives {want.reshape(-1)[k].item():g}; {len(bad)} of {n} "
                    f"elements differ, max |difference| {diff:g}.{hint}"
                )
            if case["ops"] != ["reduce_scatter", "all_gather"]:
                raise CheckFailed(
                    f"{name} issued {case['ops'] or 'no collective'} {where} through "
                    "minizero.collectives; expected exactly ['reduce_scatter', 'all_gather'] "
                    "(call minizero.collectives.reduce_scatter and .all_gather, not "
                    "torch.distributed, so that the CommLedger sees them)"
                )
    for rank in SUBGROUP:
        for case in results[rank].get("sub") or []:
            what = f"for a tensor of shape {tuple(case['shape'])} on rank {rank}"
            if case["error"]:
                raise subgroup_failure(name, world, f"raised {what}: {case['error']}.")
            if not case["ok"]:
                raise subgroup_failure(name, world, f"gave a wrong sum {what}.")
    info = results[0]["info"]
    report_pass(
        f"{name} equals dist.all_reduce on {len(SHAPES)} shapes, {world} ranks "
        f"({describe(info)}) and on the subgroup {list(SUBGROUP)}, each with one reduce_scatter "
        "+ one all_gather"
    )
