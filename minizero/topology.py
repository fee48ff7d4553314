"""Nodes and rings: which of a collective's bytes cross a node boundary (issue 17, lesson 08).

A node is a block of ``node_size`` consecutive global ranks: rank r is on node ``r // node_size``
(torchrun numbers ranks node by node). The model is the ring of nccl-tests and the ZeRO paper's
volumes: a group of n ranks forms one ring in group-rank order (``ranks[0] -> ranks[1] -> ... ->
ranks[n-1] -> ranks[0]``), and the payload S (bytes; the full, unsharded size) moves in chunks
of S/n:

    all-reduce       2(n-1) steps (reduce-scatter, then all-gather); each rank sends S/n per step
    reduce-scatter   n-1 steps, S/n per step
    all-gather       n-1 steps, S/n per step
    broadcast        a chain from the source along the ring: every rank but the last sends S once
    all-to-all       no ring: each rank sends S/n straight to each of the n-1 others

so in a ring a rank sends ``2(n-1)/n * S`` for an all-reduce, all of it to its successor. Those
bytes cross a node boundary when the successor is on another node: in a group spread over k
nodes in rank order (k > 1), k of the ring's n hops cross (k-1 between nodes, 1 closing the ring),
so a ring over 2 nodes x 2 ranks sends half its bytes across. Real libraries choose other
algorithms (NCCL's trees, hierarchical rings), and gloo emulates a reduce-scatter with a whole
all-reduce; this model counts what the ring algorithm sends, the one the volumes above count.
Bytes are floats: S/n need not be whole (minizero's sharded buffers are padded so that it is).
"""

from __future__ import annotations

RING_STEPS = {  # steps of S/n bytes each rank sends, as functions of the group size n
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
}


def node_of(rank: int, node_size: int) -> int:
    """The node of global rank ``rank``: consecutive blocks of ``node_size`` ranks."""
    return rank // node_size


def ring_bytes(
    op: str, nbytes: int, ranks: tuple[int, ...], rank: int, node_size: int, src: int = 0
) -> tuple[float, float]:
    """(inside, across): the bytes global rank ``rank`` sends in one ``op`` of payload ``nbytes``
    (S) over the group of global ``ranks`` (group-rank order; ``src``: a broadcast's source, a
    group rank) that stay inside its node and that cross to another (the model: see above)."""
    n = len(ranks)
    if n == 1:
        return 0.0, 0.0
    me = ranks.index(rank)
    successor = ranks[(me + 1) % n]
    if op == "all_to_all":  # S/n to each other rank, directly
        away = sum(node_of(r, node_size) != node_of(rank, node_size) for r in ranks)
        return (n - 1 - away) * nbytes / n, away * nbytes / n
    if op == "broadcast":  # the chain src, src+1, ..., src+n-1 (group ranks, mod n)
        sent = 0.0 if (me - src) % n == n - 1 else float(nbytes)
    else:
        sent = RING_STEPS[op](n) * nbytes / n
    crosses = node_of(rank, node_size) != node_of(successor, node_size)
    return (0.0, sent) if crosses else (sent, 0.0)
