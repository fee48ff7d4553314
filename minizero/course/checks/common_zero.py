"""What the ZeRO checks of lessons 02-04 share: training runs side by side, compared step by step.

Same contract as every check (:mod:`.common`): each check trains the student's class on real ranks
(``minizero.launch``: gloo on CPU, or one rank per GPU over NCCL) next to its references, step by
step, and prints ``PASS`` with what was compared, or raises :class:`~.common.CheckFailed`
naming the step, the rank, the parameter (or the bucket element and the parameter it belongs to)
and the size of the difference. The references: one process on the whole batch, minizero's own
class for the stage, and PyTorch's peer (stage 1: ``ZeroRedundancyOptimizer``; stage 2: FSDP2
``fully_shard(reshard_after_forward=False)``; stage 3: FSDP2 ``fully_shard``).

The student's class is a subclass of minizero's stage class with one or two methods rewritten,
so the layout (buckets, chunks, masters) is the reference's and the gradient shards it hands to
the optimizer can be compared element by element with minizero's (the comparing, and why its
tolerances hold on any machine: :mod:`.compare_zero`). The checks themselves live
beside their lessons: :mod:`.lesson02` (stage 1), :mod:`.lesson03` (stage 2), :mod:`.lesson04`
(stage 3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401  imported here, so that forked ranks inherit it
import torch.distributed.optim  # noqa: F401  (as above: seconds to import, once per process)
from torch import nn

from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.course.checks.common import (
    SUBGROUP,
    CheckFailed,
    check_seed,
    guard,
    launch_check,
    on_subgroup,
    raised_hint,
    rank_device,
    run_info,
    strict_ledger,
    subgroup_failure,
)
from minizero.course.checks.compare_zero import compare
from minizero.habits import Habits
from minizero.models import MLP, count_params, synthetic_batch
from minizero.optimizer import attach
from minizero.precision import POLICIES, Precision
from minizero.zero3 import ZeRO3

STEPS, LR = 3, 1e-2
# The 16-bit policies the ZeRO checks also train the student's class in, each against
# minizero's own class in the same policy: bf16 and fp16 as minizero names them, and (lesson 03,
# whose exercise makes the bucket) bf16 reduced in fp32 (FSDP2's MixedPrecisionPolicy(
# param_dtype=bf16, reduce_dtype=fp32), as production bf16 training runs), where a bucket made
# in the gradient's dtype is the wrong one.
# One SGD step over 2 micro-batches (accumulation included): SGD's update is lr times the
# gradient, so a gradient scaled by a constant shows in the update (Adam's m / sqrt(v) would
# divide it out). One step: the float64 run already checks what later steps add.
# Compared bit for bit: see compare_zero.compare_precision.
PRECISIONS = {
    "bf16": POLICIES["bf16"],
    "fp16": POLICIES["fp16"],
    "bf16 reduced in fp32": Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}
PRECISION_MICRO = (2,)
# The fp16 runs' first loss scale: at LossScaler's 2^16 an fp16 backward of this MLP overflows,
# and the step is skipped (nothing to compare); at 2^10 none overflows, every step steps.
FP16_SCALE = 2.0**10
ROWS = 4  # rows per rank: global batch 4 N, two equal micro-batches per rank when accumulating
CAP_MB = 0.002  # 2 KiB, torch DDP's rule: the MLP's 7 parameters in 2 buckets in fp32, 3 in fp64


# -- building the runs -----------------------------------------------------------------------------
def mlp(dev: torch.device, precision: str = "fp32") -> nn.Module:
    """The checks' model: the same initial weights on every rank and in every reference; float64
    for the "fp32" runs (see RTOL), float32 under a 16-bit ``precision`` (its masters)."""
    torch.manual_seed(check_seed())
    module = MLP().to(dev)
    return module if precision in PRECISIONS else module.double()


def lib_precision(precision: str) -> str | Precision:
    """The ``precision=`` minizero's classes get: "fp32" runs are float64 runs (see RTOL); a name
    of :data:`PRECISIONS`, its policy."""
    return "fp64" if precision == "fp32" else PRECISIONS.get(precision, precision)


def named_params(module: nn.Module):
    """A function returning ``module``'s parameters as full fp32 CPU tensors, by name."""
    return lambda: {n: p.detach().double().cpu().clone() for n, p in module.named_parameters()}


