"""Lesson 09's check rejects plausible wrong training loops, naming the mistake.

The right loop is the lesson's solution; each wrong one is that loop with one of the mistakes a
nanoGPT user makes when the loop goes distributed: the gradients reduced on the first micro-batch
instead of the last, on every one, the loss not divided by the micro-batches, nanoGPT's
evaluation on rank 0 alone (at stage 0, and at stage 3 only, where a forward is collective and
the loop would wait forever), each rank's own eval mean, the schedule or the clipping left out,
and a shard saved for the state dict. The check runs on 3 gloo ranks, then on the subgroup [0, 1].
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import minizero
from minizero.collectives import all_reduce
from minizero.course.checks import CheckFailed, lesson09
from minizero.course.checks.common import MIN_WORLD
from minizero.launcher import rank_device
from minizero.models import TinyGPT
from minizero.tools import shakespeare
from minizero.tools.train import eval_batches, get_lr, make_optimizer, train_batch

pytestmark = pytest.mark.timeout(300)


def loop(cfg, stage, group=None, *, sync="last", scale=True, schedule=True, clip=True,
         evaluate="every rank", state="whole"):  # fmt: skip
    """The lesson's solution, with one mistake chosen by a keyword."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data, dev, micro = shakespeare.load(), rank_device(), cfg.gradient_accumulation_steps
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.gpt(data.vocab_size)).to(dev)
    model, opt = minizero.parallelize(model, stage, make_optimizer(model, cfg), process_group=group)
    evals = {s: eval_batches(data, cfg, s, rank, world, dev) for s in ("train", "val")}
    alone = evaluate == "rank 0" or (evaluate == "rank 0 at stage 3" and stage == 3)
    out = {"loss": [], "evals": []}
    for it in range(cfg.max_iters + 1):
        due = it % cfg.eval_interval == 0 or it == cfg.max_iters
        if due and (rank == 0 or not alone):  # nanoGPT: `and master_process`
            model.eval()
            losses = [it]
            with torch.no_grad():
                for split in ("train", "val"):
                    mean = torch.stack([model(x, y) for x, y in evals[split]]).mean()
                    if evaluate != "own rows" and not alone:
                        all_reduce(mean, group=group)
                        mean /= world
                    losses.append(mean.item())
            model.train()
            out["evals"].append(losses)
        if it == cfg.max_iters:
            break
        if schedule:
            for g in opt.param_groups:
                g["lr"] = get_lr(it, cfg)
        total = 0.0
        for m in range(micro):
            x, y = train_batch(data, cfg, it * micro + m, rank, world, dev)
            synced = {"last": m == micro - 1, "first": m == 0, "every": True}[sync]
            with contextlib.nullcontext() if synced else model.no_sync():
                loss = model(x, y) / micro if scale else model(x, y)
                loss.backward()
            total += loss.item() / (1 if scale else micro)  # the logged loss is right either way
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(total)
    if state == "whole":
        out["state_dict"] = model.state_dict()
    else:  # the parameters as this rank holds them: whole at stages 0-2, its shard at stage 3
        out["state_dict"] = model.module.state_dict(keep_vars=True)
    return out


def train(cfg, stage, group=None):
    return loop(cfg, stage, group)


def sync_on_first(cfg, stage, group=None):
    return loop(cfg, stage, group, sync="first")


def sync_on_every(cfg, stage, group=None):
    return loop(cfg, stage, group, sync="every")


def loss_not_scaled(cfg, stage, group=None):
    return loop(cfg, stage, group, scale=False)


def evaluates_on_rank_0(cfg, stage, group=None):
    return loop(cfg, stage, group, evaluate="rank 0")


def evaluates_on_rank_0_at_stage_3(cfg, stage, group=None):
    return loop(cfg, stage, group, evaluate="rank 0 at stage 3")


def own_rows_eval(cfg, stage, group=None):
    return loop(cfg, stage, group, evaluate="own rows")


