"""What the check cells of lesson 04 (04_zero3) call: ``check_zero3_gather``, ``..._prefetch``.

The student's ``ZeRO3`` subclass trains on real ranks next to one process, FSDP2 and minizero's
``ZeRO3`` (:mod:`.common_zero`), and bit for bit against minizero's ``ZeRO3`` in bf16 and in
fp16. The gather check also probes ``gather`` and ``free`` one unit at a time against an all-gather
that is still in flight (a stand-in work object that records whether it was waited for): no training
run is guaranteed to free a unit whose prefetch has not completed, and a ``free`` that drops the
storage under a running all-gather lets the backend write into freed memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.course.checks.common import CheckFailed, describe, guard, rank_device, report_pass
from minizero.course.checks.common_zero import (
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
from minizero.zero3 import ZeRO3


def _observe(model, module: nn.Module) -> dict | None:
    if not isinstance(model, ZeRO3):
        return None
    return {
        "held": [f.untyped_storage().nbytes() for f in model.flat_params],
        "max_gathered": model.max_gathered,
    }


class _InFlight:
    """Stands for an all-gather that has not completed: records whether ``wait()`` was called."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


def _probe(model) -> list[str]:
    """After training, unit by unit: does ``free`` wait for (or keep) an all-gather in flight,
    and does ``gather(i)`` (wait=True) wait for one a prefetch started? Problems, as text."""
    problems = []
    for i, flat in enumerate(model.flat_params):
        model.gather(i)  # gathered (every rank makes the same calls: collectives stay in step)
        work = model.gather_works[i] = _InFlight()  # ...with an all-gather into it still running
        model.free(i)
        freed = flat.untyped_storage().nbytes() == 0
        if freed and not work.waited:
            problems.append(
                f"free({i}) resized unit {i}'s storage to 0 bytes while its all-gather was still "
                "in flight (self.gather_works[i] was neither waited for nor kept): the backend "
                "would write into freed memory. Wait for self.gather_works[i] first, then forget "
                "it."
            )
            break
        ZeRO3.free(model, i)  # back to a clean state, whatever the student's free left
        model.gather_works[i] = None
        ZeRO3.gather(model, i)
        work = model.gather_works[i] = _InFlight()  # gathered, its prefetch not yet complete
        model.gather(i)  # a module needs the unit now
        if not work.waited:
            problems.append(
                f"gather({i}) (wait=True) returned while unit {i}'s all-gather, started by a "
                "prefetch (wait=False), was still in flight: the module would read parameters "
                "not yet written. When wait is True, wait for self.gather_works[i] even if the "
                "unit is already marked gathered."
            )
            break
        model.gather_works[i] = None
        ZeRO3.free(model, i)
    return problems


class ReusedLayer(nn.Module):
    """A model whose first layer runs twice, the first time without gradient. Backward finishes
    that layer's gradients (its unit is reduce-scattered and freed: ``started[i]``) while
    the layer that ran before it in forward still has its backward to run, and that layer's
    backward hook is the one that would prefetch it: a prefetch that does not ask gathers Ψ_unit
    for nothing. (The MLP never reaches that case: each module runs once.)"""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(13, 13), nn.Linear(13, 13), nn.Linear(13, 7)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b, c = self.layers
        with torch.no_grad():
            x = x + a(x)  # (B, 13): a's first use, no gradient
        h = a(torch.tanh(b(x)))  # (B, 13): a again, with gradient
        return nn.functional.mse_loss(c(torch.tanh(h)), y)


def _reuse_gathers(cls) -> list[int]:
    """Elements all-gathered per step by ``cls`` (a ZeRO3) training :class:`ReusedLayer`."""
    torch.manual_seed(0)
    model, dev = cls(ReusedLayer().to(rank_device())), rank_device()
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(4, 13, generator=g).to(dev), torch.randn(4, 7, generator=g).to(dev)
        with CommLedger() as ledger:
            model(x, y).backward()
        out.append(ledger.by_op().get("all_gather", 0))
    return out


