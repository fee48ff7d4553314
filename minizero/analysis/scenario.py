"""A training run at scale, priced before it runs: which data-parallel configuration fits, and how
long its step takes. Lesson 08 (sections 6, 7 and exercise 4) asks it of lesson 05's 6.7B model on
64 nodes x 8 GPUs.

A :class:`Scenario` holds the inputs (the cluster, the work per GPU, the assumptions); a
configuration is a dict of :class:`minizero.analysis.cost.Config` options (``stage``, ``hsdp``,
``hpz``, ``qwz``). For each, :func:`predict_rows` gives what a rank needs and how long a step
takes:

* memory per rank: the model states of ``cost.predict_memory`` (the real stage code on meta
  tensors, plus hpZ's secondary shard) and :func:`minizero.analysis.budget.step_budget`'s
  activations, logits and stage 3's gathered units (lesson 05's budget);
* activation checkpointing only where the plain budget does not fit in
  ``gpu_GB - headroom_GB``;
* compute: PaLM's count of FLOPs per token (arXiv 2204.02311, appendix B), 6Ψ + 12·L·s·h
  (forward and backward; 8Ψ + 16·L·s·h with checkpointing, one more forward), at ``tflops``;
* communication: ``cost.predict`` on the scenario's links, per bucket at stages 0-2 (torch DDP's
  25 MiB rule over the model's bf16 gradients, :func:`gpt_buckets`) and per unit at stage 3 (one
  per block and the root's, ``budget.gpt_units``): every bucket and every unit pays α on each
  round of its ring (2(n-1) for an all-reduce, n-1 for a reduce-scatter or an all-gather), with
  no overlap (``step_s``) and with full overlap (``overlapped_s``).

:func:`question` puts a scenario as exercise 4's decision takes it (a :class:`Question`), and
:func:`sensitivity` / :func:`question_sensitivity` ask which input, halved or doubled, changes a
choice of configuration.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from minizero import bucket
from minizero.analysis import budget, cost
from minizero.models import GPTConfig, TinyGPT

GB = 1e9  # lesson 05's GB


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """The inputs: ``nodes`` of ``gpus`` GPUs of ``gpu_GB``, NVLink at ``nvlink_GBps`` per GPU,
    ``nics`` NICs of ``nic_GBps`` a node, ``alpha_us`` per ring round on both links; per GPU,
    ``micro`` micro-batches of ``seqs`` sequences per step, at ``tflops`` achieved; ``headroom_GB``
    of each GPU kept for the CUDA context, NCCL's buffers and the allocator's slack."""

    nodes: int = 64
    gpus: int = 8
    nvlink_GBps: float = 370.0
    nic_GBps: float = 47.0
    nics: int = 8
    alpha_us: float = 10.0
    seqs: int = 4
    micro: int = 4
    tflops: float = 300.0
    gpu_GB: float = 80.0
    headroom_GB: float = 5.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0 and f.name != "headroom_GB":
                raise ValueError(f"Scenario.{f.name} must be > 0, got {getattr(self, f.name)!r}")
        if not 0 <= self.headroom_GB < self.gpu_GB:
            raise ValueError(
                f"headroom_GB must be in [0, gpu_GB = {self.gpu_GB}), got {self.headroom_GB}"
            )

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    @property
    def room(self) -> float:
        """Bytes a rank has for model states and activations."""
        return (self.gpu_GB - self.headroom_GB) * GB

    def links(self) -> cost.Links:
        alpha = self.alpha_us * 1e-6
        return cost.Links(
            intra=cost.Link(alpha, self.nvlink_GBps * 1e9),
            inter=cost.Link(alpha, self.nic_GBps * 1e9),
            nics=self.nics,
        )

    def scaled(self, name: str, factor: float) -> Scenario:
        """This scenario with input ``name`` times ``factor`` (an integer input stays one)."""
        value = getattr(self, name)
        new = int(value * factor) if isinstance(value, int) else value * factor
        return dataclasses.replace(self, **{name: new})


def step_compute_s(model: GPTConfig, sc: Scenario, checkpointing: bool) -> float:
    """Seconds of compute per optimizer step: (6Ψ + 12·L·s·h) FLOPs per token, (8Ψ + 16·L·s·h)
    with checkpointing, for ``micro`` x ``seqs`` x ``block_size`` tokens, at ``tflops``."""
    passes = 4 if checkpointing else 3  # forward = 1, backward = 2, checkpointing's forward = 1
    attention = 4 * model.n_layer * model.block_size * model.n_embd  # per token, per pass
    per_token = passes * (2 * budget.gpt_params(model) + attention)
    return per_token * sc.seqs * model.block_size * sc.micro / (sc.tflops * 1e12)


def gpt_buckets(model: GPTConfig, grad_bytes: int = 2) -> tuple[int, ...]:
    """Elements of each bucket stages 0-2 reduce for ``TinyGPT(model)``: its trainable parameters
    in reverse registration order (the order backward makes them ready), cut by torch DDP's rule
    (``bucket.assign_by_size``: 25 MiB, the first 1 MiB) at ``grad_bytes`` per element. Built on
    the meta device; unpadded (a stage pads each to a multiple of its n ranks: under n more)."""
    return _buckets(tuple(sorted(dataclasses.asdict(model).items())), grad_bytes)


@functools.cache
def _buckets(model: tuple, grad_bytes: int) -> tuple[int, ...]:
    with torch.device("meta"):
        params = bucket.trainable_parameters(TinyGPT(GPTConfig(**dict(model))))
    numels = [p.numel() for p in reversed(params)]
    cuts = bucket.assign_by_size([grad_bytes * n for n in numels])
    return tuple(sum(numels[i] for i in idx) for idx in cuts)


def comm_sizes(model: GPTConfig, stage: int) -> list[int]:
    """What one collective carries, in elements: a unit each at stage 3, a bucket each below."""
    return budget.gpt_units(model) if stage == 3 else list(gpt_buckets(model))


@functools.cache
def _states(psi: int, stage: int, hsdp: bool, hpz: bool, qwz: bool, world: int, node: int):
    cfg = cost.Config(stage=stage, world=world, node_size=node, hsdp=hsdp, hpz=hpz, qwz=qwz)
    return cost.predict_memory(cfg, psi)["total"]


def _need(model: GPTConfig, cfg: cost.Config, sc: Scenario, states: float, ckpt: bool) -> float:
    b = budget.step_budget(
        model, world=cfg.shard_ranks, stage=cfg.stage, micro_batch=sc.seqs, checkpointing=ckpt
    )
    return states + b["activations"] + b["logits"] + b["stage 3 working set"]


def predict_row(
    model: GPTConfig, sc: Scenario, name: str, options: dict, every_microbatch: bool = True
) -> dict:
    """One configuration (``options``: ``cost.Config``'s ``stage``, ``hsdp``, ``hpz``, ``qwz``):
    ``ckpt`` (checkpointing needed), ``step_s`` and ``overlapped_s`` (seconds per step, no
    overlap and full overlap), ``inter`` and ``intra`` (seconds of communication per step),
    ``alpha`` (the seconds of those that are latency, α on every ring round),
    ``states``, ``plain`` (bytes without checkpointing) and ``memory`` (bytes a rank needs)."""
    cfg = cost.Config(
        world=sc.world,
        node_size=sc.gpus,
        micro_batches=sc.micro,
        replicate_every_microbatch=every_microbatch,
        **options,
    )
    psi = budget.gpt_params(model)
    states = _states(psi, cfg.stage, cfg.hsdp, cfg.hpz, cfg.qwz, sc.world, sc.gpus)
    need = {ckpt: _need(model, cfg, sc, states, ckpt) for ckpt in (False, True)}
    ckpt = need[False] > sc.room  # checkpointing only where the memory needs it
    per_micro = step_compute_s(model, sc, ckpt) / sc.micro
    sizes, links = comm_sizes(model, cfg.stage), sc.links()  # α on each round of each ring
    p = [cost.predict(cfg, links, compute_s=per_micro, sizes=sizes, overlap=o) for o in (0, 1)]
    alpha = sum(c.times * c.latency(links) for c in cost.step_collectives(cfg, sizes) if c.n > 1)
    return dict(
        name=name,
        ckpt=ckpt,
        step_s=p[0].step_s,
        overlapped_s=p[1].step_s,
        inter=p[0].comm_s.get("inter", 0.0),
        intra=p[0].comm_s.get("intra", 0.0),
        alpha=alpha,
        states=states,
        plain=need[False],
        memory=need[ckpt],
    )


def predict_rows(
    model: GPTConfig, sc: Scenario, candidates: dict[str, dict], every_microbatch: bool = True
) -> list[dict]:
    """:func:`predict_row` for each named configuration of ``candidates``, in its order."""
    return [predict_row(model, sc, n, o, every_microbatch) for n, o in candidates.items()]


def one_nic_network_s(model: GPTConfig, sc: Scenario, options: dict) -> float:
    """Seconds of network per step in the model lesson 08 used to have: a ring that crosses nodes
    at one NIC's speed, a group inside a node at one GPU's NVLink (α as in the scenario, on every
    round of each bucket's or unit's ring, as :func:`predict_row` charges it)."""
    cfg = cost.Config(world=sc.world, node_size=sc.gpus, micro_batches=sc.micro, **options)
    beta = {True: sc.nic_GBps * 1e9, False: sc.nvlink_GBps * 1e9}
    return sum(
        c.times * (sc.alpha_us * 1e-6 * c.rounds() + c.wire() / c.times / beta[c.nodes > 1])
        for c in cost.step_collectives(cfg, comm_sizes(model, cfg.stage))
    )


def sensitivity(
    model: GPTConfig,
    sc: Scenario,
    candidates: dict[str, dict],
    choose: Callable[[list[dict], float], str | None],
    factors: tuple[float, ...] = (0.5, 2),
    keep: tuple[str, ...] = ("gpus",),
) -> dict:
    """``choose(rows, room)`` on the scenario (``"pick"``), on it with each input but ``keep``
    (the node's shape: 8 GPUs, 8 NICs) times each of ``factors`` (``"inputs"``: ``{name:
    (value, [pick per factor])}``), and with HSDP's replicate all-reduce once per step
    (``"replicate_once"``)."""
    inputs = {}
    for f in dataclasses.fields(sc):
        if f.name in keep:
            continue
        picks = []
        for factor in factors:
            changed = sc.scaled(f.name, factor)
            picks.append(choose(predict_rows(model, changed, candidates), changed.room))
        inputs[f.name] = (getattr(sc, f.name), picks)
    once = choose(predict_rows(model, sc, candidates, every_microbatch=False), sc.room)
    return dict(
        pick=choose(predict_rows(model, sc, candidates), sc.room),
        inputs=inputs,
        factors=factors,
        replicate_once=once,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Question:
    """What exercise 4 decides from: ``psi`` parameters on ``world`` ranks in nodes of ``node``
    (HSDP's shard group), ``micro`` micro-batches a step, ``compute_s`` the forward + backward of
    one, ``links`` (α per ring round), ``memory`` the bytes a rank has and ``activations`` the
    bytes it needs beyond its model states; ``buckets`` (stages 0-2) and ``units`` (stage 3), the
    elements each collective carries; ``replicate_every_microbatch`` as :class:`cost.Config`."""

    psi: int
    world: int
    node: int
    micro: int
    compute_s: float
    links: cost.Links
    memory: float
    activations: float
    buckets: tuple[int, ...]
    units: tuple[int, ...]
    replicate_every_microbatch: bool = True


def question(model: GPTConfig, sc: Scenario, every_microbatch: bool = True) -> Question:
    """The scenario as a :class:`Question`, with activation checkpointing (section 6: the plain
    activations fit no configuration): activations and logits of ``seqs`` sequences, compute with
    checkpointing's extra forward."""
    b = budget.step_budget(model, world=sc.world, stage=0, micro_batch=sc.seqs, checkpointing=True)
    return Question(
        psi=budget.gpt_params(model),
        world=sc.world,
        node=sc.gpus,
        micro=sc.micro,
        compute_s=step_compute_s(model, sc, True) / sc.micro,
        links=sc.links(),
        memory=sc.room,
        activations=b["activations"] + b["logits"],
        buckets=gpt_buckets(model),
        units=tuple(budget.gpt_units(model)),
        replicate_every_microbatch=every_microbatch,
    )


def plan_name(plan: tuple[int, bool] | None) -> str:
    """``(stage, hsdp)`` as the lesson names it: ``(1, True)`` is "ZeRO-1 HSDP", ``(0, False)``
    "DDP"; None "nothing fits"."""
    if plan is None:
        return "nothing fits"
    stage, hsdp = plan
    return ("DDP" if stage == 0 else f"ZeRO-{stage}") + (" HSDP" if hsdp else "")


def question_sensitivity(
    model: GPTConfig,
    sc: Scenario,
    choose: Callable[[Question], tuple],
    factors: tuple[float, ...] = (0.5, 2),
    keep: tuple[str, ...] = ("gpus",),
) -> dict:
    """:func:`sensitivity` for exercise 4's ``choose(question) -> (plan, reason)``: each pick is
    "plan name (reason)"."""

    def pick(s: Scenario, every: bool = True) -> str:
        plan, reason = choose(question(model, s, every))
        return f"{plan_name(plan)} ({reason})"

    inputs = {
        f.name: (getattr(sc, f.name), [pick(sc.scaled(f.name, x)) for x in factors])
        for f in dataclasses.fields(sc)
        if f.name not in keep
    }
    return dict(pick=pick(sc), inputs=inputs, factors=factors, replicate_once=pick(sc, False))
