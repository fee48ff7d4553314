"""The α-β cost model of ring collectives, fitted to measured sweeps; a step's time and memory
predicted from it. Lessons 00, 01 and 08.

A collective on a ring of n ranks is ``steps`` rounds; in each round every rank sends a chunk to
its successor (minizero/topology.py: ``RING_STEPS``, and the bytes each rank sends). The model:

    time(op, S, n) = α · steps(op, n) + wire_bytes(op, S, n) / β

    all_reduce       steps 2(n-1)   wire 2(n-1)/n · S   (a reduce-scatter, then an all-gather)
    reduce_scatter   steps  n-1     wire  (n-1)/n · S
    all_gather       steps  n-1     wire  (n-1)/n · S
    broadcast        steps  n-1     wire  S             (a chain along the ring, not pipelined)

with S the full payload in bytes (nccl-tests' size), α the latency of one round (seconds) and β
the bytes per second of one link. ``wire / time`` is nccl-tests' *busbw*, so β is the busbw the
largest messages approach. gloo has no reduce-scatter of its own: PyTorch runs an all-reduce of
the whole input (lesson 00 measures it), so ``emulated_rs=True`` costs a reduce-scatter as an
all-reduce of S. A ring spread over several nodes goes as fast as its slowest hop: a group
inside one node uses the "intra" link, a group crossing a node boundary the "inter" link.

:func:`fit` recovers α and β by least squares from (op, S, seconds) rows: the output of
``python -m minizero bench collectives`` (its JSON rows) or lesson 00's sweep.
:func:`step_collectives` lists the collectives one training step issues per rank (minizero's
stages, and the HSDP / hpZ / qwZ variants of issue 17), :func:`predict` turns them into seconds
by link class, adds compute, and reads model-state memory from ``analysis.simulate`` (the real
stage code on meta tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from minizero.topology import RING_STEPS

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Link:
    """One link class: ``alpha`` seconds per ring round, ``beta`` bytes per second."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0 and math.isfinite(self.alpha + self.beta)):
            raise ValueError(f"a link needs alpha >= 0 s and beta > 0 B/s, got {self}")


