"""What every data-parallel wrapper shares: ranks, the forward, the step's protocol, state dicts.

Taught in lesson 01 (01_ddp); every stage builds on it. The wrappers (NaiveDDP, then the paper's
chain DDP -> ZeRO1 -> ZeRO2 -> ZeRO3, each extending the one before) are ``nn.Module``s that hold
the user's model as ``.module`` and run it unchanged; what differs between them is only what they
keep, and which collectives they issue, from backward to the end of ``optimizer.step()``.

One layout serves communication and the optimizer (lesson 02): flat buckets; rank r owns a range of
each (all of it for DDP, chunk r for ZeRO), its fp32 masters one ``(owned,)`` tensor per bucket. The
optimizer gets one tensor per :class:`Fragment` (the part of one parameter in this rank's range, a
view into that master tensor, in the parameter's param group): per-group settings, skipping
parameters without gradient, checkpoints by parameter name and element range all come from them.

One optimizer step (``optimizer.step()``, see optimizer.py), top to bottom:

    before_step()   grads = step_grads()        per bucket, this rank's averaged fp32 range
                                                (the stage's ``owned_grads()``), unscaled (fp16)
                    fragment.tensor.grad = its range of grads
    <the user's optimizer steps the fragments>
    after_step()    the stage's own: masters -> working copy (and all-gather, ZeRO 1-2)
    end_step()      forget this step's gradients and norms

What a stage provides (the base calls these): ``owned_grads()``, ``after_step()``,
``reset_grads(set_to_none)``, ``full_params()``, ``reduce_norm_parts(part, op)`` (sharded_grad.py's
``GradNorms``); and, for loading, ``load_param(p, full)``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from minizero import collectives as C
from minizero import hsdp
from minizero.habits import (
    SAVE_ON_RANK_0,
    Arrival,
    TorchNames,
    Trainable,
    claim,
    full_module_state_dict,
    match_keys,
    refuse_dtypes,
)
from minizero.precision import LossScaler, Precision, floating, full_dtype, resolve
from minizero.sharded_grad import GradNorms, ShardedGrad


@dataclass(frozen=True, eq=False)
class Fragment:
    """Elements [start, end) of ``param`` (flattened) that this rank owns; they sit at
    [offset, offset + end - start) of this rank's owned range of bucket ``bucket``. ``tensor`` is
    what the optimizer steps for them: a (numel,) view of the fp32 master range, or, for fp32
    DDP, the parameter itself."""

    name: str
    param: nn.Parameter
    bucket: int
    start: int
    end: int
    offset: int
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def is_master(self) -> bool:
        """True when the optimizer steps a master view (not the parameter itself)."""
        return self.tensor is not self.param


class DataParallel(GradNorms, TorchNames, nn.Module):
    """Base class: ``module`` replicated on every rank of ``process_group``, same start."""

    stage = 0

    def __init__(
        self,
        module: nn.Module,
        *,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        replicate_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run this inside minizero.launch(fn, nprocs) "
                "or under torchrun (python -m minizero run ...)"
            )
        self.param_names = {id(p): n for n, p in reversed(list(module.named_parameters()))}
        refuse_dtypes(module.parameters(), self.param_names, full_dtype(resolve(precision)))
        claim(module, type(self).__name__)  # before any hook: a refused model stays clean
        self.module = module
        self.group = process_group
        self.replicate_group = replicate_group  # HSDP: the ranks holding my shard (hsdp.py)
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.precision = resolve(precision)
        self.scaler = LossScaler() if self.precision.loss_scale else None
        self.broadcast_buffers = broadcast_buffers
        self._sync_buffers = True  # torch DDP's rule: after a synchronised training forward
        self.find_unused_parameters = find_unused_parameters
        self.require_sync = True  # False inside no_sync()
        self._callback_queued = False
        self._used: set[int] = set()  # id(p) of parameters that got a gradient since zero_grad
        self._grads_none = True  # zero_grad(set_to_none=True) (or none yet): every p.grad None
        self._step_grads: list[torch.Tensor | None] | None = None  # this step's fp32 grads
        self._grads_ok: bool | None = None  # fp16: this step's gradients unscaled and checked
        self._norms: dict[float, dict[int, torch.Tensor]] = {}  # ord -> id(p) -> global norm
        self._hidden = False  # p.grad is a ShardedGrad until the next forward
        self.fragments: list[Fragment] = []  # what the optimizer steps, one per fragment
        self._frags_of: dict[int, list[Fragment]] = {}  # id(param) -> its fragments here
        self._trainable = Trainable(module, self.param_names)
        with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
            for t in list(module.parameters()) + list(module.buffers()):
                hsdp.broadcast(t.data, process_group, replicate_group, tag="initial state")
        for p in module.parameters():
            if p.requires_grad:  # registered before any stage's hook, so it runs first
                p.register_post_accumulate_grad_hook(lambda p: self._used.add(id(p)))
        # torch habit: model.zero_grad() on the user's module must clear the stage's gradients too
        module.zero_grad = self.zero_grad  # type: ignore[method-assign]
        module.register_state_dict_post_hook(full_module_state_dict(self))
        self._arrival = Arrival(process_group, self.world)

    def expect_every_rank(self, what: str, how: str = "print or save on rank 0 only") -> None:
        """Before a collective one might call on rank 0 only (nanoGPT's ``if master_process:``):
        every rank arrives within ``MINIZERO_ARRIVAL_S`` (30) seconds, or an error, no hang."""
        why = f"at ZeRO stage {self.stage} (a rank holds only its shard)"
        self._arrival.expect(what, why, how)

    def cast_working(self) -> None:
        """Cast the working copy to 16 bits (2Ψ bytes), after the fp32 masters were taken."""
        if self.precision.master:
            self.module.to(self.precision.param_dtype)

    # -- the layout the optimizer sees -------------------------------------------------------------
    def build_fragments(
        self, owned: list[tuple[int, int]], masters: list[torch.Tensor | None]
    ) -> None:
        """Bucket b's range [owned[b][0], owned[b][1]) is this rank's; ``masters[b]`` holds it
        (None: the optimizer steps the parameters themselves, fp32 DDP)."""
        for b, (lo, hi), m in zip(self.buckets, owned, masters, strict=True):
            for p, o in zip(b.params, b.offsets, strict=True):
                s, e = max(o, lo), min(o + p.numel(), hi)
                if s < e:
                    # (numel,) view of this rank's fp32 master range; fp32 DDP: the parameter
                    t = p if m is None else m[s - lo : e - lo]
                    f = Fragment(self.param_names[id(p)], p, b.index, s - o, e - o, s - lo, t)
                    self.fragments.append(f)
                    self._frags_of.setdefault(id(p), []).append(f)

    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer steps: one per fragment (or the parameters)."""
        return [f.tensor for f in self.fragments]

    def forward(self, *args, **kwargs):
        self._trainable.check()
        self._show_grads()
        if self.broadcast_buffers and self._sync_buffers:  # torch DDP's rule: rank 0's buffers
            with torch.no_grad():  # before any forward that follows a synchronised training one
                for buf in self.module.buffers():
                    hsdp.broadcast(buf, self.group, self.replicate_group, tag="buffers")
        self._sync_buffers = torch.is_grad_enabled() and self.require_sync
        dtype = self.precision.param_dtype
        if self.precision.cast_forward_inputs and dtype != torch.float32:  # 16 bits, or fp64
            cast = lambda t: t.to(dtype) if floating(t) else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        out = self.module(*args, **kwargs)
        if self.precision.output_dtype is not None:
            out_dtype = self.precision.output_dtype
            out = tree_map(lambda t: t.to(out_dtype) if floating(t) else t, out)
        if self.scaler is not None and torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self.scaler.scale_grad)  # fp16: backward sees loss * scale
        return out

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, for the backwards inside."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def queue_backward_end(self) -> None:
        """From inside backward (a hook): run ``self.backward_end()`` once backward has finished.
        Safe to call from every hook: it queues one callback per backward."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end_once)

    def _backward_end_once(self) -> None:
        self._callback_queued = False
        C.mark("backward end")
        if self.require_sync and not self.find_unused_parameters:
            for p in self.params:
                if id(p) not in self._used:
                    raise RuntimeError(
                        f"parameter {self.param_names[id(p)]!r} got no gradient in this backward "
                        f"on rank {self.rank}. If some parameters are unused in some steps, pass "
                        f"find_unused_parameters=True to minizero.parallelize (as with torch DDP)."
                    )
        self.backward_end()
        if self.require_sync and self.shards_grads:
            self._hide_grads()

    def backward_end(self) -> None:
        """Runs once when backward is over: finish this backward's collectives."""

    # -- p.grad between backward and the next forward (sharded_grad.py) ---------------------------
    @property
    def shards_grads(self) -> bool:
        """Whether no rank holds a whole averaged ``p.grad`` after backward (ZeRO, fp16)."""
        return bool(self.precision.loss_scale)

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """What ``p.grad`` is during backward (a bucket view, or None)."""
        return None

    def _hide_grads(self) -> None:
        for p in self.params:
            p.grad = ShardedGrad(p, self) if id(p) in self._used else None
        self._hidden = True

    def _show_grads(self) -> None:
        if not self._hidden:
            return
        cleared = self._cleared_by_hand()
        if cleared and len(cleared) == len(self._used):  # `p.grad = None` for every p:
            return self.zero_grad(set_to_none=True)  # the habit that means zero_grad()
        for p in self.params:
            if id(p) in cleared:
                self.clear_grad(p)
            p.grad = None if id(p) in cleared else self.visible_grad(p)
        self._hidden = False

    def _cleared_by_hand(self) -> set[int]:
        """id(p) of parameters whose (sharded) gradient the user replaced by None."""
        return {id(p) for p in self.params if p.grad is None and id(p) in self._used}

    def clear_grad(self, p: nn.Parameter) -> None:
        """``p.grad = None`` by hand: forget ``p``'s gradient (the stage's part)."""
        raise NotImplementedError

    # -- the step: what the optimizer returned by parallelize() calls ------------------------------
    def owned_grads(self) -> list[torch.Tensor | None]:
        """Per bucket, this rank's owned range of the averaged gradient, (owned,); None for a
        bucket that has had no backward since ``zero_grad()`` (stages 2-3 free them there)."""
        raise NotImplementedError

    def step_grads(self) -> list[torch.Tensor | None]:
        """This step's gradients in fp32, per bucket (owned,), unscaled (fp16); made once."""
        if self._step_grads is None:  # in the masters' dtype: no copy when already there
            full = full_dtype(self.precision)
            self._step_grads = [None if g is None else g.to(full) for g in self.owned_grads()]
            self.grads_finite(self._step_grads)
        return self._step_grads

    def _globally_unused(self) -> set[int]:
        """id(p) of parameters no rank produced a gradient for since zero_grad()."""
        if not self.find_unused_parameters:
            return set()
        used = torch.tensor([id(p) in self._used for p in self.params], dtype=torch.uint8)
        used = used.to(self.params[0].device)  # (P,) 1 where this rank saw a gradient
        hsdp.all_reduce(used, self.group, self.replicate_group, dist.ReduceOp.MAX, "used params")
        return {id(p) for p, u in zip(self.params, used.tolist(), strict=True) if not u}

    def before_step(self) -> bool:
        """Hand each fragment its gradient; False: skip the update (fp16 overflow)."""
        masters = [f for f in self.fragments if f.is_master]
        if self._grads_none and not self._used:  # no backward since zero_grad(): every p.grad
            for f in masters:  # is None, and torch's optimizers skip a parameter without one
                f.tensor.grad = None
            return True
        grads = self.step_grads()
        if not self._grads_ok:
            return False
        unused = self._globally_unused()
        if self._hidden:  # `p.grad = None` after backward: torch's optimizers skip p
            unused |= self._cleared_by_hand()
        for f in self.fragments:
            g = grads[f.bucket]
            if id(f.param) in unused or g is None:
                f.tensor.grad = None  # as torch DDP and FSDP2: no gradient anywhere, no step
            elif f.is_master:  # a master view: its gradient is the same range, in fp32
                f.tensor.grad = g[f.offset : f.offset + f.numel]
            # (fp32 DDP: the parameter itself, which holds its own averaged gradient)
        return True

    def after_step(self) -> None:
        """After the optimizer updated the fragments: bring the working parameters up to date."""
        raise NotImplementedError

    def end_step(self) -> None:
        for f in self.fragments:
            if f.is_master:
                f.tensor.grad = None
        self._step_grads = None
        self._grads_ok = None
        self._norms.clear()

    def grads_finite(self, grads: list[torch.Tensor | None]) -> bool:
        """fp16: unscale ``grads`` in place, once per step; True when no rank saw an inf or NaN."""
        if self._grads_ok is None:
            dev = self.params[0].device
            self._grads_ok = self.scaler is None or self.scaler.unscale(grads, self.group, dev)
        return self._grads_ok

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads_none = set_to_none or (self._grads_none and not self._used)  # None stays None
        self._used.clear()
        self._hidden = False
        self.reset_grads(set_to_none)

    def zero_grad_of(self, ids: set[int], set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` of an optimizer over some of the trainable parameters (``ids``
        of them): as in torch, the others keep their gradients and accumulate into them."""
        for p in self.params:
            if id(p) in ids and id(p) in self._used:
                self.clear_grad(p)
                self._used.discard(id(p))
                if set_to_none:
                    p.grad = None

    def reset_grads(self, set_to_none: bool) -> None:
        """The stage's part of ``zero_grad()``: clear (or free) its gradient buffers."""
        raise NotImplementedError

    # -- state dicts: full in, full out, under the user's model's keys -----------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The user's model's state dict with every parameter full and fp32 (collective)."""
        if self.stage > 0:  # the fp32 masters are sharded: gathering them is collective
            self.expect_every_rank("model.state_dict()", SAVE_ON_RANK_0)
        sd = self.module.state_dict(keep_vars=True)  # parameter objects are not read here
        full = self.full_params()  # id(param) -> full fp32 tensor
        names = dict(self.module.named_parameters(remove_duplicate=False))
        out = {}
        for k, v in sd.items():
            if k in names:  # (a frozen parameter: not in full; its working copy, cast)
                v = full[id(names[k])] if id(names[k]) in full else names[k].detach()
                v = v.to(full_dtype(self.precision))
            elif isinstance(v, torch.Tensor):
                v = v.detach()
            out[prefix + k] = v
        return out if destination is None else destination.update(out) or destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (a plain model's, or this wrapper's): parameters go straight to
        the fp32 masters and the working copy, so the next step starts from exactly them."""
        own = self.module.state_dict(keep_vars=True)
        state_dict, missing, unexpected = match_keys(own, state_dict, strict)
        names = dict(self.module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for k, v in state_dict.items():
                if k in names:  # (names are keys of own)
                    self.load_param(names[k], v.detach().to(full_dtype(self.precision)))
                elif k in own:
                    own[k].copy_(v)
        self._step_grads = None
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """Write a full fp32 value of ``p`` into its working copy and this rank's master views."""
        p.data.copy_(full)
        flat = full.reshape(-1).to(p.device)
        for f in self._frags_of.get(id(p), []):
            if f.is_master:
                f.tensor.copy_(flat[f.start : f.end])

    def params_written(self) -> None:
        """The working copy was written outside minizero (``module.load_state_dict``): refresh
        the fp32 masters from it (exact in fp32; 16-bit values otherwise)."""
        with torch.no_grad():
            for f in self.fragments:
                if f.is_master:
                    f.tensor.copy_(f.param.detach().reshape(-1)[f.start : f.end])

    full_state_dict = state_dict  # the name FSDP-era code knows

    def full_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the whole parameter in fp32, on this rank (collective where sharded)."""
        full = full_dtype(self.precision)
        return {id(p): p.detach().to(full).clone() for p in self.module.parameters()}

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        ps = list(self.module.parameters())
        return {"params": ps, "grads": [p.grad for p in ps if p.grad is not None]}
