"""DDP from scratch: naive, then bucketed and overlapped with backward. Taught in lesson 01.

ZeRO §3 calls this the baseline: every rank holds all model states, (2 + 2 + K)Ψ bytes in mixed
precision, and each step all-reduces Ψ gradient elements, which moves 2Ψ (§7.1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.bucket import Bucket, make_buckets, trainable_parameters
from minizero.data_parallel import DataParallel
from minizero.precision import Precision


class NaiveDDP(DataParallel):
    """After backward, all-reduce every gradient, one collective per parameter, then average.

    Correct and slow: Ψ elements cross the network only after backward has finished, in as many
    small messages as there are parameters. fp32 only; use :class:`DDP` for mixed precision.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
    ):
        super().__init__(
            module, process_group=process_group, find_unused_parameters=find_unused_parameters
        )
        self.params = trainable_parameters(module)
        for p in self.params:
            # The hook's argument is the *parameter*; its gradient is p.grad, already accumulated.
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._queue_backward_end()

    def _backward_end(self) -> None:
        if not self._require_sync:
            return
        for p in self.params:
            if p.grad is None:  # unused on this rank: it still takes part in the average
                p.grad = torch.zeros_like(p)
            C.all_reduce(p.grad, group=self.group, tag="naive")
            p.grad.div_(self.world)

    def _zero_grad(self, set_to_none: bool) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class DDP(DataParallel):
    """DDP with gradient buckets whose all-reduce starts while backward is still running.

    Model states per rank: (2 + 2 + K)Ψ mixed precision, (4 + 4 + K)Ψ in fp32 (nothing partitioned).
    Communication per step: one all-reduce of every bucket, 2Ψ elements (ZeRO §7.1).

    Gradients live in flat buckets (``p.grad`` is a view into its bucket, as with torch DDP's
    ``gradient_as_bucket_view=True``). When the last gradient of a bucket is accumulated, the
    bucket is divided by the world size and its all-reduce starts asynchronously; at the end of
    backward every pending all-reduce is waited on, so ``optimizer.step()`` sees averaged gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 25,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
        **options,  # broadcast_buffers, find_unused_parameters: see DataParallel
    ):
        super().__init__(module, precision=precision, process_group=process_group, **options)
        self.params = trainable_parameters(module)
        self.buckets = make_buckets(self.params, bucket_cap_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.masters: list[torch.Tensor] = []  # mixed precision: (numel,) fp32 copy per bucket
        if self.precision.master:  # taken from the fp32 weights, before the cast to 16 bits
            self.masters = [
                b.flatten([p.detach() for p in b.params], torch.float32) for b in self.buckets
            ]
        self._cast_working()
        # (numel,) flat gradient buffer per bucket, reduce dtype; p.grad views into it
        self.grad_buffers = [
            torch.zeros(b.numel, dtype=self.precision.reduce_dtype, device=b.params[0].device)
            for b in self.buckets
        ]
        owned = [(0, b.numel) for b in self.buckets]  # DDP: every rank owns all of every bucket
        self._build_fragments(owned, self.masters or [None] * len(self.buckets))
        self._pending = [len(b.params) for b in self.buckets]  # grads still to come, per bucket
        self._works: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _grad_view(self, p: nn.Parameter) -> torch.Tensor:
        b = self._bucket_of[id(p)]
        return b.view(self.grad_buffers[b.index], p)

    def _on_grad_ready(self, p: nn.Parameter) -> None:  # argument: the parameter, not its grad
        b = self._bucket_of[id(p)]
        if p.grad._base is not self.grad_buffers[b.index]:  # 1st backward / after zero_grad
            view = b.view(self.grad_buffers[b.index], p)
            if view.dtype == p.dtype:  # p.grad holds the whole local sum: it moves in
                view.copy_(p.grad)
                p.grad = view
            else:  # fp32 reduction of 16-bit grads: the (zeroed) bucket sums micro-batches
                view.add_(p.grad)
                p.grad = None
        if not self._require_sync:
            return
        self._queue_backward_end()
        self._pending[b.index] -= 1
        if self._pending[b.index] == 0:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        buf = self.grad_buffers[b.index]  # (numel,) flat, this rank's local gradient
        buf.div_(self.world)
        self._works.append(
            C.all_reduce(buf, group=self.group, async_op=True, tag=f"ddp bucket {b.index}")
        )
        self._pending[b.index] = -1  # launched

    def _backward_end(self) -> None:
        if not self._require_sync:
            return
        for b in self.buckets:  # buckets with parameters unused in this backward
            if self._pending[b.index] >= 0:
                for p in b.params:
                    if p.grad is None:  # unused here: its slot is 0 and still averaged
                        p.grad = self._visible_grad(p)
                self._launch(b)
        for w in self._works:
            w.wait()
        self._works.clear()
        self._pending = [len(b.params) for b in self.buckets]

    # -- the optimizer's side ----------------------------------------------------------------
    def _grad_shards(self) -> list[torch.Tensor]:
        return self.grad_buffers  # (numel,) per bucket, averaged, all of it this rank's

    def _visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        view = self._grad_view(p)
        return view if view.dtype == p.dtype else None

    def after_step(self) -> None:
        if not self.masters:
            return
        with torch.no_grad():
            for b, m in zip(self.buckets, self.masters, strict=True):
                for p in b.params:
                    p.copy_(b.view(m, p))  # fp32 master -> 16-bit working copy

    def _zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:  # the next backward's hooks copy fresh gradients into the buckets
            for p in self.params:
                p.grad = None
        for buf in self.grad_buffers:
            buf.zero_()  # (a grad that stays a view into its bucket accumulates in place)

    def _full_params(self) -> dict[int, torch.Tensor]:
        if not self.masters:
            return super()._full_params()
        return {
            id(p): b.view(m, p).clone()
            for b, m in zip(self.buckets, self.masters)
            for p in b.params
        }

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.module.parameters()), "grads": self.grad_buffers}
