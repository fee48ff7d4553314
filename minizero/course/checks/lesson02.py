"""What the check cells of lesson 02 (02_zero1) call: the flat layout, stage 1, the fp16 step.

``check_bucket`` needs no ranks: it builds the student's bucket and minizero's
(:class:`minizero.bucket.Bucket`) over the same parameters, for several world sizes, and compares
the layout, the views and the flat buffers. ``check_zero1`` trains the student's ``ZeRO1``
subclass on real ranks next to its references (:mod:`.common_zero`).

``check_fp16_step`` runs the student's ``fp16_step(optimizer, masters, scale, group)``, a
standalone function over this rank's gradient shards as a stage calls it between the
reduce-scatter and the optimizer's step: unscale, decide on every rank alike whether some rank saw
an inf or a NaN, step or skip, return the next loss scale. It runs on real ranks on shards whose
whole is known to every rank, is compared with one process (a plain SGD step), and its collectives
are counted with a ``CommLedger``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from minizero.analysis.ledger import CommLedger
from minizero.bucket import Bucket
from minizero.course.checks.common import (
    SUBGROUP,
    CheckFailed,
    describe,
    guard,
    launch_check,
    on_subgroup,
    on_world_and_subgroup,
    rank_device,
    report_pass,
    run_info,
    strict_ledger,
)
from minizero.course.checks.common_zero import (
    STEPS,
    check_subgroup,
    minizero_build,
    one_process,
    precision_runs,
    results,
    run_all,
    torch_zero,
    with_subgroup,
)
from minizero.course.checks.compare_zero import check_precisions, check_volume, compare
from minizero.zero1 import ZeRO1

# (parameter shapes, world size): the MLP's 1,837 elements over 3 ranks; fewer elements than
# ranks (ranks that own only padding); an exact multiple; a small uneven case; one rank.
LAYOUTS = [
    ([(7,), (7,), (7, 29), (29,), (29, 37), (37,), (37, 13)], 3),
    ([(3,), (2,)], 8),
    ([(4, 4)], 2),
    ([(7,), (1,), (10,)], 4),
    ([(2, 3), (5,)], 1),
]


def _is_view_of(t: torch.Tensor, flat: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _dirty_allocator(numel: int) -> None:
    """Free a NaN-filled buffer of this size, so that ``torch.empty`` often hands it back."""
    junk = torch.full((numel,), float("nan"))
    del junk


def _check_one_layout(cls, shapes: list[tuple], world: int) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = Bucket(params, 0, world)
    name = getattr(cls, "__name__", "your bucket")
    case = f"for parameters of shapes {shapes} ({ref.numel} elements) on {world} ranks"
    mine, err = guard(cls, params, 0, world)
    if err:
        raise CheckFailed(f"{name}(params, 0, world={world}) raised {case}: {err}")
    for attr in ("numel", "offsets", "shard", "padded"):
        if not hasattr(mine, attr):
            raise CheckFailed(f"{name} has no attribute {attr!r} {case}")
    if mine.numel != ref.numel:
        raise CheckFailed(f"numel = {mine.numel} {case}: the sum of the parameters' numel()")
    if list(mine.offsets) != ref.offsets:
        raise CheckFailed(
            f"offsets = {list(mine.offsets)} {case}, expected {ref.offsets}: each parameter "
            "starts where the one before it ends, the first at 0"
        )
    if mine.shard != ref.shard:
        hint = " (rounded down: the last elements would belong to no rank)"
        hint = hint if mine.shard == ref.numel // world else ""
        raise CheckFailed(
            f"shard = {mine.shard} {case}, expected ceil({ref.numel} / {world}) = {ref.shard}"
            f"{hint}: every rank owns the same number of elements, so round up"
        )
    if mine.padded != ref.padded:
        raise CheckFailed(
            f"padded = {mine.padded} {case}, expected shard * world = {ref.padded}: numel "
            "rounded up to a multiple of the world size"
        )
    flat = torch.arange(ref.padded, dtype=torch.float32)  # (padded,) element k holds k
    for i, p in enumerate(params):
        got, err = guard(mine.view, flat, p)
        if err:
            raise CheckFailed(f"view(flat, params[{i}]) raised {case}: {err}")
        want = ref.view(flat, p)
        if tuple(got.shape) != tuple(p.shape):
            raise CheckFailed(
                f"view(flat, params[{i}]) has shape {tuple(got.shape)} {case}; it must be "
                f"shaped like the parameter, {tuple(p.shape)} (.view(p.shape))"
            )
        if not torch.equal(got, want):
            raise CheckFailed(
                f"view(flat, params[{i}]) holds flat elements {got.reshape(-1)[:3].long().tolist()}"
                f"... {case}, expected {want.reshape(-1)[:3].long().tolist()}...: the parameter's "
                f"elements are flat[offsets[{i}] : offsets[{i}] + numel]"
            )
        if not _is_view_of(got, flat):
            raise CheckFailed(
                f"view(flat, params[{i}]) returned a copy {case}: it must be a view into flat "
                "(slice it, then .view(p.shape)), so that p.data and p.grad can live in the flat "
                "buffer"
            )
    for r in range(world):
        got, err = guard(mine.chunk, flat, r)
        if err:
            raise CheckFailed(f"chunk(flat, {r}) raised {case}: {err}")
        want = ref.chunk(flat, r)
        if got.shape != want.shape or not torch.equal(got, want):
            raise CheckFailed(
                f"chunk(flat, {r}) is elements {got[:1].long().tolist()}... ({got.numel()} of "
                f"them) {case}; rank {r} owns [{r} * shard, {r + 1} * shard) = "
                f"[{r * ref.shard}, {(r + 1) * ref.shard})"
            )
        if not _is_view_of(got, flat):
            raise CheckFailed(
                f"chunk(flat, {r}) returned a copy {case}: a reduce-scatter writes into it and "
                "an all-gather reads it, in the flat buffer itself: return a slice"
            )
    tensors = [torch.randn(s) for s in shapes]
    for dtype in (None, torch.float64):
        _dirty_allocator(ref.padded)
        got, err = (
            guard(mine.flatten, tensors) if dtype is None else guard(mine.flatten, tensors, dtype)
        )
        call = "flatten(tensors)" if dtype is None else "flatten(tensors, torch.float64)"
        if err:
            raise CheckFailed(f"{call} raised {case}: {err}")
        want = ref.flatten(tensors, dtype)
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckFailed(
                f"{call} returned {tuple(got.shape)} {got.dtype} {case}, expected "
                f"{tuple(want.shape)} {want.dtype}: one (padded,) buffer, of the tensors' dtype "
                "unless dtype is given"
            )
        pad = got[ref.numel :]
        if not torch.equal(pad, torch.zeros_like(pad)):
            raise CheckFailed(
                f"{call}: the {pad.numel()} padding elements hold {pad[:3].tolist()}... {case}; "
                "they must be zeros (a reduce-scatter sums them, the optimizer steps them): start "
                "from torch.zeros, not torch.empty"
            )
        if not torch.equal(got, want):
            k = int((got != want).nonzero()[0])
            raise CheckFailed(
                f"{call}: flat element {k} is {got[k].item():.4g}, expected {want[k].item():.4g} "
                f"{case}: copy tensors[i] into view(flat, params[i])"
            )
        if any(_is_view_of(t, got) for t in tensors):
            raise CheckFailed(f"{call} returned a buffer that shares memory with its inputs {case}")


def check_bucket(cls) -> None:
    """Lesson 02, the layout: ``cls(params, index, world)`` must lay ``params`` end to end as
    minizero's :class:`~minizero.bucket.Bucket` does (offsets, shard, padded) and give the same
    views (``view``, ``chunk``: views into the flat buffer) and flat buffers (``flatten``)."""
    for shapes, world in LAYOUTS:
        _check_one_layout(cls, shapes, world)
    name = getattr(cls, "__name__", "your bucket")
    report_pass(
        f"{name}: offsets, shard, padded, view, chunk and flatten equal minizero's Bucket on "
        f"{len(LAYOUTS)} layouts (world sizes {sorted({w for _, w in LAYOUTS})}), views sharing "
        "the flat buffer's memory, padding zeros"
    )


# -- ZeRO-1 ----------------------------------------------------------------------------------------
def _zero1_rank(student) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {
        "one process on the whole batch": one_process,
        "torch ZeroRedundancyOptimizer": torch_zero,
        "minizero.zero1.ZeRO1": minizero_build(ZeRO1),
    }
    out = run_all(refs, minizero_build(student), rank, world, dev)
    if out["error"] is None:  # 16-bit: fp32 masters apart from the working copy, bit for bit
        out.update(precision_runs(ZeRO1, student, rank, world, dev))
    return with_subgroup(out, ZeRO1, student)


def check_zero1(cls, nprocs: int | None = None) -> None:
    """Lesson 02: ``cls`` (a ZeRO1 subclass) must train as one process, torch's
    ZeroRedundancyOptimizer and minizero's ZeRO1 do (float64), with one reduce-scatter and
    one all-gather per bucket per step (2Ψ); and under each 16-bit policy, bit for bit as
    minizero's ZeRO1 in the same policy."""
    res_all, world, name = results(_zero1_rank, nprocs, cls)
    for rank, res in enumerate(res_all):
        mine, refs = res["mine"], res["refs"]
        compare(
            mine,
            refs,
            "minizero.zero1.ZeRO1",
            rank,
            world,
            shards="Reduce-scatter each bucket's gradients into this rank's chunk, then average",
            params=" The gradients were right: after the step, all-gather every rank's updated "
            "chunk into the bucket's flat buffer (self.flat_params[i]).",
        )
    policies = check_precisions(
        res_all,
        "minizero's ZeRO1",
        world,
        " In 16 bits the optimizer steps a separate fp32 master (self.optim_params[i]): copy it "
        "into your 16-bit chunk before the all-gather (when self.precision.master).",
        " In finish_grad_sync: if divides_before_sum(flat), flat.div_(self.world) before the "
        "reduce-scatter; else chunk.div_(self.world) after it.",
    )
    res = res_all[0]
    volume = check_volume(
        res["mine"],
        res["refs"]["minizero.zero1.ZeRO1"],
        "minizero.zero1.ZeRO1",
        "one reduce-scatter and one all-gather of every bucket's padded flat buffer",
    )
    psi = res["psi"]
    check_subgroup(res_all, world, name)  # last: the mistakes above name themselves
    report_pass(
        f"{name}: gradient shards and parameters equal {', '.join(res['refs'])} for {STEPS} "
        f"Adam steps on {world} ranks ({describe(res['info'])}); bit for bit minizero's ZeRO1 "
        f"under {', '.join(policies)} (SGD); "
        f"moved {volume} elements per step = {volume / psi:.3f} Ψ (2Ψ, Ψ = {psi}, plus padding)"
    )


