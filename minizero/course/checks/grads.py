"""Checks for what a sharded step does to the gradient shards: lesson 02's fp16 skip, lesson 03's
clipping.

Both exercises are standalone functions over this rank's list of gradient shards and a process
group, as a stage calls them between the reduce-scatter and the optimizer's step:

* ``fp16_step(optimizer, masters, scale, group)`` (lesson 02): unscale, decide on every rank
  alike whether some rank saw an inf or a NaN, step or skip, return the next loss scale;
* ``clip_grad_norm_(shards, valid, max_norm, group)`` (lesson 03): the global L2 norm from partial
  sums of squares and one all-reduce, the padding left out; scale every shard in place.

Each check runs the function on real ranks (``minizero.launch``) on shards whose whole is known
to every rank, compares with one process (``torch.nn.utils.clip_grad_norm_``, a plain SGD step),
and counts the collectives with a ``CommLedger``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.bucket import make_buckets
from minizero.checks import CheckFailed, describe, guard, launch_check, rank_device, report_pass
from minizero.checks import run_info as _run_info

# -- lesson 02: the fp16 step, skipped on every rank when one rank saw an inf or a NaN -------------
SHARD_SIZES = (5, 11, 3)  # this rank's (shard,) master tensors
FP16_LR, SCALE = 0.5, 1024.0
CASES = ("every gradient finite", "an inf in the last rank's shard", "a NaN in rank 0's shard")


def _fp16_case(fn, case: int) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    g = torch.Generator().manual_seed(100 * case + rank)
    masters = [torch.randn(n, generator=g).to(dev).requires_grad_() for n in SHARD_SIZES]
    grads = [torch.randn(n, generator=g).to(dev) for n in SHARD_SIZES]  # the true gradients
    bad_rank = {1: world - 1, 2: 0}.get(case)
    if rank == bad_rank:
        grads[1][3] = math.inf if case == 1 else math.nan
    before = [m.detach().clone() for m in masters]
    for m, t in zip(masters, grads, strict=True):
        m.grad = t * SCALE  # what backward left: the gradient of loss * scale
    opt = torch.optim.SGD(masters, lr=FP16_LR)
    with C.CommLedger() as ledger:
        scale, err = guard(fn, opt, masters, SCALE, group=None)
    out = {"error": err, "ops": [r.op for r in ledger.records], "scale": scale}
    out["after"] = [m.detach().cpu() for m in masters]
    out["before"] = [b.cpu() for b in before]
    out["stepped"] = [(b - FP16_LR * t).cpu() for b, t in zip(before, grads, strict=True)]
    out["scaled"] = [(b - FP16_LR * SCALE * t).cpu() for b, t in zip(before, grads, strict=True)]
    out["bad_rank"] = bad_rank
    return out


def _fp16_rank(fn) -> dict:
    out = {"info": _run_info(), "cases": []}
    for case in range(len(CASES)):
        res = _fp16_case(fn, case)
        out["cases"].append(res)
        if res["error"]:
            break  # the other ranks may be out of step now; stop on every rank alike
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def check_fp16_step(fn, nprocs: int | None = None) -> None:
    """Lesson 02: ``fn(optimizer, masters, scale, group=None) -> next scale`` must unscale every
    ``m.grad``, step only when no rank saw an inf or a NaN (one all-reduce decides, for all
    shards), and return ``scale`` after a step, ``scale / 2`` after a skipped one."""
    per_rank = launch_check(_fp16_rank, nprocs, fn)
    world = len(per_rank)
    name = getattr(fn, "__name__", "your function")
    for case, what in enumerate(CASES):
        for rank, res in enumerate(per_rank):
            r = res["cases"][case]
            where = f"with {what} (rank {rank} of {world}, scale {SCALE:g})"
            if r["error"]:
                raise CheckFailed(f"{name} raised {where}: {r['error']}")
            if r["ops"].count("all_reduce") != 1 or len(r["ops"]) != 1:
                hint = (
                    "each rank sees only its own shards, so the ranks must agree before anyone "
                    "steps: one all_reduce (minizero.collectives) of a found-inf flag"
                    if not r["ops"]
                    else "add up the flags of all shards locally, then all-reduce once"
                )
                raise CheckFailed(f"{name} issued {r['ops'] or 'no collective'} {where}: {hint}")
            bad = r["bad_rank"]
            if bad is None:
                if _same(r["after"], r["stepped"]):
                    pass
                elif _same(r["after"], r["scaled"]):
                    raise CheckFailed(
                        f"{name} stepped with the scaled gradient {where}: divide every m.grad "
                        "by scale first (in place), then step"
                    )
                elif _same(r["after"], r["before"]):
                    raise CheckFailed(
                        f"{name} skipped the step {where}: every rank's gradients were finite"
                    )
                else:
                    raise CheckFailed(f"{name} {where}: the masters after the step are wrong")
                if r["scale"] != SCALE:
                    raise CheckFailed(
                        f"{name} returned scale {r['scale']} {where}: after a good step keep it "
                        f"({SCALE:g}); a scaler grows it only after many good steps in a row"
                    )
                continue
            if not _same(r["after"], r["before"]):
                kind = "inf" if case == 1 else "NaN"
                if rank == bad:
                    hint = (
                        " torch.isinf does not see a NaN: test with torch.isfinite."
                        if case == 2
                        else " Test every shard with torch.isfinite before stepping."
                    )
                    msg = f"rank {rank} stepped with a {kind} in its own gradient shard.{hint}"
                else:
                    msg = (
                        f"rank {rank} stepped although rank {bad}'s shard holds a {kind}: every "
                        "rank must skip. Sum (or max) a found-inf flag over the ranks with one "
                        "all_reduce, and skip where it is not zero"
                    )
                raise CheckFailed(f"{name} {where}: {msg}")
            if r["scale"] != SCALE / 2:
                raise CheckFailed(
                    f"{name} returned scale {r['scale']} {where}: after a skipped step halve it "
                    f"({SCALE / 2:g}), so that the next step's gradients fit in fp16"
                )
    report_pass(
        f"{name}: unscaled, stepped and kept scale {SCALE:g} when every gradient was finite; "
        f"skipped on every rank and halved the scale when one rank's shard held an inf or a NaN; "
        f"one all-reduce per step; {world} ranks ({describe(per_rank[0]['info'])})"
    )


# -- lesson 03: the global gradient norm over shards, the padding left out ----------------------
SHAPES = [(37, 13), (37,), (29, 37), (29,), (7, 29), (7,), (7,)]  # the MLP's, 1,837 elements
CLIP_CAP_MB, PADDING_VALUE = 0.002, 3.0


def _grads() -> list[torch.Tensor]:
    """One fixed full (averaged) gradient per parameter of SHAPES, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [0.1 * torch.randn(s, generator=g) for s in SHAPES]


