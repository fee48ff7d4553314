"""One link's α-β model, and its fit to measured sweeps. Lessons 00 and 01; lesson 08 uses one
per link class (minizero/analysis/cost.py, which re-exports these names: ``cost.fit``, ...).

A collective on a ring of n ranks is ``rounds`` rounds (minizero/analysis/topology.py: the ring
model, and the bytes each rank sends, ``wire``):

    time(op, S, n) = α · rounds(op, n) + wire(op, S, n) / β

    all_reduce       rounds 2(n-1)   wire 2(n-1)/n · S   (a reduce-scatter, then an all-gather)
    reduce_scatter   rounds  n-1     wire  (n-1)/n · S
    all_gather       rounds  n-1     wire  (n-1)/n · S
    broadcast        rounds  n-1     wire  S             (a chain along the ring, not pipelined)

with S the full payload in bytes (nccl-tests' size), α the latency of one round (seconds) and β
the bytes per second one rank sends. ``wire / time`` is nccl-tests' *busbw*, so β is the busbw
the largest messages approach. PyTorch's gloo backend does not call gloo's own reduce-scatter
(``ReduceScatterHalvingDoubling``): ``ProcessGroupGloo`` all-reduces a clone of the whole input,
which ``emulated_rs=True`` prices (an all-reduce of S). minizero's reduce-scatter on gloo is an
all-to-all of the chunks to their owners and a local sum, a reduce-scatter's rounds and bytes, so
rows measured through minizero.collectives fit and predict with ``emulated_rs=False`` on every
backend (lesson 00 measures both).

:func:`fit` recovers α and β by least squares from (op, S, seconds) rows: the output of
``python -m minizero bench collectives`` (its JSON rows) or :func:`sweep` (lesson 00's).
:func:`bucket_exposed` is lesson 01's bucket-size trade-off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from minizero.analysis.ledger import CommLedger
from minizero.analysis.topology import ring

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")  # what sweep() measures
# sweep()'s payloads, bytes: 4 KiB (latency-bound) to 64 MiB (bandwidth-bound). The large ones
# decide β: with more ranks than cores the scheduler adds milliseconds to any call, and under
# 16 MiB that noise can hide the growth with size (lesson 08's 4 ranks on 2 cores did, at 4 MiB).
SIZES = (2**12, 2**16, 2**20, 2**22, 2**24, 2**26)


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per ring round, ``beta`` bytes per second that one sender
    (a GPU on NVLink, a NIC on the network, a rank on loopback) puts on it."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha + self.beta)):
            raise ValueError(f"a link needs alpha >= 0 s and beta > 0 B/s, got {self}")


def collective_time(op: str, nbytes: float, n: int, link: Link, *, emulated_rs=False) -> float:
    """Seconds the α-β model gives ``op`` of payload ``nbytes`` on a ring of ``n`` over ``link``."""
    steps, wire = ring(op, nbytes, n, emulated_rs=emulated_rs)
    return link.alpha * steps + wire / link.beta


def fit(
    rows: Iterable[Mapping], n: int, *, emulated_rs: bool = False, relative: bool = True
) -> Link:
    """α and β from measured rows ``{"op", "nbytes", "seconds"}`` on ``n`` ranks, by least squares
    on ``seconds = α·steps + wire/β`` (two unknowns, α and 1/β). ``relative``: weight each row by
    1/seconds, so a 4 KiB call counts as much as a 16 MiB one (else the largest rows decide α too).
    Needs rows with at least two different (steps, wire) ratios: two sizes, or two ops."""
    a11 = a12 = a22 = b1 = b2 = 0.0
    count = 0
    for r in rows:
        steps, wire = ring(r["op"], r["nbytes"], n, emulated_rs=emulated_rs)
        t = float(r["seconds"])
        if not t > 0:
            raise ValueError(f"a measured time must be > 0 s, got {r}")
        w = 1 / t**2 if relative else 1.0
        a11, a12, a22 = a11 + w * steps * steps, a12 + w * steps * wire, a22 + w * wire * wire
        b1, b2 = b1 + w * steps * t, b2 + w * wire * t
        count += 1
    det = a11 * a22 - a12 * a12
    if count < 2 or det <= 1e-12 * a11 * a22:
        raise ValueError(
            f"cannot fit α and β from {count} row(s) on {n} ranks: give two message sizes or more"
        )
    alpha, inv_beta = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if inv_beta <= 0:
        raise ValueError(
            "the rows do not grow with message size (fitted 1/β <= 0): measure larger messages"
        )
    return Link(alpha=max(alpha, 0.0), beta=1 / inv_beta)


def sweep(
    sizes: Iterable[int] = SIZES,
    ops: Iterable[str] = ("all_reduce", "all_gather"),
    repeats: int = 5,
    group=None,
) -> list[dict]:
    """Inside a launched rank: each of ``ops`` at each payload of ``sizes`` bytes (fp32, rounded
    down to a multiple of the group size), ``repeats`` timed calls after one warm-up; rows
    ``{"op", "nbytes", "seconds"}`` with this rank's median time, ready for :func:`fit`."""
    import statistics

    import torch
    import torch.distributed as dist

    from minizero.launcher import rank_device

    n, dev, rows = dist.get_world_size(group), rank_device(), []
    for op in ops:
        for size in sizes:
            count = max(n, size // 4 // n * n)
            full = torch.zeros(count, device=dev)  # (S,) zeros: sums never overflow
            shard = torch.zeros(count // n, device=dev)  # (S/n,) this rank's chunk
            call = lambda: _call(op, full, shard, group)  # noqa: B023 (called in this loop)
            call()
            with CommLedger() as ledger:
                for _ in range(repeats):
                    call()
            median = statistics.median(r.seconds for r in ledger.records)
            rows.append(dict(op=op, nbytes=count * 4, seconds=median))
    return rows


def _call(op: str, full, shard, group) -> None:
    from minizero import collectives as C

    if op == "all_reduce":
        C.all_reduce(full, group=group)
    elif op == "reduce_scatter":
        C.reduce_scatter(shard, full, group=group)
    elif op == "all_gather":
        C.all_gather(full, shard, group=group)
    else:
        C.broadcast(full, group=group)


def fit_links(sweeps: Mapping[str, tuple[Iterable[Mapping], int]], **kw) -> dict[str, Link]:
    """One :class:`Link` per link class: ``{"intra": (rows, n), "inter": (rows, n)}`` -> links."""
    return {name: fit(rows, n, **kw) for name, (rows, n) in sweeps.items()}


def bucket_exposed(bucket_bytes: Iterable[float], backward_s: float, n: int, link: Link) -> float:
    """Seconds of DDP's all-reduces left after backward ends (lesson 01's bucket-size trade-off).

    Backward produces the gradient bytes at a steady rate over ``backward_s``; bucket i (bytes in
    ``bucket_bytes``, in the order they fill) is ready when its last byte is, and its all-reduce
    starts then or when the previous one ends, whichever is later (one channel). For k equal
    buckets of S/k and c = time(all_reduce, S/k): exposed = c + (k - 1) · max(0, c - backward/k).
    Large buckets leave the last one exposed (c grows with S/k); small ones pay α · rounds k
    times, which backward hides only while c <= backward/k."""
    sizes = list(bucket_bytes)
    total, filled, free = float(sum(sizes)), 0.0, 0.0
    if not sizes or total <= 0 or backward_s < 0:
        raise ValueError("need at least one bucket of > 0 bytes and a backward time >= 0 s")
    for b in sizes:
        filled += b
        ready = backward_s * filled / total
        free = max(free, ready) + collective_time("all_reduce", b, n, link)
    return free - backward_s