def one_process(module: nn.Module):
    """Reference: the plain module and Adam, run by one process on the whole batch."""
    return module, torch.optim.Adam(module.parameters(), lr=LR), named_params(module)


def minizero_build(cls, precision: str = "fp32", **kw):
    """``cls(module, ...)`` with Adam on what it says to optimize (SGD under the 16-bit
    :data:`PRECISIONS`), composed as ``minizero.parallelize`` composes it: the habits around the
    core, the buckets rebuilt."""

    def build(module: nn.Module):
        cap = {} if issubclass(cls, ZeRO3) else {"bucket_cap_mb": CAP_MB}  # stage 3: units
        parts = {"extension": Habits}  # parallelize's composition (the bucket rebuild in it)
        model = cls(module, precision=lib_precision(precision), **cap, **parts, **kw)
        optim = torch.optim.SGD if precision in PRECISIONS else torch.optim.Adam
        opt = attach(optim(model.optimizer_params(), lr=LR), model)
        if isinstance(model, ZeRO3):  # full parameters live only while gathered: ask the masters
            return (
                model,
                opt,
                lambda: {k: v.double().cpu() for k, v in model.full_state_dict().items()},
            )
        return model, opt, named_params(module)

    return build


def torch_zero(module: nn.Module):
    """Reference for stage 1: torch DDP with ``ZeroRedundancyOptimizer``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    dev = rank_device()
    ddp = DistributedDataParallel(module, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    return ddp, opt, named_params(module)


def fsdp2(reshard_after_forward: bool):
    """Reference for stages 2 (``False``) and 3 (``True``): FSDP2, one unit per Linear + root."""

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
                n: p.full_tensor().detach().double().cpu().clone()
                for n, p in module.named_parameters()
            },
        )

    return build


def layout(model, module: nn.Module) -> list[dict]:
    """Per bucket: its chunk size and which parameter sits where in the flat buffer."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        {
            "shard": b.shard,
            "params": [(names[id(p)], o, p.numel()) for p, o in zip(b.params, b.offsets)],
        }
        for b in model.buckets
    ]


# -- one run: a step per entry of micro (STEPS of Adam; 16-bit: 2 of SGD) on the MLP ---------
def train(
    build,
    rank: int,
    world: int,
    dev: torch.device,
    *,
    micro=(1,) * STEPS,
    precision="fp32",
    observe=None,
    after=None,
) -> dict:
    """Train a fresh MLP wrapped by ``build``, one step per entry of ``micro``: step s takes
    ``micro[s]`` backwards
    over equal micro-batches of this rank's slice. Records per step: the local loss, the full
    parameters after the step, the gradients the optimizer stepped with (minizero: flat shards),
    the collectives and marks of the step, and ``observe(model, module)`` after each backward.
    ``after(model)``, if given, runs once training is over on minizero's classes (the student's
    included); what it returns is ``out["after"]``."""
    module = mlp(dev, precision)
    model, opt, params = build(module)
    if getattr(model, "scaler", None) is not None:  # fp16: see FP16_SCALE
        model.scaler.scale = FP16_SCALE
    seen: list = []
    if hasattr(model, "buckets"):  # minizero: the flat (shard,) gradients of this rank's chunks

        def record(o, args, kwargs):
            grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
            seen.append([t.detach().double().cpu().clone() for t in grads])

        opt.register_step_pre_hook(record)
    dtype = torch.float32 if precision in PRECISIONS else torch.float64  # 16-bit: the policy casts
    out = {"loss": [], "params": [], "seen": seen, "records": [], "marks": [], "observed": []}
    out["masters"] = []  # per step: (name, start, end, the fp32 master) of this rank's fragments
    out["param_dtype"] = next(module.parameters()).dtype  # the working copy's
    for step in range(len(micro)):
        batch = ROWS * dist.get_world_size()  # the same global batch in every run, references too
        x, y = synthetic_batch("mlp", batch, step, rank=rank, world=world, seed=check_seed(),
                               device=dev)  # fmt: skip
        loss_sum = 0.0
        with CommLedger() as ledger:
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
            if hasattr(model, "buckets") and len(seen) == step:  # skipped (an fp16 inf): none
                seen.append([])
            opt.zero_grad()
        out["loss"].append(loss_sum)
        out["params"].append(params())
        out["masters"].append(
            [
                (f.name, f.start, f.end, f.tensor.detach().double().cpu().clone())
                for f in getattr(model, "fragments", [])
                if f.is_flat_view
            ]
        )
        out["records"].append([(r.op, r.numel, r.async_op, r.index, r.tag) for r in ledger.records])
        out["marks"].append(ledger.marks)
    if hasattr(model, "buckets"):
        out["layout"] = layout(model, module)
    if after is not None and hasattr(model, "buckets"):  # minizero's classes and the student's
        out["after"] = after(model)
    return out