def _zero3_rank(student, with_marks: bool) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    ref = minizero_build(ZeRO3)
    refs = {
        "one process on the whole batch": one_process,
        "torch FSDP2 (fully_shard)": fsdp2(True),
        "minizero.zero3.ZeRO3": _with_marks(ref) if with_marks else ref,
    }
    mine = _with_marks(minizero_build(student)) if with_marks else minizero_build(student)
    after = _unit_labels if with_marks else lambda model: {"problems": _probe(model)}
    out = run_all(refs, mine, rank, world, dev, observe=_observe, after=after)
    if out["error"] is None:  # 16-bit: bit for bit minizero's ZeRO3 in the same policy
        out.update(precision_runs(ZeRO3, student, rank, world, dev))
    if with_marks and out["error"] is None:  # the prefetch check: a layer used twice
        out["reuse_ref"] = _reuse_gathers(ZeRO3)
        out["reuse"], out["error"] = guard(_reuse_gathers, student)
    return with_subgroup(out, ZeRO3, student)


def _unit_labels(model) -> dict:
    return {"units": model._unit_labels}  # module name -> its units, from _with_marks


def _with_marks(build):
    """Mark ``fwd:<module>`` on the ledger's timeline as each unit-owning module's forward starts,
    and ``bwd:<module>`` as its backward starts, before the stage's own hooks run."""

    def wrapped(module: nn.Module):
        model, opt, params = build(module)
        names = {m: n or "(root)" for n, m in module.named_modules()}
        for m in model.units_of:
            label = names[m]

            def pre(mod, args, label=label):
                C.mark(f"fwd:{label}")

            def post(mod, args, out, label=label):
                if torch.is_grad_enabled():
                    for t in out if isinstance(out, tuple | list) else [out]:
                        if isinstance(t, torch.Tensor) and t.requires_grad:
                            t.register_hook(lambda g, label=label: C.mark(f"bwd:{label}"))

            m.register_forward_pre_hook(pre, prepend=True)
            m.register_forward_hook(post, prepend=True)  # its tensor hook runs before the stage's
        model._unit_labels = {names[m]: units for m, units in model.units_of.items()}
        return model, opt, params

    return wrapped


def _gather_order(records: list, marks: list, units: dict[str, list[int]]) -> str:
    """The first structural fault of one step's all-gathers, or ``""``: a blocking all-gather, or
    a module whose own units were gathered after another unit's prefetch in its hook."""
    for op, _, async_op, _, tag in records:
        if op == "all_gather" and not async_op:
            return (
                f"the all-gather {tag!r} was blocking: start every all-gather with "
                "async_op=True, keep the work in self.gather_works[i], and wait for it only when "
                "wait=True (a prefetch must not stop the module that issues it)"
            )
    events = sorted(
        [(i, "mark", label) for i, label in marks if label[:4] in ("fwd:", "bwd:")]
        + [(i, "gather", tag) for op, _, _, i, tag in records if op == "all_gather"]
    )
    for k, (_, kind, label) in enumerate(events):
        if kind != "mark":
            continue
        own = {f"zero3 params {u}" for u in units[label[4:]]}
        seen_other = None
        for _, kind2, tag in events[k + 1 :]:
            if kind2 == "mark":
                break
            if tag not in own:
                seen_other = seen_other or tag
            elif seen_other:
                phase = "forward" if label.startswith("fwd:") else "backward"
                return (
                    f"in the {phase} hook of {label[4:]}, the prefetch {seen_other!r} was issued "
                    f"before {tag!r}, the unit this module needs now: gather (and wait for) the "
                    "module's own units first, then prefetch its neighbour's"
                )
    return ""


