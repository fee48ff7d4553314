"""The wrapped model: what a PyTorch user does to it, and what the wrapper must notice.

One wrapper per model; fp32 parameters only (the stage makes the 16-bit copy); which parameters
train fixed at construction; the model's own attributes through the wrapper (an error naming the
wrapper's class otherwise); the model's own ``state_dict()`` full and fp32; every rank arriving at
a collective that one might call on rank 0 only.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from minizero.data_parallel import SAVE_ON_RANK_0


def refuse_dtypes(params: list[nn.Parameter], names: dict[int, str]) -> None:
    """The stages keep fp32 gradient buckets and fp32 masters and cast the 16-bit working copy
    themselves (``precision=``): a parameter of another dtype would never get its gradient."""
    for p in params:
        if p.dtype != torch.float32:
            if p.dtype in (torch.float16, torch.bfloat16):
                fix = f"call model.float() and pass precision='{_short(p.dtype)}' instead"
            else:
                fix = "call model.float() (minizero trains fp32 parameters), or use torch DDP"
            raise TypeError(
                f"parameter {names[id(p)]!r} is {p.dtype}: minizero takes an fp32 model and "
                f"makes the 16-bit working copy itself (precision=...); {fix}"
            )


def _short(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def refuse_second_wrapper(module: nn.Module, wrapper: str) -> None:
    """One wrapper per model: a second ``parallelize`` of the same module (a notebook cell run
    twice) would stack a second set of hooks and buckets on it."""
    held = module.__dict__.get("_minizero_wrapped_by")
    if held is not None:
        raise RuntimeError(
            f"this model is already wrapped by minizero ({held}): a cell run twice? Build a fresh "
            f"model (e.g. model = Model(config)) before calling minizero.parallelize again, or "
            f"keep using the wrapper you have"
        )
    module.__dict__["_minizero_wrapped_by"] = wrapper  # not an attribute nn.Module registers


class FrozenFlags:
    """Which parameters train is fixed when the buckets are built: freezing or unfreezing one
    later (``p.requires_grad_(...)``, mid-run fine-tuning) is refused at the next forward."""

    def __init__(self, module: nn.Module, names: dict[int, str]):
        self.flags = [(p, p.requires_grad) for p in module.parameters()]
        self.names = names

    @torch.compiler.disable  # Python bookkeeping; under torch.compile it must not trace shards
    def check(self) -> None:
        changed = [p for p, flag in self.flags if p.requires_grad != flag]
        if changed:
            p = changed[0]
            now = "unfrozen" if p.requires_grad else "frozen"
            raise RuntimeError(
                f"parameter {self.names[id(p)]!r} was {now} after minizero.parallelize built its "
                f"buckets and shards (which parameters train is fixed then, as with FSDP2's "
                f"construction). Set requires_grad on every parameter before parallelize; to "
                f"unfreeze mid-run, save a checkpoint, build a new model with the new flags, "
                f"parallelize it and load the checkpoint"
            )


def forward_attribute(wrapper, name: str):
    """``model.config`` and other attributes of the wrapped model, on the wrapper (FSDP2 keeps the
    model's class, so they work there). A name neither has is an error that names the wrapper's
    class (a typo in a subclass a lesson writes, ``self.grad_buffer``), and the model's."""
    module = wrapper.__dict__["_modules"].get("module")
    if not name.startswith("_") and module is not None:
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    nor = "" if module is None else f" (nor has the model it wraps, {type(module).__name__})"
    raise AttributeError(f"{type(wrapper).__name__!r} object has no attribute {name!r}{nor}")


def full_module_state_dict(wrapper) -> Callable[..., None]:
    """A state-dict hook for the wrapped model itself (nanoGPT's ``raw_model.state_dict()``,
    Hugging Face's ``unwrap_model(model).save_pretrained``): its parameters full and fp32, as
    the wrapper's ``state_dict()`` gives them, not stage 3's empty shards or the 16-bit working
    copy (collective then, as the wrapper's). ``keep_vars=True`` keeps the parameter objects."""
    ref = weakref.ref(wrapper)

    def hook(module, state_dict, prefix, local_metadata) -> None:
        w = ref()
        if w is None or not (w.stage == 3 or w.precision.master):
            return  # the working copy is full fp32 there already
        named = [(prefix + n, p) for n, p in module.named_parameters(remove_duplicate=False)]
        if any(isinstance(state_dict.get(k), nn.Parameter) for k, _ in named):
            return  # keep_vars=True (minizero itself asks so)
        if w.stage > 0:
            w.habits.before_collective("model.module.state_dict()", SAVE_ON_RANK_0)
        full = w.full_params()  # id(param) -> full fp32
        for k, p in named:  # (frozen ones: kept once in the working dtype; fp32 out)
            if k in state_dict:
                state_dict[k] = full[id(p)] if id(p) in full else state_dict[k].float()

    return hook


class ArrivalCheck:
    """Before a collective that one might call on rank 0 only (nanoGPT's ``if master_process:``):
    every rank of ``group`` arrives within ``MINIZERO_ARRIVAL_S`` (30) seconds, or an error.

    Through the process group's key-value store (the one torchrun's rendezvous made), so it
    needs no collective of its own, works on subgroups, and costs one store round trip."""

    def __init__(self, group: dist.ProcessGroup | None, world: int):
        self.world = world
        self.store = None
        self.calls = 0
        if world == 1:
            return
        c10d = dist.distributed_c10d
        name = "world" if group is None else c10d._get_process_group_name(group)
        try:
            store = c10d._get_default_store()
            # the n-th wrapper this rank builds over this group: equal on every member rank
            n = store.add(f"minizero/wrappers/{name}/{dist.get_rank()}", 1)
        except (RuntimeError, AttributeError, ValueError):  # no usable store (the fake backend
            return  # of minizero.simulate): no check
        self.store, self.prefix = store, f"minizero/arrival/{name}/{n}"

    def __deepcopy__(self, memo) -> ArrivalCheck:  # copy.deepcopy(model) shares the store
        return self

    def expect(self, what: str, why: str, how: str) -> None:
        if self.store is None:
            return
        self.calls += 1
        key = f"{self.prefix}/{self.calls}"
        seconds = float(os.environ.get("MINIZERO_ARRIVAL_S", "30"))
        if self.store.add(key, 1) == self.world:
            self.store.set(key + "/all", "1")
        try:
            self.store.wait([key + "/all"], timedelta(seconds=seconds))
        except RuntimeError:  # torch's DistStoreError is a RuntimeError
            raise RuntimeError(
                f"{what} is collective {why} and some rank did not call it within {seconds:g} s. "
                f"Call it on every rank, {how}."
            ) from None
