"""ZeRO-DP stage 2: optimizer states and gradients partitioned. Taught in lesson 03 (03_zero2).

Rajbhandari et al., arXiv 1910.02054, §5.2. What this file adds to zero1.py: gradients are
reduce-scattered bucket by bucket *during* backward, and each rank keeps only its own shard of them.

The moments it overrides, and what each does differently from ZeRO1:

    init_grads()        no persistent buffers: ``grad_shards`` (shard,) and ``filling`` (padded,)
                        per bucket, None until used
    post_accumulate_grad_hook(p)  copy p.grad into the bucket it fills, drop it; last: reduce_bucket
    reduce_bucket(b)    async reduce-scatter into chunk r, one in flight at a time
    finish_in_flight()  wait, average, add into ``grad_shards``, free the buffer
    backward_end()      DDP's again: reduce what unused parameters left incomplete, then finish
    finish_grad_sync()  the shards backward reduced (HSDP: what it held back from the nodes)
    visible_grad(p), clear_grad(p), reset_grads(): no local full gradient to keep
    no_sync()           DataParallel's, as DDP: full gradients accumulate in ``filling`` (Ψ)
"""

from __future__ import annotations

import torch
from torch import nn

from minizero import collectives as C
from minizero.bucket import Bucket
from minizero.ddp import DDP
from minizero.precision import divides_before_sum
from minizero.seams import Sharded
from minizero.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    """P_os+g: each rank keeps the optimizer states and the gradients of its shard only.

    Model states per rank: 2Ψ + (2 + K)Ψ/N in mixed precision (4Ψ + (4 + K)Ψ/N in fp32).
    Communication per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, as DDP and stage 1 (§7.2.1).

    Full gradients live only in bucket buffers (the table), at most two at a time: the one being
    filled and the one whose reduce-scatter is in flight (double buffering, as DeepSpeed's
    ``overlap_comm``). After backward the gradient is in ``grad_shards``; until the next forward
    ``p.grad`` is a ShardedGrad (habits/sharded_grad.py), which ``clip_grad_norm_`` works on.

    ``zero_grad()`` (``set_to_none=True``, torch's default) frees the gradient shards, as FSDP2
    does: between steps a rank keeps no gradient; the next backward allocates each again.

    What lesson 03 asks you to write: ``post_accumulate_grad_hook(p)`` (fill ``filling[b.index]``,
    count ``pending``, ``reduce_bucket(b)`` when complete) and ``finish_in_flight()`` (wait for
    ``in_flight``, average, add into ``grad_shards``, forget the buffer).
    """

    stage = 2
    sharded = Sharded(state=True, grads=True)
    requires_all_reduce = True  # HSDP: False holds the shards back from the nodes (FSDP2's)

    def init_grads(self) -> None:
        # (shard,) per bucket: rank r's chunk of the averaged gradient, accumulated over backwards;
        # None between zero_grad() and the bucket's next reduce-scatter (no gradient held)
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        # (padded,) per bucket while it fills, until its reduce-scatter is done; else None
        self.filling: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.in_flight = None  # (bucket, work, buffer, output) of the running reduce-scatter
        self.unreplicated: dict[int, torch.Tensor] = {}  # HSDP: bucket -> (shard,) not yet over R

    # no_sync() is DataParallel's (the table): the bucket buffers stay, accumulating, until the
    # next synchronised backward reduce-scatters their sum, as FSDP2 keeps its unsharded gradients;
    # the cost: the full gradient, Ψ elements in the reduce dtype, the memory stage 2 saves.

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        comm = [g for g in self.filling if g is not None]  # full buffers alive for a collective
        comm += [self.in_flight[2]] if self.in_flight is not None else []
        params = self.flat_params + list(self.module.parameters())
        return {"params": params, "grads": [g for g in self.grad_shards if g is not None],
                "comm": comm}  # fmt: skip

    def holds_unsynced_grads(self) -> bool:
        """True while no_sync() backwards have left full gradients in the bucket buffers."""
        return self.in_flight is None and any(g is not None for g in self.filling)

    def new_bucket_buffer(self, b: Bucket) -> torch.Tensor:
        """(padded,) zeros in the reduce dtype: parameters without gradients stay 0."""
        dev = b.params[0].device
        buf = torch.zeros(b.padded, dtype=self.precision.reduce_dtype, device=dev)
        self.filling[b.index] = buf
        return buf

    def post_accumulate_grad_hook(self, p: nn.Parameter) -> None:  # argument: the parameter
        b = self.bucket_of(p)
        buf = self.filling[b.index]
        if buf is None:
            buf = self.new_bucket_buffer(b)
        b.view(buf, p).add_(p.grad)  # (into zeros; or the no_sync() backwards' sum)
        p.grad = None  # the full gradient is freed as soon as it is in the bucket
        if not self.require_sync:  # no_sync(): the bucket keeps it, nothing is reduced
            return
        self.queue_backward_end()
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_in_order(b)

    def reduce_bucket(self, b: Bucket) -> None:
        self.finish_in_flight()  # at most one reduce-scatter in flight
        if self.grad_shards[b.index] is None:  # the first backward since zero_grad(): (shard,)
            self.grad_shards[b.index] = torch.zeros(
                b.shard, dtype=self.precision.reduce_dtype, device=b.params[0].device
            )
        buf = self.filling[b.index]
        if buf is None:  # no parameter of b was used in this backward
            buf = self.new_bucket_buffer(b)
        self.filling[b.index] = None  # in_flight keeps it until the reduce-scatter is done
        out = b.chunk(buf, self.rank)  # (shard,) in place: chunk r of the bucket gets the sum
        if divides_before_sum(buf):
            buf.div_(self.world)
        work = self.reduce_scatter(out, buf, f"zero2 grads {b.index}")
        self.in_flight = (b, work, buf, out)
        self.started[b.index] = True

    def reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor, tag: str):
        """Start the sum over ranks of chunk r of ``buf`` (padded,) into ``out`` (shard,)."""
        return C.reduce_scatter(out, buf, group=self.group, async_op=True, tag=tag)

    def finish_in_flight(self) -> None:
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            if not divides_before_sum(out):
                out.div_(self.world)
            self.add_to_shard(b.index, out)
            self.in_flight = None  # the last reference to the buffer (out is a view): freed

    def add_to_shard(self, i: int, out: torch.Tensor) -> None:
        """Bucket ``i``'s chunk, averaged over the group, into this rank's gradient shard."""
        if self.replicate_group is not None:  # HSDP: averaged over the nodes too, or held back
            out = self.over_nodes(i, out)
        if out is not None:
            self.grad_shards[i].add_(out)

    # Stage 1's backward_end does nothing (it reduces at the step); stage 2 reduces during
    # backward again, as DDP does, so it needs DDP's: reduce the buckets that parameters unused in
    # this backward left incomplete (zeros, so that every rank issues the same reduce-scatters),
    # wait for the one in flight, reset the counts. Its reduce_bucket is this file's.
    backward_end = DDP.backward_end

    def finish_grad_sync(self) -> list[torch.Tensor | None]:
        """The shards backward reduced (HSDP: with what it held back from the nodes, averaged)."""
        for i in sorted(self.unreplicated):
            self.grad_shards[i].add_(self.over_nodes(i, self.unreplicated.pop(i), step=True))
        return self.grad_shards  # (shard,) per bucket; None: no backward since zero_grad()

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        return None  # the full gradient of p exists only while its bucket fills

    def clear_grad(self, p: nn.Parameter) -> None:
        for f in self.fragments_of.get(id(p), []):  # its ranges of this rank's shards
            shard = self.grad_shards[f.bucket]  # (shard,) or None
            if shard is not None:
                shard[f.offset : f.offset + f.numel].zero_()

    def reset_grads(self, set_to_none: bool) -> None:
        self.filling = [None] * len(self.buckets)  # no_sync() backwards' sums: dropped
        self.unreplicated.clear()  # (HSDP)
        if set_to_none:  # freed; the next backward allocates them again
            self.grad_shards = [None] * len(self.buckets)
        for g in self.grad_shards:
            if g is not None:
                g.zero_()
        for p in self.params:
            p.grad = None

    # -- HSDP (hsdp.py): a replicate group, the same shards on every node ----------------------
    def over_nodes(self, i: int, out: torch.Tensor, step: bool = False) -> torch.Tensor | None:
        """Bucket ``i``'s chunk ``out``, with what earlier backwards held back, averaged over the
        nodes (``replicate_group``); None: held back instead, after
        ``set_requires_all_reduce(False)``, until a backward with it True, or the ``step``."""
        if i in self.unreplicated:
            out.add_(self.unreplicated.pop(i))
        if not (step or self.requires_all_reduce):
            self.unreplicated[i] = out.clone()
            return None
        self.average_replicas(out, f"zero2 replicas {i}")
        return out

    def set_requires_all_reduce(self, requires: bool) -> None:
        """FSDP2's switch for HSDP's gradient accumulation (:meth:`over_nodes`); False on every
        micro-batch averages over the nodes once a step, as DeepSpeed MiCS does."""
        self.requires_all_reduce = bool(requires)