def _prefetch_status(records: list, marks: list, units: dict[str, list[int]]) -> list[tuple]:
    """For each module mark of one step: was its units' all-gather issued before the module
    started (``prefetched``), after (``on demand``), or not at all (``none``, still gathered)?"""
    events = sorted(
        [(i, "mark", label) for i, label in marks if label[:4] in ("fwd:", "bwd:")]
        + [(i, "gather", tag) for op, _, _, i, tag in records if op == "all_gather"]
    )
    module_marks = [k for k, e in enumerate(events) if e[1] == "mark"]
    out = []
    for j, k in enumerate(module_marks):
        lo = module_marks[j - 1] if j else -1
        hi = module_marks[j + 1] if j + 1 < len(module_marks) else len(events)
        label = events[k][2]
        tags = {f"zero3 params {u}" for u in units[label[4:]]}
        before = any(events[x][2] in tags for x in range(lo + 1, k))
        after = any(events[x][2] in tags for x in range(k + 1, hi))
        out.append((label, "prefetched" if before else "on demand" if after else "none"))
    return out


def _check_common(res_all: list[dict], world: int, hint: str) -> list[str]:
    for rank, res in enumerate(res_all):
        mine, refs = res["mine"], res["refs"]
        ref = refs["minizero.zero3.ZeRO3"]
        for problem in mine["after"].get("problems", []):  # structural, and deterministic: first
            raise CheckFailed(f"rank {rank}: {problem}")
        compare(
            mine,
            refs,
            "minizero.zero3.ZeRO3",
            rank,
            world,
            shards="Backward computes these from the gathered parameters: with wait=True, "
            "gather(i) must wait for the all-gather; free(i) must wait for one in flight",
            loss=hint,
        )
        for k, obs in enumerate(mine["observed"]):
            held = [i for i, n in enumerate(obs["held"]) if n]
            if held:
                raise CheckFailed(
                    f"rank {rank}, after backward {k}: units {held} still hold their full "
                    f"parameters ({sum(obs['held'])} bytes); free(i) must resize the flat "
                    "buffer's storage to 0 bytes (flat.untyped_storage().resize_(0))."
                )
        most, ref_most = mine["observed"][-1]["max_gathered"], ref["observed"][-1]["max_gathered"]
        if most > ref_most:
            raise CheckFailed(
                f"rank {rank}: up to {most} units were gathered at once, minizero's ZeRO3 never "
                f"has more than {ref_most}: free each module's units after its forward and after "
                "its backward, and prefetch only the next module's."
            )
    return check_precisions(res_all, "minizero's ZeRO3", world, None, hint)


def check_zero3_gather(cls, nprocs: int | None = None) -> None:
    """Lesson 04, gather/free: ``cls`` (a ZeRO3 subclass) must give the losses of minizero's ZeRO3
    and FSDP2, the parameters of one process too, hold no full parameter after backward, move
    3Ψ per step (two all-gathers and one reduce-scatter of every unit), never free a unit under
    an all-gather in flight, and wait for a prefetched all-gather before a module uses it."""
    res_all, world, name = results(_zero3_rank, nprocs, cls, False)
    policies = _check_common(
        res_all,
        world,
        " Check gather: resize the storage to the padded size "
        "(in bytes), then all-gather self.param_shards[i] into self.flat_params[i]"
        "; and wait for the gather before the module uses it.",
    )
    res = res_all[0]
    mine = res["mine"]
    for step, recs in enumerate(mine["records"]):
        fault = _gather_order(recs, [], {})
        if fault:
            raise CheckFailed(f"step {step}: {fault}.")
    volume = check_volume(
        mine,
        res["refs"]["minizero.zero3.ZeRO3"],
        "minizero.zero3.ZeRO3",
        "the same all-gathers (hooks unchanged) and one reduce-scatter of every unit",
    )
    psi = res["psi"]
    check_subgroup(res_all, world, name)  # last: the mistakes above name themselves
    report_pass(
        f"{name}: losses, gradient shards and parameters equal {', '.join(res['refs'])} for "
        f"{STEPS} Adam steps on {world} ranks ({describe(res['info'])}), bit for bit minizero's "
        f"ZeRO3 under {', '.join(policies)} (SGD); no full parameter "
        f"held after backward; at most {mine['observed'][-1]['max_gathered']} units gathered at "
        f"once; moved {volume} elements per step = {volume / psi:.3f} Ψ (Ψ = {psi}), as "
        "minizero's ZeRO3; free and gather wait for an all-gather in flight"
    )


