"""What a training step costs across nodes: a link model that follows NCCL, the collectives each
configuration issues, a step's time and memory. Lessons 00, 01 (one link: the α-β model of
minizero/analysis/link.py, re-exported here) and 08.

:class:`Links`: the "intra" link's β is what one GPU sends over its NVLink, the "inter" link's β
what one NIC sends, and a node has ``nics`` NICs (a DGX H100: 8 GPUs, 8 NICs of 400 Gb/s). The
model, and what it assumes:

* NCCL runs a collective as several rings at once (channels) spread over all of a node's NICs,
  NVLink carrying each GPU's share to the GPU beside the NIC. So a ring that crosses nodes is not
  as slow as one NIC: every NIC of the node works on it. The inputs: β_NVLink from
  github.com/NVIDIA/nccl-tests/issues/212 (~370 GB/s ring busbw) and β_NIC from /290 (46-48
  GB/s per NDR NIC); the one multi-node measurement held against the model: /309, 365.84 GB/s
  on 4 nodes x 8 GPUs, 8 NICs each, where the model gives 376 (lesson 08 prints them).
* A collective on a group of n ranks spread over k nodes, p = n/k on each, costs
  ``latency + max(gpu_bytes / β_intra, node_bytes / (nics · β_inter))``, its bottleneck.
  ``gpu_bytes``: what one GPU sends over NVLink, its ring bytes less the share of the ring's hops
  that leave the node (k of n). ``node_bytes``: what one node sends to the others: each ring
  leaves each node once, and node_size / p such groups run at once on a node (a flat ring: 1;
  HSDP's replicate groups, one rank per node: node_size). An all-to-all sends S/n to each rank
  straight. α per round as NCCL's tuner charges a ring (src/graph/tuning.cc): the inter link's
  on the rounds that cross nodes (2(k-1) for an all-reduce, k-1 for the others), the intra
  link's on the rest.
* Rings only: NCCL also runs trees, NVLS (NVLink SHARP) and CollNet, with other busbw. A step's
  collectives run one after another (NCCL issues them on one stream), each alone on the links;
  compute and communication do not slow each other (``overlap`` says how much is hidden).

:func:`step_collectives` lists the collectives one optimizer step issues per rank, as minizero's
library issues them; where DeepSpeed or FSDP2 differ, :class:`Config` says how, and gives FSDP2's
switch where FSDP2 has one. :func:`predict` prices them, adds compute, and reads model-state
memory from ``analysis.simulate`` (the real stage code on meta tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from minizero.analysis.link import (  # noqa: F401 (cost's names since lessons 00 and 01)
    OPS,
    SIZES,
    Link,
    bucket_exposed,
    collective_time,
    fit,
    fit_links,
    sweep,
)
from minizero.analysis.topology import ring


@dataclass(frozen=True, kw_only=True)
class Links:
    """A cluster's links: ``intra`` (β: bytes/s one GPU sends over NVLink, or one rank over this
    machine's loopback), ``inter`` (β: bytes/s one NIC sends), ``nics`` NICs per node, all of
    them used by every collective that crosses nodes."""

    intra: Link
    inter: Link
    nics: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.nics, int) or self.nics < 1:
            raise ValueError(f"a node has nics >= 1 NICs, got {self.nics!r}")


@dataclass(frozen=True)
class Comm:
    """One collective of a step: ``op`` on a group (``group``: the ledger's name) of ``n`` ranks
    spread over ``nodes`` nodes of ``node_size`` ranks, payload ``nbytes`` (S), issued ``times``
    times per step (per rank)."""

    op: str
    nbytes: float
    n: int
    nodes: int
    node_size: int
    group: str  # "world" | "shard" | "replicate" | "hpZ"
    what: str
    times: int = 1

    def rounds(self, emulated_rs: bool = False) -> int:
        return ring(self.op, self.nbytes, self.n, emulated_rs=emulated_rs)[0]

    def inter_rounds(self, emulated_rs: bool = False) -> int:
        """The rounds charged the inter link's α, as NCCL's tuner charges a ring
        (src/graph/tuning.cc, ``nInterSteps``): none inside a node; 2(nodes - 1) for an
        all-reduce, nodes - 1 for the others; an all-to-all: one per peer on another node."""
        if self.nodes == 1 or self.n == 1:
            return 0
        if self.op == "all_to_all":
            return self.n - self.n // self.nodes
        twice = self.op == "all_reduce" or (self.op == "reduce_scatter" and emulated_rs)
        return (2 if twice else 1) * (self.nodes - 1)

    def latency(self, links: Links, emulated_rs: bool = False) -> float:
        """α of one call: the inter link's on :meth:`inter_rounds`, the intra link's on the
        other rounds."""
        inter = self.inter_rounds(emulated_rs)
        intra = self.rounds(emulated_rs) - inter
        return links.inter.alpha * inter + links.intra.alpha * intra

    def wire(self, emulated_rs: bool = False) -> float:
        """Bytes each rank sends per step for this collective (the ring model)."""
        return self.times * ring(self.op, self.nbytes, self.n, emulated_rs=emulated_rs)[1]

    def gpu_bytes(self, emulated_rs: bool = False) -> float:
        """Bytes one GPU sends over NVLink in one call."""
        per_node = self.n // self.nodes  # p: the group's ranks on one node
        if self.op == "all_to_all":
            return (per_node - 1) * self.nbytes / self.n
        crossing = self.nodes if self.nodes > 1 else 0  # the ring's hops that leave a node
        sent = ring(self.op, self.nbytes, self.n, emulated_rs=emulated_rs)[1]
        return sent * (self.n - crossing) / self.n

    def node_bytes(self, emulated_rs: bool = False) -> float:
        """Bytes one node sends to other nodes in one call (all its groups doing this one)."""
        if self.nodes == 1:
            return 0.0
        per_node = self.n // self.nodes
        if self.op == "all_to_all":  # each of the node's ranks: S/n to each rank elsewhere
            return self.node_size * (self.n - per_node) * self.nbytes / self.n
        sent = ring(self.op, self.nbytes, self.n, emulated_rs=emulated_rs)[1]
        return (self.node_size // per_node) * sent  # each group's ring leaves the node once

    def seconds(self, links: Links, emulated_rs: bool = False) -> float:
        """One call's time: α per round (:meth:`latency`) + the slower of NVLink and the node's
        NICs."""
        if self.n == 1:
            return 0.0
        nvlink = self.gpu_bytes(emulated_rs) / links.intra.beta
        nics = self.node_bytes(emulated_rs) / (links.nics * links.inter.beta)
        return self.latency(links, emulated_rs) + max(nvlink, nics)


NVLS_EFFICIENCY_HOPPER = 0.85  # NCCL's tuner: nvlsEfficiency for compute capability 9.0


def nvls_busbw(n: int, beta_nvlink: float, efficiency: float = NVLS_EFFICIENCY_HOPPER) -> tuple:
    """(links' bound, NCCL's estimate) of an NVLS all-reduce's nccl-tests busbw on one node of
    ``n`` GPUs, in ``beta_nvlink``'s unit. NVIDIA gives NVLS's algbw as the NVLink bandwidth
    times n/(n+1) (a GPU moves S(n+1)/n: nccl-tests#212, #239); nccl-tests reports busbw =
    algbw x 2(n-1)/n whatever the algorithm; NCCL's tuner scales NVLS by ``efficiency`` (0.85 on
    Hopper, src/graph/tuning.cc). Not used by :func:`predict`, which prices rings only."""
    bound = beta_nvlink * n / (n + 1) * 2 * (n - 1) / n
    return bound, bound * efficiency


@dataclass(kw_only=True)
class Config:
    """A data-parallel configuration, priced as minizero's library runs it.

    ``world``: N ranks, in nodes of ``node_size`` consecutive ranks. ``hsdp``: shard over a node,
    replicate across nodes (a mesh; stage 0 with a mesh is DDP over every rank). ``hpz``: stage 3
    keeps a secondary shard per node after each forward, so backward's all-gather stays in the node
    (ZeRO++ hpZ; ``reshard_after_forward=node_size``). ``qwz``: stage 3's all-gathers from the
    primary shards go as int8 with one fp32 scale per ``qwz_block`` elements (ZeRO++ qwZ).
    ``qgz``: stage 3 reduce-scatters as one all-to-all of int8 blocks (ZeRO++ qgZ in one hop).
    ``micro_batches``: forward+backward passes per optimizer step.

    Per step, as the library issues them: stages 0-1 reduce once (``no_sync`` before); stages 2-3
    reduce-scatter every micro-batch; stage 3 all-gathers in every forward and every backward;
    stages 1-2 all-gather the updated parameters once. Where others differ:

    * HSDP's replicate all-reduce: minizero runs it once per step at stage 1 and after every
      backward at stages 2-3, as FSDP2 does by default; ``replicate_every_microbatch=False`` prices
      it once per step, as DeepSpeed's MiCS does, and as FSDP2 and minizero's stages 2-3 do with
      ``model.set_requires_all_reduce(False)`` on all but the last micro-batch.
    * hpZ: minizero drops the secondary shard at every forward, as FSDP2's integer
      ``reshard_after_forward`` does, so every forward gathers across nodes; DeepSpeed keeps it
      until the optimizer step, so only the first micro-batch's forward crosses.
    * hpZ + qwZ: minizero's backward gather from the secondary shard goes in ``param_bytes``;
      DeepSpeed quantises it too.
    """

    stage: int
    world: int
    node_size: int
    hsdp: bool = False
    hpz: bool = False
    qwz: bool = False
    qgz: bool = False
    micro_batches: int = 1
    replicate_every_microbatch: bool = True  # minizero's (and FSDP2's default) at stages 2-3
    param_bytes: int = 2  # bytes per element of what is all-gathered (bf16 working weights)
    grad_bytes: int = 2  # bytes per element of what is reduced (bf16)
    qwz_block: int = 256  # minizero's block (precision.QUANT_BLOCK), for qwZ and qgZ

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.node_size < 1 or self.world < 1 or self.world % self.node_size:
            raise ValueError(
                f"world ({self.world}) must be a positive multiple of node_size ({self.node_size})"
            )
        if (self.hpz or self.qwz or self.qgz) and self.stage != 3:
            raise ValueError(
                "hpz, qwz and qgz are stage 3's (ZeRO++): set stage=3 or turn them off"
            )
        if self.hpz and self.hsdp:
            raise ValueError(
                "hpz with hsdp: HSDP already gathers inside the node; turn one of them off"
            )
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")

    @property
    def shard_ranks(self) -> int:
        """Ranks one model state is sharded over: the node with HSDP, else every rank."""
        return self.node_size if self.hsdp and self.stage > 0 else self.world


def step_collectives(cfg: Config, sizes: Iterable[int]) -> list[Comm]:
    """The collectives one rank issues in one optimizer step of ``cfg``, per bucket (stages 0-2)
    or unit (stage 3) of ``sizes`` elements each (padded, as the stage pads them; for a model at
    scale, ``[psi]``). :class:`Config` says which, how often, and where others differ."""
    m, k, ns = cfg.micro_batches, cfg.shard_ranks, cfg.node_size
    flat = cfg.world // ns  # nodes the world spans
    shard_group, shard_nodes = ("shard", 1) if cfg.hsdp else ("world", flat)
    gb, pb = cfg.grad_bytes, cfg.param_bytes

    def comm(op, nbytes, n, nodes, group, what, times=1):
        return Comm(op, nbytes, n, nodes, ns, group, what, times)

    def quantized(op, s, what, times):  # int8 elements and one fp32 scale per block of a shard
        scales = 4 * k * math.ceil(s / k / cfg.qwz_block)
        return [
            comm(op, s, k, shard_nodes, shard_group, what + " int8", times),
            comm(op, scales, k, shard_nodes, shard_group, what + " scales", times),
        ]

    out: list[Comm] = []
    for s in sizes:
        if cfg.stage == 0:
            out.append(comm("all_reduce", s * gb, cfg.world, flat, "world", "grads"))
            continue
        if cfg.stage == 3:
            for what in ("params fwd", "params bwd"):
                if (
                    what == "params bwd" and cfg.hpz and flat > 1
                ):  # from the node's secondary shards
                    out.append(comm("all_gather", s * pb, ns, 1, "hpZ", what, m))
                elif cfg.qwz:
                    out += quantized("all_gather", s, what, m)
                else:
                    out.append(comm("all_gather", s * pb, k, shard_nodes, shard_group, what, m))
        rs_times = 1 if cfg.stage == 1 else m
        if cfg.qgz:
            out += quantized("all_to_all", s, "grads", rs_times)
        else:
            out.append(
                comm("reduce_scatter", s * gb, k, shard_nodes, shard_group, "grads", rs_times)
            )
        if cfg.hsdp and flat > 1:  # each rank's shard, over the ranks holding the same shard
            times = m if cfg.stage > 1 and cfg.replicate_every_microbatch else 1
            out.append(comm("all_reduce", s * gb / k, flat, flat, "replicate", "grads", times))
        if cfg.stage in (1, 2):
            out.append(comm("all_gather", s * pb, k, shard_nodes, shard_group, "params after step"))
    return out


@dataclass
class Prediction:
    """What :func:`predict` gives: seconds per step and bytes per rank."""

    compute_s: float
    comm_s: dict[str, float]  # seconds of collectives: "intra" (inside a node), "inter" (across)
    step_s: float
    wire: dict[str, float]  # bytes sent per rank per step, same keys
    memory: dict[str, float] = field(default_factory=dict)  # model-state bytes per rank

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())


def predict(
    cfg: Config,
    links: Links,
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
    bucket of Ψ). ``links``: a :class:`Links`. ``overlap`` in [0, 1]: the fraction of the shorter
    of compute and communication hidden under the longer; 0 (default) adds them, 1 takes the
    longer. Memory: :func:`predict_memory`."""
    if not isinstance(links, Links):
        raise TypeError(
            f"links must be a cost.Links(intra=Link, inter=Link, nics=...), got "
            f"{type(links).__name__}"
        )
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
        key = "inter" if c.nodes > 1 else "intra"
        comm_s[key] = comm_s.get(key, 0.0) + c.times * c.seconds(links, emulated_rs)
        wire[key] = wire.get(key, 0.0) + c.wire(emulated_rs)
    compute = cfg.micro_batches * compute_s + optimizer_s
    comm = sum(comm_s.values())
    step = max(compute, comm) + (1 - overlap) * min(compute, comm)
    out = Prediction(compute_s=compute, comm_s=comm_s, step_s=step, wire=wire)
    if memory:
        out.memory = predict_memory(cfg, psi or sum(sizes), precision)
    return out


def predict_memory(cfg: Config, psi: int, precision: str = "bf16") -> dict[str, float]:
    """Model-state bytes per rank: ``simulate`` of Ψ parameters at ``cfg.stage`` on
    ``cfg.shard_ranks`` ranks (the real stage code, on meta tensors), plus hpZ's secondary shard
    (Ψ/node_size elements, a formula: stated, not simulated)."""
    from minizero.analysis.simulate import FlatModel, simulate

    k = cfg.shard_ranks
    got = dict(simulate(lambda: FlatModel(psi, pieces=4), cfg.stage, k, precision))
    if cfg.hpz:
        got["hpz"] = cfg.param_bytes * psi / cfg.node_size
    got["total"] = sum(got.values())
    return got
