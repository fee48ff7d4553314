"""The check cell of lesson 09 (09_capstone): ``check_estimate_loss``.

The student's ``estimate_loss(model, batches, group=None)`` evaluates a small GPT on Tiny
Shakespeare on real ranks, wrapped at stage 0 (DDP) and at stage 3 (where every forward gathers
the parameters from every rank), next to minizero's own (``minizero.tools.train.estimate_loss``)
on the same ranks and one process on the whole eval batches; then again on a subgroup (ranks 0
and 1 of 3) under a ledger that refuses a collective on any other group. The contract of every
check: :mod:`.common`.

Why the comparison holds by construction: every rank's share of an eval batch is the same size,
so the mean over the ranks of each rank's mean loss IS the mean loss of the whole batch; the three
results differ only by float32 rounding in the losses' sums. Each eval batch holds ``ROWS`` rows
per rank, so that any world size splits it evenly (a lab machine's 8 GPUs too). A cross-entropy
here sums at most 4 x 16 = 64 float32 terms on a rank, one process's at most 64 per rank of the
world, and the means add the world's and 3 batches' more; the worst case of recursive summation,
(n - 1) u with u = 2^-24 per addition, stays under 1e-5 relative up to 64 ranks, so ``RTOL`` =
1e-4 cannot fail a right answer. The mistakes it is there for are far larger: a sum
not divided is N times the mean, a rank's own mean differs from the others' by percents.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero.course.checks.common import (
    CheckFailed,
    describe,
    factor_hint,
    guard,
    launch_check,
    on_subgroup,
    raised_hint,
    rank_device,
    report_pass,
    run_info,
    strict_ledger,
    subgroup_failure,
    within,
)

RTOL = 1e-4  # see the module's docstring: 8x the worst-case float32 rounding of these sums
ROWS, BLOCK, EVAL_ITERS = 4, 16, 3  # each eval batch: 4 rows per rank, 16 characters each
TRAIN_BATCH = 12  # rows of the one training step that moves the weights off their init
STAGES = (0, 3)  # DDP; ZeRO-3, where a forward is itself collective
STAGE_WORDS = {0: "stage 0 (DDP)", 3: "stage 3 (ZeRO-3: each forward gathers the parameters)"}


def _gpt_config(vocab_size: int):
    from minizero.models import GPTConfig

    return GPTConfig(vocab_size=vocab_size, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32,
                     bias=False)  # fmt: skip


def _batches(rank: int, world: int, dev, whole_of: int | None = None) -> list:
    """This rank's rows of the eval batches of ``ROWS`` x ``world`` rows (``whole_of``: the
    batches of that many ranks, taken whole by one process: rank 0 of world 1)."""
    from minizero.tools import shakespeare

    data = shakespeare.load()
    rows = ROWS * (whole_of or world)
    return [shakespeare.get_batch(data, "val", rows, BLOCK, -1 - k, rank=rank, world=world,
                                  device=dev) for k in range(EVAL_ITERS)]  # fmt: skip


def _trained():
    """The same weights everywhere: seeded, then one SGD step on a fixed batch (so the loss is
    not the uniform log(65) that a wrong mean could still hit)."""
    from minizero.models import TinyGPT
    from minizero.tools import shakespeare

    data = shakespeare.load()
    torch.manual_seed(0)
    plain = TinyGPT(_gpt_config(data.vocab_size))
    x, y = shakespeare.get_batch(data, "train", TRAIN_BATCH, BLOCK, 0)
    plain(x, y).backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 1.0 * p.grad
            p.grad = None
    return plain


def _model(stage: int, group=None):
    import minizero

    sgd = lambda params: torch.optim.SGD(params, lr=0.0)
    return minizero.parallelize(_trained(), stage, sgd, process_group=group)[0]


def _call(fn, model, batches, group):
    """The student's function on ``model`` (training mode), watching each forward: grad mode and
    training flag as the model saw them, and the mode the model is left in."""
    seen = []
    inner = model.module
    hook = inner.register_forward_pre_hook(
        lambda m, args: seen.append((torch.is_grad_enabled(), m.training))
    )
    model.train()
    try:
        value, err = guard(fn, model, batches, group=group)
    finally:
        hook.remove()
    if err is None:
        try:
            value = float(value)
        except (TypeError, ValueError) as e:
            value, err = None, f"returned {type(value).__name__}, not a number ({e})"
    return {"value": value, "error": err, "seen": seen, "left_training": model.training}


def _rank(fn) -> dict:
    from minizero.tools.train import estimate_loss

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    out = {"info": run_info(), "cases": {}, "one": None}
    batches = _batches(rank, world, dev)
    for stage in STAGES:
        model = _model(stage)
        case = _call(fn, model, batches, None)
        case["want"] = estimate_loss(model, batches)  # minizero's, the same ranks
        out["cases"][stage] = case
        if case["error"] is not None:
            return out  # the others may now wait in a collective the student skipped
    out["one"] = _one_process(_batches(0, 1, torch.device("cpu"), whole_of=world))
    out["sub"] = on_subgroup(_sub, fn)
    return out


def _one_process(whole: list) -> float:
    """One process, the whole eval batches, plain PyTorch: the mean of the batches' losses."""
    plain = _trained().eval()
    with torch.no_grad():
        return sum(float(plain(x, y)) for x, y in whole) / len(whole)


