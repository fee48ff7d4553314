"""What the check cells of lessons 02 (02_zero1), 03 (03_zero2) and 04 (04_zero3) call.

Same contract as :mod:`minizero.checks`: each check trains the student's class on real ranks
(``minizero.launch``: gloo on CPU, or one rank per GPU over NCCL) next to its references, step by
step, and prints ``PASS`` with what was compared, or raises :class:`~minizero.checks.CheckFailed`
naming the step, the rank, the parameter (or the bucket element and the parameter it belongs to)
and the size of the difference. The references, for every check: one process on the whole batch,
minizero's own class for the stage, and PyTorch's peer (stage 1: ``ZeroRedundancyOptimizer``;
stage 2: FSDP2 ``fully_shard(reshard_after_forward=False)``; stage 3: FSDP2 ``fully_shard``).

The student's class is a subclass of minizero's stage class with one or two methods rewritten,
so the layout (buckets, chunks, masters) is the reference's and the gradient shards it hands to
the optimizer can be compared element by element with minizero's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  imported here, so that forked ranks inherit it
import torch.distributed.optim  # noqa: F401  (as above: seconds to import, once per process)
from torch import nn

from minizero import collectives as C
from minizero.checks import CheckFailed, _guard, _launch, _pass, describe, rank_device, run_info
from minizero.data import synthetic_batch
from minizero.models import MLP, count_params
from minizero.optimizer import attach
from minizero.zero1 import ZeRO1
from minizero.zero2 import ZeRO2
from minizero.zero3 import ZeRO3

STEPS, LR = 3, 1e-2
ROWS = 4  # rows per rank: global batch 4 N, two equal micro-batches per rank when accumulating
CAP_MB = 0.002  # 2 KiB buckets: the MLP (1,837 parameters) gets 3 buckets in fp32
RTOL, ATOL = 1e-4, 1e-6  # fp32, against every reference
BF16_RTOL, BF16_ATOL = 2e-2, 2e-3  # bf16 working copy, against minizero's class in bf16


# -- building the runs -----------------------------------------------------------------------------
def _mlp(dev: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every reference
    return MLP().to(dev)


def _named(module: nn.Module):
    return lambda: {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


def _one_process(module: nn.Module):
    return module, torch.optim.Adam(module.parameters(), lr=LR), _named(module)


def _minizero(cls, precision: str = "fp32", **kw):
    """``cls(module, ...)`` with Adam on what it says to optimize, as ``minizero.parallelize``."""

    def build(module: nn.Module):
        model = cls(module, bucket_cap_mb=CAP_MB, precision=precision, **kw)
        opt = attach(torch.optim.Adam(model.optimizer_params(), lr=LR), model)
        if isinstance(model, ZeRO3):  # full parameters live only while gathered: ask the masters
            return model, opt, lambda: {k: v.cpu() for k, v in model.full_state_dict().items()}
        return model, opt, _named(module)

    return build


def _torch_zero(module: nn.Module):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    dev = rank_device()
    ddp = DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return ddp, opt, _named(module)


def _fsdp2(reshard_after_forward: bool):
    def build(module: nn.Module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
        for layer in module.layers:  # one unit per Linear, as minizero's ZeRO3; the root: gain
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        opt = torch.optim.Adam(module.parameters(), lr=LR)
        return (
            module,
            opt,
            lambda: {
                n: p.full_tensor().detach().float().cpu().clone()
                for n, p in module.named_parameters()
            },
        )

    return build


def _layout(model, module: nn.Module) -> list[dict]:
    """Per bucket: its chunk size and which parameter sits where in the flat buffer."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        {
            "shard": b.shard,
            "params": [(names[id(p)], o, p.numel()) for p, o in zip(b.params, b.offsets)],
        }
        for b in model.buckets
    ]


