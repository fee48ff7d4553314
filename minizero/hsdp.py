"""Hybrid sharding (HSDP): shard inside a node, replicate across nodes. Taught in lesson 08.

The reference is FSDP2's HSDP, ``fully_shard(model, mesh=mesh)`` with a 2-D ``DeviceMesh`` whose
dims are (replicate, shard) (torch/distributed/fsdp/_fully_shard/_fully_shard.py; the reduction:
_fsdp_collectives.py's ``foreach_reduce``, a reduce-scatter over the shard dim, then an
all-reduce of the shard over the replicate dim). DeepSpeed calls the same layout MiCS (Zhang et
al., arXiv 2205.00119). As in FSDP2, HSDP is data, not a class: a stage takes the replicate
group as an option (``replicate_group=``; None, the default, is no HSDP) and, where it reduces,
averages over it too (stage 1: ``ZeRO1.finish_grad_sync``; stages 2-3: ``ZeRO2.add_to_shard``);
it broadcasts the initial state over it first (``DataParallel.broadcast_from_rank0``). This file
makes the groups from a mesh (:func:`mesh_groups`) and the stage's options (:func:`on_mesh`);
``parallelize`` calls it:

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

Gradient accumulation at stages 2-3, where every backward reduce-scatters its buckets: by default
each backward's shard is all-reduced over "replicate" at once (FSDP2's default), so Ψ/N_s crosses
the nodes once per micro-batch. ``model.set_requires_all_reduce(False)`` (FSDP2's switch,
``FSDPModule.set_requires_all_reduce``) keeps the shards apart instead, summed over the
micro-batches, and averages them over the replicas once: at the next backward run with the switch
back on (FSDP2's way), or at the step if it never is (DeepSpeed MiCS's once per accumulation
boundary). The step sees the same average either way (up to the order of the sums); what changes
is how many times the shard crosses the nodes, and Ψ/N_s more memory held for the sum meanwhile.
"""

from __future__ import annotations

import torch.distributed as dist

from minizero.data_parallel import DataParallel

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
) -> tuple[dist.ProcessGroup | None, dict]:
    """``parallelize(..., mesh=mesh)``: the group and options of ``stage`` on a mesh, the stage
    over "shard" with ``replicate_group`` "replicate". Stage 0 with a mesh is DDP over every rank
    (the world group)."""
    if process_group is not None:
        raise TypeError("pass a mesh (HSDP) or a process_group (one dimension), not both")
    shard, replicate = mesh_groups(mesh)
    if not stage.sharded.state:
        return None, options
    return shard, {**options, "replicate_group": replicate}
