"""The check cells of lesson 08 (08_beyond_one_node): ``check_hsdp_reduce``, ``check_quantize``,
``check_predict_step_time``, ``check_choose``.

``check_hsdp_reduce`` runs the student's HSDP reduction on 4 ranks as three meshes (2 x 2, 1 x 4,
4 x 1: a size hard-coded for 2 x 2 fails the other two); ``check_quantize`` compares the
student's int8 block quantiser with minizero.precision's. The last two run in the notebook's own
process (no ranks): the student's prediction of a step (α per round as NCCL charges a ring, the
slower of NVLink and the node's NICs) against ``minizero.analysis.cost.predict`` (no overlap) on
configurations that differ where a plausible mistake shows (micro-batches, NICs per node, max
or sum, α, HSDP, hpZ, qwZ), and the student's decision (which plan, and why) against the check's
own, written apart, on scenarios where the answer flips. The contract of every check:
:mod:`.common`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minizero.analysis import cost
from minizero.course.checks.common import (
    TIMEOUT,
    CheckFailed,
    allclose,
    check_seed,
    guard,
    launch_check,
    report_pass,
)
from minizero.course.checks.lesson08_choose import (
    QUESTIONS,
    REASON_RULE,
    REASONS,
    as_plan,
    asked,
    decide,
    label,
    plan_hint,
)

LINKS = cost.Links(intra=cost.Link(alpha=5e-6, beta=200e9),
                   inter=cost.Link(alpha=20e-6, beta=25e9), nics=4)  # fmt: skip
PSI, COMPUTE_S = 10**9, 0.5
CASES = [
    cost.Config(stage=0, world=16, node_size=4),
    cost.Config(stage=1, world=4, node_size=4, micro_batches=3),  # one node: NVLink only
    cost.Config(stage=2, world=16, node_size=4, micro_batches=4),
    cost.Config(stage=3, world=16, node_size=4, hsdp=True, micro_batches=2),
    cost.Config(stage=3, world=32, node_size=8, hpz=True, qwz=True, micro_batches=3),
]


def _variant(
    cfg: cost.Config, *, times=True, per_micro=True, nics=None, summed=False, alpha=None
) -> float:
    """The prediction with one plausible mistake, to name it when a student's answer matches.
    ``alpha``: "crossing" charges the inter link's α on every round of a group that crosses
    nodes; a float, that α on every round."""
    total = (cfg.micro_batches if per_micro else 1) * COMPUTE_S
    for c in cost.step_collectives(cfg, [PSI]):
        if alpha is None:
            lat = c.latency(LINKS)
        elif alpha == "crossing":
            lat = (LINKS.inter if c.nodes > 1 else LINKS.intra).alpha * c.rounds()
        else:
            lat = alpha * c.rounds()
        nvlink = c.gpu_bytes() / LINKS.intra.beta
        network = c.node_bytes() / ((nics or LINKS.nics) * LINKS.inter.beta)
        slowest = nvlink + network if summed else max(nvlink, network)
        total += (c.times if times else 1) * (lat + slowest)
    return total


def _describe(cfg: cost.Config) -> str:
    extra = [k for k in ("hsdp", "hpz", "qwz") if getattr(cfg, k)]
    return (
        f"stage {cfg.stage}, N={cfg.world} in nodes of {cfg.node_size}, "
        f"{cfg.micro_batches} micro-batch(es)" + (f", {'+'.join(extra)}" if extra else "")
    )


def check_predict_step_time(fn) -> None:
    """Lesson 08: ``fn(cfg, links, compute_s, psi)`` must return the step time, no overlap."""
    name = getattr(fn, "__name__", "your function")
    for cfg in CASES:
        want = cost.predict(cfg, LINKS, compute_s=COMPUTE_S, psi=PSI).step_s
        got, err = guard(fn, cfg, LINKS, COMPUTE_S, PSI)
        where = f"for {_describe(cfg)}"
        if err:
            raise CheckFailed(f"{name} raised {where}: {err}")
        if not isinstance(got, (int, float)) or not math.isfinite(got):
            raise CheckFailed(f"{name} returned {got!r} {where}: return seconds, a float")
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        close = lambda v: math.isclose(got, v, rel_tol=1e-6)  # noqa: B023 (used right here)
        if close(_variant(cfg, times=False)):
            hint = (
                "you counted each collective once per step; stages 2-3 reduce-scatter (and "
                "stage 3 all-gathers) every micro-batch: a Comm says how often (c.times)"
            )
        elif close(_variant(cfg, per_micro=False)):
            hint = "the compute runs once per micro-batch: cfg.micro_batches × compute_s"
        elif close(_variant(cfg, nics=1)):
            hint = (
                "a node sends across on all its NICs at once: divide c.node_bytes() by "
                "links.nics × links.inter.beta"
            )
        elif close(_variant(cfg, summed=True)):
            hint = (
                "NVLink and the NICs carry their bytes at the same time: the collective takes "
                "the slower of the two (max), not their sum"
            )
        elif close(_variant(cfg, alpha="crossing")) or any(
            close(_variant(cfg, alpha=link.alpha)) for link in (LINKS.intra, LINKS.inter)
        ):
            hint = (
                "α as NCCL charges a ring: the inter link's on the c.inter_rounds() rounds that "
                "cross nodes, the intra link's on the other c.rounds() - c.inter_rounds()"
            )
        elif close(want - cfg.micro_batches * COMPUTE_S):
            hint = "add the compute: the prediction is compute + communication (no overlap)"
        else:
            hint = (
                "a collective costs α_inter · c.inter_rounds() + α_intra · (c.rounds() - "
                "c.inter_rounds()) + max(c.gpu_bytes() / β_intra, c.node_bytes() / "
                "(nics · β_inter))"
            )
        raise CheckFailed(f"{name} gave {got:.6g} s {where}, the model gives {want:.6g} s: {hint}")
    report_pass(f"{name}: the step time of {len(CASES)} configurations (stages 0-3, HSDP, "
                "hpZ + qwZ, 1-4 micro-batches) on NVLink and 4 NICs a node")  # fmt: skip


# -- exercise 4: the decision (no ranks; the check's own decision is in lesson08_choose.py) -------
def check_choose(fn) -> None:
    """Lesson 08: ``fn(q) -> (plan, reason)`` decides a :class:`scenario.Question` as the
    check's own decision does, on scenarios where the answer flips."""
    name = getattr(fn, "__name__", "your function")
    for q in QUESTIONS:
        want, why = decide(q)
        got, err = guard(fn, q)
        where = f"for {asked(q)}"
        if err:
            raise CheckFailed(f"{name} raised {where}: {err}")
        try:
            plan, reason = got
            plan = as_plan(plan)
        except (TypeError, ValueError):
            raise CheckFailed(
                f"{name} returned {got!r} {where}: return (plan, reason), plan (stage, hsdp) "
                f"or None, reason one of {', '.join(REASONS)}"
            ) from None
        if plan != want:
            raise CheckFailed(
                f"{name} chose {label(plan)} {where}; expected {label(want)}: "
                f"{plan_hint(q, plan, want)}"
            )
        if reason != why:
            raise CheckFailed(
                f"{name} chose {label(plan)} {where}, rightly, because of {reason!r}; expected "
                f"{why!r}: {REASON_RULE}"
            )
    report_pass(
        f"{name}: {len(QUESTIONS)} decisions and their reasons (α twice, memory three times, "
        f"a tie, bytes, nothing fits) against the check's own"
    )