# -- one run: STEPS steps of Adam on the MLP -------------------------------------------------------
def _train(
    build,
    rank: int,
    world: int,
    dev: torch.device,
    *,
    micro=(1, 1, 1),
    precision="fp32",
    observe=None,
) -> dict:
    """Train a fresh MLP wrapped by ``build`` for STEPS steps; step s takes ``micro[s]`` backwards
    over equal micro-batches of this rank's slice. Records per step: the local loss, the full
    parameters after the step, the gradients the optimizer stepped with (minizero: flat shards),
    the collectives and marks of the step, and ``observe(model, module)`` after each backward."""
    module = _mlp(dev)
    model, opt, params = build(module)
    seen: list = []
    if hasattr(model, "buckets"):  # minizero: the flat (shard,) gradients of this rank's chunks

        def record(o, args, kwargs):
            grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
            seen.append([t.detach().float().cpu().clone() for t in grads])

        opt.register_step_pre_hook(record)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    out = {"loss": [], "params": [], "seen": seen, "records": [], "marks": [], "observed": []}
    for step in range(STEPS):
        batch = ROWS * dist.get_world_size()  # the same global batch in every run, references too
        x, y = synthetic_batch("mlp", batch, step, rank=rank, world=world, device=dev)
        loss_sum = 0.0
        with C.CommLedger() as ledger:
            for xi, yi in zip(x.chunk(micro[step]), y.chunk(micro[step]), strict=True):
                C.mark("forward start")
                loss = model(xi.to(dtype), yi.to(dtype)) / micro[step]
                C.mark("backward start")
                loss.backward()
                loss_sum += loss.item()
                if observe is not None:
                    out["observed"].append(observe(model, module))
            C.mark("step")
            opt.step()
            opt.zero_grad()
        out["loss"].append(loss_sum)
        out["params"].append(params())
        out["records"].append([(r.op, r.numel, r.async_op, r.index, r.tag) for r in ledger.records])
        out["marks"].append(ledger.marks)
    if hasattr(model, "buckets"):
        out["layout"] = _layout(model, module)
    if hasattr(model, "_unit_labels"):  # lesson 04: module name -> its units
        out["units"] = model._unit_labels
    return out


def _run_all(refs: dict, student, rank: int, world: int, dev, **kw) -> dict:
    """Train every reference, then the student's run (guarded: its error comes back as text)."""
    out = {"info": run_info(), "psi": count_params(_mlp(dev)), "refs": {}, "mine": None}
    for name, build in refs.items():
        one = name.startswith("one process")
        out["refs"][name] = _train(build, 0 if one else rank, 1 if one else world, dev, **kw)
    out["mine"], out["error"] = _guard(_train, student, rank, world, dev, **kw)
    return out


# -- comparing -------------------------------------------------------------------------------------
def _where_in_bucket(layout: dict, rank: int, k: int) -> str:
    """Element ``k`` of rank ``rank``'s chunk: which parameter (and which of its elements)."""
    flat = rank * layout["shard"] + k
    for name, off, n in layout["params"]:
        if off <= flat < off + n:
            return f"element {flat - off} of {name!r}"
    return "padding (zeros that no parameter owns)"


