"""The habits of a PyTorch training loop that a data-parallel wrapper must notice.

Each guard here stands for one habit that would otherwise train a different model without a word,
or hang (the README's "What a PyTorch user expects" says, habit by habit, what happens). A guard
either makes the habit mean what it means with torch DDP and FSDP2, or refuses it with one message
that names the habit and says what works instead. Used by data_parallel.py and parallelize.py.
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from minizero.units import Hook, _Guarded

SAVE_ON_RANK_0 = "save on rank 0 only: `sd = model.state_dict(); if rank == 0: torch.save(sd, p)`"


def refuse_dtypes(
    params: Iterable[nn.Parameter], names: dict[int, str], full: torch.dtype = torch.float32
) -> None:
    """The stages keep gradient buckets and masters in ``full`` (fp32; fp64 under
    ``precision="fp64"``) and cast the 16-bit working copy themselves (``precision=``): a parameter
    of another dtype would never get its gradient."""
    for p in (p for p in params if p.requires_grad):
        if p.dtype == torch.float64 and full != torch.float64:
            raise TypeError(
                f"parameter {names[id(p)]!r} is torch.float64: pass precision='fp64' to train "
                "a float64 model, or call model.float()"
            )
        if p.dtype != full:
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


def claim(module: nn.Module, wrapper: str) -> None:
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


class Trainable:
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


def check_step_is_elementwise(optimizer: torch.optim.Optimizer, base: type) -> None:
    """A subclass of an elementwise optimizer is elementwise only if it keeps the base's
    ``step``: LAMB written on Adam (or LARS on SGD) overrides it with per-tensor norms, which on
    a flat shard would be norms of fragments. A subclass that is elementwise anyway says so with
    ``minizero_elementwise = True``."""
    cls = type(optimizer)
    if getattr(cls, "minizero_elementwise", False):
        return
    want = inspect.unwrap(base.step)  # torch wraps step with profiling hooks; compare the code
    for c in cls.__mro__[: cls.__mro__.index(base)]:
        step = None if c.__dict__.get("minizero_wraps_step") else c.__dict__.get("step")
        if step is not None and inspect.unwrap(step) is not want:
            raise TypeError(
                f"{cls.__name__}.step overrides {base.__name__}.step: at stages 1-3 (and in mixed "
                f"precision) each rank steps flat fragments of the parameters, so a step that "
                f"uses per-tensor norms (LAMB, LARS) would compute them over fragments. Use "
                f"stage=0 with precision='fp32', or, if your step is elementwise, set "
                f"{cls.__name__}.minizero_elementwise = True"
            )


def match_keys(own: dict, state_dict: dict, strict: bool) -> tuple[dict, list[str], list[str]]:
    """``load_state_dict`` of a plain model's or torch DDP's (``module.``) state dict: the keys
    and shapes must match the wrapped model's (only the keys unless ``strict``)."""
    if state_dict and all(k.startswith("module.") for k in state_dict):  # torch DDP's keys
        state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unexpected[:5]} "
            f"(pass strict=False to load the keys that match)"
        )
    for k, v in state_dict.items():
        if k in own and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(own[k].shape):
            raise RuntimeError(
                f"load_state_dict: {k!r} has shape {tuple(v.shape)} in the state dict and "
                f"{tuple(own[k].shape)} in the model"
            )
    return state_dict, missing, unexpected


class TorchNames:
    """What PyTorch users reach for on torch DDP's and FSDP2's wrappers, on minizero's too.

    ``model.config`` and other attributes of the wrapped model (FSDP2 keeps the model's class, so
    they work there); ``model.set_requires_gradient_sync(False)`` (FSDP2) and nanoGPT's
    ``model.require_backward_grad_sync = False`` (torch DDP's attribute): ``no_sync()`` until set
    back, refused where ``no_sync()`` is (stages 2-3 keep no local gradient to accumulate into)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (nn.Module's)
        except AttributeError:
            if name.startswith("_") or name == "module" or "module" not in self._modules:
                raise
            return getattr(self.module, name)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        with nullcontext() if requires else self.no_sync():  # stages 2-3 refuse here
            pass
        self.require_sync = requires

    require_backward_grad_sync = property(
        lambda self: self.require_sync, set_requires_gradient_sync
    )


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
            w.expect_every_rank("model.module.state_dict()", SAVE_ON_RANK_0)
        full = w.full_params()  # id(param) -> full fp32
        for k, p in named:  # (frozen ones: kept once in the working dtype; fp32 out)
            if k in state_dict:
                state_dict[k] = full[id(p)] if id(p) in full else state_dict[k].float()

    return hook


def full_module_load_state_dict(wrapper) -> None:
    """``raw_model.load_state_dict(sd)`` on the wrapped model itself: three hooks on it, the
    inverse of :func:`full_module_state_dict` (each a ``Hook``: a deepcopy of the model drops them,
    so loading into a copy leaves the wrapper alone).

    torch ``copy_``s each value into the parameter; then ``wrapper.params_written()`` refreshes the
    fp32 masters from the working copy (exact in fp32). Where that copy is sharded (stage 3: a
    ShardedParameterError) or 16-bit (mixed precision: masters rounded), a pre-hook takes the
    trainable parameters' full fp32 entries (``sd`` as ``state_dict()`` gives it, nanoGPT's resume)
    out of torch's copy of the dict, and a post-hook, after ``params_written``, gives each to
    ``wrapper.load_param``: this rank's ranges go into its shard or working copy and its fp32
    masters, exactly (local: no collective), and the keys come off ``missing_keys``. Buffers,
    frozen parameters, a wrong shape (torch's message) and stage 3 inside ``summon_full_params()``
    (full parameters) are left to torch."""
    ref = weakref.ref(wrapper)
    taken: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}

    def pre(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        taken.clear()
        w = ref()
        if w is None or not (w.stage == 3 or w.precision.master):
            return
        for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
            v = state_dict.get(name)
            ok = isinstance(v, torch.Tensor) and v.shape == p.shape and p.requires_grad
            if ok and (w.stage < 3 or isinstance(p, _Guarded)):
                taken[name] = (p, v.detach())
                del state_dict[name]  # (torch's own copy of the dict)

    def written(module, incompatible_keys) -> None:
        w = ref()
        if w is not None:
            w.params_written()

    def post(module, incompatible_keys) -> None:
        from minizero.precision import full_dtype  # (precision imports this module)

        w = ref()
        with torch.no_grad():
            for name, (p, v) in taken.items():
                w.load_param(p, v.to(full_dtype(w.precision)))
                if name in incompatible_keys.missing_keys:
                    incompatible_keys.missing_keys.remove(name)
        taken.clear()

    wrapper.module.register_load_state_dict_pre_hook(Hook(pre))
    wrapper.module.register_load_state_dict_post_hook(Hook(written))
    wrapper.module.register_load_state_dict_post_hook(Hook(post))


class Arrival:
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

    def __deepcopy__(self, memo) -> Arrival:  # copy.deepcopy(model) shares the store
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
