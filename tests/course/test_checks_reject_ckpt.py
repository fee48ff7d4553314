"""Lesson 07's checks reject plausible wrong answers, with a message that names what is wrong."""

import pytest

from minizero.course.checks import lesson07
from minizero.course.checks.common import CheckFailed


# -- exercise 1: owned_ranges ----------------------------------------------------------------------
def _bucket_offsets_not_param_offsets(model):
    """Wrong: the range counted from the bucket's first element, not the parameter's."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    owned = {}
    for b in model.buckets:
        lo, hi = (
            (0, b.numel) if model.stage == 0 else (model.rank * b.shard, (model.rank + 1) * b.shard)
        )
        for p, o in zip(b.params, b.offsets, strict=True):
            s, e = max(o, lo), min(o + p.numel(), hi)
            if s < e:
                owned[names[id(p)]] = (s, e)
    return owned


def _whole_parameters(model):
    """Wrong: every parameter that touches the chunk, whole (as if ranks owned whole tensors)."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    owned = {}
    for b in model.buckets:
        lo, hi = (
            (0, b.numel) if model.stage == 0 else (model.rank * b.shard, (model.rank + 1) * b.shard)
        )
        for p, o in zip(b.params, b.offsets, strict=True):
            if max(o, lo) < min(o + p.numel(), hi):
                owned[names[id(p)]] = (0, p.numel())
    return owned


@pytest.mark.parametrize("wrong", [_bucket_offsets_not_param_offsets, _whole_parameters])
def test_owned_ranges_rejects(wrong):
    with pytest.raises(CheckFailed) as e:
        lesson07.check_owned_ranges(wrong, 2)
    msg = str(e.value)
    assert msg.startswith("MLP (a frozen weight, a tied one), stage "), msg
    assert "but this rank owns (" in msg, msg


# -- exercise 2: read_plan -------------------------------------------------------------------------
def _dst_from_zero(saved, want):
    """Wrong: the destination counted from element 0 of the parameter, not from want[0]."""
    plan = []
    for k, (s, e) in enumerate(saved):
        a, b = max(s, want[0]), min(e, want[1])
        if a < b:
            plan.append((k, a - s, a, b - a))
    return plan


def _touching_counts(saved, want):
    """Wrong: <= instead of <, so pieces that only touch the range get an empty entry."""
    plan = []
    for k, (s, e) in enumerate(saved):
        a, b = max(s, want[0]), min(e, want[1])
        if a <= b:
            plan.append((k, a - s, a - want[0], b - a))
    return plan


@pytest.mark.parametrize("wrong", [_dst_from_zero, _touching_counts])
def test_read_plan_rejects(wrong):
    with pytest.raises(CheckFailed) as e:
        lesson07.check_read_plan(wrong)
    msg = str(e.value)
    assert msg.startswith("plan entry ("), msg
    assert "reaches outside piece" in msg, msg
