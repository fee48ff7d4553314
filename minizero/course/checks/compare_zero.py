"""How the ZeRO checks of lessons 02-04 compare a student's run with its references: the
tolerances (and why each holds on any machine), step by step comparison of losses, gradient
shards and parameters, the 16-bit runs (bit for bit, and their masters' structure), and the
ledger's volume. The runs themselves are
built in :mod:`.common_zero`."""

from __future__ import annotations

import math

import torch

from minizero.course.checks.common import CheckFailed, allclose, factor_hint, within, worst

# The "fp32" runs train in float64 (minizero's precision="fp64", the references in float64 too),
# so that a right answer sits ~1e-16 from every reference whatever the order of its sums (ranks,
# kernels, threads). Why 1e-8: Adam's step lr*m/(sqrt(v)+eps) changes by at most lr/eps = 1e6
# times a change in the gradient (at a gradient near 0), and these gradients are sums of < 100
# terms below 1, each sum off by < 100 * 1.1e-16: under 1e-8 after the step, at every step. A
# wrong answer (a sum for an average, a stale shard, a missed bucket) is off by ~lr = 1e-2.
RTOL, ATOL = 1e-8, 1e-8  # float64 parameters after the step, against every reference
# The gradients themselves are sums, off by < 100 * 1.1e-16 * (terms < 1) = 1.1e-14: 1e-12. (A
# float32 buffer in between rounds them by 6e-8 of their size: it fails here, named.)
GRAD_RTOL, GRAD_ATOL = 1e-12, 1e-12
# The 16-bit runs (bf16, fp16, bf16 reduced in fp32) are compared bit for bit against minizero's
# class in the same policy, trained with SGD (compare_precision, below, says why bit for bit), and
# by structure (compare_masters): the optimizer's fp32 masters, cast to the working dtype, ARE the
# working copy, on every rank, after every step.


# -- comparing -------------------------------------------------------------------------------------
def close(got: float, want: float, rtol: float, atol: float) -> bool:
    """``|got - want| <= atol + rtol |want|``, and False whenever either is NaN or infinite."""
    if not (math.isfinite(got) and math.isfinite(want)):
        return False
    return within(abs(got - want), atol + rtol * abs(want), "ZeRO loss")


FP32_HINT = (
    " A difference this small is float32's rounding: this check trains in float64 (see "
    "common_zero.RTOL), and a tensor made without dtype= (torch.zeros(n)) is float32: make your "
    "buffers in the policy's reduce dtype (self.precision.reduce_dtype)."
)


def rounding_hint(diff: float, hint: str) -> str:
    """``hint``, or :data:`FP32_HINT` for a difference float32 makes (a wrong step makes ~1e-2)."""
    return FP32_HINT if 0 < diff < 1e-4 else hint


def where_in_bucket(bucket_layout: dict, rank: int, k: int) -> str:
    """Element ``k`` of rank ``rank``'s chunk: which parameter (and which of its elements)."""
    flat = rank * bucket_layout["shard"] + k
    for name, off, n in bucket_layout["params"]:
        if off <= flat < off + n:
            return f"element {flat - off} of {name!r}"
    return "padding (zeros that no parameter owns)"


