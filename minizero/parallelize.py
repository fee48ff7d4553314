"""One entry point for every stage: ``parallelize(model, stage, optimizer)``. Every lesson.

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # any param groups
    model, optimizer = minizero.parallelize(model, stage=2, optimizer=optimizer)
    for x, y in data:                      # a normal PyTorch loop, unchanged
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

stage 0 is DDP (ZeRO §3's baseline); 1, 2, 3 are ZeRO-DP's P_os, P_os+g, P_os+g+p (§5).

parallelize's arguments:
- ``optimizer``: a torch optimizer over ``model``'s parameters (any param groups; elementwise at
  stages 1-3 and in mixed precision, where it steps this rank's fp32 shards), or a function
  ``params -> optimizer``. Without one only the model is returned, and an optimizer built over its
  parameters afterwards (FSDP2's order) is adopted at its first ``step()``.
- ``precision``: "fp32", "bf16", "fp16" or a :class:`minizero.Precision`.
- ``bucket_cap_mb``: torch DDP's, in MiB (stages 0-2); ``mesh``: HSDP (hsdp.py); ``process_group``,
  ``broadcast_buffers``, ``find_unused_parameters``: as torch DDP's.
- stage 3's options: :func:`class_for_options`.

Under NCCL the model moves to this rank's GPU.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from minizero import hsdp
from minizero.data_parallel import DataParallel
from minizero.ddp import DDP
from minizero.habits import Habits
from minizero.optimizer import attach
from minizero.optimizer.state import regroup
from minizero.precision import Precision, resolve
from minizero.zero1 import ZeRO1
from minizero.zero2 import ZeRO2
from minizero.zero3 import ZeRO3
from minizero.zeropp import ZeROPlusPlus

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

OptimizerFn = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


STAGE_CLASSES = {0: DDP, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}  # the paper's chain, each extending the last
ZEROPP_OPTIONS = {"reshard_after_forward", "quantize_weights", "quantize_gradients"}  # zeropp.py
STAGE3_OPTIONS = {"units", "min_unit_params", "prefetch", "reshard_root",
                  "check_modules"} | ZEROPP_OPTIONS  # fmt: skip
TORCH_DDP_ONLY = {  # torch DDP's arguments a user carries over, and why minizero needs none
    "gradient_as_bucket_view": "minizero's p.grad is always a view of its bucket, as with True",
    "static_graph": "minizero needs no declaration that the graph is static",
    "device_ids": "under NCCL the model is moved to this rank's GPU by parallelize",
    "output_device": "the output stays where the model computed it",
}


def parallelize(
    model: nn.Module,
    stage: int,
    optimizer: torch.optim.Optimizer | OptimizerFn | None = None,
    *,
    precision: str | Precision = "fp32",
    bucket_cap_mb: float | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    broadcast_buffers: bool = True,
    find_unused_parameters: bool = False,
    **stage_options,
) -> tuple[nn.Module, torch.optim.Optimizer] | nn.Module:
    """Wrap ``model`` for data-parallel training at ZeRO ``stage``; return it and its optimizer
    (without ``optimizer``, only the model). Every argument: this module's docstring."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (ZeRO), got {stage!r}")
    if isinstance(model, DataParallel):
        raise ValueError("model is already parallelized; pass the plain nn.Module")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    cls = STAGE_CLASSES[stage]
    if stage_options or (bucket_cap_mb is not None and stage == 3):
        cls = class_for_options(stage, stage_options, bucket_cap_mb)
    if bucket_cap_mb is not None:
        stage_options["bucket_cap_mb"] = bucket_cap_mb
    if mesh is not None:  # HSDP: shard inside a node, replicate across nodes (hsdp.py)
        process_group, stage_options = hsdp.on_mesh(cls, mesh, process_group, stage_options)
    policy = resolve(precision)
    built = optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        built = build_optimizer(optimizer, model)  # a function params -> optimizer
    if built is not None:  # refused by name, before anything is wrapped (habits/optimizer.py)
        Habits.refuse_optimizer(built, sharded=stage > 0 or policy.master)
    if dist.is_initialized() and dist.get_backend(process_group) == "nccl":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    wrapped = cls(
        model,
        precision=policy,
        process_group=process_group,
        broadcast_buffers=broadcast_buffers,
        find_unused_parameters=find_unused_parameters,
        extension=Habits,  # the habits of a PyTorch loop, around the core (minizero/habits/)
        **stage_options,
    )
    wrapped.extension.adopt_on_first_step()  # an optimizer built after wrapping, over its params
    atexit.unregister(destroy_at_exit)  # registered once, however many models are wrapped
    atexit.register(destroy_at_exit)
    if built is None:
        return wrapped
    wrapped.extension.check_optimizer(built)  # its parameters are the model's, once each
    if any(f.is_flat_view for f in wrapped.fragments):  # stages 1-3, or a 16-bit working copy
        regroup(built, wrapped)  # it steps this rank's fp32 fragments, not the parameters
    return wrapped, wrapped.extension.attached(attach(built, wrapped))  # (a scheduler built before)


