"""What the check cell of lesson 06 (06_myths) calls: ``check_owned_tensors``.

The student's ZeroRedundancyOptimizer (each rank owns whole tensors, steps an optimizer on those
only, broadcasts each from its owner) on real ranks (``minizero.launch``), on the world and on a
subgroup, with AdamW and with Adafactor: its owners against the balance torch's sorted-greedy
partition reaches, its parameters after each step against one optimizer over every tensor and
against torch's own ``ZeroRedundancyOptimizer`` given the same gradients, its traffic on the
ledger. It prints ``PASS`` with what was compared, or raises :class:`~.common.CheckFailed` saying
what is wrong (the contract of every check: :mod:`.common`).
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
OWNED_OPTIMIZERS = {  # name -> (class, defaults); Adafactor is not elementwise (row, column)
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2)),
    "Adafactor": (torch.optim.Adafactor, dict(lr=1e-2)),
}
OWNER_LISTS = [  # (numels, world): sizes that a careless assignment balances badly
    ([10, 1, 10, 1, 10, 1, 10, 1], 2),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
    ([100] + [1] * 100, 2),
    ([1, 1, 2], 2),  # in the given order, greedy makes loads (3, 1); largest first (2, 2)
    ([2, 3, 1, 2, 2, 3, 1], 3),  # greedy in order: a 6; largest first: 5, 5, 4
]  # world 2: run on the subgroup; world 3: on the whole world (its size)


def _largest_first(numels: list[int], world: int) -> int:
    """The largest load of the greedy assignment that visits the largest tensors first (LPT),
    the partition of torch's ZeroRedundancyOptimizer (``_partition_parameters``)."""
    load = [0] * world
    for n in sorted(numels, reverse=True):
        load[load.index(min(load))] += n
    return max(load)


def _build(cls, params, opt_name: str, group):
    """The student's optimizer on ``params`` and its owners: ``(zro, owners, None)`` or
    ``(None, None, error text)``."""
    opt_class, defaults = OWNED_OPTIMIZERS[opt_name]
    zro, err = guard(cls, params, opt_class, group=group, **defaults)
    if err is not None:
        return None, None, f"{cls.__name__}(...) raised: {err}"
    owners = getattr(zro, "owners", None)
    try:
        owners = [int(o) for o in owners]
    except (TypeError, ValueError):
        return None, None, f"{cls.__name__}.owners must be a list of ranks, got {owners!r}"
    return zro, owners, None


def _owner_lists(group, cls) -> list:
    """Inside a rank of ``group``: the student's owners of parameters of each list's sizes."""
    world, out = dist.get_world_size(group), []
    for numels, w in OWNER_LISTS:
        if (w == 2) != (group is not None):
            continue
        params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
        _, owners, err = _build(cls, params, "AdamW", group)
        out.append((numels, world, owners, err))
    return out


def _check_owners(name: str, numels: list[int], world: int, owners, err) -> list[int]:
    where = f"{name}'s owners ({len(numels)} tensors, world={world})"
    if err is not None:
        raise CheckFailed(err)
    if len(owners) != len(numels):
        raise CheckFailed(f"{where}: {len(owners)} owners for {len(numels)} tensors: one each")
    if any(not 0 <= o < world for o in owners):
        raise CheckFailed(
            f"{where} are {list(owners)}: every owner must be a rank of the group, 0..{world - 1}"
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
            f"rank owns more than total/N + the largest tensor = {bound:,.0f}: count the elements "
            "each rank owns so far and give the next tensor to the rank that owns the fewest"
        )
    lpt = _largest_first(list(numels), world)
    if load[worst] > lpt:
        raise CheckFailed(
            f"{where}: rank {worst} owns {load[worst]:,} elements (loads {load}); torch's "
            f"ZeroRedundancyOptimizer's partition leaves no rank more than {lpt:,}. Greedy in the "
            "given order leaves the big tensors for last, when they unbalance the loads: visit "
            "the tensors largest first."
        )
    return list(owners)


def _owned_rank(cls, opt_name: str, sub: bool) -> dict:
    """Inside a rank: the owner lists and :func:`_owned_run` on the world; with ``sub``, both
    again on the subgroup."""
    out = dict(lists=_owner_lists(None, cls) if sub else [])
    out.update(_owned_run(None, cls, opt_name))
    failed = out["error"] is not None or out.get("stopped", False)
    if sub and not _any_rank(failed, None):  # new_group on every rank, or on none
        out["sub"] = on_subgroup(_on_group, cls, opt_name)
    return out


