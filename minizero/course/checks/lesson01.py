"""The check cells of lesson 01 (01_ddp): ``check_allreduce_gradients``, ``check_bucketed_ddp``.

The student's gradient averaging (a function) and bucketed DDP (a class) train an MLP on real ranks
next to PyTorch's ``DistributedDataParallel``, minizero's ``DDP`` and one process on the whole
batch, step by step: gradients after the sync, parameters after each step, the volume moved, and
for the buckets whether their all-reduces were issued during backward (overlap). The contract of
every check: :mod:`.common`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.course.checks.common import (
    SUBGROUP,
    CheckFailed,
    allclose,
    check_seed,
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
)

STEPS, ROWS_PER_RANK, LR = 3, 4, 0.1  # global batch: ROWS_PER_RANK * world
# SGD is linear in the gradient, so a difference in the order of the float32 sums (ranks, rows,
# kernels) stays one: each gradient element is off by at most ~n * 6e-8 times the sum of the
# magnitudes of its n < 64 terms (~1e-6 here), the parameters by LR times that. A wrong answer
# (a sum, the weights averaged, a stale bucket) is off by the gradient itself, ~1e-2.
RTOL, ATOL = 1e-4, 1e-6


def _mlp(dev: torch.device) -> torch.nn.Module:
    from minizero.models import MLP

    torch.manual_seed(check_seed())  # the same initial weights on every rank and the reference
    return MLP().to(dev)


def _train(make, rank: int, world: int, dev: torch.device, sync=None, grad_marks: bool = False):
    """Train ``make(model)`` for STEPS steps of SGD; record grads (after sync) and params.

    ``grad_marks``: mark "grad NAME" on the ledger's timeline as each gradient becomes ready
    (hooks registered after the model's own, so they run just after them)."""
    from minizero.models import synthetic_batch

    model = make(_mlp(dev))
    inner = getattr(model, "module", model)
    if grad_marks:
        for name, p in inner.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: C.mark(f"grad {name}"))
    opt = torch.optim.SGD(inner.parameters(), lr=LR)
    trace = {"grads": [], "params": [], "moved": [], "ledgers": []}
    for step in range(STEPS):
        batch = ROWS_PER_RANK * dist.get_world_size()  # the same global batch for every variant
        x, y = synthetic_batch("mlp", batch, step, rank=rank, world=world, seed=check_seed(),
                               device=dev)  # fmt: skip
        before = [p.detach().clone() for p in inner.parameters()]
        with CommLedger() as ledger:
            C.mark("forward start")
            loss = model(x, y)
            C.mark("backward start")
            loss.backward()
            if sync is not None:
                sync(inner)
        trace["moved"].append(
            [
                n
                for (n, p), b in zip(inner.named_parameters(), before, strict=True)
                if not torch.equal(p.detach(), b)
            ]
        )
        trace["ledgers"].append(ledger)
        trace["grads"].append(
            {
                n: p.grad.detach().cpu().clone()
                for n, p in inner.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
        opt.zero_grad()
        trace["params"].append({n: p.detach().cpu().clone() for n, p in inner.named_parameters()})
    return trace


def _ddp_rank(student, kind: str, bucket_cap_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from minizero.ddp import DDP
    from minizero.naive_ddp import NaiveDDP

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {"one process on the whole batch": _train(lambda m: m, 0, 1, dev)}
    ids = [dev.index] if dev.type == "cuda" else None
    refs["torch DistributedDataParallel"] = _train(
        lambda m: DistributedDataParallel(m, device_ids=ids, bucket_cap_mb=bucket_cap_mb),
        rank,
        world,
        dev,
    )
    if kind == "naive":
        refs["minizero.naive_ddp.NaiveDDP"] = _train(lambda m: NaiveDDP(m), rank, world, dev)
        mine, err = guard(_train, lambda m: m, rank, world, dev, sync=student)
    else:
        refs["minizero.ddp.DDP"] = _train(
            lambda m: DDP(m, bucket_cap_mb=bucket_cap_mb), rank, world, dev
        )
        make = lambda m: student(m, bucket_cap_mb=bucket_cap_mb)
        mine, err = guard(_train, make, rank, world, dev, grad_marks=True)
    local = _train(lambda m: m, rank, world, dev)  # no communication at all: for the hints
    out = {"info": run_info(), "error": err, "refs": refs, "mine": None, "local": local}
    if mine is not None:
        led = mine.pop("ledgers")
        mine["records"] = [
            [(r.op, r.numel, r.async_op, r.index, r.waited_at) for r in L.records] for L in led
        ]
        mine["marks"] = [L.marks for L in led]
        out["mine"] = mine
    for r in [*refs.values(), local]:
        r.pop("ledgers")
    out["psi"] = sum(p.numel() for p in _mlp(dev).parameters())
    out["n_params"] = len(list(_mlp(dev).parameters()))
    if err is None:
        out["sub"] = on_subgroup(_sub_run, student, kind, bucket_cap_mb)
    return out


def _sub_run(group, student, kind: str, bucket_cap_mb: float) -> dict:
    """On the members of a subgroup: the student's code given ``group``, against minizero's."""
    from minizero.ddp import DDP
    from minizero.naive_ddp import NaiveDDP

    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    if kind == "naive":
        ref = _train(lambda m: NaiveDDP(m, process_group=group), rank, world, dev)
        sync = lambda m: student(m, group=group)
        with strict_ledger(group):
            mine, err = guard(_train, lambda m: m, rank, world, dev, sync=sync)
    else:
        make = lambda m: DDP(m, bucket_cap_mb=bucket_cap_mb, process_group=group)
        ref = _train(make, rank, world, dev)
        make = lambda m: student(m, bucket_cap_mb=bucket_cap_mb, group=group)
        with strict_ledger(group):
            mine, err = guard(_train, make, rank, world, dev)
    if err is not None:
        return {"error": err}
    same = all(
        allclose(mine["grads"][s][n], g, RTOL, ATOL, "01 DDP grads vs minizero (subgroup)")
        for s in range(STEPS)
        for n, g in ref["grads"][s].items()
    )
    return {"error": None, "same": same}


def _compare(mine: dict, refs: dict, local: dict, rank: int, world: int) -> None:
    for step in range(STEPS):
        if mine["moved"][step]:
            raise CheckFailed(
                f"step {step}, rank {rank}: parameters {mine['moved'][step]} changed during "
                "backward. Only gradients may be communicated: the hook's argument is the "
                "parameter itself, its gradient is param.grad."
            )
        for what in ("grads", "params"):
            for ref_name, ref in refs.items():
                for name, want in ref[what][step].items():
                    got = mine[what][step].get(name)
                    label = "gradient" if what == "grads" else "parameter after optimizer.step()"
                    if got is None:
                        raise CheckFailed(f"step {step}, rank {rank}: {name} has no gradient")
                    if not allclose(got, want, RTOL, ATOL, f"01 DDP {what} vs {ref_name}"):
                        diff = (got - want).abs().max().item()
                        ratio = (got * want).sum() / (want * want).sum().clamp_min(1e-30)
                        hint = factor_hint(float(ratio), world) if what == "grads" else ""
                        if (
                            not hint
                            and what == "grads"
                            and torch.equal(got, local["grads"][step][name])
                        ):
                            hint = (
                                f" It is rank {rank}'s own local gradient: nothing was averaged "
                                "into p.grad. (A post-accumulate-grad hook receives the "
                                "PARAMETER; all-reducing that argument averages the weights, "
                                "not the gradient.)"
                            )
                        raise CheckFailed(
                            f"step {step}, rank {rank}, {label} of {name!r}: max |yours - "
                            f"{ref_name}| = {diff:.3g} (tolerance {ATOL:g} + {RTOL:g} * "
                            f"|ref|).{hint}"
                        )


def _check_ddp(student, kind: str, nprocs: int | None, bucket_cap_mb: float) -> tuple:
    results = launch_check(_ddp_rank, nprocs, student, kind, bucket_cap_mb)
    world = len(results)
    name = getattr(student, "__name__", "your code")
    for rank, res in enumerate(results):
        if res["error"]:
            raise CheckFailed(
                f"{name} raised on rank {rank} (world size {world}): {res['error']}."
                f"{raised_hint(world, res['error'])}"
            )
        _compare(res["mine"], res["refs"], res["local"], rank, world)
    res = results[0]
    res["subs"] = [results[r].get("sub") or {} for r in SUBGROUP]
    psi = res["psi"]
    for step, recs in enumerate(res["mine"]["records"]):
        moved = sum(2 * numel for op, numel, *_ in recs if op == "all_reduce")
        others = sorted({op for op, *_ in recs if op != "all_reduce"})
        if others or moved != 2 * psi:
            raise CheckFailed(
                f"step {step}: the CommLedger saw {len(recs)} collectives moving {moved} elements"
                f"{' and ' + str(others) if others else ''}; DDP moves 2Ψ = {2 * psi} (one "
                "all-reduce of every gradient element, through minizero.collectives.all_reduce)"
            )
    return res, world, name


def _check_subgroup(res: dict, world: int, name: str) -> None:
    for rank, sub in zip(SUBGROUP, res["subs"], strict=True):
        if sub.get("error"):
            raise subgroup_failure(name, world, f"raised on rank {rank}: {sub['error']}.")
        if not sub.get("same", True):
            raise subgroup_failure(
                name, world, f"rank {rank}'s gradients differ from minizero's on the subgroup."
            )


def check_allreduce_gradients(fn, nprocs: int | None = None) -> None:
    """Lesson 01, naive DDP: ``fn(model, group=None)``, called after ``loss.backward()``, must
    leave in every ``p.grad`` the average over the ranks, as one process on the whole batch gets."""
    res, world, name = _check_ddp(fn, "naive", nprocs, 25)
    _check_subgroup(res, world, name)
    refs = ", ".join(res["refs"])
    report_pass(
        f"{name}: gradients and parameters equal {refs} for {STEPS} steps on {world} ranks "
        f"({describe(res['info'])}); moved 2Ψ = {2 * res['psi']} elements per step"
    )


def check_bucketed_ddp(cls, nprocs: int | None = None, bucket_cap_mb: float = 0.002) -> None:
    """Lesson 01, bucketed DDP: ``cls(module, bucket_cap_mb=...)`` must give the same gradients as
    the references, one all-reduce per bucket, and start some of them before backward ends."""
    res, world, name = _check_ddp(cls, "bucketed", nprocs, bucket_cap_mb)
    for step, (recs, marks) in enumerate(
        zip(res["mine"]["records"], res["mine"]["marks"], strict=True)
    ):
        ends = [i for i, label in marks if label == "backward end"]
        if len(ends) != 1:
            raise CheckFailed(
                f"step {step}: expected one 'backward end' mark, found {len(ends)} "
                "(keep the provided lines that queue _finish and call mark())"
            )
        if not all(a for _, _, a, *_ in recs):
            raise CheckFailed(
                f"step {step}: some all-reduces were blocking; start each bucket's "
                "all-reduce with async_op=True and wait for it in _finish()"
            )
        if len(recs) >= res["n_params"] and res["n_params"] > 1:
            raise CheckFailed(
                f"step {step}: {len(recs)} all-reduces for {res['n_params']} "
                "parameters: all-reduce each bucket's flat buffer once, not each "
                "gradient"
            )
        last_grad = max(i for i, label in marks if label.startswith("grad "))
        early = [(i, w) for _, _, _, i, w in recs if i < last_grad]
        if not early:
            raise CheckFailed(
                f"step {step}: none of the {len(recs)} bucket all-reduces was issued before the "
                "last gradient was ready, so none overlaps backward. Start each one from the "
                "hook, as soon as its bucket's last gradient is in."
            )
        end = ends[0]
        waited = [i for i, w in early if w is None or w <= end]  # returned before backward ended
        if waited:
            raise CheckFailed(
                f"step {step}: {len(waited)} of the {len(early)} all-reduces issued during "
                "backward were waited on before backward ended (their wait() returned before the "
                "'backward end' mark): you wait for each all-reduce right after issuing it: "
                "nothing overlaps backward; wait in the backward-end hook (_finish)."
            )
    _check_subgroup(res, world, name)
    report_pass(
        f"{name}: gradients and parameters equal {', '.join(res['refs'])} for {STEPS} steps on "
        f"{world} ranks ({describe(res['info'])}); {len(res['mine']['records'][0])} bucket "
        f"all-reduces per step, {len(early)} issued while backward still ran and waited on after "
        f"it (and the same on the subgroup {list(SUBGROUP)}); moved 2Ψ = "
        f"{2 * res['psi']} elements per step"
    )
