"""Lesson 08's checks reject plausible wrong answers, with a message that names what is wrong."""

from __future__ import annotations

import re

import pytest

from minizero.analysis import cost
from minizero.course.checks import CheckFailed, lesson08


def _step(cfg, links, compute_s, psi, *, times=True, per_micro=True, nics=None, summed=False,
          alpha=None, compute=True):  # fmt: skip
    total = (cfg.micro_batches if per_micro else 1) * compute_s if compute else 0.0
    for c in cost.step_collectives(cfg, [psi]):
        if alpha == "crossing":  # the old model: the inter α on every round of a crossing group
            lat = (links.inter if c.nodes > 1 else links.intra).alpha * c.rounds()
        elif alpha is not None:
            lat = alpha * c.rounds()
        else:  # NCCL's ring (src/graph/tuning.cc): inter α on 2(k-1) or k-1 rounds
            per = {"all_reduce": 2}.get(c.op, 1)
            inter = 0 if c.nodes == 1 else (c.n - c.n // c.nodes if c.op == "all_to_all"
                                             else per * (c.nodes - 1))  # fmt: skip
            lat = links.inter.alpha * inter + links.intra.alpha * (c.rounds() - inter)
        nvlink = c.gpu_bytes() / links.intra.beta
        network = c.node_bytes() / ((nics or links.nics) * links.inter.beta)
        slowest = nvlink + network if summed else max(nvlink, network)
        total += (c.times if times else 1) * (lat + slowest)
    return total


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_the_right_prediction_passes(capsys):
    lesson08.check_predict_step_time(lambda *a: _step(*a))
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda *a: _step(*a, times=False), "every micro-batch: a Comm says how often"),
        (lambda *a: _step(*a, per_micro=False), "compute runs once per micro-batch"),
        (lambda *a: _step(*a, nics=1), "on all its NICs at once"),
        (lambda *a: _step(*a, summed=True), "the slower of the two (max), not their sum"),
        (lambda *a: _step(*a, alpha=a[1].intra.alpha), "α as NCCL charges a ring"),
        (lambda *a: _step(*a, alpha="crossing"), "the inter link's on the c.inter_rounds()"),
        (lambda *a: _step(*a, compute=False), "add the compute"),
        (lambda cfg, links, c, psi: _step(cfg, links, c, psi) * 1.01, "α_inter · c.inter_rounds()"),
        (lambda *a: None, "return seconds"),
    ],
)
def test_wrong_predictions_fail_naming_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=re.escape(message)):
        lesson08.check_predict_step_time(wrong)


def _decision(q, *, memory=True, alpha=True, shard="node", calls="buckets", ties="less",
              hsdp=True, order=("memory", "latency", "tie"), none=True):  # fmt: skip
    """Exercise 4 written here, with a switch per mistake a student makes."""

    def need(stage, n):
        return q.psi * (2 / (n if stage == 3 else 1) + 2 / (n if stage >= 2 else 1)
                        + 12 / (n if stage else 1)) + q.activations  # fmt: skip

    def pick(memory=memory, alpha=alpha, ties=ties):
        plans = [(s, False) for s in range(4)]
        plans += [(s, True) for s in (1, 2, 3) if hsdp and q.world > q.node]
        rows = []
        for stage, h in plans:
            n = (q.node if shard == "node" else q.world) if h else q.world
            if memory and need(stage, n) > q.memory:
                continue
            cfg = cost.Config(stage=stage, world=q.world, node_size=q.node, hsdp=h,
                              micro_batches=q.micro)  # fmt: skip
            sizes = [q.psi] if calls == "one" else (q.units if stage == 3 else q.buckets)
            t = cost.predict(cfg, q.links, compute_s=q.compute_s, sizes=sizes).step_s
            if not alpha:
                t -= sum(c.times * c.latency(q.links) for c in cost.step_collectives(cfg, sizes))
            rows.append((t, need(stage, n), (stage, h)))
        if not rows:
            return None if none else (3, False)
        best = min(r[0] for r in rows)
        equal = [r for r in rows if abs(r[0] - best) <= 1e-9 * best]
        if ties == "first":
            return equal[0][2]
        return (min if ties == "less" else max)(equal, key=lambda r: r[1])[2]

    plan = pick()
    flips = {"memory": dict(memory=False), "latency": dict(alpha=False), "tie": dict(ties="more")}
    for reason in order:
        if (reason == "memory" and plan is None) or pick(**flips[reason]) != plan:
            return plan, reason
    return plan, "bandwidth"


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_the_right_decision_passes(capsys):
    lesson08.check_choose(_decision)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda q: _decision(q, memory=False), "does not fit: the paper's formula gives"),
        (lambda q: _decision(q, shard="world"), "HSDP shards over the node's 8 ranks"),
        (lambda q: _decision(q, alpha=False), "ranked the plans by their bytes alone"),
        (lambda q: _decision(q, calls="one"), "α is paid per call"),
        (lambda q: _decision(q, hsdp=False), "you left HSDP out"),
        (lambda q: _decision(q, ties="more"), "equal step times: take the plan that needs less"),
        (lambda q: _decision(q, ties="first"), "equal step times: take the plan that needs less"),
        (lambda q: _decision(q, none=False), "expected nothing fits"),
        (lambda q: _decision(q, order=("latency", "memory", "tie")), "expected 'memory'"),
        (
            lambda q: _decision(q, order=("memory", "latency")),
            "because of 'bandwidth'; expected 'tie'",
        ),
        (
            lambda q: (_decision(q)[0], "latency"),
            "because of 'latency'; expected 'memory': the reason",
        ),
        (lambda q: "ZeRO-1 HSDP", "return (plan, reason), plan (stage, hsdp)"),
        (lambda q: ((1, "yes"), "latency"), "return (plan, reason)"),
    ],
)
def test_wrong_decisions_fail_naming_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=re.escape(message)):
        lesson08.check_choose(wrong)
