"""The check cell of lesson 09 (09_capstone): ``check_train``, and the :class:`LoopWatch` that
both the check and the lesson's lab watch a training loop with.

The student's ``train(cfg, stage, group=None)`` is nanoGPT's loop at a ZeRO stage, on this rank:
the model, ``minizero.parallelize``, nanoGPT's AdamW, schedule and clipping, micro-batches with
the gradients reduced on the last one only, an evaluation every ``eval_interval`` iterations on
every rank, and the whole state dict at the end. The check runs it at stages 0, 1, 2 and 3 in one
launch of real ranks on a tiny configuration (:func:`tiny_config`), then on the subgroup [0, 1]
of the world at stage 3 under a ledger that refuses a collective on any other group, and compares
it with one process running minizero's own loop (``minizero.tools.train.single_process``, plain
PyTorch, on the same rows). The contract of every check: :mod:`.common`.

What the loop did is seen from outside it (:class:`LoopWatch`, torch's global hooks; the loop is
not changed): per optimizer step, the learning rate of each param group, the squared norm of the
gradients stepped, and each backward since the step before (the gradient that reached the loss,
1/micro-batches when the loss is scaled, and whether that backward reduced the gradients). Each
mistake is named from what it is, not from its effect on the loss: with Adam, which divides
out a gradient's scale, and clipping, which caps it, a loss not divided by the micro-batches
trains almost as the right one does. The forwards run in lockstep: each waits, through the
store, for every rank's, and if one rank evaluates while another trains, every rank raises
:class:`OutOfStep` at once, naming it (at stage 3 that loop would otherwise wait forever in the
next all-gather).

Tolerances. The runs and one process see the same rows; what differs is float32 rounding: sums in
another order (the ranks' gradients averaged, a mean over the ranks' rows), which Adam's division
by the gradients' running magnitude carries into the weights. ``python -m minizero margins``
measures it (the comparison "09 train loss"): the largest relative difference of a logged loss
from one process's, over stages, seeds, world sizes and CPU kernels, is about 2e-7 at this
size; ``RTOL`` = 1e-4 is more than 100x that. The mistakes that remain for it after the named
ones (a loss logged for the last micro-batch only, the wrong rows) move a loss by percents. The
learning rates are compared to 1e-9 (the same arithmetic), the clipped norm to 1e-3 of
``grad_clip`` (clip_grad_norm_ scales by ``max_norm / (norm + 1e-6)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from minizero.course.checks.common import (
    MIN_WORLD,
    SUBGROUP,
    CheckFailed,
    check_seed,
    check_timeout,
    describe,
    guard,
    launch_check,
    on_subgroup,
    raised_hint,
    report_pass,
    run_info,
    strict_ledger,
    subgroup_failure,
    within,
)
from minizero.course.checks.loop_watch import (  # noqa: F401 (lesson09.LoopWatch: the lab's)
    LOCKSTEP_S,
    LoopWatch,
    OutOfStep,
    as_floats,
    state_summary,
)

RTOL = 1e-4  # a logged or evaluated loss against one process's: the module's docstring
LR_RTOL = 1e-9  # the learning rate against get_lr(it, cfg): the same arithmetic
CLIP_RTOL = 1e-3  # the gradient's norm at the step against cfg.grad_clip
STAGES = (0, 1, 2, 3)
SUB_STAGE = 3  # the subgroup's run: the stage whose forward is itself collective


def tiny_config(world: int):
    """The check's run: nanoGPT's loop on a 2-layer model of width 16, 4 iterations of 2
    micro-batches, each a global batch that ``world`` ranks and the subgroup's 2 both split.
    ``grad_clip`` binds at every step (the gradients' norm is about 0.6), the schedule changes
    the learning rate at every step, evaluations at iterations 0, 2 and 4."""
    from minizero.tools.train import TrainConfig

    return TrainConfig(n_layer=2, n_head=2, n_embd=16, block_size=16,
                       batch_size=math.lcm(world, len(SUBGROUP)), gradient_accumulation_steps=2,
                       max_iters=4, warmup_iters=2, learning_rate=1e-2, min_lr=1e-3,
                       grad_clip=0.1, eval_interval=2, eval_iters=1, seed=check_seed(1337),
                       sample_tokens=0, val_full=False)  # fmt: skip


def _one_stage(fn, cfg, stage: int, group=None) -> dict:
    """The student's loop at ``stage`` under a :class:`LoopWatch`; what it did and returned."""
    with LoopWatch(group, norms=True, lockstep_s=min(LOCKSTEP_S, check_timeout(180.0) / 3)) as w:
        value, err = guard(fn, cfg, stage, group=group)
    res = {"error": err, "steps": w.steps, "forwards": w.forwards, "wrapped_at": w.stage}
    if err is not None:
        return res
    if not isinstance(value, Mapping) or not {"loss", "evals", "state_dict"} <= set(value):
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        res["error"] = f'returned {got}, not a dict with "loss", "evals" and "state_dict"'
        return res
    conv, err = guard(lambda: (as_floats(value["loss"]), as_floats(value["evals"])))
    if err is not None:
        res["error"] = f'"loss" or "evals" is not a list of numbers ({err})'
        return res
    res["loss"], res["evals"] = conv
    res["state"] = state_summary(value["state_dict"], cfg)
    return res


def _agree(name: str, ok: bool, group=None) -> bool:
    """Every member of ``group`` says whether its stage ran, through the store (a collective could
    pair with one a failed loop left behind); True when all did."""
    c10d = dist.distributed_c10d
    store = c10d._get_default_store()
    members = dist.get_process_group_ranks(group or c10d._get_default_group())
    key = f"minizero/check09/{name}"
    store.set(f"{key}/{dist.get_rank()}", "1" if ok else "0")
    try:
        store.wait([f"{key}/{r}" for r in members], timedelta(seconds=check_timeout(180.0) / 3))
    except RuntimeError:
        return False
    return all(store.get(f"{key}/{r}") == b"1" for r in members)


def _rank(fn, cfg) -> dict:
    out = {"info": run_info(), "stages": {}}
    for stage in STAGES:
        res = out["stages"][stage] = _one_stage(fn, cfg, stage)
        if not _agree(f"stage{stage}", res["error"] is None):
            return out  # a rank failed: the others stop with it
    out["sub"] = on_subgroup(_sub, fn, cfg)
    return out


def _sub(group, fn, cfg) -> dict:
    with strict_ledger(group):
        return {"stages": {SUB_STAGE: _one_stage(fn, cfg, SUB_STAGE, group)}}


# -- the judgement, in the kernel ------------------------------------------------------------------
def _syncs(pattern: list[bool], micro: int) -> str | None:
    """What is wrong with the backwards' sync flags of one step, or None."""
    if pattern == [False] * (micro - 1) + [True]:
        return None
    if pattern == [True] + [False] * (micro - 1):
        return (
            "the gradients were reduced on the FIRST micro-batch and the last ran under "
            "no_sync(): the later micro-batches' gradients stay on their rank, never reduced, and "
            "the ranks step with different gradients. Reduce on the last: no_sync() on every "
            "micro-batch but the last."
        )
    if not pattern[-1]:
        return (
            "the last micro-batch's backward ran under no_sync(): its gradients were never "
            "reduced over the ranks. no_sync() goes on every micro-batch but the last."
        )
    return (
        f"{sum(pattern)} of the {micro} backwards reduced the gradients: reduce on the last "
        "micro-batch only and wrap the others in model.no_sync(), which accumulates locally "
        "(torch DDP's way; nanoGPT's require_backward_grad_sync), or every micro-batch pays "
        "a whole gradient reduction."
    )


def _steps(per_rank: list[dict], cfg, stage: int) -> None:
    """Micro-batches, loss scaling, sync, schedule and clipping, from what the watch saw."""
    from minizero.tools.train import get_lr

    micro = cfg.gradient_accumulation_steps
    for rank, r in enumerate(per_rank):
        if r["wrapped_at"] != stage:
            what = "never went through minizero.parallelize" if r["wrapped_at"] is None else (
                f"was wrapped at stage {r['wrapped_at']}")  # fmt: skip
            raise CheckFailed(f"asked for stage {stage}, the model of rank {rank} {what}: "
                              "minizero.parallelize(model, stage, optimizer).")  # fmt: skip
        if len(r["steps"]) != cfg.max_iters:
            raise CheckFailed(f"rank {rank} called opt.step() {len(r['steps'])} times; "
                              f"cfg.max_iters = {cfg.max_iters} steps.")  # fmt: skip
        for it, step in enumerate(r["steps"]):
            where = f"rank {rank}, iteration {it}"
            grads = [g for g, _ in step["backwards"]]
            if len(grads) != micro:
                raise CheckFailed(
                    f"{where}: {len(grads)} backward(s) through the parallelized model before "
                    f"opt.step(); cfg.gradient_accumulation_steps = {micro}: one forward and "
                    "backward per micro-batch, then one step."
                )
            if any(abs(g * micro - 1) > 1e-6 for g in grads):
                hint = (
                    f" Yours is 1.0: the step's gradient is the SUM of the {micro} micro-batches' "
                    f"gradients, {micro}x the mean one process computes on the whole batch."
                    if all(abs(g - 1) < 1e-6 for g in grads) else ""
                )  # fmt: skip
                raise CheckFailed(
                    f"{where}: the gradient reaching each micro-batch's loss was "
                    f"{', '.join(f'{g:g}' for g in grads)}, not 1/{micro}: divide each "
                    "micro-batch's loss by cfg.gradient_accumulation_steps before backward()."
                    + hint
                )
            wrong = _syncs([s for _, s in step["backwards"]], micro)
            if wrong:
                raise CheckFailed(f"{where}: {wrong}")
            want = get_lr(it, cfg)
            for k, lr in enumerate(step["lr"]):
                if abs(lr - want) > LR_RTOL * want:
                    hint = (
                        " It stayed at cfg.learning_rate: the schedule is missing."
                        if all(abs(s["lr"][k] - cfg.learning_rate) < 1e-12 for s in r["steps"])
                        else ""
                    )
                    raise CheckFailed(
                        f"{where}: param group {k} stepped with lr {lr:g}; nanoGPT's schedule "
                        f"(warm-up, then cosine decay) gives get_lr({it}, cfg) = {want:g}. Before "
                        f'each step, set every param group\'s "lr" to get_lr(it, cfg).{hint}'
                    )
    for it in range(cfg.max_iters):
        sq = [r["steps"][it]["sq"] for r in per_rank]
        norm = math.sqrt(sq[0] if stage == 0 else sum(sq))  # stages 1-3: the ranks' shards
        if norm > cfg.grad_clip * (1 + CLIP_RTOL):
            raise CheckFailed(
                f"iteration {it}: the gradients' norm at opt.step() was {norm:.4g}, above "
                f"cfg.grad_clip = {cfg.grad_clip:g}: clip with torch.nn.utils.clip_grad_norm_("
                "model.parameters(), cfg.grad_clip) after the last micro-batch's backward, "
                "before opt.step() (minizero makes the norm global where the gradients are "
                "sharded)."
            )


def _close(got: float, want: float, what: str) -> bool:
    return within(abs(got - want), RTOL * abs(want), what)


def _evals(per_rank: list[dict], one: dict, cfg) -> None:
    want_its = [e[0] for e in one["evals"]]
    for rank, r in enumerate(per_rank):
        if r["forwards"]["eval"] == 0:
            raise CheckFailed(f"rank {rank} never evaluated: every rank runs the evaluation.")
        its = [int(e[0]) if len(e) == 3 else None for e in r["evals"]]
        if its != want_its:
            raise CheckFailed(
                f'rank {rank} returned "evals" at iterations {its}; want [it, train loss, val '
                f"loss] at iterations {want_its} (every cfg.eval_interval and after the last "
                "step), on every rank."
            )
    for k, (it, *ref) in enumerate(one["evals"]):
        for split, j in (("train", 1), ("val", 2)):
            values = [r["evals"][k][j] for r in per_rank]
            if max(values) - min(values) > RTOL * abs(ref[j - 1]):
                raise CheckFailed(
                    f"iteration {it}, {split}: the ranks' eval losses differ ("
                    + ", ".join(f"rank {q}: {v:.6f}" for q, v in enumerate(values))
                    + "): each evaluated its own rows only. All-reduce each rank's mean (it "
                    "sums) and divide by the number of ranks: the same value on every rank."
                )
            if not _close(values[0], ref[j - 1], "09 eval loss"):
                ratio = values[0] / ref[j - 1]
                summed = abs(ratio - len(per_rank)) < 0.05 * len(per_rank)
                hint = f" Yours is {ratio:.2f}x: the all-reduce sums; divide by the ranks' number."
                hint = hint if summed else ""
                raise CheckFailed(
                    f"iteration {it}: your {split} eval loss is {values[0]:.6f}, one process's "
                    f"on the whole eval batches {ref[j - 1]:.6f} (tolerance {RTOL:g} relative)."
                    + hint
                )


def _losses(per_rank: list[dict], one: dict, cfg) -> None:
    micro = cfg.gradient_accumulation_steps
    for rank, r in enumerate(per_rank):
        if len(r["loss"]) != cfg.max_iters:
            raise CheckFailed(f'rank {rank} logged {len(r["loss"])} losses in "loss"; want one '
                              f"per iteration, {cfg.max_iters}.")  # fmt: skip
    for it, ref in enumerate(one["loss"]):
        got = sum(r["loss"][it] for r in per_rank) / len(per_rank)  # equal shares of the rows
        if not _close(got, ref, "09 train loss"):
            hint = (f" Yours is {got / ref:.2f}x: log the mean over the micro-batches (each "
                    f"loss divided by {micro}, summed), not their sum."
                    if abs(got / ref - micro) < 0.05 * micro else
                    " Log this rank's loss of the step: the mean over its micro-batches, each "
                    "drawn with train_batch(data, cfg, it * micro + m, rank, world, device)."
                    )  # fmt: skip
            raise CheckFailed(
                f"iteration {it}: the mean over the ranks of your logged losses is {got:.6f}, "
                f"one process's {ref:.6f} on the same rows (tolerance {RTOL:g} relative).{hint}"
            )


def _state(per_rank: list[dict], stage: int, world: int) -> None:
    s = per_rank[0]["state"]
    if s is None:
        raise CheckFailed(
            'rank 0 returned "state_dict": None; return the whole state dict '
            "(model.state_dict(), called on every rank) on rank 0 at least."
        )
    if s.get("shapes") or s.get("missing") or s.get("unexpected"):
        what = "; ".join(
            [f"{k}: {got} where the plain model has {want}" for k, got, want in s["shapes"][:3]]
            + ([f"missing keys {s['missing'][:3]}"] if s["missing"] else [])
            + ([f"unexpected keys {s['unexpected'][:3]}"] if s["unexpected"] else [])
        )
        shard = f" A rank holds 1/{world} of each parameter at stage 3:" if stage == 3 else ""
        raise CheckFailed(
            f"the state dict rank 0 returned is not a plain model's, whole ({what}).{shard} call "
            "model.state_dict() on the parallelized model, on every rank: minizero gathers the "
            "full fp32 parameters under the plain model's keys (collective at stages 1-3)."
        )
    if "unreadable" in s:
        k, err = s["unreadable"]
        raise CheckFailed(
            f"the state dict rank 0 returned is not whole: reading {k!r} raised {err[:90]}... "
            f"At stage 3 a rank holds 1/{world} of each parameter between uses: call "
            "model.state_dict() on the parallelized model, on every rank, which gathers the full "
            "fp32 parameters under the plain model's keys."
        )
    if "error" in s:
        raise CheckFailed(f"the state dict rank 0 returned: {s['error']}.")
    last = per_rank[0]["evals"][-1][2]
    if not _close(s["val"], last, "09 saved model"):
        raise CheckFailed(
            f"the state dict loads into a plain model, but that model's val loss is "
            f"{s['val']:.6f}, your last evaluation's {last:.6f}: return the trained model's state "
            "dict, taken after the last step."
        )


def _judge(per_rank: list[dict], one: dict, cfg, stage: int, name: str) -> None:
    world = len(per_rank)
    words = f"stage {stage}"
    try:
        errors = [(q, r["error"]) for q, r in enumerate(per_rank) if r["error"] is not None]
        steps = [e for e in errors if e[1].startswith("OutOfStep")]
        if steps:
            raise CheckFailed(steps[0][1].split(": ", 1)[1].split(" (at line")[0])
        if errors:
            rank, err = errors[0]
            raise CheckFailed(f"{name} raised on rank {rank}: {err}.{raised_hint(world, err)}")
        _steps(per_rank, cfg, stage)
        _evals(per_rank, one, cfg)
        _losses(per_rank, one, cfg)
        _state(per_rank, stage, world)
    except CheckFailed as e:
        raise CheckFailed(f"{words} (world size {world}): {e}") from None


def check_train(fn, nprocs: int | None = None) -> None:
    """Lesson 09: ``fn(cfg, stage, group=None)``, called on every rank of ``group``, trains
    nanoGPT's model for ``cfg.max_iters`` steps at ``stage`` and returns ``{"loss": [...],
    "evals": [[it, train, val], ...], "state_dict": {...}}`` (see the lesson)."""
    from minizero.launcher import default_nprocs
    from minizero.tools.train import single_process

    world = max(nprocs or default_nprocs(), MIN_WORLD)  # launch_check's
    name = getattr(fn, "__name__", "your function")
    results = launch_check(_rank, nprocs, fn, tiny_config(world), timeout=180.0)
    world = len(results)
    cfg = tiny_config(world)
    one = single_process(cfg)
    for stage in STAGES:
        per_rank = [r["stages"].get(stage) for r in results]
        if any(p is None for p in per_rank):
            break
        _judge(per_rank, one, cfg, stage, name)
    subs = [results[r].get("sub") for r in SUBGROUP]
    try:
        if None in subs:
            raise CheckFailed(f"the run at stages {list(STAGES)} stopped before the subgroup's")
        _judge([s["stages"][SUB_STAGE] for s in subs], one, cfg, SUB_STAGE, name)
    except CheckFailed as e:
        raise subgroup_failure(name, world, str(e)) from None
    r0 = results[0]["stages"][3]
    report_pass(
        f"{name}: at stages 0-3 on {world} ranks ({describe(results[0]['info'])}) and at stage "
        f"{SUB_STAGE} on the subgroup {list(SUBGROUP)}, given as group=: {cfg.max_iters} steps of "
        f"{cfg.gradient_accumulation_steps} micro-batches, each loss scaled by "
        f"1/{cfg.gradient_accumulation_steps}, the gradients reduced on the last only; nanoGPT's "
        f"schedule and clipping; every rank evaluating, averaged; every logged loss within "
        f"{RTOL:g} of one process's (last val loss {r0['evals'][-1][2]:.4f}, one process "
        f"{one['evals'][-1][2]:.4f}); the whole state dict, loaded strictly into a plain model."
    )