def class_for_options(stage: int, options: dict, bucket_cap_mb: float | None) -> type[ZeRO3]:
    """The class that ``options`` (beyond the ones every stage takes) build; only stage 3 takes
    any: ``units`` (module classes or a predicate; default: the repeated blocks),
    ``min_unit_params`` (smaller units folded into the one around them), ``prefetch``,
    ``reshard_root``, ``check_modules`` (minizero/zero3.py); with ZeRO++'s
    ``reshard_after_forward`` (True, False, or the ranks per node: hpZ, as FSDP2 defines it),
    ``quantize_weights`` (qwZ: int8 all-gathers) or ``quantize_gradients`` (qgZ):
    minizero/zeropp.py's ZeROPlusPlus. Refuses, with what to do instead, an option that is not
    stage 3's, and ``bucket_cap_mb`` at stage 3."""
    unknown = sorted(set(options) - STAGE3_OPTIONS)
    if unknown:
        hints = " ".join(f"{k}: {TORCH_DDP_ONLY[k]}." for k in unknown if k in TORCH_DDP_ONLY)
        raise TypeError(
            f"parallelize() got unknown option(s) {unknown}; it takes precision, bucket_cap_mb, "
            f"process_group, broadcast_buffers, find_unused_parameters, and at stage 3 "
            f"{sorted(STAGE3_OPTIONS)}. {hints}".rstrip()
        )
    if stage != 3:
        raise TypeError(f"{sorted(options)}: only stage 3 takes these options")
    if bucket_cap_mb is not None:
        raise TypeError(
            "stage 3 takes no bucket_cap_mb: its buckets are the units (units=..., default: the "
            "repeated blocks), one all-gather and one reduce-scatter per unit"
        )
    return ZeROPlusPlus if set(options) & ZEROPP_OPTIONS else ZeRO3


def build_optimizer(optimizer: OptimizerFn, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``optimizer(params)`` builds over the trainable parameters."""
    if not callable(optimizer) or isinstance(optimizer, nn.Module):  # (a module is callable)
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer over the model's parameters or a function "
            f"params -> optimizer, got {type(optimizer).__name__}"
            + (" (a list of optimizers is not supported: put every parameter in one optimizer, "
               "with param groups)" if isinstance(optimizer, list | tuple) else "")
        )  # fmt: skip
    built = optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer function returned {type(built).__name__}, not one "
            f"torch.optim.Optimizer; e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    return built


def destroy_at_exit() -> None:
    """At interpreter exit, destroy the default process group if the script did not.

    A script that leaves its group to the exit (``torchrun train.py`` without
    ``destroy_process_group()``) lets gloo's C++ threads outlive the interpreter, still holding
    work objects whose tensors have Python references: destroying those during finalisation can
    abort the process ("terminate called without an active exception", SIGABRT) after training
    finished, and torchrun then reports the job failed (pytorch/pytorch#190489, #179291). atexit
    handlers run while the interpreter is whole, so destroying the group here is safe; a script
    that destroyed it already makes this a no-op."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (and buffers) under the unwrapped model's keys, on every rank.

    Collective for ZeRO-1/2/3 (their masters are sharded): call it on every rank.
    """
    if isinstance(model, DataParallel):
        return model.state_dict()
    return {
        k: v.detach().float() if v.is_floating_point() else v.detach()
        for k, v in model.state_dict().items()
    }


def consolidate_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, to: int = 0) -> None:
    """Every rank calls it (collective); then rank ``to``'s ``optimizer.state_dict()`` is the
    whole optimizer state, as torch DDP's is, until the next step. ZeroRedundancyOptimizer's
    ``consolidate_state_dict(to=0)``, taking the model as FSDP2's ``get_optimizer_state_dict``
    does, so that it works before the optimizer's first step too (nanoGPT's resume saves before
    it): an optimizer over ``model``'s parameters that is not yet adopted is adopted here. nanoGPT::

        if iter_num % eval_interval == 0:  # every rank, before `if master_process:` saves
            minizero.consolidate_state_dict(model, optimizer)
    """
    if not isinstance(model, DataParallel):
        raise TypeError(
            f"consolidate_state_dict takes the model minizero.parallelize returned, got "
            f"{type(model).__name__}"
        )
    if optimizer not in model.optimizers and not model.extension.adopt(optimizer):
        raise ValueError(
            "this optimizer holds none of the model's parameters: pass the optimizer built "
            "over model.parameters()"
        )
    optimizer.consolidate_state_dict(to)
