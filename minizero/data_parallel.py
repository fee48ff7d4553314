"""What every data-parallel wrapper shares: ranks, the forward, the optimizer's view, state dicts.

Taught in lesson 01 (01_ddp). The wrappers (NaiveDDP, DDP, ZeRO1, ZeRO2, ZeRO3) are ``nn.Module``s
that hold the user's model as ``.module`` and run it unchanged; what differs between them is only
what they keep, and which collectives they issue, from backward to the end of ``optimizer.step()``.

One layout serves communication and the optimizer at once (lesson 02). Parameters are
communicated in flat buckets; rank r owns a range of each bucket (all of it for DDP, chunk r for
ZeRO) and keeps its fp32 master weights as one ``(owned,)`` tensor per bucket. The optimizer gets
one tensor per *fragment*: the part of one parameter that falls in this rank's range, a view into
that master tensor, placed in the parameter's own param group. So per-group settings (no weight
decay on biases), skipping parameters that got no gradient, and checkpoints addressed by parameter
name and element range all come from the same views.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from minizero import collectives as C
from minizero.precision import LossScaler, Precision, resolve
from minizero.sharded_grad import ShardedGrad


@dataclass(frozen=True, eq=False)
class Fragment:
    """Elements [start, end) of ``param`` (flattened) that this rank owns; they sit at
    [offset, offset + end - start) of this rank's owned range of bucket ``bucket``."""

    name: str
    param: nn.Parameter
    bucket: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class DataParallel(nn.Module):
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
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run this inside minizero.launch(fn, nprocs) "
                "or under torchrun (python -m minizero run ...)"
            )
        self.module = module
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.precision = resolve(precision)
        self.scaler = LossScaler() if self.precision.loss_scale else None
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self._require_sync = True  # False inside no_sync()
        self._callback_queued = False
        self._used: set[int] = set()  # id(p) of parameters that got a gradient since zero_grad
        self._grads_none = True  # zero_grad(set_to_none=True) (or none yet): every p.grad None
        self._step_grads_cache: list[torch.Tensor] | None = None  # this step's fp32 grads
        self._grads_ok: bool | None = None  # fp16: this step's gradients unscaled and checked
        self._norms: dict[float, dict[int, torch.Tensor]] = {}  # ord -> id(p) -> global norm
        self._hidden = False  # p.grad is a ShardedGrad until the next forward
        self.fragments: list[Fragment] = []
        self.frag_tensors: list[torch.Tensor] = []  # what the optimizer steps, one per fragment
        self._frag_index: dict[int, list[int]] = {}  # id(param) -> positions of its fragments
        self._names = {id(p): n for n, p in reversed(list(module.named_parameters()))}
        with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
            for t in list(module.parameters()) + list(module.buffers()):
                C.broadcast(t.data, src=0, group=process_group, tag="initial state")
        for p in module.parameters():
            if p.requires_grad:  # registered before any stage's hook, so it runs first
                p.register_post_accumulate_grad_hook(self._mark_used)
        # torch habit: model.zero_grad() on the user's module must clear the stage's gradients too
        module.zero_grad = self.zero_grad  # type: ignore[method-assign]
        module.register_load_state_dict_post_hook(lambda m, keys: self._params_written())

    def _mark_used(self, p: nn.Parameter) -> None:
        self._used.add(id(p))

    def _cast_working(self) -> None:
        """Cast the working copy to 16 bits (2Ψ bytes), after the fp32 masters were taken."""
        if self.precision.param_dtype != torch.float32:
            self.module.to(self.precision.param_dtype)

    # -- the layout the optimizer sees -------------------------------------------------------------
    def _build_fragments(
        self, owned: list[tuple[int, int]], masters: list[torch.Tensor | None]
    ) -> None:
        """Bucket b's range [owned[b][0], owned[b][1]) is this rank's; ``masters[b]`` holds it
        (None: the optimizer steps the parameters themselves, fp32 DDP)."""
        for b, (lo, hi), m in zip(self.buckets, owned, masters, strict=True):
            for p, o in zip(b.params, b.offsets, strict=True):
                s, e = max(o, lo), min(o + p.numel(), hi)
                if s < e:
                    f = Fragment(self._names[id(p)], p, b.index, s - o, e - o, s - lo)
                    self.fragments.append(f)
                    # (numel,) view of this rank's fp32 master range; fp32 DDP: the parameter
                    t = p if m is None else m[f.offset : f.offset + f.numel]
                    self._frag_index.setdefault(id(p), []).append(len(self.frag_tensors))
                    self.frag_tensors.append(t)

    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer steps: one view per fragment (or the parameters)."""
        return self.frag_tensors

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._show_grads()
        if self.broadcast_buffers and torch.is_grad_enabled():  # as torch DDP's default
            with torch.no_grad():
                for buf in self.module.buffers():
                    C.broadcast(buf, src=0, group=self.group, tag="buffers")
        dtype = self.precision.param_dtype
        if self.precision.cast_forward_inputs and dtype != torch.float32:
            cast = lambda t: t.to(dtype) if _floating(t) else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        out = self.module(*args, **kwargs)
        if self.precision.output_dtype is not None:
            out_dtype = self.precision.output_dtype
            out = tree_map(lambda t: t.to(out_dtype) if _floating(t) else t, out)
        if self.scaler is not None and torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self.scaler.scale_grad)  # fp16: backward sees loss * scale
        return out

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, for the backwards inside."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    # -- backward ----------------------------------------------------------------------------------
    def _queue_backward_end(self) -> None:
        """From inside backward: call ``self._backward_end()`` once backward has finished."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end_once)

    def _backward_end_once(self) -> None:
        self._callback_queued = False
        C.mark("backward end")
        if self._require_sync and not self.find_unused_parameters:
            for p in self.params:
                if id(p) not in self._used:
                    raise RuntimeError(
                        f"parameter {self._names[id(p)]!r} got no gradient in this backward on "
                        f"rank {self.rank}. If some parameters are unused in some steps, pass "
                        f"find_unused_parameters=True to minizero.parallelize (as with torch DDP)."
                    )
        self._backward_end()
        if self._require_sync and self._hides_grads():
            self._hide_grads()

    def _backward_end(self) -> None:
        raise NotImplementedError

    # -- p.grad between backward and the next forward (sharded_grad.py) ---------------------------
    def _hides_grads(self) -> bool:
        return self.stage >= 1 or self.precision.loss_scale

    def _visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        return None  # what p.grad is during backward: stage 1 keeps a bucket view

    def _hide_grads(self) -> None:
        for p in self.params:
            p.grad = ShardedGrad(p, self) if id(p) in self._used else None
        self._hidden = True

    def _show_grads(self) -> None:
        if self._hidden:
            for p in self.params:
                p.grad = self._visible_grad(p)
            self._hidden = False

    # -- the step: what the optimizer returned by parallelize() calls ------------------------------
    def _grad_shards(self) -> list[torch.Tensor | None]:
        """Per bucket, this rank's owned range of the averaged gradient, (owned,); None for a
        bucket that has had no backward since ``zero_grad()`` (stages 2-3 free them there)."""
        raise NotImplementedError

    def _step_grads(self) -> list[torch.Tensor | None]:
        """This step's gradients in fp32, per bucket (owned,), unscaled (fp16); made once."""
        if self._step_grads_cache is None:  # .float(): no copy when already fp32
            grads = [None if g is None else g.float() for g in self._grad_shards()]
            self._step_grads_cache = grads
            self.grads_finite(grads)
        return self._step_grads_cache

    def _globally_unused(self) -> set[int]:
        """id(p) of parameters no rank produced a gradient for since zero_grad()."""
        if not self.find_unused_parameters:
            return set()
        used = torch.tensor([id(p) in self._used for p in self.params], dtype=torch.uint8)
        used = used.to(self.params[0].device)  # (P,) 1 where this rank saw a gradient
        C.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group, tag="used parameters")
        return {id(p) for p, u in zip(self.params, used.tolist(), strict=True) if not u}

    def before_step(self) -> bool:
        if self._grads_none and not self._used:  # no backward since zero_grad(): every p.grad
            for f, t in zip(self.fragments, self.frag_tensors, strict=True):  # is None, and
                if t is not f.param:  # torch's optimizers skip a parameter without a gradient
                    t.grad = None
            return True
        grads = self._step_grads()
        if not self._grads_ok:
            return False
        unused = self._globally_unused()
        for f, t in zip(self.fragments, self.frag_tensors, strict=True):
            if id(f.param) in unused or grads[f.bucket] is None:
                t.grad = None  # as torch DDP and FSDP2: no gradient anywhere, no step
            elif t is not f.param:  # a master view: its gradient is the same range, in fp32
                t.grad = grads[f.bucket][f.offset : f.offset + f.numel]
        return True

    def after_step(self) -> None:
        raise NotImplementedError

    def end_step(self) -> None:
        for f, t in zip(self.fragments, self.frag_tensors, strict=True):
            if t is not f.param:
                t.grad = None
        self._step_grads_cache = None
        self._grads_ok = None
        self._norms.clear()

    def grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """fp16: unscale ``grads`` in place, once per step; True when no rank saw an inf or NaN."""
        if self._grads_ok is not None:
            return self._grads_ok
        if self.scaler is None:
            self._grads_ok = True
            return True
        grads = [g for g in grads if g is not None]
        bad = torch.zeros(1, device=self.params[0].device)  # (1,) inf or NaN seen on some rank
        for g in grads:
            g.div_(self.scaler.scale)
            bad += (~torch.isfinite(g)).any()
        C.all_reduce(bad, group=self.group, tag="fp16 inf check")
        self._grads_ok = bad.is_meta or not bad.item()  # meta (minizero.simulate): no values
        self.scaler.update(found_inf=not self._grads_ok)
        return self._grads_ok

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads_none = set_to_none or (self._grads_none and not self._used)  # None stays None
        self._used.clear()
        self._hidden = False
        self._zero_grad(set_to_none)

    def _zero_grad(self, set_to_none: bool) -> None:
        raise NotImplementedError

    # -- gradients seen whole: clip_grad_norm_ ----------------------------------------------------
    def _frags_of(self, p: nn.Parameter) -> list[torch.Tensor]:
        """This rank's fragments of p's averaged fp32 gradient (views, possibly none)."""
        grads = self._step_grads()
        frags = [self.fragments[i] for i in self._frag_index.get(id(p), [])]
        return [grads[f.bucket][f.offset : f.offset + f.numel] for f in frags
                if grads[f.bucket] is not None]  # fmt: skip

    def _grad_norm(self, p: nn.Parameter, ord_: float) -> torch.Tensor:
        """The norm of p's whole averaged gradient; the first call of a step computes every
        parameter's at once (partial sums over fragments, one all-reduce)."""
        ord_ = float(ord_)
        if ord_ not in self._norms:
            if ord_ not in (2.0, float("inf")):
                raise RuntimeError(
                    f"minizero's sharded gradients support norm 2 and inf, not {ord_}"
                )
            inf = ord_ == float("inf")
            part = torch.zeros(len(self.params), dtype=torch.float32, device=self.params[0].device)
            for i, q in enumerate(self.params):
                for g in self._frags_of(q):
                    part[i] = (
                        torch.maximum(part[i], g.abs().max()) if inf else part[i] + g.pow(2).sum()
                    )
            if self.stage >= 1:  # disjoint ranges: sum (or max) over ranks; DDP owns it all
                op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                C.all_reduce(part, op=op, group=self.group, tag="grad norm")
            norms = part if inf else part.sqrt()
            self._norms[ord_] = {id(q): norms[i] for i, q in enumerate(self.params)}
        return self._norms[ord_][id(p)]

    def _grad_apply_(self, p: nn.Parameter, op, args, kwargs) -> None:
        for g in self._frags_of(p):
            op(g, *args, **kwargs)
        self._norms.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm is at most ``max_norm``; return the norm."""
        norms = torch.stack([self._grad_norm(p, norm_type) for p in self.params])
        total = norms.max() if float(norm_type) == float("inf") else norms.pow(2).sum().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in (g for g in self._step_grads() if g is not None):
            g.mul_(coef)
        self._norms.clear()
        return total

    # -- state dicts: full in, full out, under the user's model's keys -----------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The user's model's state dict with every parameter full and fp32 (collective)."""
        sd = self.module.state_dict(keep_vars=True)  # parameter objects are not read here
        full = self._full_params()  # id(param) -> full fp32 tensor
        names = dict(self.module.named_parameters(remove_duplicate=False))
        out = {}
        for k, v in sd.items():
            if k in names:
                v = full[id(names[k])] if id(names[k]) in full else names[k].detach().float()
            elif isinstance(v, torch.Tensor):
                v = v.detach()
            out[prefix + k] = v
        return out if destination is None else destination.update(out) or destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (a plain model's, or this wrapper's): parameters go straight to
        the fp32 masters and the working copy, so the next step starts from exactly them."""
        if state_dict and all(k.startswith("module.") for k in state_dict):  # torch DDP's keys
            state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
        own = self.module.state_dict(keep_vars=True)
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
        names = dict(self.module.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for k, v in state_dict.items():
                if k in names:  # (names are keys of own)
                    self._load_param(names[k], v.detach().to(torch.float32))
                elif k in own:
                    own[k].copy_(v)
        self._after_load()
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """Write a full fp32 value of ``p`` into its working copy and this rank's master views."""
        p.data.copy_(full)
        flat = full.reshape(-1).to(p.device)
        for i in self._frag_index.get(id(p), []):
            f, t = self.fragments[i], self.frag_tensors[i]
            if t is not p:
                t.copy_(flat[f.start : f.end])

    def _after_load(self) -> None:
        self._step_grads_cache = None

    def _params_written(self) -> None:
        """The working copy was written outside minizero (``module.load_state_dict``): refresh
        the fp32 masters from it (exact in fp32; 16-bit values otherwise)."""
        with torch.no_grad():
            for f, t in zip(self.fragments, self.frag_tensors, strict=True):
                if t is not f.param:
                    t.copy_(f.param.detach().reshape(-1)[f.start : f.end])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The user's model's state dict with every parameter full and in fp32 (collective)."""
        return self.state_dict()

    def _full_params(self) -> dict[int, torch.Tensor]:
        return {id(p): p.detach().float().clone() for p in self.module.parameters()}

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None]}


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()
