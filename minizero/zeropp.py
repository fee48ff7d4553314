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
quantisation per contribution; minizero.tools.bench_zeropp simulates the alternatives).

:class:`ZeROPlusPlus` is ZeRO3 with these three options: it overrides how a unit is gathered
(``start_gather``), released after forward (``release``) and its gradient reduce-scattered
(``reduce_scatter``), the moments ``ZeRO3.subclass_moments`` offers a subclass, and reads of
stage 3 only the face and ``ZeRO3.subclass_reads``. ``parallelize(model, 3, opt,
reshard_after_forward=..., ...)`` builds it.
Its parts: ``SecondaryShards`` (hpZ), ``QuantizedGather`` (qwZ), ``QuantizedReduceScatter``
(qgZ), and the block quantiser, ``quantize_blockwise``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.zero3 import ZeRO3

# -- block-wise int8 quantisation: qwZ and qgZ (ZeRO++ §3.1, §3.3) -------------------------------
QUANT_BLOCK = 256  # elements per block, each with its own scale


def quantize_blockwise(
    x: torch.Tensor, block: int = QUANT_BLOCK, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of the 1-D ``x`` in blocks of ``block`` elements (the last
    one may be shorter). Returns ``q`` (n,) int8 in [-L, L], L = 2^(bits-1) - 1 (127 for int8;
    7 for ``bits=4``, still one int8 per element: not packed), and ``scales`` (ceil(n / block),)
    fp32, with x ≈ q * scale of its block; scale = absmax(block) / L."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be 2..8, got {bits}")
    levels = 2 ** (bits - 1) - 1
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block)  # (blocks, block)
    scales = rows.abs().amax(dim=1) / levels  # (blocks,) fp32
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: q = 0
    q = torch.round(rows / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: int = QUANT_BLOCK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`, row by row: ``q`` (rows, n) int8 and ``scales``
    (rows, ceil(n / block)), e.g. every rank's quantised shard after an all-gather. Writes into
    ``out`` (rows, n) (any float dtype) when given; returns (rows, n)."""
    q2 = q if q.dim() == 2 else q.view(1, -1)  # (rows, n) int8
    s2 = scales if scales.dim() == 2 else scales.view(1, -1)  # (rows, blocks) fp32
    rows, n = q2.shape
    blocks = s2.shape[1]
    full = torch.zeros(rows, blocks * block, dtype=torch.float32, device=q.device)
    full[:, :n] = q2
    deq = (full.view(rows, blocks, block) * s2[:, :, None]).view(rows, -1)[:, :n]
    if out is None:
        return deq
    out.view(rows, n).copy_(deq)
    return out


def quantization_error(x: torch.Tensor, block: int = QUANT_BLOCK) -> dict[str, float]:
    """How far int8 block quantisation moves ``x``: ``max_rel`` = max|x - x̂| / max|x| and
    ``rms_rel`` = ||x - x̂|| / ||x|| (0 for an all-zero x)."""
    x = x.detach().reshape(-1).float()
    q, s = quantize_blockwise(x, block)
    err = dequantize_blockwise(q, s, block).view(-1) - x
    big, norm = float(x.abs().max()) if x.numel() else 0.0, float(x.norm())
    return {
        "max_rel": float(err.abs().max()) / big if big else 0.0,
        "rms_rel": float(err.norm()) / norm if norm else 0.0,
    }


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
        # group_desc: what ledgers call the group (analysis/ledger.py's group_label)
        blocks = [list(range(s, s + k)) for s in range(0, world, k)]
        groups = [dist.new_group(ranks, group_desc="hpZ") for ranks in blocks]
        rank = dist.get_rank()
        self.k, self.index = k, rank % k  # this rank's chunk of the unit within its block
        self.group = groups[rank // k]
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


class ZeROPlusPlus(ZeRO3):
    """ZeRO3 (P_os+g+p) with ZeRO++'s communication options (Wang et al., arXiv 2306.10209).

    ``reshard_after_forward`` (hpZ, §3.2; FSDP2's name): True (ZeRO3's: free after forward),
    False (keep units whole until their reduce-scatter) or k, the ranks per node (keep a
    secondary 1/k shard, gather within the node in backward). ``quantize_weights`` (qwZ, §3.1):
    int8 all-gathers from the shards. ``quantize_gradients`` (qgZ, §3.3): int8 all-to-all
    reduce-scatters. Model states per rank as ZeRO3's, (2 + 2 + K)Ψ/N, plus hpZ's Ψ/k between a
    unit's forward and its backward."""

    def __init__(
        self,
        module: nn.Module,
        *,
        reshard_after_forward: bool | int = True,
        quantize_weights: bool = False,
        quantize_gradients: bool = False,
        **options,  # ZeRO3's
    ):
        self.reshard_after_forward = reshard_size(
            reshard_after_forward, options.get("process_group")
        )
        self.secondary = None  # hpZ: SecondaryShards when reshard_after_forward is an int
        self.quantize_weights = bool(quantize_weights)  # qwZ: int8 all-gathers from the shards
        self.quantize_gradients = bool(quantize_gradients)  # qgZ: int8 all-to-all
        super().__init__(module, **options)
        if not isinstance(self.reshard_after_forward, bool):
            self.secondary = SecondaryShards(self.reshard_after_forward, len(self.buckets))

    def start_gather(self, i: int, flat: torch.Tensor):
        """From the block's secondary shards (hpZ, backward after an int reshard_after_forward),
        int8-quantised (qwZ), or plainly."""
        tag = f"zero3 params {i}"
        if self.secondary is not None and self.secondary.shards[i] is not None:
            return self.secondary.gather(i, flat, tag + " hpZ")
        if self.quantize_weights:
            return QuantizedGather(flat, self.param_shards[i], self.group, tag + " qwZ")
        return super().start_gather(i, flat)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        hpz = [t for t in self.secondary.shards if t is not None] if self.secondary else []
        return {**held, "params": held["params"] + hpz}

    def release(self, i: int, after_forward: bool = False) -> None:
        """After forward, reshard_after_forward=False keeps the unit whole; an int keeps this
        rank's secondary shard (hpZ) first."""
        if after_forward and self.reshard_after_forward is False:
            return  # stays gathered (and unguarded) until its gradients are reduce-scattered
        if self.secondary is not None and after_forward:
            self.gather(i)  # gathered already: waits until the whole unit is here
            self.secondary.keep(i, self.flat_params[i])
        elif self.secondary is not None:
            self.secondary.drop(i)
        super().release(i)

    def pre_forward(self, m: nn.Module, args) -> None:
        if m is self.module and self.secondary is not None:  # a new forward: an earlier
            self.secondary.drop()  # forward's hpZ shards may be stale
        super().pre_forward(m, args)

    def reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor, tag: str):
        if self.quantize_gradients:  # int8 blocks by all-to-all, summed in fp32 on arrival
            return QuantizedReduceScatter(out, buf, self.group, tag + " qgZ")
        return super().reduce_scatter(out, buf, tag)

    def after_step(self) -> None:
        if self.secondary is not None:
            self.secondary.drop()
        super().after_step()