# -- the fp16 step, skipped on every rank when one rank saw an inf or a NaN ------------------------
SHARD_SIZES = (5, 11, 3)  # this rank's (shard,) master tensors
FP16_LR, SCALE = 0.5, 1024.0
CASES = ("every gradient finite", "an inf in the last rank's shard", "a NaN in rank 0's shard")


def _fp16_case(fn, case: int, group=None) -> dict:
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
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
    with CommLedger() if group is None else strict_ledger(group) as ledger:
        scale, err = guard(fn, opt, masters, SCALE, group=group)
    out = {"error": err, "ops": [r.op for r in ledger.records], "scale": scale}
    out["after"] = [m.detach().cpu() for m in masters]
    out["before"] = [b.cpu() for b in before]
    out["stepped"] = [(b - FP16_LR * t).cpu() for b, t in zip(before, grads, strict=True)]
    out["scaled"] = [(b - FP16_LR * SCALE * t).cpu() for b, t in zip(before, grads, strict=True)]
    out["bad_rank"] = bad_rank
    return out


def _fp16_rank(fn) -> dict:
    out = _fp16_cases(None, fn)
    if all(c["error"] is None for c in out["cases"]):
        out["sub"] = on_subgroup(_fp16_cases, fn)
    return out


def _fp16_cases(group, fn) -> dict:
    out = {"info": run_info(), "cases": []}
    for case in range(len(CASES)):
        res = _fp16_case(fn, case, group)
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
    name = getattr(fn, "__name__", "your function")
    world = on_world_and_subgroup(per_rank, name, _check_fp16)
    report_pass(
        f"{name}: unscaled, stepped and kept scale {SCALE:g} when every gradient was finite; "
        f"skipped on every rank and halved the scale when one rank's shard held an inf or a NaN; "
        f"one all-reduce per step; {world} ranks ({describe(per_rank[0]['info'])}) and the "
        f"subgroup {list(SUBGROUP)}"
    )


def _check_fp16(per_rank: list[dict], world: int, name: str) -> None:
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
