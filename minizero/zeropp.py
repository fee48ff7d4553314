"""ZeRO++ at stage 3: how a unit is gathered and reduced when ranks span nodes. Lesson 08.

ZeRO++ (Wang et al., arXiv 2306.10209), opt-in; measured by ``python -m minizero bench
zeropp``. hpZ (§3.2), ``reshard_after_forward`` as FSDP2 defines it: True, stage 3's default (free
after forward, all-gather again in backward over all N ranks); False:
units stay whole from their forward to their reduce-scatter (no backward all-gather, up to
Ψ more bytes held); an int k dividing N (the ranks per node): after forward each rank keeps
1/k of the unit (its secondary shard; Ψ/k more between forward and backward), and backward
all-gathers within its block of k consecutive ranks ("hpZ" in the ledger). qwZ (§3.1),
``quantize_weights=True``: all-gathers from the shards go as int8 blocks of 256 with an fp32
scale each (about Ψ(1 + 4/256) bytes instead of 2Ψ or 4Ψ); the shards and the optimizer's
masters stay full precision. qgZ (§3.3), ``quantize_gradients=True``: each unit's gradient
goes as int8 blocks by one all-to-all, dequantised and summed in fp32 by its owner (one
quantisation per contribution; minizero.tools.zeropp simulates the alternatives).

``SecondaryShards`` (hpZ), ``QuantizedGather`` (qwZ) and ``QuantizedReduceScatter`` (qgZ) are what
zero3.py and zero2.py call; the block quantiser itself is ``precision.quantize_blockwise``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.precision import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise


class SecondaryShards:
    """hpZ (ZeRO++ §3.2; FSDP2's ``reshard_after_forward=k``): after a unit's forward, rank r
    keeps 1/k of the unit, chunk ``r % k`` of it, so that its block of k consecutive ranks (a
    node: ranks ``k * (r // k)`` ..) holds the whole unit between them, and backward all-gathers
    over those k ranks only, not over all N. Cost: ``padded / k`` elements per unit per rank, in
    the working dtype, from the end of the unit's forward to its backward.

    Every rank makes every block's group (``dist.new_group`` must be entered by every process of
    the job, in the same order), so the wrapper's group must be the world."""

    def __init__(self, k: int, n_units: int) -> None:
        world = dist.get_world_size()
        groups = [dist.new_group(list(range(s, s + k))) for s in range(0, world, k)]
        rank = dist.get_rank()
        self.k, self.index = k, rank % k  # this rank's chunk of the unit within its block
        self.group = C.name_group(groups[rank // k], "hpZ")
        self.shards: list[torch.Tensor | None] = [None] * n_units  # (padded / k,) per unit

    def keep(self, i: int, flat: torch.Tensor) -> None:
        """Unit i's full ``flat`` (padded,) is about to be freed: keep this rank's 1/k of it."""
        if self.shards[i] is None:
            self.shards[i] = flat.view(self.k, -1)[self.index].clone()  # (padded / k,)

    def gather(self, i: int, flat: torch.Tensor, tag: str):
        """Async all-gather of unit i from the block's k secondary shards into ``flat``."""
        return C.all_gather(flat, self.shards[i], group=self.group, async_op=True, tag=tag)

    def drop(self, i: int | None = None) -> None:
        """Forget unit i's secondary shard (every unit's with None)."""
        for j in range(len(self.shards)) if i is None else [i]:
            self.shards[j] = None


class QuantizedGather:
    """qwZ (ZeRO++ §3.1): all-gather a unit's shards as int8 blocks with one fp32 scale per block
    (two all-gathers: N * shard bytes and 4 * N * ceil(shard / block) bytes, against 2 or 4 bytes
    per element unquantised), dequantised into ``flat`` (padded,) on :meth:`wait`. The shard
    itself (the master copy's working-dtype image) is never quantised: only the gathered copy."""

    def __init__(self, flat: torch.Tensor, shard: torch.Tensor, group, tag: str) -> None:
        n = dist.get_world_size(group)
        self.q, self.scales = quantize_blockwise(shard, QUANT_BLOCK)  # (shard,) int8, (blocks,)
        self.all_q = torch.empty(n, shard.numel(), dtype=torch.int8, device=shard.device)
        self.all_scales = torch.empty(n, self.scales.numel(), device=shard.device)  # fp32
        self.works = [
            C.all_gather(self.all_q.view(-1), self.q, group, async_op=True, tag=tag + " int8"),
            C.all_gather(
                self.all_scales.view(-1), self.scales, group, async_op=True, tag=tag + " scales"
            ),
        ]
        self.flat = flat

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        dequantize_blockwise(self.all_q, self.all_scales, QUANT_BLOCK, out=self.flat)
        return True


def reshard_size(value: bool | int, group) -> bool | int:
    """``reshard_after_forward`` checked, by FSDP2's rule: True, False, or an int k dividing the
    group size N; k == 1 means False, k == N means True."""
    world = dist.get_world_size(group)
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or world % value:
        raise ValueError(
            f"reshard_after_forward must be True, False or an int dividing the group size "
            f"{world} (the ranks per node, e.g. torch.cuda.device_count()), got {value!r}"
        )
    if value in (1, world):
        return value == world
    if group is not None and group != dist.group.WORLD:
        raise ValueError(
            f"reshard_after_forward={value} (hpZ) needs the wrapper over the world group: "
            "its blocks of ranks are made with dist.new_group on every rank"
        )
    return value


class QuantizedReduceScatter:
    """qgZ (ZeRO++ §3.3), in one hop: a reduce-scatter of ``buf`` (N * shard,) into ``out``
    (shard,) as an all-to-all of int8 blocks: row j of ``buf`` (the part rank j owns) is
    quantised (blocks of 256, fp32 scales) and sent to rank j, which dequantises the N rows it
    receives and sums them in fp32 on :meth:`wait`. Each contribution is quantised once; a ring
    would quantise the partial sum at every hop. Bytes: N * shard + 4 * N * blocks, against 2 or
    4 per element unquantised. ZeRO++ goes hierarchical (within nodes, then across) and int4."""

    def __init__(self, out: torch.Tensor, buf: torch.Tensor, group, tag: str) -> None:
        n = dist.get_world_size(group)
        parts = [quantize_blockwise(row, QUANT_BLOCK) for row in buf.view(n, -1)]
        self.q = torch.stack([q for q, _ in parts])  # (N, shard) int8: row j for rank j
        self.scales = torch.stack([s for _, s in parts])  # (N, blocks) fp32
        self.got_q, self.got_scales = torch.empty_like(self.q), torch.empty_like(self.scales)
        self.works = [
            C.all_to_all(self.got_q, self.q, group, async_op=True, tag=tag + " int8"),
            C.all_to_all(self.got_scales, self.scales, group, async_op=True, tag=tag + " scales"),
        ]
        self.out = out

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        rows = dequantize_blockwise(self.got_q, self.got_scales, QUANT_BLOCK)  # (N, shard) fp32
        self.out.copy_(rows.sum(0))
        return True
