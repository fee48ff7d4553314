"""DDP from scratch, bucketed and overlapped with backward (naive_ddp.py: the naive one). Lesson 01.

The data-parallel baseline of the ZeRO paper (§1-2; §3 analyses its memory), and the first link
of the chain (data_parallel.py): ZeRO1 (zero1.py) extends it.

The moments it overrides (data_parallel.py lists them all), and the bucket moments it adds:

    post_accumulate_grad_hook(p)  p.grad becomes its view of the bucket; the bucket's last one:
                        reduce_in_order(b) -> reduce_bucket(b), an async all-reduce
    backward_end()      all-reduce the buckets unused parameters left incomplete, wait for all
    finish_grad_sync()  the gradient buffers themselves: averaged in backward, all this rank's
    after_step()        mixed precision: fp32 masters -> 16-bit working copy (fp32: nothing)
    reset_grads()       zero the buffers (they persist, as torch DDP's reducer buckets)
    visible_grad(p), clear_grad(p), full_params(): the bucket view of p, the masters

Bucket moments, overridden below: cut_buckets(ready), owned(b), take_optim_params(b), init_grads(),
reduce_bucket(b), finish_in_flight(). The bucket rebuild (optimizer.state.Rebuild, in the habits
parallelize composes) cuts them again once, in the order the first backward made gradients ready.
"""

from __future__ import annotations

import torch
from torch import nn

from minizero import collectives as C
from minizero.bucket import Bucket, buckets_in_order, trainable_parameters
from minizero.data_parallel import DataParallel