def check_zero3_prefetch(cls, nprocs: int | None = None) -> None:
    """Lesson 04, prefetch: ``cls`` (a ZeRO3 subclass with its own ``pre_forward`` and
    ``pre_backward``) must train as the references and issue each module's all-gather before
    the module starts wherever minizero's ZeRO3 does (after the first, recording, step)."""
    res_all, world, name = results(_zero3_rank, nprocs, cls, True)
    policies = _check_common(
        res_all,
        world,
        " Gather every unit of the module (wait for it) before its forward or backward runs.",
    )
    res = res_all[0]
    mine, ref = res["mine"], res["refs"]["minizero.zero3.ZeRO3"]
    units = ref["after"]["units"]
    for step in range(STEPS):
        fault = _gather_order(mine["records"][step], mine["marks"][step], units)
        if fault:
            raise CheckFailed(f"step {step}: {fault}.")
    n_pre = 0
    for step in range(1, STEPS):  # step 0 records the order of the modules
        got = _prefetch_status(mine["records"][step], mine["marks"][step], units)
        want = _prefetch_status(ref["records"][step], ref["marks"][step], units)
        for (label, g), (wlabel, w) in zip(got, want, strict=False):
            if label != wlabel:
                raise CheckFailed(
                    f"step {step}: modules ran in a different order ({label} where minizero's "
                    f"ZeRO3 ran {wlabel})"
                )
            if g != w:
                phase = "forward" if label.startswith("fwd:") else "backward"
                raise CheckFailed(
                    f"step {step}, {phase} of {label[4:]}: its all-gather was {g} (minizero's "
                    f"ZeRO3: {w}). In {phase}, once this module's own units are gathered, start "
                    f"(wait=False) the gather of the {'next' if phase == 'forward' else 'previous'}"
                    " module in the recorded order: self.neighbour(m, "
                    f"{'+' if phase == 'forward' else '-'}self.prefetch)."
                )
        n_pre += sum(s == "prefetched" for _, s in got)
    volume = check_volume(
        mine,
        ref,
        "minizero.zero3.ZeRO3",
        "every unit gathered for its forward and its backward, and reduce-scattered once",
        at_most="all_gather",
        too_many="In backward, do not prefetch a unit whose gradients are already "
        "reduce-scattered (self.started[i]): nothing needs it any more.",
    )
    for step, (got, want) in enumerate(zip(res["reuse"], res["reuse_ref"], strict=True)):
        if got > want:
            raise CheckFailed(
                f"step {step}, a model whose first layer runs twice (checks.lesson04.ReusedLayer):"
                f" yours all-gathered {got} elements, minizero's ZeRO3 {want}: a unit was "
                "gathered after its backward was over. In backward, do not prefetch a unit whose "
                "gradients are already reduce-scattered (self.started[i]): nothing needs "
                "it any more."
            )
    check_subgroup(res_all, world, name)  # last: the mistakes above name themselves
    report_pass(
        f"{name}: losses and parameters equal {', '.join(res['refs'])} for {STEPS} Adam steps on "
        f"{world} ranks ({describe(res['info'])}), bit for bit ZeRO3's under "
        f"{', '.join(policies)} (SGD); {n_pre} module all-gathers prefetched in steps "
        f"1-{STEPS - 1}, as minizero's ZeRO3; moved {volume / res['psi']:.3f} Ψ per step"
    )