def _sub(group, fn) -> dict:
    from minizero.tools.train import estimate_loss

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    batches = _batches(rank, world, rank_device())
    cases = {}
    for stage in STAGES:
        model = _model(stage, group)
        want = estimate_loss(model, batches, group)
        with strict_ledger(group):
            case = _call(fn, model, batches, group)
        case["want"] = want
        cases[stage] = case
        if case["error"] is not None:
            break
    return {"cases": cases}


def _judge(per_rank: list[dict], one: float | None, name: str, world: int) -> None:
    """Raise CheckFailed at the first case that differs; ``per_rank``: each rank's cases."""
    stages = STAGE_WORDS
    for stage in STAGES:
        for rank, cases in enumerate(per_rank):
            c = cases.get(stage)
            if c is None:
                continue
            if c["error"] is not None:
                raise CheckFailed(
                    f"{name} raised on rank {rank} at {stages[stage]} (world size {world}): "
                    f"{c['error']}.{raised_hint(world, c['error'])}"
                )
            if any(grad for grad, _ in c["seen"]):
                raise CheckFailed(
                    f"rank {rank}, {stages[stage]}: the model ran forward with gradients enabled: "
                    "an evaluation builds no graph; decorate the function with @torch.no_grad() "
                    "(or compute inside `with torch.no_grad():`)."
                )
            if any(training for _, training in c["seen"]):
                raise CheckFailed(
                    f"rank {rank}, {stages[stage]}: the model ran forward in training mode: call "
                    "model.eval() before evaluating (dropout off), as nanoGPT's estimate_loss does."
                )
            if not c["left_training"]:
                raise CheckFailed(
                    f"rank {rank}, {stages[stage]}: the model was left in eval mode: call "
                    "model.train() before returning, or the next training steps run without "
                    "dropout."
                )
        values = [cases[stage]["value"] for cases in per_rank if stage in cases]
        want = per_rank[0][stage]["want"]
        for rank, got in enumerate(values):
            if within(abs(got - want), RTOL * abs(want), "09 eval loss"):
                continue
            spread = max(values) - min(values)
            if spread > RTOL * abs(want):
                raise CheckFailed(
                    f"{stages[stage]}: the ranks returned different losses ("
                    + ", ".join(f"rank {r}: {v:.6f}" for r, v in enumerate(values))
                    + f"); the mean over every rank's rows is {want:.6f}. Each rank evaluated its "
                    "own rows only: all-reduce the mean (a sum over the ranks) and divide by "
                    "the number of ranks."
                )
            hint = factor_hint(got / want, world)
            raise CheckFailed(
                f"{stages[stage]}, rank {rank}: yours is {got:.6f}, the mean loss over every "
                f"rank's rows is {want:.6f} (minizero's estimate_loss on the same ranks; "
                f"tolerance {RTOL:g} relative).{hint}"
            )
    if one is not None and abs(want - one) > RTOL * abs(one):  # the reference itself
        raise CheckFailed(f"internal: minizero's estimate {want} differs from one process's {one}")


def check_estimate_loss(fn, nprocs: int | None = None) -> None:
    """Lesson 09: ``fn(model, batches, group=None)``, called on every rank of ``group`` with this
    rank's rows of each eval batch, must return the mean loss over every rank's rows, the same on
    every rank, computed with no graph, in eval mode, leaving the model in training mode."""
    results = launch_check(_rank, nprocs, fn)
    world = len(results)
    name = getattr(fn, "__name__", "your function")
    _judge([r["cases"] for r in results], results[0]["one"], name, world)
    subs = [results[r].get("sub") for r in (0, 1)]
    try:
        _judge([s["cases"] for s in subs], None, name, 2)
    except CheckFailed as e:
        raise subgroup_failure(name, world, str(e)) from None
    r0 = results[0]
    report_pass(
        f"{name}: the mean eval loss over every rank's rows ({r0['cases'][0]['want']:.6f}; one "
        f"process on the whole batches: {r0['one']:.6f}) on each of {world} ranks at stages 0 "
        f"and 3 ({describe(r0['info'])}), under no_grad, in eval mode, the model left training; "
        "and the same on the subgroup [0, 1], given as group="
    )
