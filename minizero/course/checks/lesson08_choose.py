"""Lesson 08's exercise 4, the decision: the check's own, written apart from the lesson's
solution (``check_choose`` in :mod:`.lesson08` compares the student's with it). The plans, the
paper's memory per rank, ``cost.predict`` per bucket or unit, and the counterfactual reason; the
keyword arguments of ``_pick``/``decide`` make the mistakes a student makes, so that a wrong answer
that matches one is named.
"""

from __future__ import annotations

import math

from minizero.analysis import cost

PLANS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
REASONS = ("memory", "latency", "tie", "bandwidth")


def _need(q, stage: int, hsdp: bool, shard: int | None = None) -> float:
    """Bytes a rank needs: (2 + 2 + 12)Ψ with each part divided by the ranks that shard it (the
    node with HSDP, else the world), plus the activations."""
    n = shard or (q.node if hsdp else q.world)
    per = 2 / (n if stage >= 3 else 1) + 2 / (n if stage >= 2 else 1) + 12 / (n if stage else 1)
    return per * q.psi + q.activations


def _priced(q, plan: tuple[int, bool], one_call: bool) -> tuple[float, float]:
    """(step seconds, of which α) of ``plan``, per bucket or unit (``one_call``: one call of Ψ)."""
    stage, hsdp = plan
    cfg = cost.Config(
        stage=stage, world=q.world, node_size=q.node, hsdp=hsdp, micro_batches=q.micro,
        replicate_every_microbatch=q.replicate_every_microbatch,
    )  # fmt: skip
    sizes = [q.psi] if one_call else list(q.units if stage == 3 else q.buckets)
    step = cost.predict(cfg, q.links, compute_s=q.compute_s, sizes=sizes).step_s
    alpha = sum(c.times * c.latency(q.links) for c in cost.step_collectives(cfg, sizes) if c.n > 1)
    return step, alpha


def _pick(q, *, memory=True, alpha=True, shard_world=False, one_call=False, ties="less", hsdp=True):
    """The plan: the fastest that fits, equal times to the one needing less memory; None."""
    same = lambda a, b: math.isclose(a, b, rel_tol=1e-9)
    rows = []
    for plan in PLANS:
        if plan[1] and (q.world <= q.node or not hsdp):
            continue  # HSDP on one node is the flat plan
        step, lat = _priced(q, plan, one_call)
        need = _need(q, *plan, q.world if shard_world else None)
        if need <= q.memory or not memory:
            rows.append((step if alpha else step - lat, need, plan))
    if not rows:
        return None
    best = min(r[0] for r in rows)
    equal = [r for r in rows if same(r[0], best)]
    return {"less": min(equal, key=lambda r: r[1]), "more": max(equal, key=lambda r: r[1]),
            "first": equal[0]}[ties][2]  # fmt: skip


def decide(q, **mistake) -> tuple[tuple[int, bool] | None, str]:
    """(plan, reason): "memory" if ignoring memory picks another plan (or none fits); else
    "latency" if ignoring α does; else "tie" if an other plan that fits is as fast; else
    "bandwidth"."""
    plan = _pick(q, **mistake)
    if plan is None or _pick(q, **{**mistake, "memory": False}) != plan:
        return plan, "memory"
    if _pick(q, **{**mistake, "alpha": False}) != plan:
        return plan, "latency"
    if _pick(q, **{**mistake, "ties": "more"}) != plan:
        return plan, "tie"
    return plan, "bandwidth"


def _question(alpha=10e-6, memory=80e9, activations=20e9, world=64):
    from minizero.analysis.scenario import Question

    links = cost.Links(intra=cost.Link(alpha, 300e9), inter=cost.Link(alpha, 40e9), nics=8)
    psi = 2 * 10**9
    return Question(
        psi=psi, world=world, node=8, micro=2, compute_s=0.5, links=links, memory=memory,
        activations=activations, buckets=(psi // 40,) * 40, units=(psi // 10,) * 10,
    )  # fmt: skip


# Where the answer flips: α decides (ZeRO-3 HSDP's few units at 512 ranks and 50 µs; ZeRO-1
# HSDP's short rings at 64 and 10 µs); memory decides, three times (ZeRO-1 HSDP's node-sized
# shards, ZeRO-3 HSDP's); a tie; bytes decide; nothing fits.
QUESTIONS = [
    _question(alpha=50e-6, world=512),
    _question(),
    _question(memory=30e9),
    _question(world=512, memory=30e9),  # ignoring memory, and ignoring α, pick ZeRO-1
    _question(alpha=1e-7),
    _question(alpha=1e-7, memory=40e9),
    _question(world=512, memory=21e9),
    _question(memory=15e9),
]


def asked(q) -> str:
    return (
        f"Ψ = {q.psi / 1e9:g}B on {q.world} ranks in nodes of {q.node}, α "
        f"{q.links.intra.alpha * 1e6:g} µs, {q.memory / 1e9:g} GB a rank of which "
        f"{q.activations / 1e9:g} GB activations"
    )


def label(plan) -> str:
    from minizero.analysis.scenario import plan_name

    return plan_name(plan)


def as_plan(got):
    """The student's plan as (stage, hsdp), or None; raises ValueError if it is neither."""
    if got is None:
        return None
    stage, hsdp = got  # a tuple or a list of two
    if stage not in (0, 1, 2, 3) or not isinstance(hsdp, bool):
        raise ValueError
    return int(stage), hsdp


def plan_hint(q, got, want) -> str:
    gb = lambda b: f"{b / 1e9:.1f} GB"
    if got is not None and _need(q, *got) > q.memory:
        flat = (
            f" HSDP shards over the node's {q.node} ranks, not the world's {q.world}."
            if got[1] and _need(q, *got, q.world) <= q.memory
            else ""
        )
        return (
            f"{label(got)} does not fit: the paper's formula gives {gb(_need(q, *got))} a rank "
            f"with the activations, over the {gb(q.memory)} there is.{flat}"
        )
    mistakes = [
        (dict(alpha=False), "you ranked the plans by their bytes alone: α is paid on every ring "
         "round, and at many ranks it is the larger term; rank by cost.predict's step_s"),
        (dict(one_call=True), "you priced Ψ as one collective: α is paid per call, so price each "
         "bucket (q.buckets, stages 0-2) or unit (q.units, stage 3) as sizes="),
        (dict(hsdp=False), "you left HSDP out: stages 1-3 may also shard over the node and "
         "replicate across nodes, plan (stage, True), when there is more than one node"),
        (dict(ties="more"), "equal step times: take the plan that needs less memory"),
        (dict(ties="first"), "equal step times: take the plan that needs less memory"),
    ]  # fmt: skip
    for mistake, hint in mistakes:
        if _pick(q, **mistake) == got:
            return hint
    if got is None:
        return f"{label(want)} fits: it needs {gb(_need(q, *want))} of {gb(q.memory)} (<= fits)"
    return (
        f"{label(want)} fits and is faster; the plans are stages 0-3, flat or HSDP (stage >= 1, "
        f"more than one node), priced with cost.predict on q.links"
    )


REASON_RULE = (
    'the reason is what the answer depends on, asked in this order: "memory" if ignoring memory '
    'changes the plan (or nothing fits), "latency" if ignoring α (step_s less its α) does, '
    '"tie" if another plan that fits is as fast, else "bandwidth"'
)
