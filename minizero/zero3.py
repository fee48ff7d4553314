"""ZeRO-DP stage 3: optimizer states, gradients and parameters partitioned. Taught in lesson 04.

Rajbhandari et al., arXiv 1910.02054, §5.3. What this file adds to zero2.py: parameters too live
sharded between uses; each module's are all-gathered just before its forward and again before its
backward, and freed right after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from minizero import collectives as C
from minizero.bucket import Bucket
from minizero.precision import Precision
from minizero.zero2 import ZeRO2


class ZeRO3(ZeRO2):
    """P_os+g+p: each rank keeps only its shard of every model state.

    Model states per rank: (2 + 2 + K)Ψ/N in mixed precision ((4 + 4 + K)Ψ/N in fp32).
    Communication per step: all-gather Ψ in forward + all-gather Ψ in backward + reduce-scatter Ψ
    of the gradients = 3Ψ, 1.5x DDP (§7.2.2).

    Units: every module that owns trainable parameters directly (``parameters(recurse=False)``)
    is one bucket; a tied parameter belongs to the first module that owns it, and every module that
    uses it gathers that unit. Between uses a unit's flat buffer has its storage resized to 0 bytes:
    only ``param_shards`` (rank r's chunk) stays. Tensors autograd saved in forward point at the
    same storage, so the gather before backward makes them whole again.

    A unit that several modules use (tied weights) stays gathered from its first use in forward
    to its last, so that after the first step each unit is gathered once in forward.

    Prefetch: the order in which modules ran in the first forward is recorded; with ``prefetch=1``
    the next module's all-gather is issued (asynchronously) as soon as the current one's is done,
    in forward, and the previous module's in backward. ``bucket_cap_mb`` is not used.
    """

    stage = 3

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 25,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
        prefetch: int = 1,
        **options,  # broadcast_buffers, find_unused_parameters: see DataParallel
    ):
        self.param_shards: list[torch.Tensor] = []  # (shard,) per unit; filled by super().__init__
        super().__init__(
            module,
            bucket_cap_mb=bucket_cap_mb,
            precision=precision,
            process_group=process_group,
            **options,
        )
        self.prefetch = prefetch
        self._gathers: list = [None] * len(self.buckets)  # in-flight all-gather per unit
        self._gathered = [True] * len(self.buckets)  # flat_params[i] holds the full unit
        self.max_gathered = 0  # most units gathered at once (a structure check)
        self._order: list[nn.Module] = []  # modules with units, in the first forward's order
        self._recording = True
        self._last_use: dict[int, int] = {}  # unit -> position of its last user in _order
        for m in self._units_of:
            m.register_forward_pre_hook(self._pre_forward)
            m.register_forward_hook(self._post_forward)
        for i in range(len(self.buckets)):
            self._free(i)

    # -- layout: one unit per module that owns parameters ----------------------------------------
    def _make_buckets(self, bucket_cap_mb: float) -> list[Bucket]:
        owner: dict[int, int] = {}  # id(param) -> unit index
        groups: list[list[nn.Parameter]] = []
        self._units_of: dict[nn.Module, list[int]] = {}  # module -> units its forward needs
        for m in self.module.modules():
            mine = [p for p in m.parameters(recurse=False) if p.requires_grad]
            new = [p for p in mine if id(p) not in owner]
            if new:
                owner.update({id(p): len(groups) for p in new})
                groups.append(new)
            if mine:
                self._units_of[m] = sorted({owner[id(p)] for p in mine})
        return [Bucket(g, i, self.world) for i, g in enumerate(groups)]

    def _own_chunk_master(self, b: Bucket) -> torch.Tensor:
        # (shard,) the only copy of these parameters this rank keeps between uses
        shard = b.chunk(self.flat_params[b.index], self.rank).clone()
        self.param_shards.append(shard)
        return shard.float().clone() if self.precision.master else shard

    def _cast_working(self) -> None:
        super()._cast_working()
        dtype = self.precision.param_dtype
        self.param_shards = [s.to(dtype) for s in self.param_shards]  # (shard,) working dtype

    def _load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        flat = full.reshape(-1).to(self.param_shards[0].device)  # only this rank's ranges
        for i in self._frag_index.get(id(p), []):
            f, t = self.fragments[i], self.frag_tensors[i]
            self.param_shards[f.bucket][f.offset : f.offset + f.numel].copy_(flat[f.start : f.end])
            t.copy_(flat[f.start : f.end])
        b = self._bucket_of[id(p)]
        if self._gathered[b.index]:  # refresh the full copy too, should it be in use
            b.view(self.flat_params[b.index], p).copy_(full)

    def _params_written(self) -> None:
        with torch.no_grad():
            for shard, m in zip(self.param_shards, self.masters, strict=True):
                if m is not shard:
                    m.copy_(shard)

    # -- gather and free ---------------------------------------------------------------------
    def _gather(self, i: int, wait: bool = True) -> None:
        if not self._gathered[i]:
            flat = self.flat_params[i]  # (padded,) storage back to full size, then filled
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            self._gathers[i] = C.all_gather(
                flat, self.param_shards[i], group=self.group, async_op=True, tag=f"zero3 params {i}"
            )
            self._gathered[i] = True
            self.max_gathered = max(self.max_gathered, sum(self._gathered))
        if wait and self._gathers[i] is not None:
            self._gathers[i].wait()
            self._gathers[i] = None

    def _free(self, i: int) -> None:
        if self._gathers[i] is not None:
            self._gathers[i].wait()
            self._gathers[i] = None
        self.flat_params[i].untyped_storage().resize_(0)  # p.data views stay, with 0 bytes
        self._gathered[i] = False

    def _neighbour(self, m: nn.Module, step: int) -> list[int]:
        if self._recording or m not in self._order:
            return []
        j = self._order.index(m) + step
        return self._units_of[self._order[j]] if 0 <= j < len(self._order) else []

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, m: nn.Module, args) -> None:
        if self._recording and m not in self._order:
            self._order.append(m)
        for i in self._units_of[m]:
            self._gather(i)
        for i in self._neighbour(m, +self.prefetch):
            self._gather(i, wait=False)

    def _post_forward(self, m: nn.Module, args, out):
        for i in self._units_of[m]:
            if self._recording or self._last_use[i] <= self._order.index(m):
                self._free(i)  # (a tied unit stays gathered until its last use in forward)
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, m=m: self._pre_backward(m))

    def _pre_backward(self, m: nn.Module) -> None:
        self._queue_backward_end()
        for i in self._units_of[m]:
            self._gather(i)
        for i in self._neighbour(m, -self.prefetch):
            if self._pending[i] != -1:  # not a unit whose backward is already over
                self._gather(i, wait=False)

    def _launch(self, b: Bucket) -> None:
        super()._launch(b)  # every gradient of the unit is in: reduce-scatter it...
        self._free(b.index)  # ...and drop the full parameters again

    def _backward_end(self) -> None:
        super()._backward_end()
        for i in range(len(self.buckets)):
            if self._gathered[i]:
                self._free(i)
        if self._recording:  # the forward order is known now: where each unit is last used
            self._recording = False
            self._last_use = {i: j for j, m in enumerate(self._order) for i in self._units_of[m]}

    # -- the optimizer's side: no all-gather after the step; the next forward gathers --------
    def after_step(self) -> None:
        if self.precision.master:
            with torch.no_grad():
                for shard, m in zip(self.param_shards, self.masters):
                    shard.copy_(m)
                    m.grad = None

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        state = super()._minizero_state_tensors()
        frozen = [p for p in self.module.parameters() if not p.requires_grad]  # replicated
        state["params"] = self.param_shards + frozen
        gathered = [f for f, g in zip(self.flat_params, self._gathered) if g]  # transient
        state["comm"] = state["comm"] + gathered
        return state
