"""ZeRO-DP stage 1: optimizer states partitioned. Taught in lesson 02 (02_zero1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054 (SC20), §5.1. Plain synchronous data parallelism: every rank still runs the whole
model on its own micro-batch; what changes is who keeps which optimizer state. What this file adds
to ddp.py: buckets padded to a multiple of N and cut into N chunks; rank r owns chunk r (its
masters and optimizer states cover only that); the all-reduce becomes a reduce-scatter at the
step, and the updated chunks are all-gathered back.

The moments it overrides, and what each does differently from DDP:

    cut_buckets, owned, take_optim_params, cast_working: flat parameter buffers, chunk r is rank r's
    post_accumulate_grad_hook(p)  only accumulate into the bucket view: no collective in backward
    backward_end()      nothing to finish (no collective was started)
    visible_grad(p)     None once the step has reduced: the local sums are not p's gradient
    finish_grad_sync()  reduce-scatter every bucket now: this rank's chunk, averaged
    after_step()        optim_params -> own chunk, all-gather every chunk into the flat parameters
    full_params()       all-gather the fp32 masters
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.bucket import Bucket, buckets_in_order
from minizero.ddp import DDP
from minizero.precision import divides_before_sum
from minizero.seams import Sharded


class ZeRO1(DDP):
    """P_os: each rank keeps the optimizer states (and fp32 master weights) of its shard only.

    Model states per rank: 2Ψ + 2Ψ + KΨ/N in mixed precision (4Ψ + 4Ψ + KΨ/N in fp32).
    Communication per step: reduce-scatter of the gradients (Ψ) + all-gather of the updated
    parameters (Ψ) = 2Ψ, the same volume as DDP's all-reduce (§7.2.1).

    Layout: each bucket's parameters are views of one flat buffer (``flat_params``), cut into N
    chunks (above); gradients, views of a flat buffer of the same layout (``grad_buffers``, as
    DDP's), accumulate with no communication (``no_sync()`` needs nothing special) until the step.

    What lesson 02 asks you to write: ``finish_grad_sync()``. Called once a step, by the first
    of ``clip_grad_norm_`` and ``step()`` (``step_grads()`` keeps its result for both); may
    assume every backward since ``zero_grad()`` has accumulated into ``grad_buffers``; must
    return, per bucket, this rank's ``(shard,)`` chunk of the gradient averaged over the ranks of
    ``self.group`` (N = ``self.world``), and leave no collective in flight. And ``after_step()``:
    called once the optimizer has stepped ``optim_params``; copy each (mixed precision) into this
    rank's chunk of ``flat_params`` and all-gather every chunk over ``self.group``.
    """

    stage = 1
    sharded = Sharded(state=True)

    # -- layout: chunk r of every bucket is rank r's -----------------------------------------
    def cut_buckets(self, ready: list[nn.Parameter]) -> list[Bucket]:
        return self.flatten(buckets_in_order(ready, self.bucket_cap_mb, self.world))

    def flatten(self, buckets: list[Bucket]) -> list[Bucket]:
        """(padded,) flat per bucket; p.data views into it; rank r owns chunk r. Built in the
        parameters' dtype, cast by ``cast_working`` once the masters are taken."""
        self.flat_params = []
        for b in buckets:
            flat = b.flatten([p.detach() for p in b.params])
            for p in b.params:
                p.data = b.view(flat, p)
            self.flat_params.append(flat)
        return buckets

    def owned(self, b: Bucket) -> tuple[int, int]:
        return self.rank * b.shard, (self.rank + 1) * b.shard

    def take_optim_params(self, b: Bucket) -> torch.Tensor:
        # (shard,) fp32: chunk r of flat_params itself, stepped in place. Mixed precision: a
        # separate fp32 copy of that chunk (the K in KΨ/N includes it)
        chunk = b.chunk(self.flat_params[b.index], self.rank)
        return chunk.float().clone() if self.precision.master else chunk

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        return {**held, "params": self.flat_params + held["params"]}

    def cast_working(self) -> None:
        dtype = self.precision.param_dtype
        if not self.precision.master:  # fp32 (or fp64): the parameters are the masters
            return
        super().cast_working()  # frozen parameters and buffers
        for b in self.buckets:
            self.flat_params[b.index] = flat = self.flat_params[b.index].to(dtype)
            for p in b.params:
                p.data = b.view(flat, p)

    # -- gradients: full buffers, reduced at the step ------------------------------------------
    def post_accumulate_grad_hook(self, p: nn.Parameter) -> None:  # argument: the parameter
        if self.require_sync:
            # backward's end: no collective here, but the habits' backward_end() then puts a
            # ShardedGrad in p.grad (without it, clip_grad_norm_ would clip the local,
            # unaveraged gradients without a word) and checks that every parameter got one
            self.queue_backward_end()
        b = self.bucket_of(p)
        b.hold_grad(self.grad_buffers[b.index], p)  # p.grad: a view of its bucket

    def backward_end(self) -> None:
        pass  # stage 1 communicates in optimizer.step()

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        # local, until the step reduces it
        return None if self.averaged is not None else super().visible_grad(p)

    def finish_grad_sync(self) -> list[torch.Tensor]:
        """Reduce-scatter every bucket: rank r receives the average of chunk r in a new (shard,)
        tensor. The local buffers keep this rank's own sums, so a second ``step()``, or more
        backwards without ``zero_grad()``, reduce them again rightly."""
        before = divides_before_sum(self.grad_buffers[0]) if self.grad_buffers else False
        if before:
            for g in self.grad_buffers:
                g.div_(self.world)
        # (shard,) per bucket: rank r's chunk of the sum over ranks
        shards = [g.new_empty(b.shard) for b, g in zip(self.buckets, self.grad_buffers)]
        works = [
            C.reduce_scatter(s, g, group=self.group, async_op=True, tag=f"zero1 grads {i}")
            for i, (s, g) in enumerate(zip(shards, self.grad_buffers))
        ]
        for w, s in zip(works, shards):
            w.wait()
            if not before:
                s.div_(self.world)
        if before:  # the local sums back (exact when N is a power of 2)
            for g in self.grad_buffers:
                g.mul_(self.world)
        if self.replicate_group is not None:  # HSDP: over the nodes too
            for i, s in enumerate(shards):
                self.average_replicas(s, f"zero1 replicas {i}")
        return shards  # (shard,) per bucket, averaged over ranks

    def average_replicas(self, shard: torch.Tensor, tag: str) -> None:
        """HSDP: a gradient shard (shard,), averaged over this node, averaged over the R nodes
        that hold the same shard: all-reduce over ``replicate_group``, / R (fp16: first)."""
        r = dist.get_world_size(self.replicate_group)
        before = divides_before_sum(shard)  # fp16: the sum of R scaled shards could overflow
        if before:
            shard.div_(r)
        C.all_reduce(shard, group=self.replicate_group, tag=tag)
        if not before:
            shard.div_(r)

    # -- the optimizer's side ----------------------------------------------------------------
    def after_step(self) -> None:
        works = []
        with torch.no_grad():
            for b, m, flat in zip(self.buckets, self.optim_params, self.flat_params):
                own = b.chunk(flat, self.rank)  # (shard,) view, this rank's updated chunk
                if self.precision.master:
                    own.copy_(m)
                tag = f"params {b.index}"
                works.append(C.all_gather(flat, own, group=self.group, async_op=True, tag=tag))
        for w in works:
            w.wait()

    def full_params(self) -> dict[int, torch.Tensor]:
        full = {}
        for b, m in zip(self.buckets, self.optim_params):
            flat = torch.empty(b.padded, dtype=m.dtype, device=m.device)  # (padded,) masters'
            C.all_gather(flat, m, group=self.group, tag="full_state_dict")
            full.update({id(p): b.view(flat, p).clone() for p in b.params})
        return full
