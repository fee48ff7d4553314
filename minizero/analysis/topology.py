"""Rings and nodes: the one ring model of the cost side (minizero/analysis/cost.py prices it,
CommLedger.node_bytes counts a run's bytes with it; lessons 00 and 08).

A node is a block of ``node_size`` consecutive global ranks: rank r is on node ``r // node_size``
(torchrun numbers ranks node by node). A group of n ranks forms one ring in group-rank order
(``ranks[0] -> ranks[1] -> ... -> ranks[n-1] -> ranks[0]``), the algorithm nccl-tests' bus
bandwidth and the ZeRO paper's volumes count. The payload S (bytes; the full, unsharded size, as
nccl-tests counts it) moves in chunks of S/n:

    op               rounds   bytes each rank sends (to its successor)
    all-reduce       2(n-1)   2(n-1)/n · S   (a reduce-scatter, then an all-gather)
    reduce-scatter    n-1      (n-1)/n · S
    all-gather        n-1      (n-1)/n · S
    broadcast         n-1      S             (a chain from the source; its last rank sends 0)
    all-to-all        n-1      (n-1)/n · S   (no ring: S/n straight to each of the n-1 others)

A rank's ring bytes cross a node boundary when its successor is on another node: in a group spread
over k > 1 nodes in rank order, k of the ring's n hops cross (k-1 between nodes, 1 closing the
ring), so a ring over 2 nodes x 2 ranks sends half its bytes across. Bytes are floats: S/n need
not be whole (minizero's sharded buffers are padded so that it is). What this leaves out: NCCL's
trees, NVLS and CollNet algorithms; minizero's reduce-scatter on gloo, which sends each chunk
straight to its owner (the ring's bytes in all, split over node boundaries as an all-to-all's; the
model, and ``CommLedger.node_bytes``, count the ring's split); PyTorch's own gloo
``reduce_scatter_tensor``, an all-reduce of the whole input (``emulated_rs``; lesson 00 measures
both). minizero/analysis/ledger.py keeps nccl-tests' busbw factors, which define a measurement;
this file is the model.
"""

from __future__ import annotations

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
RING_STEPS = {  # rounds of one collective on a ring of n ranks (S/n bytes a round, but broadcast)
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
}


def ring(op: str, nbytes: float, n: int, *, emulated_rs: bool = False) -> tuple[int, float]:
    """(rounds, bytes each rank sends) of ``op`` with payload ``nbytes`` (S) on a ring of ``n``
    (a broadcast: what every rank but the chain's last sends). ``emulated_rs``: PyTorch's gloo
    ``reduce_scatter_tensor``, an all-reduce of S (minizero's on gloo is not: lesson 00)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a group has n >= 1 ranks, got {n!r}")
    if n == 1:
        return 0, 0.0
    if op == "reduce_scatter" and emulated_rs:
        op = "all_reduce"
    steps = RING_STEPS[op](n)
    return steps, float(nbytes) if op == "broadcast" else steps * nbytes / n


def node_of(rank: int, node_size: int) -> int:
    """The node of global rank ``rank``: consecutive blocks of ``node_size`` ranks."""
    return rank // node_size


def ring_bytes(
    op: str, nbytes: int, ranks: tuple[int, ...], rank: int, node_size: int, src: int = 0
) -> tuple[float, float]:
    """(inside, across): the bytes global rank ``rank`` sends in one ``op`` of payload ``nbytes``
    (S) over the group of global ``ranks`` (group-rank order; ``src``: a broadcast's source, a
    group rank) that stay inside its node and that cross to another (the model above)."""
    n = len(ranks)
    if n == 1:
        return 0.0, 0.0
    me = ranks.index(rank)
    if op == "all_to_all":  # S/n to each other rank, directly
        away = sum(node_of(r, node_size) != node_of(rank, node_size) for r in ranks)
        return (n - 1 - away) * nbytes / n, away * nbytes / n
    sent = ring(op, nbytes, n)[1]
    if op == "broadcast" and (me - src) % n == n - 1:  # the chain's last rank
        sent = 0.0
    crosses = node_of(rank, node_size) != node_of(ranks[(me + 1) % n], node_size)
    return (0.0, sent) if crosses else (sent, 0.0)