# -- exercise: HSDP's two-step gradient reduction (on ranks) -------------------------------------
HSDP_MESHES = [(2, 2), (1, 4), (4, 1)]  # (nodes R, ranks per node N_s): 2 x 2 and the two ends
HSDP_NUMEL = 24  # divides by 1, 2 and 4


def _local_grad(rank: int) -> torch.Tensor:
    """Whole numbers: every sum of them is exact in float32, in any order, and the mean divides by
    a power of two (4 ranks, in one step or two), so a right answer equals the reference exactly;
    the tolerance below only names the check's slack."""
    g = torch.Generator().manual_seed(check_seed(1000 + rank))
    return torch.randint(-50, 51, (HSDP_NUMEL,), generator=g).float()


def _hsdp_rank(fn) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for shape in HSDP_MESHES:  # every rank makes every mesh (its groups), as c10d requires
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        got, err = guard(
            fn, _local_grad(dist.get_rank()), mesh.get_group("shard"), mesh.get_group("replicate")
        )
        out.append({"shape": shape, "got": got, "error": err})
        if err:  # the other ranks may be waiting in a collective: stop here, on every rank
            break
    return out


def _hsdp_expected(rank: int, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The right answer for ``rank`` and what the plausible mistakes give."""
    nodes, per_node = shape
    world = nodes * per_node
    grads = torch.stack([_local_grad(r) for r in range(world)])  # (world, numel)
    node, s = divmod(rank, per_node)  # the mesh is arange(world).view(R, N_s)
    chunk = lambda t: t.view(per_node, -1)[s]  # (numel / N_s,) this rank's shard
    node_mean = lambda n: grads[n * per_node : (n + 1) * per_node].mean(0)
    mixed = sum(node_mean(r // per_node).view(per_node, -1)[r % per_node] for r in range(world))
    return {
        "want": chunk(grads.mean(0)),
        "node": chunk(node_mean(node)),
        "mixed": mixed / nodes,  # an all-reduce over the world: other ranks' chunks added in
    }


def check_hsdp_reduce(fn) -> None:
    """Lesson 08: ``fn(grad, shard_group, replicate_group)`` returns this rank's (numel / N_s,)
    chunk of the gradient averaged over every rank, on 4 ranks as 2 x 2, 1 x 4 and 4 x 1."""
    name = getattr(fn, "__name__", "your function")
    results = launch_check(_hsdp_rank, 4, fn, timeout=TIMEOUT, min_world=4)  # its meshes: 4 ranks
    for rank, cases in enumerate(results):
        for case in cases:
            nodes, per_node = case["shape"]
            where = f"on rank {rank} of {nodes} node(s) x {per_node} rank(s)"
            if case["error"]:
                hint = "" if case["shape"] == HSDP_MESHES[0] else (
                    " It ran on 2 x 2 but not here: a size hard-coded for 2 x 2 (a 2?) fails "
                    "other meshes; take N_s and R from the groups, dist.get_world_size(group)."
                )  # fmt: skip
                raise CheckFailed(f"{name} raised {where}: {case['error']}{hint}")
            got, ref = case["got"], _hsdp_expected(rank, case["shape"])
            want = ref["want"]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise CheckFailed(
                    f"{name} returned {shape} {where}; want this rank's shard, {tuple(want.shape)}"
                    f" = numel / N_s: reduce-scatter over shard_group (not the world)"
                )
            got = got.float()
            if allclose(got, want, 0.0, 1e-5, "08 HSDP reduce"):
                continue
            hint = _hsdp_hint(got, ref, nodes, per_node)
            err = (got - want).abs().max().item()
            raise CheckFailed(f"{name} {where}: off by up to {err:.3g}.{hint}")
    report_pass(
        f"{name}: the world's average of this rank's shard on every rank of 4, as 2 x 2, 1 x 4 "
        f"and 4 x 1 (nodes x ranks per node)"
    )


def _hsdp_hint(got, ref, nodes, per_node) -> str:
    close = lambda t: torch.allclose(got, t, atol=1e-5)
    want = ref["want"]
    if nodes > 1 and close(ref["node"]):
        return (
            " It is the average over your node only: all-reduce the shard over replicate_group "
            "(the ranks of the other nodes that hold the same shard), then divide by their number."
        )
    mixed = [ref["mixed"] * c for c in (1, nodes, 1 / per_node)]
    if nodes > 1 and per_node > 1 and any(close(m) for m in mixed):
        return (
            " Other shards were added into yours: the all-reduce ran on the default group (the "
            "world). Pass group=replicate_group: only ranks that hold the same shard may be summed."
        )
    ratio = (got / want)[want.abs() > 1e-3]
    if ratio.numel() and torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4):
        c = ratio[0].item()
        return (
            f" It is {c:.3g} x the average: divide the sum by every rank's count, N_s x R = "
            f"{per_node} x {nodes} here; with sizes hard-coded (a 2?) only a 2 x 2 mesh passes: "
            f"use dist.get_world_size(shard_group) and dist.get_world_size(replicate_group)."
        )
    return " Reduce-scatter over shard_group, all-reduce the result over replicate_group, divide."


# -- exercise: qwZ's block quantisation (no ranks) -------------------------------------------------
def _quant_cases() -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    spiky = torch.randn(512, generator=g)
    spiky[7] = 40.0  # one outlier: only its block's scale grows
    zeros = torch.randn(300, generator=g)
    zeros[:100] = 0  # an all-zero block
    return [
        ("1000 normal values, blocks of 256 (the last one 232 long)", x, 256),
        ("512 values with one outlier of 40, blocks of 64", spiky, 64),
        ("300 values whose first block of 100 is all zeros", zeros, 100),
    ]


def check_quantize(fn) -> None:
    """Lesson 08: ``fn(x, block) -> (q, scales)``, symmetric absmax int8 per block, as
    minizero.precision.quantize_blockwise (qwZ's quantiser)."""
    from minizero.zeropp import dequantize_blockwise, quantize_blockwise

    name = getattr(fn, "__name__", "your function")
    for what, x, block in _quant_cases():
        want_q, want_s = quantize_blockwise(x, block)
        res, err = guard(fn, x.clone(), block)
        where = f"for {what}"
        if err:
            raise CheckFailed(f"{name} raised {where}: {err}")
        if not (isinstance(res, tuple) and len(res) == 2):
            raise CheckFailed(f"{name} returned {type(res).__name__} {where}: return (q, scales)")
        q, s = res
        if q.dtype != torch.int8:
            raise CheckFailed(
                f"{name}'s q is {q.dtype} {where}: make it int8 (1 byte an element is what qwZ "
                f"saves: 4x less than fp32, 2x less than bf16)"
            )
        if s.numel() != want_s.numel():
            raise CheckFailed(
                f"{name} gave {s.numel()} scale(s) {where}; want one per block of {block}, "
                f"ceil({x.numel()} / {block}) = {want_s.numel()}: one outlier must not cost every "
                f"other block its precision"
            )
        if not torch.isfinite(s).all():
            raise CheckFailed(f"{name}'s scales are not finite {where}")
        if not allclose(s.float().view(-1), want_s, 1e-5, 0.0, "08 qwZ scales"):
            ratio = (s.float().view(-1)[want_s > 0] / want_s[want_s > 0]).mean().item()
            hint = (
                " The scale is absmax / 127, so that the largest |x| maps to ±127."
                if abs(ratio - 127 / 128) < 1e-3 or abs(ratio - 127 / 255) < 1e-3
                else " The scale of a block is max|x| over that block / 127."
            )
            raise CheckFailed(
                f"{name}'s scales differ {where} (yours / the right: {ratio:.4g}).{hint}"
            )
        if not torch.equal(q.view(-1), want_q):
            safe = torch.where(want_s > 0, want_s, torch.ones_like(want_s))  # (blocks,)
            scaled = x / safe.repeat_interleave(block)[: x.numel()]  # x in units of its scale
            back = dequantize_blockwise(q.view(-1), s.float().view(-1), block).view(-1)
            hint = (
                " Round to the nearest level (torch.round) before .to(torch.int8), which "
                "truncates toward zero: truncation doubles the error and biases it."
                if torch.equal(q.view(-1), scaled.trunc().to(torch.int8))
                else f" Your q dequantises up to {(back - x).abs().max().item():.3g} from x."
            )
            raise CheckFailed(f"{name}'s q differs {where}.{hint}")
    report_pass(f"{name}: q and scales equal minizero's quantiser on {len(_quant_cases())} inputs")
