"""How the ZeRO checks of lessons 02-04 compare a student's run with its references: the
tolerances (and why each holds on any machine), step by step comparison of losses, gradient
shards and parameters, the bf16 runs' structure, and the ledger's volume. The runs themselves are
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
# The bf16 runs check what only bf16 has, by structure (compare_bf16): the optimizer's fp32
# masters, cast to bf16, ARE the working copy, on every rank, after every step. Their numbers are
# not compared with a tolerance: a right answer that orders its bf16 sums otherwise differs by
# 2^-8 of the terms, and Adam turns that into anything up to lr; the float64 run above already
# holds the arithmetic to 1e-8.


# -- comparing -------------------------------------------------------------------------------------
def close(got: float, want: float, rtol: float, atol: float) -> bool:
    """``|got - want| <= atol + rtol |want|``, and False whenever either is NaN or infinite."""
    if not (math.isfinite(got) and math.isfinite(want)):
        return False
    return within(abs(got - want), atol + rtol * abs(want), "ZeRO loss")


FP32_HINT = (
    " A difference this small is float32's rounding: this check trains in float64 (see "
    "common_zero.RTOL), and a tensor made without dtype= (torch.zeros(n)) is float32: make your "
    "buffers in the gradient's dtype (p.grad.dtype)."
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


def compare_bf16(per_rank: list[dict], ref_name: str, hint: str) -> None:
    """The bf16 runs (``train(..., precision="bf16")`` of every rank): the gradients the optimizer
    stepped have the reference's shapes; after every step each rank's bf16 working copy is the
    same, and equals, over this rank's range, its fp32 masters cast to bf16, bit for bit."""
    for step in range(len(per_rank[0]["mine"]["params"])):
        for rank, res in enumerate(per_rank):
            mine = res["mine"]
            got = [tuple(t.shape) for t in mine["seen"][step]]
            want = [tuple(t.shape) for t in res["ref"]["seen"][step]]
            if got != want:
                raise CheckFailed(
                    f"bf16, step {step}, rank {rank}: the optimizer stepped with gradients of "
                    f"shapes {got}, {ref_name} with {want} (one (shard,) per bucket)"
                )
            first = per_rank[0]["mine"]["params"][step]
            for name, t in mine["params"][step].items():
                if not torch.equal(t, first[name]):
                    raise CheckFailed(
                        f"bf16, step {step}: parameter {name!r} differs between rank 0 and rank "
                        f"{rank} after the step: every rank must end the step with the same "
                        f"working copy (all-gather every rank's chunk).{hint}"
                    )
            for name, lo, hi, master in mine["masters"][step]:
                working = mine["params"][step][name].reshape(-1)[lo:hi]
                if not torch.equal(working, master.to(torch.bfloat16).double()):
                    diff = (working - master).abs().max().item()
                    raise CheckFailed(
                        f"bf16, step {step}, rank {rank}: parameter {name!r}, elements [{lo}, "
                        f"{hi}) (this rank's) differ by up to {diff:.3g} from the fp32 master the "
                        f"optimizer stepped, cast to bf16.{hint}"
                    )


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
