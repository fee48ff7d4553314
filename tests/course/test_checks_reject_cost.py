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


def _fastest(rows, memory):  # ignores memory
    return min(rows, key=lambda r: r["step_s"])["name"]


def _fits_no_ties(rows, memory):  # the first of equal times, not the one using less memory
    fits = [r for r in rows if r["memory"] <= memory]
    return min(fits, key=lambda r: r["step_s"])["name"] if fits else None


def _never_none(rows, memory):  # the least memory when nothing fits
    fits = [r for r in rows if r["memory"] <= memory] or [min(rows, key=lambda r: r["memory"])]
    return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"]


def _strictly_less(rows, memory):  # an exact fit refused
    fits = [r for r in rows if r["memory"] < memory]
    return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"] if fits else None


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_the_right_choice_passes(capsys):
    def choose(rows, memory):
        fits = [r for r in rows if r["memory"] <= memory]
        return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"] if fits else None

    lesson08.check_choose(choose)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (_fastest, "B does not fit: it needs 90 GB"),
        (_fits_no_ties, "equal step times: take the one that leaves more memory free"),
        (_never_none, "nothing fits: return None"),
        (_strictly_less, "A fits: it needs 80 GB of the 80 GB"),
        (lambda rows, memory: rows.index(rows[0]), "is not a row's name"),
    ],
)
def test_wrong_choices_fail_naming_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=re.escape(message)):
        lesson08.check_choose(wrong)