def ring(op: str, nbytes: float, n: int, *, emulated_rs: bool = False) -> tuple[int, float]:
    """(steps, bytes each rank sends) of ``op`` with payload ``nbytes`` (S) on a ring of ``n``."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a group has n >= 1 ranks, got {n!r}")
    if n == 1:
        return 0, 0.0
    if op == "reduce_scatter" and emulated_rs:  # gloo: an all-reduce of the whole input
        op = "all_reduce"
    if op == "broadcast":
        return n - 1, float(nbytes)
    steps = RING_STEPS[op](n)
    return steps, steps * nbytes / n


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
    sizes: Iterable[int],
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

    from minizero import collectives as C
    from minizero.launcher import rank_device

    n, dev, rows = dist.get_world_size(group), rank_device(), []
    for op in ops:
        for size in sizes:
            count = max(n, size // 4 // n * n)
            full = torch.zeros(count, device=dev)  # (S,) zeros: sums never overflow
            shard = torch.zeros(count // n, device=dev)  # (S/n,) this rank's chunk
            call = lambda: _call(op, full, shard, group)  # noqa: B023 (called in this loop)
            call()
            with C.CommLedger() as ledger:
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


# -- one training step -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Config:
    """A data-parallel configuration, as issue 17 names it.

    ``world``: N ranks, in nodes of ``node_size`` consecutive ranks. ``hsdp``: shard over a node,
    replicate across nodes (FSDP2's HSDP; at stage 0 it is DDP over every rank). ``hpz``: stage 3
    keeps a secondary shard per node after forward, so backward's all-gather stays in the node
    (ZeRO++ hpZ, FSDP2's ``reshard_after_forward=node_size``). ``qwz``: stage 3 all-gathers int8
    weights with one fp32 scale per ``qwz_block`` elements (ZeRO++ qwZ). ``micro_batches``:
    forward+backward passes per optimizer step (stages 0-1 accumulate under ``no_sync``; stages 2-3
    reduce-scatter every micro-batch, stage 3 also gathers every micro-batch)."""

    stage: int
    world: int
    node_size: int
    hsdp: bool = False
    hpz: bool = False
    qwz: bool = False
    micro_batches: int = 1
    param_bytes: int = 2  # bytes per element of what is all-gathered (bf16 working weights)
    grad_bytes: int = 2  # bytes per element of what is reduced (FSDP2 reduces in param dtype)
    qwz_block: int = 256

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.node_size < 1 or self.world < 1 or self.world % self.node_size:
            raise ValueError(
                f"world ({self.world}) must be a positive multiple of node_size ({self.node_size})"
            )
        if (self.hpz or self.qwz) and self.stage != 3:
            raise ValueError("hpz and qwz are stage 3's (ZeRO++): set stage=3 or turn them off")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")

    @property
    def shard_ranks(self) -> int:
        """Ranks one model state is sharded over: the node with HSDP, else every rank."""
        return self.node_size if self.hsdp and self.stage > 0 else self.world


@dataclass(frozen=True)
class Comm:
    """One collective of a step: ``op`` on a group of ``n`` ranks, payload ``nbytes`` (S), over
    the ``link`` class, issued ``times`` times per step (per rank)."""

    op: str
    nbytes: float
    n: int
    link: str  # "intra" | "inter"
    what: str
    times: int = 1

    def wire(self, emulated_rs: bool = False) -> float:
        """Bytes each rank sends per step for this collective."""
        return self.times * ring(self.op, self.nbytes, self.n, emulated_rs=emulated_rs)[1]


def step_collectives(cfg: Config, sizes: Iterable[int]) -> list[Comm]:
    """The collectives one rank issues in one optimizer step of ``cfg``, per bucket (stages 0-2)
    or unit (stage 3) of ``sizes`` elements each (padded, as the stage pads them; for a model at
    scale, ``[psi]``). minizero's order: stage 0 all-reduces each bucket once (``no_sync`` on
    earlier micro-batches); stage 1 reduce-scatters once and all-gathers the updated params once;
    stage 2 reduce-scatters every micro-batch; stage 3 all-gathers each unit in forward and again in
    backward and reduce-scatters it, every micro-batch. HSDP adds one all-reduce of the shard across
    nodes per step (FSDP2's ``set_requires_all_reduce(False)`` on earlier micro-batches)."""
    m, k = cfg.micro_batches, cfg.shard_ranks
    crosses = "inter" if cfg.world > cfg.node_size else "intra"
    shard_link = "intra" if cfg.hsdp else crosses
    gb, pb = cfg.grad_bytes, cfg.param_bytes
    out: list[Comm] = []
    for s in sizes:
        if cfg.stage == 0:
            out.append(Comm("all_reduce", s * gb, cfg.world, crosses, "grads"))
            continue
        rs_times = 1 if cfg.stage == 1 else m
        if cfg.stage == 3:
            fwd = s * (1 + 4 / cfg.qwz_block) if cfg.qwz else s * pb  # int8 + fp32 scales
            out.append(Comm("all_gather", fwd, k, shard_link, "params fwd", m))
            if cfg.hpz and not cfg.hsdp:  # from the node's secondary shard
                out.append(Comm("all_gather", fwd, cfg.node_size, "intra", "params bwd", m))
            else:
                out.append(Comm("all_gather", fwd, k, shard_link, "params bwd", m))
        out.append(Comm("reduce_scatter", s * gb, k, shard_link, "grads", rs_times))
        if cfg.hsdp and cfg.world > cfg.node_size:
            out.append(Comm("all_reduce", s * gb / k, cfg.world // k, "inter", "grads across"))
        if cfg.stage in (1, 2):
            out.append(Comm("all_gather", s * pb, k, shard_link, "params after step"))
    return out


@dataclass
class Prediction:
    """What :func:`predict` gives: seconds per step and bytes per rank."""

    compute_s: float
    comm_s: dict[str, float]  # seconds of collectives per link class
    step_s: float
    wire: dict[str, float]  # bytes sent per rank per step, per link class
    memory: dict[str, float] = field(default_factory=dict)  # model-state bytes per rank

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())


def predict(
    cfg: Config,
    links: Mapping[str, Link],
    *,
    compute_s: float,
    sizes: Iterable[int] | None = None,
    psi: int | None = None,
    optimizer_s: float = 0.0,
    overlap: float = 0.0,
    emulated_rs: bool = False,
    memory: bool = False,
    precision: str = "bf16",
) -> Prediction:
    """A step's time (and, with ``memory=True``, model-state bytes per rank) for ``cfg``.

    ``compute_s``: forward+backward of one micro-batch on one rank (measured or given);
    ``optimizer_s``: the optimizer step. ``sizes`` (buckets or units, elements) or ``psi`` (one
    bucket of Ψ). ``links``: {"intra": Link, "inter": Link} (one is enough if only one is used).
    ``overlap`` in [0, 1]: the fraction of the shorter of compute and communication hidden under
    the longer; 0 (default) adds them, 1 takes the longer. Memory: :func:`analysis.simulate` of a
    ``FlatModel(psi)`` sharded over ``cfg.shard_ranks``, plus hpZ's secondary shard (Ψ/node_size
    parameters, a formula: stated, not simulated)."""
    if sizes is None:
        if psi is None:
            raise ValueError("give the model's size: sizes=[elements per bucket] or psi=Ψ")
        sizes = [psi]
    sizes = list(sizes)
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    comm_s: dict[str, float] = {}
    wire: dict[str, float] = {}
    for c in step_collectives(cfg, sizes):
        if c.n == 1:
            continue
        if c.link not in links:
            raise ValueError(f"{c.what} runs over the {c.link!r} link: give links[{c.link!r}]")
        t = c.times * collective_time(c.op, c.nbytes, c.n, links[c.link], emulated_rs=emulated_rs)
        comm_s[c.link] = comm_s.get(c.link, 0.0) + t
        wire[c.link] = wire.get(c.link, 0.0) + c.wire(emulated_rs)
    compute = cfg.micro_batches * compute_s + optimizer_s
    comm = sum(comm_s.values())
    step = max(compute, comm) + (1 - overlap) * min(compute, comm)
    out = Prediction(compute_s=compute, comm_s=comm_s, step_s=step, wire=wire)
    if memory:
        out.memory = predict_memory(cfg, psi or sum(sizes), precision)
    return out


def predict_memory(cfg: Config, psi: int, precision: str = "bf16") -> dict[str, float]:
    """Model-state bytes per rank: ``simulate`` of Ψ parameters at ``cfg.stage`` on
    ``cfg.shard_ranks`` ranks (the real stage code, on meta tensors), plus hpZ's secondary shard."""
    from minizero.analysis.simulate import FlatModel, simulate

    k = cfg.shard_ranks
    got = dict(simulate(lambda: FlatModel(psi, pieces=4), cfg.stage, k, precision))
    if cfg.hpz and not cfg.hsdp:
        got["hpz"] = cfg.param_bytes * psi / cfg.node_size
    got["total"] = sum(got.values())
    return got
