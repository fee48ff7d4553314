"""What the check cells of lesson 03 (03_zero2) call: stage 2, and clipping on shards.

The student's ``ZeRO2`` subclass trains on real ranks next to one process, FSDP2 and minizero's
``ZeRO2`` (:mod:`.common_zero`), in fp32, and bit for bit against minizero's ``ZeRO2`` in each
16-bit policy (bf16, fp16, bf16 reduced in fp32), with gradient accumulation in one step.
Beyond the numbers it checks the structure: no full ``p.grad`` after backward, every
reduce-scatter issued during backward, and no more full bucket buffers, nor bytes of them, alive
at once than minizero's ``ZeRO2`` keeps. The references and
the step-by-step comparison: :mod:`.common_zero`.

``check_clip_grad_norm`` runs the student's ``clip_grad_norm_(shards, valid, max_norm, group)``, a
standalone function over this rank's gradient shards as a stage calls it between the
reduce-scatter and the optimizer's step: the global L2 norm from partial sums of squares and one
all-reduce, the padding left out; every shard scaled in place. It runs on real ranks on shards
whose whole is known to every rank, is compared with one process
(``torch.nn.utils.clip_grad_norm_``), and its collectives are counted with a ``CommLedger``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from minizero.analysis.ledger import CommLedger
from minizero.bucket import make_buckets
from minizero.course.checks.common import (
    SUBGROUP,
    CheckFailed,
    allclose,
    check_seed,
    describe,
    guard,
    launch_check,
    on_subgroup,
    on_world_and_subgroup,
    raised_hint,
    rank_device,
    report_pass,
    run_info,
    strict_ledger,
    within,
)
from minizero.course.checks.common_zero import (
    PRECISIONS,
    STEPS,
    check_subgroup,
    fsdp2,
    minizero_build,
    one_process,
    precision_runs,
    results,
    run_all,
    with_subgroup,
)
from minizero.course.checks.compare_zero import check_precisions, check_volume, compare
from minizero.zero2 import ZeRO2

MICRO = (1, 2, 1)  # step 1 accumulates two backwards into the gradient shards


def _observe(model, module: nn.Module) -> dict:
    kept = model.__dict__.pop("_kept", set())
    return {
        # parameters whose p.grad was still set right after the class's gradient hook (the
        # base class replaces p.grad by a ShardedGrad, no memory, at backward end, hiding it later)
        "full_grads": [n for n, p in module.named_parameters() if id(p) in kept],
        "live": getattr(model, "_live_max", None),
        "live_bytes": getattr(model, "_live_bytes_max", None),
    }


def _count_live(model) -> None:
    """After each gradient hook of ``model``: how many full-size bucket buffers are alive, and
    their bytes (the one filling, in ``filling``, and the one in flight, ``in_flight``)."""
    model._live_max = model._live_bytes_max = 0

    def after(p, model=model):
        if p.grad is not None:  # the class's own hook ran: stage 2 has dropped p.grad by now
            model.__dict__.setdefault("_kept", set()).add(id(p))
        live = [g for g in getattr(model, "filling", []) if g is not None]
        flight = getattr(model, "in_flight", None)
        if flight is not None:
            live.append(flight[2])
        model._live_max = max(model._live_max, len(live))
        nbytes = sum(t.untyped_storage().nbytes() for t in live)
        model._live_bytes_max = max(model._live_bytes_max, nbytes)

    for p in model.params:  # registered after the class's own hook, so it runs after it
        p.register_post_accumulate_grad_hook(after)


def _with_live_count(build):
    def wrapped(module):
        model, opt, params = build(module)
        _count_live(model)
        return model, opt, params

    return wrapped


def _zero2_rank(student) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {
        "one process on the whole batch": one_process,
        "torch FSDP2 (reshard_after_forward=False)": fsdp2(False),
        "minizero.zero2.ZeRO2": _with_live_count(minizero_build(ZeRO2)),
    }
    mine = _with_live_count(minizero_build(student))
    out = run_all(refs, mine, rank, world, dev, micro=MICRO, observe=_observe)
    if out["error"] is None:  # 16-bit: the buckets in the reduce dtype, bit for bit
        out.update(
            precision_runs(
                ZeRO2,
                student,
                rank,
                world,
                dev,
                _with_live_count,
                tuple(PRECISIONS),
                observe=_observe,
            )  # fmt: skip
        )
    return with_subgroup(out, ZeRO2, student, micro=MICRO)


def _check_structure(mine: dict, ref: dict, rank: int, precision: str) -> None:
    for k, obs in enumerate(mine["observed"]):
        if obs["full_grads"]:
            raise CheckFailed(
                f"{precision}, rank {rank}, backward {k}: after their gradient hook "
                f"{obs['full_grads']} still hold a full gradient in p.grad; stage 2 keeps "
                "gradients only in the buckets and the shard: set p.grad = None once it is "
                "copied into its bucket."
            )
    live = max(obs["live"] for obs in mine["observed"])
    if live > 2:
        raise CheckFailed(
            f"{precision}, rank {rank}: up to {live} full-size gradient buffers were alive at once "
            "during backward: keep one being filled (self.filling[b.index]) and one in "
            "flight, and free each as it completes."
        )
    got = max(obs["live_bytes"] for obs in mine["observed"])
    want = max(obs["live_bytes"] for obs in ref["observed"])
    if got > want:
        raise CheckFailed(
            f"{precision}, rank {rank}: your bucket buffers held up to {got} bytes at once during "
            f"backward, minizero's ZeRO2 {want}: allocate each (padded,) buffer in the reduce "
            "dtype (self.precision.reduce_dtype) and forget it once its reduce-scatter is done."
        )


def check_zero2(cls, nprocs: int | None = None) -> None:
    """Lesson 03: ``cls`` (a ZeRO2 subclass) must train as one process, FSDP2 and minizero's
    ZeRO2 (gradient accumulation included; bit for bit ZeRO2 under each 16-bit policy), keep no full
    ``p.grad`` after backward, start each bucket's reduce-scatter during backward, and keep no
    more full bucket buffers (two: one filling, one in flight), nor bytes, than ZeRO2 keeps."""
    res_all, world, name = results(_zero2_rank, nprocs, cls)
    shards = (
        "Add each reduce-scattered, averaged chunk into self.grad_shards[b.index] "
        "(add, not copy: backwards accumulate until the step)"
    )
    for rank, res in enumerate(res_all):
        mine, refs = res["mine"], res["refs"]
        _check_structure(mine, refs["minizero.zero2.ZeRO2"], rank, "fp32")
        compare(mine, refs, "minizero.zero2.ZeRO2", rank, world, shards=shards)
        for precision, run in res["prec"].items():
            _check_structure(run["mine"], run["ref"], rank, precision)
    policies = check_precisions(
        res_all,
        "minizero's ZeRO2",
        world,
        hint=" In finish_in_flight: reduce_bucket (given) has divided an fp16 buffer already; "
        "divide out by self.world only if not divides_before_sum(out). In "
        "post_accumulate_grad_hook: the buffer's dtype is self.precision.reduce_dtype.",
    )
    res = res_all[0]
    mine = res["mine"]
    for step, (recs, marks) in enumerate(zip(mine["records"], mine["marks"], strict=True)):
        starts = [i for i, label in marks if label == "backward start"]
        ends = [i for i, label in marks if label == "backward end"]
        if len(ends) != len(starts):
            raise CheckFailed(
                f"step {step}: {len(starts)} backwards but {len(ends)} 'backward end' marks: "
                "keep the provided self.queue_backward_end() call at the top of "
                "post_accumulate_grad_hook"
            )
        rs = [i for op, _, _, i, _ in recs if op == "reduce_scatter"]
        inside = [i for i in rs if any(b < i < e for b, e in zip(starts, ends, strict=True))]
        if len(inside) != len(rs):
            raise CheckFailed(
                f"step {step}: {len(inside)} of {len(rs)} reduce-scatters started during backward, "
                f"the others after it ended: start each bucket's reduce-scatter from the hook, as "
                "soon as its last gradient is in (self.reduce_bucket(b)), so it overlaps backward."
            )
    live = max(obs["live"] for obs in mine["observed"])
    volume = check_volume(
        mine,
        res["refs"]["minizero.zero2.ZeRO2"],
        "minizero.zero2.ZeRO2",
        "one reduce-scatter of every bucket per backward, one all-gather per step",
    )
    psi = res["psi"]
    check_subgroup(res_all, world, name)  # last: the mistakes above name themselves
    report_pass(
        f"{name}: gradient shards and parameters equal {', '.join(res['refs'])} for {STEPS} "
        f"Adam steps (one of them over 2 micro-batches) on {world} ranks "
        f"({describe(res['info'])}); bit for bit minizero's ZeRO2 under {', '.join(policies)} "
        f"(SGD); no p.grad after backward; "
        f"every reduce-scatter started during backward; at most {live} full bucket buffers "
        f"alive (not counting the backend's own copies); moved {volume} elements per step = "
        f"{volume / psi:.3f} Ψ"
    )


# -- clipping: the global gradient norm over shards, the padding left out --------------------------
SHAPES = [(37, 13), (37,), (29, 37), (29,), (7, 29), (7,), (7,)]  # the MLP's, 1,837 elements
CLIP_CAP_MB, PADDING_VALUE = 0.002, 3.0
# A right answer rounds its float32 norm and scaled shards a few times (each 2^-24 relative) from
# the float64 reference; a wrong one (padding counted, a local norm, norms summed, scaling up) is
# off by 1% or more. 3e-5 sits between them, 100x from each side.
CLIP_RTOL = 3e-5


def _grads() -> list[torch.Tensor]:
    """One fixed full (averaged) gradient per parameter of SHAPES, the same on every rank: whole
    multiples of 1/64 below 0.2 in size, so every square is a multiple of 2^-12 and every sum of
    them (< 70) is exact in float32 in any order (any ranks, kernels, threads): a right answer's
    norm is sqrt of the exact sum, one rounding from the float64 reference."""
    g = torch.Generator().manual_seed(check_seed(7))
    return [torch.randint(-12, 13, s, generator=g).float() / 64 for s in SHAPES]


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
    out = _clip_cases(None, fn)
    if all(c["error"] is None for c in out["cases"]):
        out["sub"] = on_subgroup(_clip_cases, fn)
    return out


def _clip_cases(group, fn) -> dict:
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    norm = torch.cat([g.reshape(-1) for g in _grads()]).norm().item()
    out = {"info": run_info(), "norm": norm, "cases": []}
    for max_norm in (0.5 * norm, 2.0 * norm):  # clips; does not
        shards, valid = _chunks(_grads(), world, rank)
        shards = [s.to(dev) for s in shards]
        with CommLedger() if group is None else strict_ledger(group) as ledger:
            got, err = guard(fn, shards, list(valid), max_norm, group=group)
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
    name = getattr(fn, "__name__", "your function")
    world = on_world_and_subgroup(per_rank, name, _check_clip)
    report_pass(
        f"{name}: the global norm {per_rank[0]['norm']:.6g} and the clipped shards equal "
        f"torch.nn.utils.clip_grad_norm_ on the whole gradient (clipping and not), padding left "
        f"out, one all-reduce per call, {world} ranks ({describe(per_rank[0]['info'])}) and the "
        f"subgroup {list(SUBGROUP)}"
    )


def _check_clip(per_rank: list[dict], world: int, name: str) -> None:
    for rank, res in enumerate(per_rank):
        for case in res["cases"]:
            where = f"on rank {rank} of {world}, max_norm {case['max_norm']:.4g}"
            if case["error"]:
                raise CheckFailed(
                    f"{name} raised {where}: {case['error']}.{raised_hint(world, case['error'])}"
                )
            if case["ops"] != ["all_reduce"]:
                raise CheckFailed(
                    f"{name} issued {case['ops'] or 'no collective'} {where}: add up the squares "
                    "of all this rank's shards into one number, then one all_reduce "
                    "(minizero.collectives) sums the ranks' numbers"
                )
            params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
            for p, g in zip(params, _grads(), strict=True):
                p.grad = g.double()
            want = float(torch.nn.utils.clip_grad_norm_(params, case["max_norm"]))
            got = case["norm"]
            err = abs(got - want) if isinstance(got, float) else float("inf")
            if not within(err, CLIP_RTOL * want, "03 clip norm"):
                hint = _clip_hint(got, want, rank, world) if got is not None else ""
                raise CheckFailed(
                    f"{name} returned norm {got} {where}; torch.nn.utils.clip_grad_norm_ on the "
                    f"whole gradient gives {want:.6g}.{hint}"
                )
            ref, _ = _chunks([p.grad for p in params], world, rank)
            for i, (g, w) in enumerate(zip(case["shards"], ref, strict=True)):
                w = w[: g.numel()]
                if not allclose(g, w, CLIP_RTOL, 0.0, "03 clip shards"):
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