def _chunks(grads: list[torch.Tensor], world: int, rank: int) -> tuple[list, list[int]]:
    """Rank ``rank``'s (shard,) chunk of every bucket of ``grads`` (the MLP's shapes in 2 KiB
    buckets), the padding filled with PADDING_VALUE; and how many elements of each are real."""
    params = [torch.nn.Parameter(torch.empty(s)) for s in SHAPES]
    of = {id(p): g for p, g in zip(params, grads, strict=True)}
    shards, valid = [], []
    for b in make_buckets(params, CLIP_CAP_MB, world):
        n = max(0, min(b.shard, b.numel - rank * b.shard))  # real elements in this chunk
        chunk = b.chunk(b.flatten([of[id(p)] for p in b.params]), rank).clone()
        chunk[n:] = PADDING_VALUE  # memory no parameter owns: not guaranteed to be zero
        shards.append(chunk)
        valid.append(n)
    return shards, valid


def _clip_rank(fn) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    norm = torch.cat([g.reshape(-1) for g in _grads()]).norm().item()
    out = {"info": _run_info(), "norm": norm, "cases": []}
    for max_norm in (0.5 * norm, 2.0 * norm):  # clips; does not
        shards, valid = _chunks(_grads(), world, rank)
        shards = [s.to(dev) for s in shards]
        with C.CommLedger() as ledger:
            got, err = guard(fn, shards, list(valid), max_norm, group=None)
        case = {"max_norm": max_norm, "error": err, "ops": [r.op for r in ledger.records]}
        if err is None:
            case["norm"] = float(got) if got is not None else None
            case["shards"] = [s[:n].cpu() for s, n in zip(shards, valid, strict=True)]
        out["cases"].append(case)
        if err:
            break
    return out