def _any_rank(failed: bool, group) -> bool:
    """Whether ``failed`` on any rank of ``group``, on every rank of it: where one rank cannot
    go on, all stop together, instead of the others waiting for it in their next collective."""
    flag = torch.tensor([float(failed)], device=rank_device())
    dist.all_reduce(flag, group=group)
    return bool(flag.item())


def _on_group(group, cls, opt_name: str) -> dict:
    return dict(_owned_run(group, cls, opt_name), lists=_owner_lists(group, cls))


def _owned_run(group, cls, opt_name: str) -> dict:
    """Inside a rank of ``group``: TinyGPT tiny, gradients averaged by an all-reduce per tensor
    (DDP's 2Ψ), then the student's optimizer's ``step()``. Beside it, with the same averaged
    gradients: a twin of the model whose one optimizer steps every tensor (the same float32
    operations in the same order, so a right answer equals it bit for bit), torch's own
    ZeroRedundancyOptimizer, and, for the student's information, one process on the whole batch
    (which sums in another order: about 1e-7 apart)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from minizero.analysis.memory import model_state_bytes
    from minizero.models import synthetic_batch

    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    opt_class, defaults = OWNED_OPTIMIZERS[opt_name]
    torch.manual_seed(check_seed())
    model = TinyGPT(GPTConfig.tiny()).to(dev)
    torch.manual_seed(check_seed())
    ref = TinyGPT(GPTConfig.tiny()).to(dev)
    params, names = list(model.parameters()), [n for n, _ in model.named_parameters()]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    out = dict(error=None, steps=[], volume=[], ops=[], opt_bytes=0, psi=count_params(model))
    out["numels"] = [p.numel() for p in params]
    zro, owners, err = _build(cls, params, opt_name, group)
    bad = err is not None or len(owners) != len(params) or any(not 0 <= o < world for o in owners)
    inner = getattr(zro, "optimizer", None)
    held = {id(p) for g in getattr(inner, "param_groups", []) for p in g["params"]}
    if not bad and held != {id(p) for p, o in zip(params, owners) if o == rank}:
        n = sum(o == rank for o in owners)
        err = (
            f"self.optimizer holds {len(held)} of the {len(params)} parameters; this rank owns "
            f"{n}. Build it on the owned ones only: the optimizer states of a tensor live on its "
            "owner alone, which is the memory ZeroRedundancyOptimizer saves"
        )
    if _any_rank(bad or err is not None, group):  # the parent names the mistake
        return dict(out, error=err, owners=owners, stopped=True)
    out["owners"] = owners
    torch_zro = ZeroRedundancyOptimizer(theirs, opt_class, process_group=group, **defaults)
    twin_opt, ref_opt = opt_class(twin, **defaults), opt_class(ref.parameters(), **defaults)
    for step in range(OWNED_STEPS):
        x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, seed=check_seed(),
                               device=dev)  # fmt: skip
        before = [p.detach().cpu().clone() for p in params]
        model(x, y).backward()
        with CommLedger() if group is None else strict_ledger(group) as ledger:
            for p in params:  # DDP: every rank gets the average gradient of every tensor
                C.all_reduce(p.grad, group=group, tag="ddp")
                p.grad.div_(world)
            for t, u, p in zip(twin, theirs, params, strict=True):
                t.grad, u.grad = p.grad.detach().clone(), p.grad.detach().clone()
            _, err = guard(zro.step)
        if err is not None:  # its peers may wait in a broadcast: the launcher stops them
            what = f"{cls.__name__} on rank {rank} with {opt_name}: step() raised: {err}"
            if group is None:
                raise CheckFailed(what)
            raise subgroup_failure(cls.__name__, dist.get_world_size(), what)
        twin_opt.step()
        torch_zro.step()
        for p in params + twin + theirs:
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
                torch=[t.detach().cpu().clone() for t in theirs],
                one=[p.detach().cpu().clone() for p in ref.parameters()],
            )
        )
        out["volume"].append(ledger.volume_elements)
        out["ops"].append(sorted({r.op for r in ledger.records}))
    out["opt_bytes"] = model_state_bytes(None, inner)["optimizer"]
    out["torch_opt_bytes"] = model_state_bytes(None, torch_zro.optim)["optimizer"]
    out["names"] = names
    return out


# A right answer runs the twin's float32 operations in the same order: equal bit for bit. The
# tolerance, 8 units in the last place of max(|value|, lr), only absorbs a kernel that contracts
# an elementwise a*b+c into one rounding (FMA) in one optimizer and not the other; a wrong step
# moves a value by about lr = 1e-2, 10^5 times more.
ULPS8 = 2.0**-20


def _compare_owned(results: list[dict], opt_name: str) -> float:
    """Raise at the first tensor that differs from the twin (or from torch's); return the largest
    difference from one process on the whole batch (shown, not failed on)."""
    psi, lr, one, owners = results[0]["psi"], 1e-2, 0.0, results[0]["owners"]
    for rank, res in enumerate(results):
        if res["owners"] != owners:
            raise CheckFailed(
                f"rank {rank}'s owners {res['owners']} differ from rank 0's {owners}: every rank "
                "must compute the same owners (from the sizes alone), or a broadcast's source "
                "differs between ranks"
            )
    for step in range(OWNED_STEPS):
        for rank, res in enumerate(results):
            s = res["steps"][step]
            for k, (mine, want) in enumerate(zip(s["mine"], s["want"], strict=True)):
                one = max(one, (mine - s["one"][k]).abs().max().item())
                ok = allclose(mine, want, ULPS8, ULPS8 * lr, f"06 zero step {opt_name}")
                if ok and allclose(mine, s["torch"][k], ULPS8, ULPS8 * lr, "06 vs torch"):
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
                    f"{where} differs by up to {diff:.3g} from torch's ZeroRedundancyOptimizer "
                    "and from one optimizer stepping every tensor with the same averaged "
                    "gradients: build the optimizer on this rank's tensors only, step it, then "
                    "broadcast every tensor from its owner"
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


def _check_run(results: list[dict], name: str, opt_name: str) -> float:
    lists = [e for res in results for e in res.get("lists", [])]
    for numels, world, owners, _ in lists:  # the balance first, from any rank that built
        if owners is not None:
            _check_owners(name, numels, world, owners, None)
    for numels, world, owners, err in lists:
        _check_owners(name, numels, world, owners, err)
    for res in results:
        if res["error"] is None and res.get("owners") is not None:
            _check_owners(name, res["numels"], len(results), res["owners"], None)
    for rank, res in enumerate(results):
        if res["error"] is not None:
            raise CheckFailed(f"{name} on rank {rank} with {opt_name}: {res['error']}")
    return _compare_owned(results, opt_name)


def check_owned_tensors(cls, nprocs: int | None = None) -> None:
    """Lesson 06: ``cls(params, optimizer_class, group=None, **defaults)`` must own whole tensors
    (``.owners``, balanced), keep an optimizer on this rank's (``.optimizer``) and, in ``step()``
    after DDP's all-reduce, train as one process and torch's ZeroRedundancyOptimizer do, with
    AdamW and Adafactor, moving 3Ψ."""
    name = getattr(cls, "__name__", "the optimizer")
    world = max(nprocs or default_nprocs(), MIN_WORLD)  # launch_check's world
    lines = []
    for k, opt_name in enumerate(OWNED_OPTIMIZERS):
        sub = k == 0  # the owner lists and the subgroup once, with the first optimizer
        results = launch_check(_owned_rank, world, cls, opt_name, sub, timeout=TIMEOUT)
        one = _check_run(results, name, opt_name)
        if sub:
            try:
                _check_run([results[r]["sub"] for r in SUBGROUP], name, opt_name)
            except CheckFailed as e:
                raise subgroup_failure(name, world, str(e)) from None
        per_rank = ", ".join(format_bytes(r["opt_bytes"]) for r in results)
        theirs = ", ".join(format_bytes(r["torch_opt_bytes"]) for r in results)
        lines.append(
            f"{opt_name}: equal to torch's ZeroRedundancyOptimizer and to one optimizer over every "
            f"tensor with the same gradients; beside one process on the whole batch, max "
            f"|difference| {one:.2g} (its sums run in another order); optimizer states per rank "
            f"{per_rank} (torch's: {theirs})"
        )
    print("\n".join(lines))
    print(
        f"PASS  {name} balances whole tensors and trains TinyGPT as torch's "
        f"ZeroRedundancyOptimizer does, with AdamW and with Adafactor, for {OWNED_STEPS} steps on "
        f"{world} ranks (AdamW on the subgroup {list(SUBGROUP)} too), moving 3Ψ per step "
        "(all-reduce 2Ψ + broadcast Ψ)"
    )
