"""What the check cell of lesson 03's stage-2 exercise (03_zero2) calls: ``check_zero2``.

The student's ``ZeRO2`` subclass trains on real ranks next to one process, FSDP2 and minizero's
``ZeRO2`` (:mod:`minizero.checks_zero`), in fp32 and again in bf16 against minizero's ``ZeRO2`` in
bf16, with gradient accumulation in one step. Beyond the numbers it checks the structure: no full
``p.grad`` after backward, every reduce-scatter issued during backward, and no more full bucket
buffers, nor bytes of them, alive at once than minizero's ``ZeRO2`` keeps.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from minizero.checks import CheckFailed, describe, guard, rank_device, report_pass
from minizero.checks_zero import (
    BF16_ATOL,
    BF16_RTOL,
    STEPS,
    check_volume,
    compare,
    fsdp2,
    minizero_build,
    one_process,
    results,
    run_all,
    train,
)
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
    their bytes (the one being filled, ``_filling``, and the one in flight, ``_in_flight``)."""
    model._live_max = model._live_bytes_max = 0

    def after(p, model=model):
        if p.grad is not None:  # the class's own hook ran: stage 2 has dropped p.grad by now
            model.__dict__.setdefault("_kept", set()).add(id(p))
        live = list(getattr(model, "_filling", {}).values())
        flight = getattr(model, "_in_flight", None)
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
    if out["error"] is None:  # bf16: the buckets hold bf16 gradients, the shards too
        kw = dict(micro=MICRO, observe=_observe, precision="bf16")
        ref = _with_live_count(minizero_build(ZeRO2, "bf16"))
        out["bf16_ref"] = train(ref, rank, world, dev, **kw)
        bf16 = _with_live_count(minizero_build(student, "bf16"))
        out["bf16"], out["error"] = guard(train, bf16, rank, world, dev, **kw)
    return out


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
            "during backward: keep one being filled (self._filling) and one in flight, and free "
            "each as it completes."
        )
    got = max(obs["live_bytes"] for obs in mine["observed"])
    want = max(obs["live_bytes"] for obs in ref["observed"])
    if got > want:
        raise CheckFailed(
            f"{precision}, rank {rank}: your bucket buffers held up to {got} bytes at once during "
            f"backward, minizero's ZeRO2 {want}: allocate each (padded,) buffer in the gradient's "
            "dtype (p.grad.dtype) and forget it once its reduce-scatter is done."
        )


def check_zero2(cls, nprocs: int | None = None) -> None:
    """Lesson 03: ``cls`` (a ZeRO2 subclass) must train as one process, FSDP2 and minizero's
    ZeRO2 (gradient accumulation included; bf16 too, against ZeRO2 in bf16), keep no full
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
        _check_structure(res["bf16"], res["bf16_ref"], rank, "bf16")
        compare(
            res["bf16"],
            {"minizero ZeRO2 in bf16": res["bf16_ref"]},
            "minizero ZeRO2 in bf16",
            rank,
            world,
            shards=f"In bf16. {shards}",
            rtol=BF16_RTOL,
            atol=BF16_ATOL,
        )
    res = res_all[0]
    mine = res["mine"]
    for step, (recs, marks) in enumerate(zip(mine["records"], mine["marks"], strict=True)):
        starts = [i for i, label in marks if label == "backward start"]
        ends = [i for i, label in marks if label == "backward end"]
        if len(ends) != len(starts):
            raise CheckFailed(
                f"step {step}: {len(starts)} backwards but {len(ends)} 'backward end' marks: keep "
                "the provided self._queue_backward_end() call at the top of _on_grad_ready"
            )
        rs = [i for op, _, _, i, _ in recs if op == "reduce_scatter"]
        inside = [i for i in rs if any(b < i < e for b, e in zip(starts, ends, strict=True))]
        if len(inside) != len(rs):
            raise CheckFailed(
                f"step {step}: {len(inside)} of {len(rs)} reduce-scatters started during backward, "
                f"the others after it ended: start each bucket's reduce-scatter from the hook, as "
                "soon as its last gradient is in (self._launch(b)), so it overlaps backward."
            )
    live = max(obs["live"] for obs in mine["observed"])
    volume = check_volume(
        mine,
        res["refs"]["minizero.zero2.ZeRO2"],
        "minizero.zero2.ZeRO2",
        "one reduce-scatter of every bucket per backward, one all-gather per step",
    )
    psi = res["psi"]
    report_pass(
        f"{name}: gradient shards and parameters equal {', '.join(res['refs'])} for {STEPS} "
        f"Adam steps (one of them over 2 micro-batches) on {world} ranks "
        f"({describe(res['info'])}), and minizero's ZeRO2 in bf16; no p.grad after backward; "
        f"every reduce-scatter started during backward; at most {live} full bucket buffers "
        f"alive (not counting the backend's own copies); moved {volume} elements per step = "
        f"{volume / psi:.3f} Ψ"
    )
