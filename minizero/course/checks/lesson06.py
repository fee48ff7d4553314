"""What the check cell of lesson 06 (06_myths) calls: ``check_owned_tensors``.

A ZeroRedundancyOptimizer-like step (each rank owns whole tensors, updates them, broadcasts them)
on real ranks (``minizero.launch``), against one process, with AdamW and with Adafactor; and the
student's assignment of tensors to ranks, against a balance any greedy assignment reaches. It
prints ``PASS`` with what was compared, or raises :class:`~.common.CheckFailed` saying what is
wrong (the contract of every check: :mod:`.common`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import format_bytes
from minizero.course.checks.common import (
    MIN_WORLD,
    SUBGROUP,
    CheckFailed,
    allclose,
    check_seed,
    default_nprocs,
    guard,
    launch_check,
    on_subgroup,
    rank_device,
    strict_ledger,
    subgroup_failure,
)
from minizero.models import GPTConfig, TinyGPT, count_params

TIMEOUT = 180.0  # seconds for the check's ranks

OWNED_STEPS = 3
OWNED_OPTIMIZERS = {  # name -> builder; Adafactor is not elementwise (row and column statistics)
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "Adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}
OWNER_LISTS = [  # (numels, world): sizes that a careless assignment balances badly
    ([10, 1, 10, 1, 10, 1, 10, 1], 2),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
    ([100] + [1] * 100, 2),
    ([7] * 5, 4),
    ([1, 1, 2], 2),  # in the given order, greedy makes loads (3, 1); largest first (2, 2)
    ([2, 3, 1, 2, 2, 3, 1], 3),  # greedy in order: a 6; largest first: 5, 5, 4
]


def _largest_first(numels: list[int], world: int) -> int:
    """The largest load of the greedy assignment that visits the largest tensors first (LPT)."""
    load = [0] * world
    for n in sorted(numels, reverse=True):
        load[load.index(min(load))] += n
    return max(load)


def _check_owners(assign_owners, numels: list[int], world: int, name: str) -> list[int]:
    owners, err = guard(assign_owners, list(numels), world)
    where = f"{name}({len(numels)} tensors, world={world})"
    if err is not None:
        raise CheckFailed(f"{where} raised: {err}")
    if not isinstance(owners, (list, tuple)) or len(owners) != len(numels):
        raise CheckFailed(f"{where} must return a list of {len(numels)} ranks, got {owners!r}")
    if any(not isinstance(o, int) or not 0 <= o < world for o in owners):
        raise CheckFailed(
            f"{where} returned {list(owners)}: every owner must be a rank in 0..{world - 1}"
        )
    load = [0] * world
    for n, o in zip(numels, owners):
        load[o] += n
    total, bound = sum(numels), sum(numels) / world + max(numels)
    worst = max(range(world), key=load.__getitem__)
    if load[worst] > bound:
        raise CheckFailed(
            f"{where}: rank {worst} owns {load[worst]:,} of {total:,} elements "
            f"({load[worst] / total:.0%}; loads {load}). Whole tensors can be balanced so that no "
            f"rank owns more than total/N + the largest tensor = {bound:,.0f}: give each tensor to "
            "the least-loaded rank, largest tensors first"
        )
    lpt = _largest_first(list(numels), world)
    if load[worst] > lpt:
        raise CheckFailed(
            f"{where}: rank {worst} owns {load[worst]:,} elements (loads {load}); giving each "
            f"tensor to the least-loaded rank, largest tensors first, no rank owns more than "
            f"{lpt:,}. Greedy in the given order leaves the big tensors for last, when they "
            "unbalance the loads: sort the tensors by size, largest first, then go greedy."
        )
    return list(owners)


def _owned_rank(owned_step, owners: list[int], opt_name: str, sub_owners=None) -> dict:
    """Inside a rank: :func:`_owned_run` on the world; with ``sub_owners``, then on the subgroup."""
    out = _owned_run(None, owned_step, owners, opt_name)
    if sub_owners is not None and out["error"] is None:
        out["sub"] = on_subgroup(_owned_run, owned_step, sub_owners, opt_name)
    return out


def _owned_run(group, owned_step, owners: list[int], opt_name: str) -> dict:
    """Inside a rank of ``group``: TinyGPT tiny, gradients averaged by an all-reduce per tensor
    (DDP's 2Ψ), then the student's ``owned_step``. Beside it, the reference the check holds the
    student to: a twin of the model whose one optimizer steps every tensor with the same averaged
    gradients (the same float32 operations in the same order, so a right answer equals it bit for
    bit on any CPU or GPU); and, for the student's information, one process on the whole batch
    (which sums in another order: about 1e-7 apart, more where Adam divides a gradient near zero
    by its own size)."""
    from minizero.analysis.memory import model_state_bytes
    from minizero.models import synthetic_batch

    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    make = OWNED_OPTIMIZERS[opt_name]
    torch.manual_seed(check_seed())
    model = TinyGPT(GPTConfig.tiny()).to(dev)
    torch.manual_seed(check_seed())
    ref = TinyGPT(GPTConfig.tiny()).to(dev)
    params, names = list(model.parameters()), [n for n, _ in model.named_parameters()]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = make([p for p, o in zip(params, owners) if o == rank])
    twin_opt, ref_opt = make(twin), make(ref.parameters())
    out = dict(error=None, steps=[], volume=[], ops=[], opt_bytes=0, psi=count_params(model))
    for step in range(OWNED_STEPS):
        x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, seed=check_seed(),
                               device=dev)  # fmt: skip
        before = [p.detach().cpu().clone() for p in params]
        model(x, y).backward()
        with CommLedger() if group is None else strict_ledger(group) as ledger:
            for p in params:  # DDP: every rank gets the average gradient of every tensor
                C.all_reduce(p.grad, group=group, tag="ddp")
                p.grad.div_(world)
            for t, p in zip(twin, params, strict=True):
                t.grad = p.grad.detach().clone()
            _, err = guard(owned_step, params, list(owners), opt, group=group)
        if err is not None:
            out["error"] = err
            return out
        twin_opt.step()
        for p in params:
            p.grad = None
        gx, gy = synthetic_batch("gpt", 4 * world, step, seed=check_seed(), device=dev)
        ref(gx, gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["steps"].append(
            dict(
                mine=[p.detach().cpu().clone() for p in params],
                before=before,
                want=[t.detach().cpu().clone() for t in twin],
                one=[p.detach().cpu().clone() for p in ref.parameters()],
            )
        )
        out["volume"].append(ledger.volume_elements)
        out["ops"].append(sorted({r.op for r in ledger.records}))
    out["opt_bytes"] = model_state_bytes(None, opt)["optimizer"]
    out["names"] = names
    return out


# A right answer runs the twin's float32 operations in the same order: equal bit for bit. The
# tolerance, 8 units in the last place of max(|value|, lr), only absorbs a kernel that contracts
# an elementwise a*b+c into one rounding (FMA) in one optimizer and not the other; a wrong step
# moves a value by about lr = 1e-2, 10^5 times more.
ULPS8 = 2.0**-20


def _compare_owned(results: list[dict], owners: list[int], opt_name: str) -> float:
    """Raise at the first tensor that differs from the twin; return the largest difference from
    one process on the whole batch (shown, not failed on)."""
    psi, lr, one = results[0]["psi"], 1e-2, 0.0
    for step in range(OWNED_STEPS):
        for rank, res in enumerate(results):
            s = res["steps"][step]
            for k, (mine, want) in enumerate(zip(s["mine"], s["want"], strict=True)):
                one = max(one, (mine - s["one"][k]).abs().max().item())
                if allclose(mine, want, ULPS8, ULPS8 * lr, f"06 owned_step {opt_name}"):
                    continue
                owner = owners[k]
                where = (
                    f"{opt_name}, step {step}, rank {rank}: parameter {res['names'][k]!r} (owned "
                    f"by rank {owner})"
                )
                if torch.equal(mine, s["before"][k]) and owner != rank:
                    raise CheckFailed(
                        f"{where} still holds its value from before the step: only its owner "
                        f"updates it, so after the update every rank must receive it from rank "
                        f"{owner} (a broadcast with src={owner})"
                    )
                if torch.equal(mine, s["before"][k]):
                    raise CheckFailed(
                        f"{where}: the owner's update was overwritten by a copy from before the "
                        "step: broadcast each tensor after the optimizer's step, from its owner"
                    )
                diff = (mine - want).abs().max().item()
                raise CheckFailed(
                    f"{where} differs by up to {diff:.3g} from one optimizer stepping every tensor "
                    "with the same averaged gradients: step the optimizer (it holds this rank's "
                    "tensors only), then broadcast every tensor from its owner"
                )
        ops, volume = results[0]["ops"][step], results[0]["volume"][step]
        if ops != ["all_reduce", "broadcast"] or volume != 3 * psi:
            raise CheckFailed(
                f"{opt_name}, step {step}: the ledger saw {ops or 'nothing'} moving "
                f"{volume / psi:.2f}Ψ; DDP's all-reduce (2Ψ) and one broadcast of each tensor from "
                "its owner (Ψ) make 3Ψ. Broadcast with minizero.broadcast, so that the ledger sees "
                "it, once per tensor"
            )
    return one


def check_owned_tensors(assign_owners, owned_step, nprocs: int | None = None) -> None:
    """Lesson 06: ``assign_owners(numels, world) -> [rank per tensor]`` must balance whole tensors;
    ``owned_step(params, owners, optimizer)`` (gradients already averaged, ``optimizer`` built on
    this rank's tensors) must train as one process does, with AdamW and Adafactor, moving 3Ψ."""
    names = f"{getattr(assign_owners, '__name__', 'assign_owners')}"
    step_name = getattr(owned_step, "__name__", "owned_step")
    for numels, w in OWNER_LISTS:
        _check_owners(assign_owners, numels, w, names)
    world = max(nprocs or default_nprocs(), MIN_WORLD)  # launch_check's world
    torch.manual_seed(check_seed())
    numels = [p.numel() for p in TinyGPT(GPTConfig.tiny()).parameters()]
    owners = _check_owners(assign_owners, numels, world, names)
    sub_owners = _check_owners(assign_owners, numels, len(SUBGROUP), names)
    lines = []
    for k, opt_name in enumerate(OWNED_OPTIMIZERS):
        sub = sub_owners if k == 0 else None  # the subgroup once, with the first optimizer
        results = launch_check(
            _owned_rank, world, owned_step, owners, opt_name, sub, timeout=TIMEOUT
        )
        for rank, res in enumerate(results):
            if res["error"] is not None:
                raise CheckFailed(
                    f"{step_name} raised on rank {rank} with {opt_name}: {res['error']}"
                )
        one = _compare_owned(results, owners, opt_name)
        if sub is not None:
            subs = [results[r]["sub"] for r in SUBGROUP]
            for rank, res in zip(SUBGROUP, subs, strict=True):
                if res["error"] is not None:
                    raise subgroup_failure(step_name, world, f"raised on rank {rank}: "
                                           f"{res['error']}.")  # fmt: skip
            try:
                _compare_owned(subs, sub_owners, opt_name)
            except CheckFailed as e:
                raise subgroup_failure(step_name, world, str(e)) from None
        per_rank = ", ".join(format_bytes(r["opt_bytes"]) for r in results)
        lines.append(
            f"{opt_name}: equal to one optimizer over every tensor with the same gradients; "
            f"beside one process on the whole batch, max |difference| {one:.2g} (its sums run in "
            f"another order); optimizer states per rank {per_rank}"
        )
    print("\n".join(lines))
    print(
        f"PASS  {names} balances whole tensors; {step_name} trains TinyGPT as one process does "
        f"with AdamW and with Adafactor for {OWNED_STEPS} steps on {world} ranks (AdamW on the "
        f"subgroup {list(SUBGROUP)} too), moving 3Ψ per "
        "step (all-reduce 2Ψ + broadcast Ψ)"
    )
