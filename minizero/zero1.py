"""ZeRO-DP stage 1: optimizer states partitioned. Taught in lesson 02 (02_zero1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv 1910.02054 (SC20), §5.1. Plain synchronous data parallelism: every rank still runs the whole
model on its own micro-batch; what changes is who keeps which optimizer state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.bucket import Bucket, make_buckets, trainable_parameters
from minizero.data_parallel import DataParallel
from minizero.precision import Precision


class ZeRO1(DataParallel):
    """P_os: each rank keeps the optimizer states (and fp32 master weights) of its shard only.

    Model states per rank: 2Ψ + 2Ψ + KΨ/N in mixed precision (4Ψ + 4Ψ + KΨ/N in fp32).
    Communication per step: reduce-scatter of the gradients (Ψ) + all-gather of the updated
    parameters (Ψ) = 2Ψ, the same volume as DDP's all-reduce (§7.2.1).

    Layout: parameters are grouped into buckets (``bucket_cap_mb``); each bucket's parameters
    become views of one flat buffer, zero-padded to a multiple of the world size N and cut into N
    equal chunks. Rank r owns chunk r of every bucket: its master weights and optimizer states
    cover exactly those chunks. Gradients are views of a flat buffer of the same layout.

    Step: backward accumulates full local gradients (no communication, so gradient accumulation
    and ``no_sync()`` need nothing special); ``optimizer.step()`` reduce-scatters each bucket, so
    rank r receives the averaged gradient of its chunk, steps its chunk, and all-gathers the
    updated chunks back into every rank's full parameters.
    """

    stage = 1

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
        self.buckets = self._make_buckets(bucket_cap_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # (padded,) flat per bucket; p.data views into it; rank r owns chunk r. Built in fp32...
        self.flat_params = [self._flatten_params(b) for b in self.buckets]
        # masters: (shard,) per bucket. fp32: chunk r of flat_params itself, stepped in place.
        # Mixed precision: a separate fp32 copy of that chunk (the K in KΨ/N includes it),
        # taken from the fp32 weights before the cast.
        self.masters = [self._own_chunk_master(b) for b in self.buckets]
        self._cast_working()  # ...then cast to the working dtype
        owned = [(self.rank * b.shard, (self.rank + 1) * b.shard) for b in self.buckets]
        self._build_fragments(owned, self.masters)
        self._init_grads(self.precision.reduce_dtype)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- layout ------------------------------------------------------------------------------
    def _make_buckets(self, bucket_cap_mb: float) -> list[Bucket]:
        return make_buckets(self.params, bucket_cap_mb, self.world)

    def _flatten_params(self, b: Bucket) -> torch.Tensor:
        flat = b.flatten([p.detach() for p in b.params])
        for p in b.params:
            p.data = b.view(flat, p)
        return flat

    def _cast_working(self) -> None:
        dtype = self.precision.param_dtype
        if dtype == torch.float32:
            return
        super()._cast_working()  # frozen parameters and buffers
        for b in self.buckets:
            self.flat_params[b.index] = flat = self.flat_params[b.index].to(dtype)
            for p in b.params:
                p.data = b.view(flat, p)

    def _own_chunk_master(self, b: Bucket) -> torch.Tensor:
        chunk = b.chunk(self.flat_params[b.index], self.rank)  # (shard,) view of flat_params
        return chunk.float().clone() if self.precision.master else chunk

    # -- gradients: full buffers, reduced at the step ------------------------------------------
    def _init_grads(self, dtype: torch.dtype) -> None:
        # (padded,) flat per bucket, like flat_params; p.grad views into it
        self.grad_buffers = [
            torch.zeros(b.padded, dtype=dtype, device=b.params[0].device) for b in self.buckets
        ]
        self._reduced = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:  # argument: the parameter
        if self._require_sync:
            self._queue_backward_end()  # nothing to do there but mark the ledger's timeline
        b = self._bucket_of[id(p)]
        view = b.view(self.grad_buffers[b.index], p)
        if p.grad._base is not self.grad_buffers[b.index]:  # after zero_grad(None)
            if view.dtype == p.dtype:  # p.grad holds the whole local sum: it moves in
                view.copy_(p.grad)
                p.grad = view
            else:  # fp32 reduction of 16-bit grads: the (zeroed) bucket sums micro-batches
                view.add_(p.grad)
                p.grad = None

    def _backward_end(self) -> None:
        pass  # stage 1 communicates in optimizer.step()

    def _visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        b = self._bucket_of[id(p)]
        view = b.view(self.grad_buffers[b.index], p)  # local, until the step reduces it
        return view if view.dtype == p.dtype and not self._reduced else None

    def _reduce_grads(self) -> list[torch.Tensor]:
        """Reduce-scatter every bucket in place: chunk r of rank r's buffer gets the average."""
        shards = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        if not self._reduced:
            fp16 = self.grad_buffers[0].dtype == torch.float16 if self.grad_buffers else False
            if fp16:  # divide before the sum, so that the sum cannot overflow fp16
                for g in self.grad_buffers:
                    g.div_(self.world)
            works = [
                C.reduce_scatter(s, g, group=self.group, async_op=True, tag=f"zero1 grads {i}")
                for i, (s, g) in enumerate(zip(shards, self.grad_buffers))
            ]
            for w, s in zip(works, shards):
                w.wait()
                if not fp16:
                    s.div_(self.world)
            self._reduced = True
        return shards  # (shard,) per bucket, averaged over ranks

    # -- the optimizer's side ----------------------------------------------------------------
    def _grad_shards(self) -> list[torch.Tensor]:
        return self._reduce_grads()

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
        self._reduced = False  # the buffers hold this step's reduced chunks until zero_grad()

    def _zero_grad(self, set_to_none: bool) -> None:
        self._reduced = False
        for g in self.grad_buffers:
            g.zero_()  # the next backward adds into zeros (or, in place, into the views)
        for p in self.params:
            p.grad = None if set_to_none else self._visible_grad(p)

    def _full_params(self) -> dict[int, torch.Tensor]:
        full = {}
        for b, m in zip(self.buckets, self.masters):
            flat = torch.empty(b.padded, dtype=torch.float32, device=m.device)  # (padded,) fp32
            C.all_gather(flat, m.float(), group=self.group, tag="full_state_dict")
            full.update({id(p): b.view(flat, p).clone() for p in b.params})
        return full

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": self.flat_params + list(self.module.parameters()),
            "grads": self.grad_buffers,
        }
