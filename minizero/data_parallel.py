"""What every data-parallel wrapper shares: ranks, the forward, the fragments, the step's moments.

Taught in lesson 01 (01_ddp); every stage builds on it. The wrappers (NaiveDDP, then the paper's
chain DDP -> ZeRO1 -> ZeRO2 -> ZeRO3, each extending the one before) are ``nn.Module``s that hold
the user's model as ``.module`` and run it unchanged; they differ only in what they keep, and in
the collectives they issue from backward to the end of ``optimizer.step()``. One layout serves
communication and the optimizer (lesson 02): flat buckets, rank r owning a range of each (all of
it for DDP, chunk r for ZeRO); the optimizer steps one :class:`Fragment` per parameter and range.
The habits of a PyTorch loop are not here: the core calls them through ``self.extension``, an
:class:`~minizero.seams.Extension`; what the rest of minizero reads of a wrapper is its
:class:`~minizero.seams.Face` (seams.py).

The shape, a decision: a dozen methods are defined 3+ times along the chain, because each stage
is the one before with one more state partitioned (the paper's chain), overriding the moments that
state changes; each stage file's opening table names them. Flattened classes would repeat DDP's
buckets four times, strategy objects would hide the chain; so it stays (docs/: the reasoning).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.precision import LossScaler, Precision, cast_floating, full_dtype, resolve
from minizero.seams import Extension, Fragment, Sharded

# A moment's old name -> its name now: a subclass written before (a lesson's notebook) fails at once
RENAMED = {"on_grad_ready": "post_accumulate_grad_hook", "reduce_gradients": "finish_grad_sync",
           "take_master": "take_optim_params"}  # fmt: skip


class DataParallel(nn.Module):
    """Base class: ``module`` replicated on every rank of ``process_group``, same start.

    The moments a stage may override, the one list (each stage file's table names its own):
    backward: ``post_accumulate_grad_hook(p)`` (torch's name; order: ``register_hooks``),
    ``backward_end()``; step: ``finish_grad_sync()`` (per bucket this rank's averaged range),
    ``after_step()`` (stepped -> working copy); ``zero_grad()``: ``reset_grads(set_to_none)``;
    ``p.grad``: ``visible_grad(p)``, ``clear_grad(p)``; layout and loading: ``cast_working()``,
    ``full_params()``, ``load_param(p, full)``, ``params_written()``. A stage sets ``params``
    (trainable, registration order), ``buckets`` (bucket.py's), ``fragments``
    (:meth:`build_fragments`), calls :meth:`register_hooks`; DDP adds bucket moments (ddp.py)."""

    stage = 0
    sharded = Sharded()  # nothing: every rank holds the whole model states
    rebuilds_buckets = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if old := sorted(RENAMED.keys() & vars(cls).keys()):
            raise TypeError(f"{cls.__name__}.{old[0]}: minizero calls this moment "
                            f"{RENAMED[old[0]]} now (and self.masters is self.optim_params); "
                            "rename it in your class, as the lesson does")  # fmt: skip

    def __init__(
        self,
        module: nn.Module,
        *,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        replicate_group: dist.ProcessGroup | None = None,  # HSDP (stages 1-3): hsdp.py
        extension: type[Extension] = Extension,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run this inside minizero.launch(fn, nprocs) "
                "or under torchrun (python -m minizero run ...)"
            )
        self.param_names = {id(p): n for n, p in reversed(list(module.named_parameters()))}
        self.module = module
        self.group, self.replicate_group = process_group, replicate_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.precision = resolve(precision)
        self.scaler = LossScaler() if self.precision.loss_scale else None
        self.broadcast_buffers = broadcast_buffers
        self.sync_buffers = True  # torch DDP's rule: after a synchronised training forward
        self.find_unused_parameters = find_unused_parameters
        self.require_sync = True  # False inside no_sync()
        self.backward_end_queued = False
        self.averaged: list[torch.Tensor | None] | None = None  # this step's fp32 grads, made once
        self.grads_ok: bool | None = None  # fp16: this step's gradients unscaled and checked
        self.fragments: list[Fragment] = []  # what the optimizer steps, one per fragment
        self.fragments_of: dict[int, list[Fragment]] = {}  # id(param) -> its fragments here
        self.optimizers = weakref.WeakKeyDictionary()  # attach()ed ones -> optimizer.Adopted
        self.extension = extension(self)  # before any hook of the stage (minizero/habits/)
        for t in list(module.parameters()) + list(module.buffers()):  # rank 0's, on every rank
            self.broadcast_from_rank0(t.data, "initial state")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (nn.Module's)
        except AttributeError:
            if "extension" not in self.__dict__:
                raise
        return self.extension.missing_attribute(name)  # (outside the except: no chained error)

    def broadcast_from_rank0(self, t: torch.Tensor, tag: str) -> None:
        """Rank 0's ``t`` to every rank, in place (HSDP: over the nodes first, then the node)."""
        if self.replicate_group is not None:
            C.broadcast(t, src=0, group=self.replicate_group, tag=tag)
        C.broadcast(t, src=0, group=self.group, tag=tag)

    def cast_working(self) -> None:
        """Cast the working copy to 16 bits (2Ψ bytes), after the fp32 masters were taken."""
        if self.precision.master:
            self.module.to(self.precision.param_dtype)

    # -- the layout the optimizer sees -------------------------------------------------------------
    def build_fragments(
        self, owned: list[tuple[int, int]], stepped: list[torch.Tensor | None]
    ) -> None:
        """Bucket b's range [owned[b][0], owned[b][1]) is this rank's; ``stepped[b]`` holds it
        (None: the optimizer steps the parameters themselves, fp32 DDP)."""
        for b, (lo, hi), m in zip(self.buckets, owned, stepped, strict=True):
            for p, o in zip(b.params, b.offsets, strict=True):
                s, e = max(o, lo), min(o + p.numel(), hi)
                if s < e:
                    t = p if m is None else m[s - lo : e - lo]  # (numel,) master view, or p
                    f = Fragment(self.param_names[id(p)], p, b.index, s - o, e - o, s - lo, t)
                    self.fragments.append(f)
                    self.fragments_of.setdefault(id(p), []).append(f)

    @property
    def separate_masters(self) -> bool:  # (fp32 ZeRO: views of the flat working copy)
        return self.sharded.state or self.precision.master

    def fragment_values(self, f: Fragment) -> torch.Tensor:
        return f.param.detach().reshape(-1)[f.start : f.end]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "comm": []}  # fmt: skip

    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors this rank's optimizer steps: one per fragment (or the parameters)."""
        return [f.tensor for f in self.fragments]

    def forward(self, *args, **kwargs):
        self.extension.before_forward()
        if self.broadcast_buffers and self.sync_buffers:  # torch DDP's rule: rank 0's buffers
            with torch.no_grad():  # before any forward that follows a synchronised training one
                for buf in self.module.buffers():
                    self.broadcast_from_rank0(buf, "buffers")
        self.sync_buffers = torch.is_grad_enabled() and self.require_sync
        dtype = self.precision.param_dtype
        if self.precision.cast_forward_inputs and dtype != torch.float32:  # 16 bits, or fp64
            args, kwargs = cast_floating((args, kwargs), dtype)
        out = self.module(*args, **kwargs)
        if self.precision.output_dtype is not None:
            out = cast_floating(out, self.precision.output_dtype)
        if self.scaler is not None and torch.is_grad_enabled():
            self.scaler.scale_backward(out)  # fp16: backward sees loss * scale
        return out

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication, for the backwards inside."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """FSDP2's name (and nanoGPT's ``require_backward_grad_sync``, torch DDP's): ``no_sync()``
        until set back."""
        self.require_sync = requires

    require_backward_grad_sync = property(lambda s: s.require_sync, set_requires_gradient_sync)

    # -- backward ----------------------------------------------------------------------------------
    def register_hooks(self, params: list[nn.Parameter]) -> None:
        """Every per-parameter hook, in the order they run: ``extension.before_accumulate()``,
        then :meth:`_post_accumulate`: the extension's (the habits', the bucket rebuild's), the
        stage's ``post_accumulate_grad_hook``."""
        for p in params:
            p.register_hook(lambda grad: self.extension.before_accumulate())  # (deepcopy drops it)
            p.register_post_accumulate_grad_hook(self._post_accumulate)

    def _post_accumulate(self, p: nn.Parameter) -> None:  # argument: the parameter
        self.extension.grad_accumulated(p)  # first: it counts p as used, densifies a sparse grad
        self.post_accumulate_grad_hook(p)

    def post_accumulate_grad_hook(self, p: nn.Parameter) -> None:
        """The stage's hook: ``p.grad`` holds this backward's gradient (accumulated)."""
        self.queue_backward_end()

    def queue_backward_end(self) -> None:
        """From any hook: ``backward_end()``, then ``extension.backward_end()``, once it is over."""
        if not self.backward_end_queued:
            self.backward_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end_once)

    def _backward_end_once(self) -> None:
        self.backward_end_queued = False
        C.mark("backward end")
        self.backward_end()
        if self.require_sync:
            self.extension.backward_end()

    def backward_end(self) -> None:
        """Runs once when backward is over: finish this backward's collectives."""

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """What ``p.grad`` is during backward (a bucket view, or None)."""
        return None

    def clear_grad(self, p: nn.Parameter) -> None:
        """``p.grad = None`` by hand: forget ``p``'s gradient (the stage's part)."""
        raise NotImplementedError

    # -- the step: what the optimizer returned by parallelize() calls ------------------------------
    def finish_grad_sync(self) -> list[torch.Tensor | None]:
        """Per bucket, this rank's owned range of the averaged gradient, (owned,); None for a
        bucket that has had no backward since ``zero_grad()`` (stages 2-3 free them there)."""
        raise NotImplementedError

    def holds_unsynced_grads(self) -> bool:
        return False  # (stages 2-3: the bucket buffers that no_sync() backwards fill)

    @property
    def has_step_grads(self) -> bool:
        return self.averaged is not None

    def forget_step_grads(self) -> None:
        self.averaged = self.grads_ok = None

    def step_grads(self) -> list[torch.Tensor | None]:
        """This step's fp32 gradients, per bucket (owned,), unscaled; made once a step."""
        if self.averaged is None:  # in the masters' dtype (fp32; fp64): no copy when already so
            full = full_dtype(self.precision)
            self.averaged = [None if g is None else g.to(full) for g in self.finish_grad_sync()]
            scaler, dev = self.scaler, self.params[0].device  # fp16: unscale; all skip on an inf
            self.grads_ok = scaler is None or scaler.unscale(self.averaged, self.group, dev)
        return self.averaged

    def before_step(self) -> bool:
        """Hand each fragment its range of the averaged gradient; False: skip the update (fp16)."""
        skip = self.extension.params_without_grad()  # id(p): no gradient anywhere, no step
        if skip is None:  # no backward since zero_grad(): no fragment gets a gradient, and
            self.end_step()  # torch's optimizers skip a parameter without one
            return True
        grads = self.step_grads()
        if not self.grads_ok:
            return False
        for f in self.fragments:
            g = grads[f.bucket]
            if id(f.param) in skip or g is None:
                f.tensor.grad = None  # as torch DDP and FSDP2: no gradient anywhere, no step
            elif f.is_flat_view:  # its range, in fp32 (fp32 DDP's parameter holds its own already)
                f.tensor.grad = g[f.offset : f.offset + f.numel]
        return True

    def after_step(self) -> None:
        """After the optimizer updated the fragments: bring the working parameters up to date."""
        raise NotImplementedError

    def end_step(self) -> None:
        for f in self.fragments:
            if f.is_flat_view:
                f.tensor.grad = None
        self.forget_step_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.extension.zero_grad(set_to_none)  # (the bucket rebuild too: before reset_grads)
        self.forget_step_grads()
        self.reset_grads(set_to_none)

    def reset_grads(self, set_to_none: bool) -> None:
        """The stage's part of ``zero_grad()``: clear (or free) its gradient buffers."""
        raise NotImplementedError

    # -- state dicts: what the habits make them (a full fp32 one, under the model's keys) -------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.extension.state_dict(destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.extension.load_state_dict(state_dict, strict)

    full_state_dict = state_dict  # the name FSDP-era code knows

    def load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """Write a full fp32 value of ``p`` into its working copy and this rank's master views."""
        p.data.copy_(full)
        flat = full.reshape(-1).to(p.device)
        for f in self.fragments_of.get(id(p), []):
            if f.is_flat_view:
                f.tensor.copy_(flat[f.start : f.end])

    def params_written(self) -> None:
        """The working copy was written outside minizero (``module.load_state_dict``): refresh
        the fp32 masters from it (exact in fp32; 16-bit values otherwise)."""
        with torch.no_grad():
            for f in self.fragments:
                if f.is_flat_view:
                    f.tensor.copy_(f.param.detach().reshape(-1)[f.start : f.end])

    def full_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the whole parameter in fp32, on this rank (collective where sharded)."""
        full = full_dtype(self.precision)
        return {id(p): p.detach().to(full).clone() for p in self.module.parameters()}