def _clip_hint(got: float, norm: float, rank: int, world: int) -> str:
    """Which wrong computation gives ``got``, from every rank's chunks (each rank knows them)."""
    local, padded = [], []
    for r in range(world):
        shards, valid = _chunks(_grads(), world, r)
        local.append(sum(float(s[:n].pow(2).sum()) for s, n in zip(shards, valid, strict=True)))
        padded.append(sum(float(s.pow(2).sum()) for s in shards))
    near = lambda x: math.isclose(got, x, rel_tol=1e-4)
    if near(math.sqrt(local[rank])):
        return (
            f" It is the norm of rank {rank}'s own shards: add up the squares of every shard, "
            "all-reduce that sum, then take the square root."
        )
    if near(math.sqrt(sum(padded))):
        return (
            " It counts the padding: only the first valid[i] elements of shards[i] are "
            "gradient; the rest is memory no parameter owns."
        )
    if near(sum(math.sqrt(x) for x in local)):
        return (
            " It is the sum of the ranks' norms: norms do not add, squares do. All-reduce the "
            "sum of squares, then take the square root."
        )
    if near(norm * norm):
        return " It is the squared norm: take the square root of the all-reduced sum."
    return ""


def check_clip_grad_norm(fn, nprocs: int | None = None) -> None:
    """Lesson 03: ``fn(shards, valid, max_norm, group=None)`` must return the L2 norm of the whole
    gradient (every rank's real elements, no padding), the same on every rank, as
    ``torch.nn.utils.clip_grad_norm_`` on the full gradient, scale every shard in place by
    ``min(1, max_norm / (norm + 1e-6))``, and issue exactly one all-reduce."""
    per_rank = launch_check(_clip_rank, nprocs, fn)
    world = len(per_rank)
    name = getattr(fn, "__name__", "your function")
    for rank, res in enumerate(per_rank):
        for case in res["cases"]:
            where = f"on rank {rank} of {world}, max_norm {case['max_norm']:.4g}"
            if case["error"]:
                raise CheckFailed(f"{name} raised {where}: {case['error']}")
            if case["ops"] != ["all_reduce"]:
                raise CheckFailed(
                    f"{name} issued {case['ops'] or 'no collective'} {where}: add up the squares "
                    "of all this rank's shards into one number, then one all_reduce "
                    "(minizero.collectives) sums the ranks' numbers"
                )
            params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]  # one process
            for p, g in zip(params, _grads(), strict=True):
                p.grad = g
            want = float(torch.nn.utils.clip_grad_norm_(params, case["max_norm"]))
            got = case["norm"]
            if got is None or not math.isclose(got, want, rel_tol=1e-5):
                hint = _clip_hint(got, want, rank, world) if got is not None else ""
                raise CheckFailed(
                    f"{name} returned norm {got} {where}; torch.nn.utils.clip_grad_norm_ on the "
                    f"whole gradient gives {want:.6g}.{hint}"
                )
            ref, _ = _chunks([p.grad for p in params], world, rank)
            for i, (g, w) in enumerate(zip(case["shards"], ref, strict=True)):
                w = w[: g.numel()]
                if not torch.allclose(g, w, rtol=1e-5, atol=1e-7):
                    hint = (
                        "scale every shard in place by max_norm / (norm + 1e-6)"
                        if case["max_norm"] < want
                        else "the norm is below max_norm: the coefficient is "
                        "min(1, max_norm / (norm + 1e-6)), so nothing changes"
                    )
                    raise CheckFailed(
                        f"{name} {where}: shard {i} after clipping differs from "
                        f"torch.nn.utils.clip_grad_norm_'s by up to {(g - w).abs().max():.3g}: "
                        f"{hint}"
                    )
    report_pass(
        f"{name}: the global norm {per_rank[0]['norm']:.6g} and the clipped shards equal "
        f"torch.nn.utils.clip_grad_norm_ on the whole gradient (clipping and not), padding left "
        f"out, one all-reduce per call, {world} ranks ({describe(per_rank[0]['info'])})"
    )