def compare(
    mine: dict,
    refs: dict[str, dict],
    stage_ref: str,
    rank: int,
    world: int,
    *,
    shards: str,
    params: str = "",
    loss: str = "",
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    """Step by step, stop at the first difference: the local loss (against the data-parallel
    references), the gradient shards the optimizer stepped with (against ``refs[stage_ref]``),
    then every parameter after the step (against every reference). The strings are hints.
    A NaN or an infinity anywhere is a difference."""
    for step in range(len(mine["params"])):
        for ref_name, ref in refs.items():
            want, got = ref["loss"][step], mine["loss"][step]
            if not ref_name.startswith("one process") and not close(got, want, rtol, atol):
                what = (
                    ""
                    if math.isfinite(got)
                    else " A loss that is not finite: the forward read memory never filled."
                )
                raise CheckFailed(
                    f"step {step}, rank {rank}: the forward gave loss {got:.7g}, {ref_name} "
                    f"{want:.7g}: the parameters used in forward were not the right ones.{what}"
                    f"{loss}"
                )
        g_rtol, g_atol = (GRAD_RTOL, GRAD_ATOL) if (rtol, atol) == (RTOL, ATOL) else (rtol, atol)
        compare_shards(step, mine, refs[stage_ref], stage_ref, rank, world, shards, g_rtol, g_atol)
        for ref_name, ref in refs.items():
            for name, want in ref["params"][step].items():
                got = mine["params"][step].get(name)
                if got is None:
                    raise CheckFailed(
                        f"step {step}, rank {rank}: no parameter {name!r} after the step"
                    )
                if not allclose(got, want, rtol, atol, f"ZeRO params vs {ref_name}"):
                    diff = (got - want).abs().max().item()
                    raise CheckFailed(
                        f"step {step}, rank {rank}, parameter {name!r} after optimizer.step(): max "
                        f"|yours - {ref_name}| = {diff:.3g} (tolerance {atol:g} + {rtol:g} * "
                        f"|ref|).{rounding_hint(diff, params)}"
                    )


def compare_masters(per_rank: list[dict], precision: str, ref_name: str, hint: str) -> None:
    """A 16-bit run (``train(..., precision=precision)`` of every rank, as ``{"mine", "ref"}``):
    the gradients the optimizer stepped have the reference's shapes; after every step each rank's
    16-bit working copy is the same, and equals, over this rank's range, its fp32 masters cast to
    the working dtype, bit for bit."""
    for step in range(len(per_rank[0]["mine"]["params"])):
        for rank, res in enumerate(per_rank):
            mine = res["mine"]
            got = [tuple(t.shape) for t in mine["seen"][step]]
            want = [tuple(t.shape) for t in res["ref"]["seen"][step]]
            if got != want:
                raise CheckFailed(
                    f"{precision}, step {step}, rank {rank}: the optimizer stepped with gradients "
                    f"of shapes {got}, {ref_name} with {want} (one (shard,) per bucket)"
                )
            first = per_rank[0]["mine"]["params"][step]
            for name, t in mine["params"][step].items():
                if not torch.equal(t, first[name]):
                    raise CheckFailed(
                        f"{precision}, step {step}: parameter {name!r} differs between rank 0 and "
                        f"rank {rank} after the step: every rank must end the step with the same "
                        f"working copy (all-gather every rank's chunk).{hint}"
                    )
            for name, lo, hi, master in mine["masters"][step]:
                working = mine["params"][step][name].reshape(-1)[lo:hi]
                if not torch.equal(working, master.to(mine["param_dtype"]).double()):
                    diff = (working - master).abs().max().item()
                    raise CheckFailed(
                        f"{precision}, step {step}, rank {rank}: parameter {name!r}, elements "
                        f"[{lo}, {hi}) (this rank's) differ by up to {diff:.3g} from the fp32 "
                        f"master the optimizer stepped, cast to {mine['param_dtype']}.{hint}"
                    )


# The 16-bit runs (common_zero.PRECISIONS) are compared bit for bit, by construction. The
# student's class is a subclass of minizero's with one or two methods rewritten, trained in the
# same process right after minizero's, from the same weights, on the same data, by the same
# kernels: every local gradient is the same bits. What the exercises write is the reduction, and
# minizero's is one fixed sequence: copy the gradients into a bucket in the policy's reduce_dtype,
# divide by N before the sum in fp16 (so that N scaled gradients cannot overflow) or after it
# otherwise (precision.divides_before_sum), let the backend sum (gloo's and NCCL's order depends
# only on the sizes and the ranks, the same for both), add into the shard. A right answer does
# exactly that, so every gradient shard, every loss and every parameter after the step is equal.
# A tolerance could not do better: a different order of a 16-bit sum moves a result by 2^-8 (bf16)
# or 2^-11 (fp16) of its terms, and the nearest wrong answer, a factor of 2 or N, by 1/2; no
# bound sits 100x from both. A difference is therefore either a wrong factor, named below, or a
# different arithmetic (a bucket in the wrong dtype, a division on the wrong side of the sum).
def compare_precision(
    mine: dict, ref: dict, precision: str, ref_name: str, rank: int, world: int, hint: str
) -> None:
    """Step by step, the loss, then the gradient shards the (SGD) optimizer stepped with, then
    every parameter after the step, each equal to ``ref``'s bit for bit. ``hint``: what the
    lesson's arithmetic is, for a difference of rounding."""
    where = f"under precision={precision!r}"
    for step in range(len(ref["params"])):
        got, want = mine["loss"][step], ref["loss"][step]
        if not within(_bits(torch.tensor(got), torch.tensor(want)), 0.0, f"ZeRO {precision} loss"):
            raise CheckFailed(
                f"{where}, step {step}, rank {rank}: the forward gave loss {got:.7g}, {ref_name} "
                f"{want:.7g}: the parameters used in forward were not the same"
            )
        got_all, want_all = mine["seen"][step], ref["seen"][step]
        for i, (g, w) in enumerate(zip(got_all, want_all, strict=False)):
            err = _bits(g, w) if g.shape == w.shape else math.inf
            if not within(err, 0.0, f"ZeRO {precision} grad shards (bit-equal)"):
                raise CheckFailed(
                    f"{where}, step {step}, rank {rank}, bucket {i}: your gradient shards are "
                    f"{_scale_of(g, w, precision, ref_name, world, hint)}"
                )
        if len(got_all) != len(want_all):
            raise CheckFailed(
                f"{where}, step {step}, rank {rank}: the optimizer stepped with {len(got_all)} "
                f"gradients, {ref_name} with {len(want_all)} (one flat shard per bucket)"
            )
        for name, w in ref["params"][step].items():
            g = mine["params"][step].get(name)
            err = math.inf if g is None or g.shape != w.shape else _bits(g, w)
            if not within(err, 0.0, f"ZeRO {precision} params (bit-equal)"):
                raise CheckFailed(
                    f"{where}, step {step}, rank {rank}: parameter {name!r} after the SGD step "
                    f"differs from {ref_name}'s by up to {err:.3g} (the gradient shards were the "
                    f"same): the update must be the reference's, bit for bit.{hint}"
                )


def _bits(got: torch.Tensor, want: torch.Tensor) -> float:
    """0.0 when ``got`` and ``want`` hold the same values (NaN where NaN), else the largest
    difference (infinite where only one is NaN or infinite)."""
    same = (got == want) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return 0.0
    diff = (got - want).abs()[~same].nan_to_num(nan=math.inf)
    return float(diff.max())


def _scale_of(got, want, precision: str, ref_name: str, world: int, hint: str) -> str:
    """How ``got`` relates to ``want``: a factor that names the usual mistake, or rounding."""
    if got.shape != want.shape:
        return f"of shape {tuple(got.shape)}, {ref_name}'s {tuple(want.shape)} (this rank's chunk)"
    ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
    diff = float((got - want).abs().nan_to_num(nan=math.inf).max())
    head = f"{ratio:.2f}x minizero's"
    if abs(ratio * world - 1) < 0.05:
        return (
            f"{head} (1/{world}): divided by the world twice? In fp16 the bucket is divided by "
            "N before the sum (minizero.precision.divides_before_sum(buffer) is True): then not "
            f"again after it.{hint}"
        )
    if abs(ratio - world) < 0.05 * world:
        return (
            f"{head}: divided by the world never? The collective sums; divide by N once, before "
            f"the sum in fp16 (minizero.precision.divides_before_sum), after it otherwise.{hint}"
        )
    if abs(ratio - 1) < 0.05:
        dtype = {"fp16": "fp16"}.get(precision, "bf16")
        return (
            f"{head}, but not bit for bit (max difference {diff:.3g}, {dtype}'s rounding): "
            f"minizero's arithmetic is the same in every policy, and yours must be too: the "
            f"bucket in the policy's reduce dtype (self.precision.reduce_dtype, which need not "
            f"be p.grad's), divided by N before the sum in fp16 "
            f"(minizero.precision.divides_before_sum(buffer)), after it otherwise.{hint}"
        )
    return f"{head} (max difference {diff:.3g}).{hint}"


def compare_shards(
    step: int, mine: dict, ref: dict, ref_name: str, rank: int, world: int, what: str, rtol, atol
) -> None:
    """The (shard,) gradients the optimizer stepped with, bucket by bucket, element by element."""
    got_all, want_all = mine["seen"][step], ref["seen"][step]
    if len(got_all) != len(want_all):
        raise CheckFailed(
            f"step {step}, rank {rank}: the optimizer stepped with {len(got_all)} gradients, "
            f"{ref_name} with {len(want_all)} (one flat shard per bucket); {what}"
        )
    for i, (got, want) in enumerate(zip(got_all, want_all, strict=True)):
        if got.shape != want.shape:
            raise CheckFailed(
                f"step {step}, rank {rank}, bucket {i}: the gradient the optimizer saw has shape "
                f"{tuple(got.shape)}, {ref_name}'s {tuple(want.shape)} (this rank's chunk: "
                f"(shard,)); {what}"
            )
        bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)  # NaN: not close
        if not within(*worst(got, want, rtol, atol), f"ZeRO grad shards vs {ref_name}"):
            k = int(bad.nonzero()[0])
            ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
            diff = float((got - want).abs().max())
            hint = factor_hint(ratio, world) or rounding_hint(diff, f" {what}.")
            if abs(ratio) < 0.05:
                hint = " Yours is ~0: did the reduced chunk reach this rank's shard?"
            raise CheckFailed(
                f"step {step}, rank {rank}, bucket {i}: the averaged gradient the optimizer "
                f"stepped with differs from {ref_name}'s at {int(bad.sum())} of {got.numel()} "
                f"elements; first at chunk element {k} = "
                f"{where_in_bucket(ref['layout'][i], rank, k)}: yours {got[k].item():.6g}, "
                f"reference {want[k].item():.6g}.{hint}"
            )


