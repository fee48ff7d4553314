"""The bucket: a flat buffer with one view per parameter. Taught in lesson 01 (01_ddp).

Every stage of minizero moves data in buckets. A bucket holds a few parameters, in the order their
gradients become ready in backward, laid end to end in one flat buffer. One collective per bucket
replaces one collective per parameter. Two cuts, by torch DDP's size rule: :func:`make_buckets`
over a predicted order (the reverse of registration order), then :func:`buckets_in_order` over the
order the first backward made them ready (minizero/optimizer/state.py), as torch DDP does.

For ZeRO the flat buffer is padded to a multiple of the world size ``n`` (not counted against the
cap) and cut into ``n`` equal chunks: rank ``r`` owns chunk ``r`` of every bucket. A reduce-scatter
of a bucket leaves each rank the chunk it owns; an all-gather of the chunks rebuilds the bucket.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch import nn


class Bucket:
    """``params`` end to end in a flat buffer of ``padded`` elements: ``world`` chunks of ``shard``.
    The layout only: each stage decides which flat buffers it keeps alive (DDP: gradients)."""

    def __init__(self, params: list[nn.Parameter], index: int, world: int = 1):
        self.params = params
        self.index = index
        self.offsets = list(accumulate((p.numel() for p in params), initial=0))
        self.numel = n = self.offsets.pop()  # params[i] at [offsets[i], offsets[i + 1]) of numel
        self.world = world
        self.shard = math.ceil(n / world)  # chunk size; rank r owns [r * shard, (r + 1) * shard)
        self.padded = self.shard * world  # numel rounded up to a multiple of world
        self._slot = {id(p): i for i, p in enumerate(params)}

    def __contains__(self, p: nn.Parameter) -> bool:
        return id(p) in self._slot

    def view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """The view of ``flat`` (padded,) that belongs to ``p``, shaped like ``p``."""
        i = self._slot[id(p)]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def hold_grad(self, flat: torch.Tensor, p: nn.Parameter) -> None:
        """Make ``p.grad`` its view of the gradient buffer ``flat`` (the first backward since
        zero_grad moves it in); a 16-bit ``p.grad`` reduced in fp32 is added, and dropped."""
        if p.grad._base is not flat:
            view = self.view(flat, p)
            if view.dtype == p.dtype:  # p.grad holds the whole local sum: it moves in
                view.copy_(p.grad)
                p.grad = view
            else:  # fp32 reduction of 16-bit grads: the (zeroed) bucket sums micro-batches
                view.add_(p.grad)
                p.grad = None

    def chunk(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Chunk ``rank`` of ``flat`` (padded,): a (shard,) view."""
        return flat[rank * self.shard : (rank + 1) * self.shard]

    def flatten(
        self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Copy one tensor per parameter into a new zero-padded flat buffer (padded,)."""
        flat = torch.zeros(self.padded, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
        for p, t in zip(self.params, tensors, strict=True):
            self.view(flat, p).copy_(t)
        return flat

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {len(self.params)} params, {self.numel} elements)"


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that need gradients, each once (tied weights once), in registration order."""
    return [p for p in module.parameters() if p.requires_grad]


DEFAULT_CAP_MB = 25  # torch DDP's default bucket_cap_mb (MiB)
FIRST_CAP_MB = 1  # its first bucket at that default (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def assign_by_size(nbytes: list[int], bucket_cap_mb: float | None = None) -> list[list[int]]:
    """torch 2.13 DDP's bucket rule (reducer.cpp's ``compute_bucket_assignment_by_size``) over
    sizes in bytes, in order: a bucket closes once it holds ``bucket_cap_mb`` MiB or more; at the
    default (None: 25 MiB) the first closes at 1 MiB. Returns indices per bucket."""
    if bucket_cap_mb is not None and bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 (MiB), got {bucket_cap_mb}")
    cap = (DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 2**20
    first = FIRST_CAP_MB * 2**20 if bucket_cap_mb is None else cap
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if not buckets or size >= (first if len(buckets) == 1 else cap):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def make_buckets(
    params: list[nn.Parameter], bucket_cap_mb: float | None = None, world: int = 1
) -> list[Bucket]:
    """``params`` in registration order, cut by :func:`assign_by_size` (MiB) *reversed*: the
    ready order torch DDP predicts for its first buckets, so bucket 0 holds the last parameters.
    Wrong where backward makes a module's parameters ready in registration order
    (``nn.LayerNorm``) or forward calls modules out of order (minizero's MLP): hence the second
    cut (above)."""
    return buckets_in_order(list(reversed(params)), bucket_cap_mb, world)


def buckets_in_order(
    ready: list[nn.Parameter], bucket_cap_mb: float | None = None, world: int = 1
) -> list[Bucket]:
    """Cut ``ready`` (the order gradients become ready) by :func:`assign_by_size` (MiB)."""
    groups = assign_by_size([p.numel() * p.element_size() for p in ready], bucket_cap_mb)
    return [Bucket([ready[i] for i in idx], k, world) for k, idx in enumerate(groups)]
