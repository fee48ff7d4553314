"""ZeRO-DP stage 1: optimizer states partitioned. Taught in lesson 02 (02_zero1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054 (SC20), §5.1. Plain synchronous data parallelism: every rank still runs the whole
model on its own micro-batch; what changes is who keeps which optimizer state. What this file adds
to ddp.py: buckets padded to a multiple of N and cut into N chunks; rank r owns chunk r (its
masters and optimizer states cover only that); the all-reduce becomes a reduce-scatter at the
step, and the updated chunks are all-gathered back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero import hsdp
from minizero.bucket import Bucket, make_buckets
from minizero.ddp import DDP


class ZeRO1(DDP):
    """P_os: each rank keeps the optimizer states (and fp32 master weights) of its shard only.

    Model states per rank: 2Ψ + 2Ψ + KΨ/N in mixed precision (4Ψ + 4Ψ + KΨ/N in fp32).
    Communication per step: reduce-scatter of the gradients (Ψ) + all-gather of the updated
    parameters (Ψ) = 2Ψ, the same volume as DDP's all-reduce (§7.2.1).

    Layout: DDP's buckets, each one's parameters made views of one flat buffer (``flat_params``),
    zero-padded to a multiple of the world size N and cut into N equal chunks. Rank r owns chunk
    r of every bucket: its master weights and optimizer states cover exactly those chunks.
    Gradients are views of a flat buffer of the same layout (``grad_buffers``, as DDP's).

    Step: backward accumulates full local gradients (no communication, so gradient accumulation
    and ``no_sync()`` need nothing special); ``optimizer.step()`` reduce-scatters each bucket, so
    rank r receives the averaged gradient of its chunk, steps its chunk, and all-gathers the
    updated chunks back into every rank's full parameters.

    What lesson 02 asks you to write: ``reduce_gradients()``. Called by the step (and by
    ``clip_grad_norm_``: when ``self.reduced`` it must not reduce again, and it sets it); may
    assume every backward since ``zero_grad()`` has accumulated into ``grad_buffers``; must
    return, per bucket, this rank's ``(shard,)`` chunk of the gradient averaged over the ranks of
    ``self.group`` (N = ``self.world``), and leave no collective in flight. And ``after_step()``:
    called once the optimizer has stepped ``masters``; copy each (mixed precision) into this
    rank's chunk of ``flat_params`` and all-gather every chunk over ``self.group``.
    """

    stage = 1

    # -- layout: chunk r of every bucket is rank r's -----------------------------------------
    def make_buckets(self, bucket_cap_mb: float | None) -> list[Bucket]:
        return self.flatten(make_buckets(self.params, bucket_cap_mb, self.world))

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

    def take_master(self, b: Bucket) -> torch.Tensor:
        # (shard,) fp32: chunk r of flat_params itself, stepped in place. Mixed precision: a
        # separate fp32 copy of that chunk (the K in KΨ/N includes it)
        chunk = b.chunk(self.flat_params[b.index], self.rank)
        return chunk.float().clone() if self.precision.master else chunk

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
    def init_grads(self) -> None:
        super().init_grads()  # (padded,) per bucket, like flat_params; p.grad views into it
        self.reduced = False
        self.reduced_shards: list[torch.Tensor] = []  # (shard,) per bucket, between reduce and step

    @property
    def shards_grads(self) -> bool:
        return True

    def on_grad_ready(self, p: nn.Parameter) -> None:  # argument: the parameter
        if self.require_sync:
            self.queue_backward_end()  # nothing to do there but mark the ledger's timeline
        self.accumulate(p)

    def backward_end(self) -> None:
        pass  # stage 1 communicates in optimizer.step()

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        # local, until the step reduces it
        return None if self.reduced else super().visible_grad(p)

    def reduce_gradients(self) -> list[torch.Tensor]:
        """Reduce-scatter every bucket: rank r receives the average of chunk r in a new (shard,)
        tensor, kept until the step ends. The local buffers keep this rank's own sums, so a
        second ``step()``, or more backwards without ``zero_grad()``, reduce them again rightly.
        With a mesh (HSDP, as FSDP2's: minizero/hsdp.py) each chunk is then averaged over the
        replicas, the ranks of the other nodes that hold the same chunk."""
        if not self.reduced:
            fp16 = self.precision.reduce_dtype == torch.float16
            if fp16:  # divide before the sum, so that the sum cannot overflow fp16
                for g in self.grad_buffers:
                    g.div_(self.world)
            # (shard,) per bucket: rank r's chunk of the sum over ranks
            pairs = zip(self.buckets, self.grad_buffers)
            self.reduced_shards = [g.new_empty(b.shard) for b, g in pairs]
            works = [
                C.reduce_scatter(s, g, group=self.group, async_op=True, tag=f"zero1 grads {i}")
                for i, (s, g) in enumerate(zip(self.reduced_shards, self.grad_buffers))
            ]
            for w, s in zip(works, self.reduced_shards):
                w.wait()
                if not fp16:
                    s.div_(self.world)
            if fp16:  # the local sums back (exact when N is a power of 2)
                for g in self.grad_buffers:
                    g.mul_(self.world)
            hsdp.average_replicas(self.reduced_shards, self.replicate_group, "zero1 replicas")
            self.reduced = True
        return self.reduced_shards  # (shard,) per bucket, averaged over ranks

    # -- the optimizer's side ----------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor | None]:
        return self.reduce_gradients()

    def reduce_norm_parts(self, part: torch.Tensor, op: dist.ReduceOp) -> None:
        C.all_reduce(part, op=op, group=self.group, tag="grad norm")  # disjoint ranges

    def after_step(self) -> None:
        works = []
        with torch.no_grad():
            for b, m, flat in zip(self.buckets, self.masters, self.flat_params):
                own = b.chunk(flat, self.rank)  # (shard,) view, this rank's updated chunk
                if self.precision.master:
                    own.copy_(m)
                works.append(
                    C.all_gather(
                        flat, own, group=self.group, async_op=True, tag=f"params {b.index}"
                    )
                )
        for w in works:
            w.wait()
        self.reduced, self.reduced_shards = False, []  # the next step reduces the buffers again

    def reset_grads(self, set_to_none: bool) -> None:
        self.reduced, self.reduced_shards = False, []
        super().reset_grads(set_to_none)

    def full_params(self) -> dict[int, torch.Tensor]:
        full = {}
        for b, m in zip(self.buckets, self.masters):
            flat = torch.empty(b.padded, dtype=m.dtype, device=m.device)  # (padded,) masters'
            C.all_gather(flat, m, group=self.group, tag="full_state_dict")
            full.update({id(p): b.view(flat, p).clone() for p in b.params})
        return full

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": self.flat_params + list(self.module.parameters()),
            "grads": self.grad_buffers,
        }
