"""The bucket: a flat buffer with one view per parameter. Taught in lesson 01 (01_ddp).

Every stage of minizero moves data in buckets. A bucket holds a few parameters, in the order their
gradients become ready in backward (the reverse of registration order, as torch DDP does), laid end
to end in one flat buffer. One collective per bucket replaces one collective per parameter.

For ZeRO the flat buffer is padded to a multiple of the world size ``n`` and cut into ``n`` equal
chunks: rank ``r`` owns chunk ``r`` of every bucket. A reduce-scatter of a bucket leaves each rank
exactly the chunk it owns, and an all-gather of the chunks rebuilds the bucket on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Bucket:
    """``params`` end to end in a flat buffer of ``padded`` elements: ``world`` chunks of ``shard``.

    The bucket stores the layout only; each stage decides which flat buffers it keeps alive
    (DDP: a gradient buffer; ZeRO-1: + parameter buffer; ZeRO-3: a parameter buffer that lives only
    while gathered).
    """

    def __init__(self, params: list[nn.Parameter], index: int, world: int = 1):
        self.params = params
        self.index = index
        self.offsets: list[int] = []  # params[i] lives at [offsets[i], offsets[i] + numel)
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
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


def make_buckets(params: list[nn.Parameter], bucket_cap_mb: float, world: int = 1) -> list[Bucket]:
    """Group ``params`` into buckets of at most ``bucket_cap_mb`` MiB, last parameter first.

    Backward produces gradients roughly in reverse registration order, so bucket 0 (the model's
    last layers) fills first and its collective starts while the rest of backward still runs.
    A parameter larger than the cap gets a bucket of its own. ``bucket_cap_mb=0`` puts every
    parameter in its own bucket.
    """
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    groups: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap:
            groups.append([])
            size = 0.0
        groups[-1].append(p)
        size += nbytes
    return [Bucket(g, i, world) for i, g in enumerate(groups)]