def _compare(
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
    then every parameter after the step (against every reference). The strings are hints."""
    for step in range(STEPS):
        for ref_name, ref in refs.items():
            want, got = ref["loss"][step], mine["loss"][step]
            if not ref_name.startswith("one process") and abs(got - want) > atol + rtol * abs(want):
                raise CheckFailed(
                    f"step {step}, rank {rank}: the forward gave loss {got:.7g}, {ref_name} "
                    f"{want:.7g}: the parameters used in forward were not the right ones.{loss}"
                )
        _compare_shards(step, mine, refs[stage_ref], stage_ref, rank, world, shards, rtol, atol)
        for ref_name, ref in refs.items():
            for name, want in ref["params"][step].items():
                got = mine["params"][step].get(name)
                if got is None:
                    raise CheckFailed(
                        f"step {step}, rank {rank}: no parameter {name!r} after the step"
                    )
                if not torch.allclose(got, want, rtol=rtol, atol=atol):
                    diff = (got - want).abs().max().item()
                    raise CheckFailed(
                        f"step {step}, rank {rank}, parameter {name!r} after optimizer.step(): max "
                        f"|yours - {ref_name}| = {diff:.3g} (tolerance {atol:g} + {rtol:g} * "
                        f"|ref|).{params}"
                    )


def _compare_shards(
    step: int, mine: dict, ref: dict, ref_name: str, rank: int, world: int, what: str, rtol, atol
) -> None:
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
        bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
        if bad.any():
            k = int(bad.nonzero()[0])
            ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
            hint = f" {what}."
            if abs(ratio - world) < 0.05 * world:
                hint = f" Yours is {ratio:.2f}x: the reduce-scatter sums; divide by {world}."
            elif abs(ratio) < 0.05:
                hint = " Yours is ~0: did the reduced chunk reach this rank's shard?"
            raise CheckFailed(
                f"step {step}, rank {rank}, bucket {i}: the averaged gradient the optimizer "
                f"stepped with differs from {ref_name}'s at {int(bad.sum())} of {got.numel()} "
                f"elements; first at chunk element {k} = "
                f"{_where_in_bucket(ref['layout'][i], rank, k)}: yours {got[k].item():.6g}, "
                f"reference {want[k].item():.6g}.{hint}"
            )


def _by_op(records: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, numel, *_ in records:
        out[op] = out.get(op, 0) + numel
    return out


def _check_volume(
    mine: dict, ref: dict, ref_name: str, what: str, at_most: str = "", too_many: str = ""
) -> int:
    """Step by step, the elements each op moved (the paper's volume: no all-reduce is allowed)
    must equal ``ref``'s; for the ops in ``at_most``, not exceed them. ``too_many``: the hint when
    nothing fell short of ``ref`` (something moved more). Returns the last step's total."""
    for step, (recs, ref_recs) in enumerate(zip(mine["records"], ref["records"], strict=True)):
        got, want = _by_op(recs), _by_op(ref_recs)
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
    return sum(_by_op(mine["records"][-1]).values())


def _results(rank_fn, nprocs, student, *args) -> tuple[list[dict], int, str]:
    results = _launch(rank_fn, nprocs, student, *args)
    world = len(results)
    name = getattr(student, "__name__", "your class")
    for rank, res in enumerate(results):
        if res["error"]:
            raise CheckFailed(f"{name} raised on rank {rank} (world size {world}): {res['error']}")
    return results, world, name


# -- lesson 02: ZeRO-1 -----------------------------------------------------------------------------
def _zero1_rank(student) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {
        "one process on the whole batch": _one_process,
        "torch ZeroRedundancyOptimizer": _torch_zero,
        "minizero.zero1.ZeRO1": _minizero(ZeRO1),
    }
    out = _run_all(refs, _minizero(student), rank, world, dev)
    if out["error"] is None:  # mixed precision: fp32 masters apart from the bf16 working copy
        out["bf16_ref"] = _train(_minizero(ZeRO1, "bf16"), rank, world, dev, precision="bf16")
        out["bf16"], out["error"] = _guard(
            _train, _minizero(student, "bf16"), rank, world, dev, precision="bf16"
        )
    return out


def check_zero1(cls, nprocs: int | None = None) -> None:
    """Lesson 02: ``cls`` (a ZeRO1 subclass) must train as one process, torch's
    ZeroRedundancyOptimizer and minizero's ZeRO1 do (fp32 and bf16), with one reduce-scatter and
    one all-gather per bucket per step (2Ψ)."""
    results, world, name = _results(_zero1_rank, nprocs, cls)
    for rank, res in enumerate(results):
        mine, refs = res["mine"], res["refs"]
        _compare(
            mine,
            refs,
            "minizero.zero1.ZeRO1",
            rank,
            world,
            shards="Reduce-scatter each bucket's gradients into this rank's chunk, then average",
            params=" The gradients were right: after the step, all-gather every rank's updated "
            "chunk into the bucket's flat buffer (self.flat_params[i]).",
        )
        _compare(
            res["bf16"],
            {"minizero ZeRO1 in bf16": res["bf16_ref"]},
            "minizero ZeRO1 in bf16",
            rank,
            world,
            shards="In bf16",
            params=" In bf16 the optimizer steps a separate fp32 master (self.masters[i]): "
            "copy it into your bf16 chunk before the all-gather (when self.precision.master).",
            rtol=BF16_RTOL,
            atol=BF16_ATOL,
        )
    res = results[0]
    volume = _check_volume(
        res["mine"],
        res["refs"]["minizero.zero1.ZeRO1"],
        "minizero.zero1.ZeRO1",
        "one reduce-scatter and one all-gather of every bucket's padded flat buffer",
    )
    psi = res["psi"]
    _pass(
        f"{name}: gradient shards and parameters equal {', '.join(res['refs'])} for {STEPS} "
        f"Adam steps on {world} ranks ({describe(res['info'])}), and minizero's ZeRO1 in bf16; "
        f"moved {volume} elements per step = {volume / psi:.3f} Ψ (2Ψ, Ψ = {psi}, plus padding)"
    )


# -- lesson 03: ZeRO-2 -----------------------------------------------------------------------------
MICRO = (1, 2, 1)  # step 1 accumulates two backwards into the gradient shards


def _observe_stage2(model, module: nn.Module) -> dict:
    return {
        # a ShardedGrad (minizero/sharded_grad.py) owns no memory: it stands in for the shard
        "full_grads": [
            n
            for n, p in module.named_parameters()
            if p.grad is not None and type(p.grad).__name__ != "ShardedGrad"
        ],
        "live": getattr(model, "_live_max", None),
    }


def _count_live(model) -> None:
    """After each gradient hook of ``model``: how many full-size bucket buffers are alive."""
    model._live_max = 0

    def after(p, model=model):
        live = len(getattr(model, "_filling", {})) + (
            getattr(model, "_in_flight", None) is not None
        )
        model._live_max = max(model._live_max, live)

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
        "one process on the whole batch": _one_process,
        "torch FSDP2 (reshard_after_forward=False)": _fsdp2(False),
        "minizero.zero2.ZeRO2": _with_live_count(_minizero(ZeRO2)),
    }
    return _run_all(
        refs,
        _with_live_count(_minizero(student)),
        rank,
        world,
        dev,
        micro=MICRO,
        observe=_observe_stage2,
    )


def check_zero2(cls, nprocs: int | None = None) -> None:
    """Lesson 03: ``cls`` (a ZeRO2 subclass) must train as one process, FSDP2 and minizero's
    ZeRO2 (gradient accumulation included), keep no full ``p.grad`` after backward, start each
    bucket's reduce-scatter during backward, and keep at most two full bucket buffers alive."""
    results, world, name = _results(_zero2_rank, nprocs, cls)
    for rank, res in enumerate(results):
        mine, refs = res["mine"], res["refs"]
        for k, obs in enumerate(mine["observed"]):
            if obs["full_grads"]:
                raise CheckFailed(
                    f"rank {rank}, backward {k}: after backward {obs['full_grads']} still hold a "
                    "full gradient in p.grad; stage 2 keeps gradients only in the buckets and the "
                    "shard: set p.grad = None once it is copied into its bucket."
                )
        _compare(
            mine,
            refs,
            "minizero.zero2.ZeRO2",
            rank,
            world,
            shards="Add each reduce-scattered, averaged chunk into self.grad_shards[b.index] "
            "(add, not copy: backwards accumulate until the step)",
        )
    res = results[0]
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
    if live > 2:
        raise CheckFailed(
            f"up to {live} full-size gradient buffers were alive at once during backward: keep "
            "one being filled (self._filling) and one in flight, and free each as it completes."
        )
    volume = _check_volume(
        mine,
        res["refs"]["minizero.zero2.ZeRO2"],
        "minizero.zero2.ZeRO2",
        "one reduce-scatter of every bucket per backward, one all-gather per step",
    )
    psi = res["psi"]
    _pass(
        f"{name}: gradient shards and parameters equal {', '.join(res['refs'])} for {STEPS} "
        f"Adam steps (one of them over 2 micro-batches) on {world} ranks "
        f"({describe(res['info'])}); no p.grad after backward; every reduce-scatter started "
        f"during backward; at most {live} full bucket buffers alive; moved {volume} elements "
        f"per step = {volume / psi:.3f} Ψ"
    )


# -- lesson 04: ZeRO-3 -----------------------------------------------------------------------------
def _observe_stage3(model, module: nn.Module) -> dict | None:
    if not isinstance(model, ZeRO3):
        return None
    return {
        "held": [f.untyped_storage().nbytes() for f in model.flat_params],
        "max_gathered": model.max_gathered,
    }


def _zero3_rank(student, with_marks: bool) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {
        "one process on the whole batch": _one_process,
        "torch FSDP2 (fully_shard)": _fsdp2(True),
        "minizero.zero3.ZeRO3": _with_marks(_minizero(ZeRO3)) if with_marks else _minizero(ZeRO3),
    }
    mine = _with_marks(_minizero(student)) if with_marks else _minizero(student)
    return _run_all(refs, mine, rank, world, dev, observe=_observe_stage3)


def _with_marks(build):
    """Mark ``fwd:<module>`` on the ledger's timeline as each unit-owning module's forward starts,
    and ``bwd:<module>`` as its backward starts, before the stage's own hooks run."""

    def wrapped(module: nn.Module):
        model, opt, params = build(module)
        names = {m: n or "(root)" for n, m in module.named_modules()}
        for m in model._units_of:
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
        model._unit_labels = {names[m]: units for m, units in model._units_of.items()}
        return model, opt, params

    return wrapped


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


def _check_zero3_common(results: list[dict], world: int, hint: str) -> None:
    for rank, res in enumerate(results):
        mine, refs = res["mine"], res["refs"]
        ref = refs["minizero.zero3.ZeRO3"]
        _compare(
            mine,
            refs,
            "minizero.zero3.ZeRO3",
            rank,
            world,
            shards="Backward computes these from the gathered parameters: with wait=True, "
            "_gather(i) must wait for the all-gather; _free(i) must wait for one in flight",
            loss=hint,
        )
        for k, obs in enumerate(mine["observed"]):
            held = [i for i, n in enumerate(obs["held"]) if n]
            if held:
                raise CheckFailed(
                    f"rank {rank}, after backward {k}: units {held} still hold their full "
                    f"parameters ({sum(obs['held'])} bytes); _free(i) must resize the flat "
                    "buffer's storage to 0 bytes (flat.untyped_storage().resize_(0))."
                )
        most, ref_most = mine["observed"][-1]["max_gathered"], ref["observed"][-1]["max_gathered"]
        if most > ref_most:
            raise CheckFailed(
                f"rank {rank}: up to {most} units were gathered at once, minizero's ZeRO3 never "
                f"has more than {ref_most}: free each module's units after its forward and after "
                "its backward, and prefetch only the next module's."
            )


def check_zero3_gather(cls, nprocs: int | None = None) -> None:
    """Lesson 04, gather/free: ``cls`` (a ZeRO3 subclass) must give the losses of minizero's ZeRO3
    and FSDP2, the parameters of one process too, hold no full parameter after backward, and move
    3Ψ per step (two all-gathers and one reduce-scatter of every unit)."""
    results, world, name = _results(_zero3_rank, nprocs, cls, False)
    _check_zero3_common(
        results,
        world,
        " Check _gather: resize the storage to the padded size "
        "(in bytes), then all-gather self.param_shards[i] into self.flat_params[i]"
        "; and wait for the gather before the module uses it.",
    )
    res = results[0]
    mine = res["mine"]
    volume = _check_volume(
        mine,
        res["refs"]["minizero.zero3.ZeRO3"],
        "minizero.zero3.ZeRO3",
        "the same all-gathers (hooks unchanged) and one reduce-scatter of every unit",
    )
    psi = res["psi"]
    _pass(
        f"{name}: losses, gradient shards and parameters equal {', '.join(res['refs'])} for "
        f"{STEPS} Adam steps on {world} ranks ({describe(res['info'])}); no full parameter "
        f"held after backward; at most {mine['observed'][-1]['max_gathered']} units gathered at "
        f"once; moved {volume} elements per step = {volume / psi:.3f} Ψ (Ψ = {psi}), as "
        "minizero's ZeRO3"
    )


def check_zero3_prefetch(cls, nprocs: int | None = None) -> None:
    """Lesson 04, prefetch: ``cls`` (a ZeRO3 subclass with its own ``_pre_forward`` and
    ``_pre_backward``) must train as the references and issue each module's all-gather before
    the module starts wherever minizero's ZeRO3 does (after the first, recording, step)."""
    results, world, name = _results(_zero3_rank, nprocs, cls, True)
    _check_zero3_common(
        results,
        world,
        " Gather every unit of the module (wait for it) before its forward or backward runs.",
    )
    res = results[0]
    mine, ref = res["mine"], res["refs"]["minizero.zero3.ZeRO3"]
    units = ref["units"]
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
                    " module in the recorded order: self._neighbour(m, "
                    f"{'+' if phase == 'forward' else '-'}self.prefetch)."
                )
        n_pre += sum(s == "prefetched" for _, s in got)
    volume = _check_volume(
        mine,
        ref,
        "minizero.zero3.ZeRO3",
        "every unit gathered for its forward and its backward, and reduce-scattered once",
        at_most="all_gather",
        too_many="In backward, do not prefetch a unit whose gradients are already "
        "reduce-scattered (self._pending[i] == -1): nothing needs it any more.",
    )
    _pass(
        f"{name}: losses and parameters equal {', '.join(res['refs'])} for {STEPS} Adam steps on "
        f"{world} ranks ({describe(res['info'])}); {n_pre} module all-gathers prefetched in steps "
        f"1-{STEPS - 1}, as minizero's ZeRO3; moved {volume / res['psi']:.3f} Ψ per step"
    )