def by_op(records: list) -> dict[str, int]:
    """Elements per op in a step's records (the payload S, not the paper's volume)."""
    out: dict[str, int] = {}
    for op, numel, *_ in records:
        out[op] = out.get(op, 0) + numel
    return out


def check_volume(
    mine: dict, ref: dict, ref_name: str, what: str, at_most: str = "", too_many: str = ""
) -> int:
    """Step by step, the elements each op moved (the paper's volume: no all-reduce is allowed)
    must equal ``ref``'s; for the ops in ``at_most``, not exceed them. ``too_many``: the hint when
    nothing fell short of ``ref`` (something moved more). Returns the last step's total."""
    for step, (recs, ref_recs) in enumerate(zip(mine["records"], ref["records"], strict=True)):
        got, want = by_op(recs), by_op(ref_recs)
        ok = set(got) == set(want) and all(
            got[op] <= want[op] if op in at_most else got[op] == want[op] for op in want
        )
        if not ok:
            short = any(
                op not in got or (got[op] < n and op not in at_most) for op, n in want.items()
            )  # an op missing or moving less than it should: collectives the ledger did not see?
            hint = "Use minizero.collectives so the ledger sees them." if short else too_many
            raise CheckFailed(
                f"step {step}: the CommLedger saw {got or 'no collective'} (elements per op), "
                f"{ref_name} {want}: {what}. {hint}".rstrip()
            )
    return sum(by_op(mine["records"][-1]).values())


def check_precisions(
    per_rank: list[dict], ref_name: str, world: int, master_hint: str | None = "", hint: str = ""
) -> list[str]:
    """Every rank's 16-bit runs (``r["prec"]``, :func:`.common_zero.precision_runs`): their
    structure (:func:`compare_masters`; not with ``master_hint=None``: stage 3, whose recorded
    parameters are the masters themselves), then bit for bit (:func:`compare_precision`).
    Returns the policies compared."""
    names = list(per_rank[0]["prec"])
    for precision in names:
        runs = [r["prec"][precision] for r in per_rank]
        if any(not seen for r in runs for seen in r["ref"]["seen"]):  # the check's own fault
            raise RuntimeError(
                f"under {precision!r} minizero's class skipped a step (an fp16 inf): nothing to "
                "compare; lower common_zero.FP16_SCALE"
            )
        if master_hint is not None:
            compare_masters(runs, precision, ref_name, master_hint)
        for rank, run in enumerate(runs):
            compare_precision(run["mine"], run["ref"], precision, ref_name, rank, world, hint)
    return names