def constant_lr(cfg, stage, group=None):
    return loop(cfg, stage, group, schedule=False)


def not_clipped(cfg, stage, group=None):
    return loop(cfg, stage, group, clip=False)


def saves_a_shard(cfg, stage, group=None):
    return loop(cfg, stage, group, state="shard")


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_the_right_answer_passes(capsys):
    lesson09.check_train(train, 2)
    out = capsys.readouterr().out
    assert out.startswith(f"PASS  train: at stages 0-3 on {MIN_WORLD} ranks"), out
    assert "on the subgroup [0, 1], given as group=" in out


WRONG = [  # (the loop, the stage whose run names it, how the message starts, what else it says)
    (sync_on_first, 0, "rank 0, iteration 0: the gradients were reduced on the FIRST micro",
     ("no_sync() on every micro-batch but the last",)),
    (sync_on_every, 0, "rank 0, iteration 0: 2 of the 2 backwards reduced the gradients",
     ("model.no_sync()",)),
    (loss_not_scaled, 0, "rank 0, iteration 0: the gradient reaching each micro-batch's loss",
     ("was 1, 1, not 1/2", "the SUM of the 2 micro-batches' gradients")),
    (evaluates_on_rank_0, 0, "at iteration 0, rank(s) [0] evaluated",
     ("while rank(s) [1, 2] trained", "every rank evaluates")),
    (evaluates_on_rank_0_at_stage_3, 3, "at iteration 0, rank(s) [0] evaluated",
     ("At stage 3 each forward all-gathers",)),
    (own_rows_eval, 0, "iteration 0, train: the ranks' eval losses differ",
     ("All-reduce each rank's mean",)),
    (constant_lr, 0, "rank 0, iteration 0: param group 0 stepped with lr 0.01",
     ("get_lr(0, cfg) = 0.00333333", "the schedule is missing")),
    (not_clipped, 0, "iteration 0: the gradients' norm at opt.step() was",
     ("above cfg.grad_clip = 0.1", "clip_grad_norm_")),
    (saves_a_shard, 3, "the state dict rank 0 returned is not whole: reading 'wte.weight'",
     ("ShardedParameterError", "At stage 3 a rank holds 1/3 of each parameter",
      "model.state_dict() on the parallelized model")),
]  # fmt: skip


@pytest.mark.parametrize("wrong, stage, starts, has", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_the_check_names_the_mistake(wrong, stage, starts, has):
    if MIN_WORLD != 3:
        pytest.skip("the messages name a world of 3")
    with pytest.raises(CheckFailed) as e:
        lesson09.check_train(wrong, 2)
    msg = str(e.value)
    assert msg.startswith(f"stage {stage} (world size 3): {starts}"), msg
    for part in has:
        assert part in msg, msg


def test_the_lessons_stub_fails_naming_its_todo():
    """The unsolved lesson's ``train`` (its exercise cell, read from lessons/) fails the check
    naming the TODO and nothing else, as an unsolved lesson's check cell must
    (test_lesson_runs.py's rule; lesson 09's unsolved run is the soak tier's: tests/lessons.py)."""
    from test_lesson_runs import assert_fails_at_checks

    from lessons import lesson_cells
    from minizero.course import grade
    from minizero.course.labs import lesson09 as lab

    cells = lesson_cells("09_capstone")
    exercise = [c for c in cells if "exercise" in c["metadata"].get("tags", [])]
    assert len(exercise) == 1
    scope = dict(vars(lab))  # what the lesson's first cell star-imports
    exec("".join(exercise[0]["source"]), scope)
    with pytest.raises(CheckFailed) as e:
        lesson09.check_train(scope["train"], 2)
    assert "NotImplementedError: TODO: write train()" in str(e.value)
    assert_fails_at_checks([grade.CellRun(5, "train", f"CheckFailed: {e.value}", 0.0)])
