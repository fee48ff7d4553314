"""Lesson 09's check rejects plausible wrong ``estimate_loss`` functions, naming the mistake.

Each is what a nanoGPT user writes when the evaluation goes distributed: each rank's own mean
(nanoGPT's ``estimate_loss`` unchanged), an all-reduce that sums and is not divided, the default
group or the world's size where the group was passed, and nanoGPT's own habits dropped (no_grad,
model.eval(), model.train() after). The check runs on 3 gloo ranks, then on the subgroup [0, 1].
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minizero.collectives import all_reduce
from minizero.course.checks import CheckFailed, lesson09
from minizero.course.checks.common import MIN_WORLD

pytestmark = pytest.mark.timeout(300)


def _mean(model, batches) -> torch.Tensor:
    return torch.stack([model(x, y) for x, y in batches]).mean()


@torch.no_grad()
def right(model, batches, group=None):
    model.eval()
    mean = _mean(model, batches)
    all_reduce(mean, group=group)
    model.train()
    return mean.item() / dist.get_world_size(group)


@torch.no_grad()
def own_rows_only(model, batches, group=None):  # nanoGPT's estimate_loss, unchanged
    model.eval()
    mean = _mean(model, batches)
    model.train()
    return mean.item()


@torch.no_grad()
def summed_not_divided(model, batches, group=None):
    model.eval()
    mean = _mean(model, batches)
    all_reduce(mean, group=group)
    model.train()
    return mean.item()


@torch.no_grad()
def default_group(model, batches, group=None):
    model.eval()
    mean = _mean(model, batches)
    all_reduce(mean)  # group= dropped: the world's ranks
    model.train()
    return mean.item() / dist.get_world_size(group)


@torch.no_grad()
def world_size_of_the_world(model, batches, group=None):
    model.eval()
    mean = _mean(model, batches)
    all_reduce(mean, group=group)
    model.train()
    return mean.item() / dist.get_world_size()  # the world's size, not the group's


def with_grad(model, batches, group=None):  # no @torch.no_grad()
    model.eval()
    mean = _mean(model, batches).detach()
    all_reduce(mean, group=group)
    model.train()
    return mean.item() / dist.get_world_size(group)


@torch.no_grad()
def training_mode(model, batches, group=None):  # no model.eval()
    mean = _mean(model, batches)
    all_reduce(mean, group=group)
    return mean.item() / dist.get_world_size(group)


@torch.no_grad()
def left_in_eval(model, batches, group=None):  # no model.train() after
    model.eval()
    mean = _mean(model, batches)
    all_reduce(mean, group=group)
    return mean.item() / dist.get_world_size(group)


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_the_right_answer_passes(capsys):
    lesson09.check_estimate_loss(right, 2)
    out = capsys.readouterr().out
    assert out.startswith("PASS  right: the mean eval loss over every rank's rows")
    assert f"on each of {MIN_WORLD} ranks at stages 0 and 3" in out  # 3, or $MINIZERO_CHECK_WORLD


@pytest.mark.parametrize(
    "wrong, starts, has",
    [
        (own_rows_only, "stage 0 (DDP): the ranks returned different losses (rank 0: ",
         ("Each rank evaluated its own rows only", "all-reduce the mean")),
        (summed_not_divided, "stage 0 (DDP), rank 0: yours is ",
         (f"Yours is {MIN_WORLD}.00x the reference: the collective sums; divide by {MIN_WORLD}.",)),
        (default_group, f"on a subgroup (ranks [0, 1] of a {MIN_WORLD}-rank world",
         ("WrongGroup", "a collective ran on the default group: pass group=")),
        (world_size_of_the_world, f"on a subgroup (ranks [0, 1] of a {MIN_WORLD}-rank world",
         ("yours is ", "dist.get_world_size(group)")),
        (with_grad, "rank 0, stage 0 (DDP): the model ran forward with gradients enabled",
         ("torch.no_grad()",)),
        (training_mode, "rank 0, stage 0 (DDP): the model ran forward in training mode",
         ("model.eval()",)),
        (left_in_eval, "rank 0, stage 0 (DDP): the model was left in eval mode",
         ("model.train()",)),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)  # fmt: skip
def test_the_check_names_the_mistake(wrong, starts, has):
    with pytest.raises(CheckFailed) as e:
        lesson09.check_estimate_loss(wrong, 2)
    msg = str(e.value)
    assert msg.startswith(starts), msg
    for part in has:
        assert part in msg, msg