def run_all(refs: dict, student, rank: int, world: int, dev, **kw) -> dict:
    """Train every reference, then the student's run (guarded: its error comes back as text)."""
    out = {"info": run_info(), "psi": count_params(mlp(dev)), "refs": {}, "mine": None}
    for name, build in refs.items():
        one = name.startswith("one process")
        out["refs"][name] = train(build, 0 if one else rank, 1 if one else world, dev, **kw)
    out["mine"], out["error"] = guard(train, student, rank, world, dev, **kw)
    return out


def precision_runs(
    ref_cls, student, rank: int, world: int, dev, wrap=None, policies=("bf16", "fp16"), **kw
) -> dict:
    """Under each of ``policies`` (names of :data:`PRECISIONS`; "bf16 reduced in fp32" where the
    exercise makes a gradient buffer, lesson 03): minizero's ``ref_cls``, then the student's class
    (guarded), both wrapped by ``wrap(build)`` if given, PRECISION_MICRO steps of SGD. Returns
    ``{"prec": {name: {"ref": run, "mine": run}}, "error": the student's error or None}``."""
    wrap = wrap or (lambda build: build)
    out: dict = {"prec": {}, "error": None}
    for name in policies:
        args = dict(kw, micro=PRECISION_MICRO, precision=name)
        ref = train(wrap(minizero_build(ref_cls, name)), rank, world, dev, **args)
        mine, err = guard(train, wrap(minizero_build(student, name)), rank, world, dev, **args)
        if err is not None:
            out["error"] = f"under precision={name!r}: {err}"
            break
        out["prec"][name] = {"ref": ref, "mine": mine}
    return out


def sub_run(group, ref_cls, student_cls, **kw) -> dict:
    """On the members of a subgroup: minizero's ``ref_cls`` and the student's class, both given
    ``process_group=group``, the student's under ``CommLedger(only_group=group)``; returns the
    error, or where the gradient shards or the parameters first differ (``diff``, else None)."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    ref = train(minizero_build(ref_cls, process_group=group), rank, world, dev, **kw)
    with strict_ledger(group):
        mine, err = guard(train, minizero_build(student_cls, process_group=group), rank, world,
                          dev, **kw)  # fmt: skip
    if err is not None:
        return {"error": err}
    try:
        compare(mine, {"minizero's class": ref}, "minizero's class", rank, world, shards="")
    except CheckFailed as e:
        return {"error": None, "diff": str(e)}
    return {"error": None, "diff": None}


def with_subgroup(out: dict, ref_cls, student_cls, **kw) -> dict:
    """``out`` (a rank's results), plus ``out["sub"]``: :func:`sub_run` on :data:`SUBGROUP`."""
    if out.get("error") is None:
        out["sub"] = on_subgroup(sub_run, ref_cls, student_cls, **kw)
    return out


def check_subgroup(res_all: list[dict], world: int, name: str) -> None:
    """Raise if the student's run on :data:`SUBGROUP` raised or differed from minizero's."""
    for rank in SUBGROUP:
        sub = res_all[rank].get("sub") or {}
        if sub.get("error"):
            raise subgroup_failure(name, world, f"raised on rank {rank}: {sub['error']}.")
        if sub.get("diff"):
            raise subgroup_failure(name, world, f"differs from minizero's: {sub['diff']}")


def results(rank_fn, nprocs, student, *args) -> tuple[list[dict], int, str]:
    """Launch ``rank_fn(student, *args)`` on the ranks; raise if the student's code raised."""
    res = launch_check(rank_fn, nprocs, student, *args)
    world = len(res)
    name = getattr(student, "__name__", "your class")
    for rank, r in enumerate(res):
        if r["error"]:
            raise CheckFailed(
                f"{name} raised on rank {rank} (world size {world}): {r['error']}."
                f"{raised_hint(world, r['error'])}"
            )
    return res, world, name
