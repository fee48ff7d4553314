"""One entry point for every stage: ``parallelize(model, stage, optimizer_fn)``. Every lesson.

    model, optimizer = minizero.parallelize(model, stage=2, optimizer_fn=lambda p: AdamW(p, 1e-3))
    for x, y in data:                      # a normal PyTorch loop, unchanged
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

stage 0 is DDP (ZeRO §3's baseline); 1, 2, 3 are ZeRO-DP's P_os, P_os+g, P_os+g+p (§5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib import import_module

import torch
import torch.distributed as dist
from torch import nn

from minizero.data_parallel import DataParallel
from minizero.optimizer import attach
from minizero.precision import check_elementwise, resolve

OptimizerFn = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


STAGES = {0: ("ddp", "DDP"), 1: ("zero1", "ZeRO1"), 2: ("zero2", "ZeRO2"), 3: ("zero3", "ZeRO3")}


def _stage_class(stage: int):
    module, name = STAGES[stage]
    return getattr(import_module(f"minizero.{module}"), name)


def parallelize(
    model: nn.Module,
    stage: int,
    optimizer_fn: OptimizerFn,
    *,
    precision: str = "fp32",
    bucket_cap_mb: float = 25,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` for data-parallel training at ZeRO ``stage`` and build its optimizer.

    ``optimizer_fn(tensors)`` builds a torch optimizer on the tensors this rank updates: the model's
    parameters for DDP in fp32, otherwise flat fp32 master shards (so the optimizer must be
    elementwise: SGD, Adam, AdamW, ...). ``precision``: "fp32", "bf16" or "fp16" (fp16 adds dynamic
    loss scaling; both keep fp32 master weights). ``bucket_cap_mb``: size of each gradient bucket
    (stages 0-2); stage 3 communicates per module. Under NCCL the model is moved to this rank's GPU.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (ZeRO), got {stage!r}")
    if not callable(optimizer_fn):
        raise TypeError(
            "optimizer_fn must be a function: tensors -> torch.optim.Optimizer, "
            "e.g. lambda p: torch.optim.AdamW(p, lr=1e-3)"
        )
    if isinstance(model, DataParallel):
        raise ValueError("model is already parallelized; pass the plain nn.Module")
    policy = resolve(precision)
    if dist.is_initialized() and dist.get_backend(process_group) == "nccl":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    wrapped = _stage_class(stage)(
        model, bucket_cap_mb=bucket_cap_mb, precision=policy, process_group=process_group
    )
    optimizer = optimizer_fn(wrapped.optimizer_params())
    if stage > 0 or policy.master:
        check_elementwise(optimizer)
    return wrapped, attach(optimizer, wrapped)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (and buffers) under the unwrapped model's keys, on every rank.

    Collective for ZeRO-1/2/3 (their masters are sharded): call it on every rank.
    """
    if isinstance(model, DataParallel):
        return model.full_state_dict()
    return {
        k: v.detach().float() if v.is_floating_point() else v.detach()
        for k, v in model.state_dict().items()
    }
