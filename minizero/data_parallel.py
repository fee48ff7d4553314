"""What every data-parallel wrapper shares: ranks, the initial broadcast, the end of backward.

Taught in lesson 01 (01_ddp). The wrappers (NaiveDDP, DDP, ZeRO1, ZeRO2, ZeRO3) are ``nn.Module``s
that hold the user's model as ``.module`` and run it unchanged; what differs between them is only
what they keep, and which collectives they issue, from backward to the end of ``optimizer.step()``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from minizero import collectives as C
from minizero.precision import LossScaler, Precision, resolve


class DataParallel(nn.Module):
    """Base class: ``module`` replicated on every rank of ``process_group``, same start."""

    def __init__(
        self,
        module: nn.Module,
        *,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
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
        self._require_sync = True  # False inside no_sync()
        self._callback_queued = False
        self._grads_ok: bool | None = None  # fp16: this step's gradients unscaled and checked
        if self.precision.param_dtype != torch.float32:
            module.to(self.precision.param_dtype)  # working copy in 16 bits: 2Ψ bytes
        with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
            for t in list(module.parameters()) + list(module.buffers()):
                C.broadcast(t.data, src=0, group=process_group, tag="initial state")

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
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

    def _queue_backward_end(self) -> None:
        """From inside backward: call ``self._backward_end()`` once backward has finished."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end_once)

    def _backward_end_once(self) -> None:
        self._callback_queued = False
        C.mark("backward end")
        self._backward_end()

    def _backward_end(self) -> None:
        raise NotImplementedError

    # -- what the optimizer returned by parallelize() calls -------------------------------------
    def grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """fp16: unscale ``grads`` in place, once per step; True when no rank saw an inf or NaN."""
        if self.scaler is None:
            return True
        if self._grads_ok is not None:  # already unscaled this step (by clip_grad_norm_)
            return self._grads_ok
        bad = torch.zeros(1, device=grads[0].device if grads else None)
        for g in grads:
            g.div_(self.scaler.scale)
            bad += (~torch.isfinite(g)).any()
        C.all_reduce(bad, group=self.group, tag="fp16 inf check")
        self._grads_ok = bad.is_meta or not bad.item()  # meta (minizero.simulate): no values
        self.scaler.update(found_inf=not self._grads_ok)
        return self._grads_ok

    def end_step(self) -> None:
        self._grads_ok = None

    def clip_grads_(
        self, grads: list[torch.Tensor], max_norm: float, sharded: bool
    ) -> torch.Tensor:
        """Scale ``grads`` so the global L2 norm is at most ``max_norm``; return the norm.

        ``sharded``: each rank holds a disjoint shard of the gradient (zero padding included), so
        the squares are summed across ranks; otherwise every rank holds all of it.
        """
        self.grads_finite(grads)  # fp16: clip the true gradients, not the scaled ones
        dev = grads[0].device if grads else None
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for g in grads:
            sq += g.float().pow(2).sum()
        if sharded and self.world > 1:
            C.all_reduce(sq, group=self.group, tag="grad norm")
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The user's model's state dict with every trainable parameter full and in fp32."""
        sd = self.module.state_dict()
        full = self._full_params()  # id(param) -> full fp32 tensor
        for name, p in self.module.named_parameters(remove_duplicate=False):
            sd[name] = full[id(p)] if id(p) in full else p.detach().float()
        return sd

    def _full_params(self) -> dict[int, torch.Tensor]:
        return {id(p): p.detach().float().clone() for p in self.module.parameters()}

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None]}
