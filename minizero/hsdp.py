"""Hybrid sharding (HSDP): shard inside a node, replicate across nodes. Taught in lesson 08.

The reference is FSDP2's HSDP, ``fully_shard(model, mesh=mesh)`` with a 2-D ``DeviceMesh`` whose
dims are (replicate, shard) (torch/distributed/fsdp/_fully_shard/_fully_shard.py; the reduction:
_fsdp_collectives.py's ``foreach_reduce``, a reduce-scatter over the shard dim, then an
all-reduce of the shard over the replicate dim). DeepSpeed calls the same layout MiCS (Zhang et
al., arXiv 2205.00119). minizero composes it around its stages, as FSDP2 composes
``FSDPModule`` around a module's class: ``hybrid(ZeRO2)`` is ``HSDPZeRO2(HSDP, ZeRO2)``, whose
:class:`HSDP` methods add the second group around the stage's own (the stage files know nothing
of it). ``parallelize`` builds it from a mesh:

    mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    model, optimizer = minizero.parallelize(model, 3, optimizer, mesh=mesh)

At stages 1-3 the model states are sharded over "shard" (the ranks of one node: N_s of them) and
every node holds the same shards: the stage runs on the shard group exactly as on a world of N_s
ranks, and each gradient shard, once reduce-scattered and averaged there, is all-reduced over
"replicate" (the R ranks, one per node, that hold the same shard) and divided by R: an average
over all R * N_s ranks. Stage 3 all-gathers parameters over "shard" only. Stage 0 with a mesh is
DDP over every rank (the world group). Per rank and step (paper volumes, Ψ elements):

    "shard"      2Ψ (stages 1-2: reduce-scatter + all-gather), 3Ψ (stage 3: two all-gathers too)
    "replicate"  2 x Ψ/N_s (an all-reduce of this rank's shard, Ψ/N_s elements)

so only the replicate all-reduce crosses a node boundary: in the ring model of
minizero/analysis/topology.py every rank sends 2(R-1)/R x Ψ/N_s elements across. Flat ZeRO-3 over
the same N = R * N_s ranks sends 3Ψ(N-1)/N per rank along one ring, and the last rank of each node
sends all of it across (on 2 nodes x 2 ranks, fp32: 9Ψ bytes from each of 2 ranks, against 2Ψ
from each of 4 with HSDP; tests/library/test_hsdp.py). The price: model states per rank are those
of a world of N_s ranks, (2 + 2 + K)Ψ/N_s at stage 3, not (2 + 2 + K)Ψ/N.

What else uses the replicate group: the initial state and the buffers (broadcast from global
rank 0 over "replicate", then over "shard"), ``find_unused_parameters`` (used anywhere). Norms and
the fp16 overflow check reduce over "shard" only: the replicas hold equal shards after the
all-reduce. Checkpoints (minizero.checkpoint) refuse a mesh: save ``model.state_dict()`` instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.data_parallel import DataParallel
from minizero.precision import divides_before_sum

MESH_DIMS = ("replicate", "shard")  # FSDP2's HSDP order: dim 0 across nodes, dim 1 inside one


def mesh_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate): this rank's groups of a 2-D mesh with dims ("replicate", "shard"),
    which ledgers call "shard" and "replicate" (their ``group_desc``). Refuses any other mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    make = 'init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))'
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"minizero's HSDP takes a 2-D mesh with dims named {MESH_DIMS} (FSDP2's order), got "
            f"a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}: make it with {make}; for one "
            f"dimension pass process_group= (or nothing: the world)"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh has {mesh.size()} ranks and the world {dist.get_world_size()}: "
            f"minizero's HSDP needs a mesh over every rank, {make}"
        )
    return mesh.get_group("shard"), mesh.get_group("replicate")  # ledgers: "shard", "replicate"


def on_mesh(
    stage: type[DataParallel], mesh, process_group: dist.ProcessGroup | None, options: dict
) -> tuple[type[DataParallel], dist.ProcessGroup | None, dict]:
    """``parallelize(..., mesh=mesh)``: the class, group and options of ``stage`` on a mesh.
    Stage 0 with a mesh is DDP over every rank (the world group)."""
    if process_group is not None:
        raise TypeError("pass a mesh (HSDP) or a process_group (one dimension), not both")
    shard, replicate = mesh_groups(mesh)
    if not stage.sharded.state:
        return stage, None, options
    return hybrid(stage), shard, {**options, "replicate_group": replicate}


def hybrid(stage: type[DataParallel]) -> type[DataParallel]:
    """``stage`` (ZeRO1, ZeRO2, ZeRO3 or a subclass) with HSDP's second group: FSDP2's way of
    composing (``FSDPModule`` before the module's class), ``HSDPZeRO2`` for ZeRO2."""
    return _HYBRIDS.setdefault(stage, type(f"HSDP{stage.__name__}", (HSDP, stage), {}))


class HSDP:
    """What a mesh adds to a ZeRO stage, placed before it in the class (:func:`hybrid`): the stage
    runs on the shard group (``process_group``) as on a world of N_s ranks, and this averages each
    gradient shard over ``replicate_group``. Every rank starts from global rank 0's state."""

    def __init__(self, module: nn.Module, *, replicate_group: dist.ProcessGroup, **options) -> None:
        self.replicate_group = replicate_group  # before the stage broadcasts the initial state
        self.replicas = Replicas(replicate_group)
        super().__init__(module, **options)

    def module_check_group(self) -> None:
        """Stage 3: the ranks of every node run the same modules (the world)."""
        return None

    def broadcast_from_rank0(self, t: torch.Tensor, tag: str) -> None:
        """Over ``replicate_group`` first (the first node's values to the same shard rank on
        every node), then over the node (the stage's group)."""
        C.broadcast(t, src=0, group=self.replicate_group, tag=tag)
        super().broadcast_from_rank0(t, tag)

    def add_to_shard(self, i: int, out: torch.Tensor) -> None:
        """Stages 2-3: bucket ``i``'s chunk, averaged over this node, is averaged over the nodes
        (now, or once later: :class:`Replicas`) into the shard."""
        self.replicas.add(i, out, super().add_to_shard, f"zero2 replicas {i}")

    def reduce_gradients(self) -> list[torch.Tensor | None]:
        shards = super().reduce_gradients()  # (shard,) per bucket, averaged over this node
        if not self.sharded.grads:  # stage 1: reduced at the step: each chunk over the nodes, now
            average_replicas(shards, self.replicate_group, "zero1 replicas")
        else:  # reduced in backward: what waited for the step (set_requires_all_reduce)
            self.replicas.flush(shards, "zero2 replicas")
        return shards

    def set_requires_all_reduce(self, requires: bool) -> None:
        """FSDP2's switch for HSDP's gradient accumulation at stages 2-3: False, and the
        backwards that follow average their shards over the nodes once, not each."""
        self.replicas.requires_all_reduce = bool(requires)

    def reset_grads(self, set_to_none: bool) -> None:
        self.replicas.clear()
        super().reset_grads(set_to_none)


_HYBRIDS: dict[type, type] = {}  # stage class -> its HSDP class, made once


class Replicas:
    """HSDP's second step at stages 2-3, where every backward reduce-scatters its buckets. By
    default each backward's shard is all-reduced over "replicate" at once (FSDP2's default): Ψ/N_s
    crosses the nodes once per micro-batch. ``model.set_requires_all_reduce(False)`` (FSDP2's
    switch, ``FSDPModule.set_requires_all_reduce``) keeps the shards apart instead, summed over
    the micro-batches, and averages them over the replicas once: at the next backward run with
    the switch back on (FSDP2's way), or at the step if it never is (DeepSpeed MiCS's once per
    accumulation boundary). The step sees the same average either way (up to the order of the
    sums); what changes is how many times the shard crosses the nodes, and Ψ/N_s more memory
    held for the sum meanwhile."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.requires_all_reduce = True
        self.partial: dict[int, torch.Tensor] = {}  # bucket -> (shard,) sum not yet averaged

    def add(self, i: int, out: torch.Tensor, into: Callable[[int, torch.Tensor], None], tag: str
            ) -> None:  # fmt: skip
        """``out`` (shard,): bucket ``i``'s chunk averaged over this node; ``into(i, out)`` the
        shard, averaged over every node, now or later."""
        if self.group is not None and not self.requires_all_reduce:
            held = self.partial.get(i)
            self.partial[i] = out.clone() if held is None else held.add_(out)
            return
        if i in self.partial:
            out.add_(self.partial.pop(i))
        average_replicas([out], self.group, tag)
        into(i, out)

    def flush(self, shards: list, tag: str) -> None:
        """At the step: average what is still held over the replicas (one all-reduce each)."""
        for i in sorted(self.partial):
            held = self.partial.pop(i)
            average_replicas([held], self.group, f"{tag} {i}")
            shards[i].add_(held)

    def clear(self) -> None:
        self.partial.clear()


def average_replicas(shards: list[torch.Tensor | None], replicate_group, tag: str) -> None:
    """HSDP's second step: each gradient shard (shard,), already averaged over its node, is
    averaged over the R nodes holding the same shard (all-reduce and / R; fp16 divides first:
    ``divides_before_sum``). Nothing without a replicate group."""
    if replicate_group is None:
        return
    r = dist.get_world_size(replicate_group)
    live = {i: s for i, s in enumerate(shards) if s is not None}  # index: the bucket's
    for s in live.values():
        if divides_before_sum(s):
            s.div_(r)
    name = lambda i: tag if len(shards) == 1 else f"{tag} {i}"
    works = [
        C.all_reduce(s, group=replicate_group, async_op=True, tag=name(i)) for i, s in live.items()
    ]
    for w, s in zip(works, live.values(), strict=True):
        w.wait()
        if not divides_before_sum(s):
            s.div_(r)
