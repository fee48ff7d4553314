"""The wrapped model: what a PyTorch user does to it, and what the wrapper must notice.

One wrapper per model; fp32 parameters only (the stage makes the 16-bit copy); which parameters
train fixed at construction; the model's own attributes through the wrapper (an error naming the
wrapper's class otherwise); state dicts full and fp32 under the model's own keys, the wrapper's
and the model's own (``torch.save(model.state_dict())`` as with one process, a plain model's or
torch DDP's state dict loaded back); every rank arriving at a collective that one might call on
rank 0 only.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from minizero.precision import full_dtype
from minizero.units import UncopiedHook, is_sharded

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


WRAPPED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # -> by whom


def refuse_second_wrapper(module: nn.Module, wrapper: str) -> None:
    """One wrapper per model: a second ``parallelize`` of the same module (a notebook cell run
    twice) would stack a second set of hooks and buckets on it. Which models are wrapped is
    minizero's record (:data:`WRAPPED`, weakly keyed), not an attribute of the model."""
    held = WRAPPED.get(module)
    if held is not None:
        raise RuntimeError(
            f"this model is already wrapped by minizero ({held}): a cell run twice? Build a fresh "
            f"model (e.g. model = Model(config)) before calling minizero.parallelize again, or "
            f"keep using the wrapper you have"
        )
    WRAPPED[module] = wrapper


class FrozenFlags:
    """Which parameters train is fixed when the buckets are built: freezing or unfreezing one
    later (``p.requires_grad_(...)``, mid-run fine-tuning) is refused at the next forward."""

    def __init__(self, module: nn.Module, names: dict[int, str]):
        self.flags = [(p, p.requires_grad) for p in module.parameters()]
        self.names = names

    @torch._disable_dynamo  # never traced (bookkeeping); Dynamo imported at first call, as optim
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


def expect_every_rank(wrapper, what: str, how: str) -> None:
    """Before a collective one might call on rank 0 only: every rank arrives, or an error."""
    why = f"at ZeRO stage {wrapper.stage} (a rank holds only its shard)"
    wrapper.extension.arrival.expect(what, why, how)


def full_state_dict(wrapper, destination: dict | None, prefix: str) -> dict:
    """The user's model's state dict with every parameter full and fp32 (collective)."""
    if wrapper.sharded.state:  # the fp32 masters are sharded: gathering them is collective
        expect_every_rank(wrapper, "model.state_dict()", SAVE_ON_RANK_0)
    sd = wrapper.module.state_dict(keep_vars=True)  # parameter objects are not read here
    full = wrapper.full_params()  # id(param) -> full fp32 tensor
    names = dict(wrapper.module.named_parameters(remove_duplicate=False))
    out = {}
    for k, v in sd.items():
        if k in names:
            v = full[id(names[k])] if id(names[k]) in full else names[k].detach()
            v = v.to(full_dtype(wrapper.precision))  # fp32, or fp64
        elif isinstance(v, torch.Tensor):
            v = v.detach()
        out[prefix + k] = v
    return out if destination is None else destination.update(out) or destination


def load_full_state_dict(wrapper, state_dict: dict, strict: bool):
    """Load a full state dict (a plain model's, torch DDP's, or the wrapper's): parameters go
    straight to the fp32 masters and the working copy, so the next step starts from them."""
    own = wrapper.module.state_dict(keep_vars=True)
    state_dict, missing, unexpected = match_keys(own, state_dict, strict)
    names = dict(wrapper.module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for k, v in state_dict.items():
            if k in names:  # (names are keys of own)
                wrapper.load_param(names[k], v.detach().to(full_dtype(wrapper.precision)))
            elif k in own:
                own[k].copy_(v)
    wrapper.forget_step_grads()  # this step's gradients, if any, were of other parameters
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


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


def full_module_state_dict(wrapper) -> Callable[..., None]:
    """A state-dict hook for the wrapped model itself (nanoGPT's ``raw_model.state_dict()``,
    Hugging Face's ``unwrap_model(model).save_pretrained``): its parameters full and fp32, as
    the wrapper's ``state_dict()`` gives them, not stage 3's empty shards or the 16-bit working
    copy (collective then, as the wrapper's). ``keep_vars=True`` keeps the parameter objects."""
    ref = weakref.ref(wrapper)

    def hook(module, state_dict, prefix, local_metadata) -> None:
        w = ref()
        if w is None or not (w.sharded.params or w.precision.master):
            return  # the working copy is full fp32 there already
        named = [(prefix + n, p) for n, p in module.named_parameters(remove_duplicate=False)]
        if any(isinstance(state_dict.get(k), nn.Parameter) for k, _ in named):
            return  # keep_vars=True (minizero itself asks so)
        if w.sharded.state:
            expect_every_rank(w, "model.module.state_dict()", SAVE_ON_RANK_0)
        full = w.full_params()  # id(param) -> full fp32
        for k, p in named:  # (frozen ones: kept once in the working dtype; fp32 out)
            if k in state_dict:
                v = full[id(p)] if id(p) in full else state_dict[k]
                state_dict[k] = v.to(full_dtype(w.precision))

    return hook


def full_module_load_state_dict(wrapper) -> None:
    """``raw_model.load_state_dict(sd)`` on the wrapped model itself: three hooks on it, the
    inverse of :func:`full_module_state_dict` (each an ``UncopiedHook``: a deepcopy of the model
    drops them, so loading into a copy leaves the wrapper alone).

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
        if w is None or not (w.sharded.params or w.precision.master):
            return
        for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
            v = state_dict.get(name)
            ok = isinstance(v, torch.Tensor) and v.shape == p.shape and p.requires_grad
            if ok and (not w.sharded.params or is_sharded(p)):
                taken[name] = (p, v.detach())
                del state_dict[name]  # (torch's own copy of the dict)

    def written(module, incompatible_keys) -> None:
        w = ref()
        if w is not None:
            w.params_written()

    def post(module, incompatible_keys) -> None:
        w = ref()
        with torch.no_grad():
            for name, (p, v) in taken.items():
                w.load_param(p, v.to(full_dtype(w.precision)))
                if name in incompatible_keys.missing_keys:
                    incompatible_keys.missing_keys.remove(name)
        taken.clear()

    wrapper.module.register_load_state_dict_pre_hook(UncopiedHook(pre))
    wrapper.module.register_load_state_dict_post_hook(UncopiedHook(written))
    wrapper.module.register_load_state_dict_post_hook(UncopiedHook(post))


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
        key = f"{self.prefix}/{self.calls}"  # the count of ranks that arrived at this call
        seconds = float(os.environ.get("MINIZERO_ARRIVAL_S", "30"))
        deadline = time.monotonic() + seconds
        arrived, pause = self.store.add(key, 1), 0.0
        # poll the count (add 0 reads it): store.wait() would cost a FileStore's 10 ms polling
        # interval at every step (the fork launcher's store); this, one round trip when every
        # rank is there (docs/results.md, "Where a step's time goes")
        while arrived < self.world:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} is collective {why} and some rank did not call it within "
                    f"{seconds:g} s. Call it on every rank, {how}."
                )
            time.sleep(pause)
            pause = min(2 * pause or 5e-5, 5e-3)  # 50 µs, doubling to 5 ms
            arrived = self.store.add(key, 0)