class DDP(DataParallel):
    """DDP with gradients in flat buckets (``p.grad`` a view into its bucket, as with torch DDP's
    ``gradient_as_bucket_view=True``), each all-reduced while backward is still running.

    Model states per rank: (2 + 2 + K)Ψ mixed precision, (4 + 4 + K)Ψ in fp32 (nothing partitioned).
    Communication per step: one all-reduce of every bucket, 2Ψ elements (ZeRO §7.1).

    The layout every later stage keeps: :meth:`lay_out` (and :meth:`init_grads`) sets it.
    """

    rebuilds_buckets = True  # cut again in ready order, as torch DDP (optimizer/state.py)

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float | None = None,  # MiB; None: 25, first bucket 1 (torch DDP's)
        **options,  # precision, process_group, broadcast_buffers, ...: see DataParallel
    ):
        if self.stage == 0 and options.get("replicate_group") is not None:  # never averaged here
            raise TypeError("DDP takes no replicate_group: HSDP shards (stages 1-3, hsdp.py)")
        super().__init__(module, **options)
        self.params = trainable_parameters(module)
        self.bucket_cap_mb = bucket_cap_mb
        self.lay_out(list(reversed(self.params)))  # the predicted ready order (bucket.py)
        self.cast_working()  # once the fp32 masters are taken
        self.register_hooks(self.params)  # every per-parameter hook (data_parallel.py)

    def lay_out(self, ready: list[nn.Parameter]) -> None:
        """Buckets over ``ready`` (the order gradients become ready), and all that sits on them."""
        self.buckets = self.cut_buckets(ready)
        self.param_bucket = {id(p): b for b in self.buckets for p in b.params}
        self.optim_params = [self.take_optim_params(b) for b in self.buckets]  # or None (fp32)
        self.fragments, self.fragments_of = [], {}
        self.build_fragments([self.owned(b) for b in self.buckets], self.optim_params)
        self.init_grads()
        self.pending = [len(b.params) for b in self.buckets]  # gradients still to come, per bucket
        self.started = [False] * len(self.buckets)  # bucket b's collective has started
        self.next_bucket = 0  # buckets below it are started (reduce_in_order)

    # -- layout ------------------------------------------------------------------------------
    def cut_buckets(self, ready: list[nn.Parameter]) -> list[Bucket]:
        return buckets_in_order(ready, self.bucket_cap_mb)

    def bucket_of(self, p: nn.Parameter) -> Bucket:
        return self.param_bucket[id(p)]

    def owned(self, b: Bucket) -> tuple[int, int]:
        """The range [lo, hi) of bucket ``b`` this rank owns: all of it (DDP)."""
        return 0, b.numel

    def take_optim_params(self, b: Bucket) -> torch.Tensor | None:
        if not self.precision.master:
            return None
        return b.flatten([p.detach() for p in b.params], torch.float32)  # (numel,) fp32

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {**super().held_tensors(), "grads": list(self.grad_buffers)}

    def init_grads(self) -> None:
        dtype = self.precision.reduce_dtype
        # (padded,) flat gradient buffer per bucket in the reduce dtype; p.grad views into it
        self.grad_buffers = [
            torch.zeros(b.padded, dtype=dtype, device=b.params[0].device) for b in self.buckets
        ]
        self.works: list = []  # all-reduces in flight

    # -- backward: fill the bucket, start its all-reduce once full ----------------------------
    def post_accumulate_grad_hook(self, p: nn.Parameter) -> None:  # the parameter, not its grad
        b = self.bucket_of(p)
        b.hold_grad(self.grad_buffers[b.index], p)  # p.grad: a view of its bucket
        if not self.require_sync:
            return
        self.queue_backward_end()
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_in_order(b)

    def reduce_in_order(self, b: Bucket) -> None:
        """Bucket ``b`` is complete: reduce it; with ``find_unused_parameters`` (ranks may complete
        buckets in other orders) every complete one, in index order as torch DDP."""
        if not self.find_unused_parameters:
            return self.reduce_bucket(b)
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self.reduce_bucket(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def reduce_bucket(self, b: Bucket) -> None:
        buf = self.grad_buffers[b.index]  # (numel,) flat, this rank's local gradient
        buf.div_(self.world)  # the sum of averages: fp16 cannot overflow
        tag = f"ddp bucket {b.index}"
        self.works.append(C.all_reduce(buf, group=self.group, async_op=True, tag=tag))
        self.started[b.index] = True

    def finish_in_flight(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()

    def backward_end(self) -> None:
        if not self.require_sync:
            return
        for b in self.buckets:  # buckets with parameters unused in this backward
            if not self.started[b.index]:
                for p in b.params:
                    if p.grad is None:  # unused here: its slot is 0 and still averaged
                        p.grad = self.visible_grad(p)
                self.reduce_bucket(b)
        self.finish_in_flight()
        self.pending = [len(b.params) for b in self.buckets]
        self.started = [False] * len(self.buckets)
        self.next_bucket = 0

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        view = self.bucket_of(p).view(self.grad_buffers[self.bucket_of(p).index], p)
        return view if view.dtype == p.dtype else None

    # -- the optimizer's side ----------------------------------------------------------------
    def finish_grad_sync(self) -> list[torch.Tensor]:
        return self.grad_buffers  # (numel,) per bucket, averaged in backward, all of it this rank's

    def after_step(self) -> None:
        if not self.precision.master:
            return
        with torch.no_grad():
            for b, m in zip(self.buckets, self.optim_params, strict=True):
                for p in b.params:
                    p.copy_(b.view(m, p))  # fp32 master -> 16-bit working copy

    def clear_grad(self, p: nn.Parameter) -> None:
        self.bucket_of(p).view(self.grad_buffers[self.bucket_of(p).index], p).zero_()

    def reset_grads(self, set_to_none: bool) -> None:
        for g in self.grad_buffers:
            g.zero_()  # the next backward adds into zeros (or, in place, into the views)
        for p in self.params:
            p.grad = None if set_to_none or p.grad is None else self.visible_grad(p)

    def full_params(self) -> dict[int, torch.Tensor]:
        if not self.precision.master:
            return super().full_params()
        return {
            id(p): b.view(m, p).clone()
            for b, m in zip(self.buckets, self.optim_params, strict=True)
            for p in b.params
        }
