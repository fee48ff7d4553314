"""Lesson 06's check (``check_owned_tensors``): the student's ZeroRedundancyOptimizer, on real
ranks, against torch's own and one optimizer over every tensor. It passes the lesson's solution
and rejects plausible wrong ones (each the solution with one mistake written in) with a message
naming the mistake."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import minizero
from minizero.course.checks import CheckFailed
from minizero.course.checks.lesson06 import check_owned_tensors


class Solution:
    """The lesson's solution; ``rule`` and ``send`` are where the wrong answers differ."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.params, self.group = list(params), group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.owners = self.rule([p.numel() for p in self.params], world)
        mine = [p for p, owner in zip(self.params, self.owners) if owner == rank]
        self.optimizer = optimizer_class(mine, **defaults)

    @staticmethod
    def rule(numels, world):  # largest first, to the least-loaded rank
        load, owners = [0] * world, [0] * len(numels)
        for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
            r = min(range(world), key=load.__getitem__)
            owners[i], load[r] = r, load[r] + numels[i]
        return owners

    def step(self):
        self.optimizer.step()
        self.send()

    def send(self):
        for p, owner in zip(self.params, self.owners):
            minizero.broadcast(p.data, src=owner, group=self.group)


class RoundRobin(Solution):
    @staticmethod
    def rule(numels, world):
        return [i % world for i in range(len(numels))]


class AllOnRankZero(Solution):
    @staticmethod
    def rule(numels, world):
        return [0] * len(numels)


class GreedyInOrder(Solution):  # least-loaded rank, but in the given order
    @staticmethod
    def rule(numels, world):
        load, owners = [0] * world, []
        for n in numels:
            r = min(range(world), key=load.__getitem__)
            owners.append(r)
            load[r] += n
        return owners


class NoBroadcast(Solution):
    def send(self):
        pass


class FromRankZero(Solution):
    def send(self):
        for p in self.params:
            minizero.broadcast(p.data, src=0, group=self.group)


class BroadcastBeforeStep(Solution):
    def step(self):
        self.send()
        self.optimizer.step()


class Unrecorded(Solution):  # torch's broadcast: the ledger cannot see it
    def send(self):
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p.data, src=dist.get_global_rank(self.group or dist.group.WORLD, owner),
                           group=self.group)  # fmt: skip


class OnTheWorld(Solution):  # group= left out
    def send(self):
        for p, owner in zip(self.params, self.owners):
            minizero.broadcast(p.data, src=owner)


class EveryTensorOptimized(Solution):  # the optimizer on every tensor: no memory saved
    def __init__(self, params, optimizer_class, group=None, **defaults):
        super().__init__(params, optimizer_class, group, **defaults)
        self.optimizer = optimizer_class(self.params, **defaults)


class OwnersByGlobalRank(Solution):  # on the subgroup: owners past the group's size
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.params, self.group = list(params), group
        world = dist.get_world_size()  # the default group's size
        self.owners = self.rule([p.numel() for p in self.params], world)
        mine = [p for p, o in zip(self.params, self.owners) if o == dist.get_rank(group)]
        self.optimizer = optimizer_class(mine, **defaults)


class OneRankOptimizesAll(Solution):  # rank 0 alone: the others must not wait for it
    def __init__(self, params, optimizer_class, group=None, **defaults):
        super().__init__(params, optimizer_class, group, **defaults)
        if dist.get_rank(group) == 0:
            self.optimizer = optimizer_class(self.params, **defaults)


class StepFailsOnOneRank(Solution):  # rank 1 raises before its first broadcast
    def step(self):
        if dist.get_rank(self.group) == 1:
            raise RuntimeError("rank 1 gave up")
        super().step()


class Broken(Solution):
    def step(self):
        raise NotImplementedError("TODO: write step()")


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_owned_tensors_passes_the_solution(capsys):
    check_owned_tensors(Solution, 2)
    out = capsys.readouterr().out
    assert "PASS  Solution balances whole tensors and trains TinyGPT as torch's" in out
    assert "moving 3Ψ per step (all-reduce 2Ψ + broadcast Ψ)" in out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (RoundRobin, "RoundRobin's owners (9 tensors, world=3): rank 2 owns 18 elements"),
        (AllOnRankZero, "rank 0 owns 45 of 45 elements (100%"),
        (
            GreedyInOrder,
            "GreedyInOrder's owners (9 tensors, world=3): rank 2 owns 18 elements (loads "
            "[12, 15, 18]); torch's ZeroRedundancyOptimizer's partition leaves no rank more than "
            "16",
        ),
        (NoBroadcast, "still holds its value from before the step"),
        (FromRankZero, "(a broadcast with src=1)"),
        (BroadcastBeforeStep, "still holds its value from before the step"),
        (Unrecorded, "the ledger saw ['all_reduce'] moving 2.00Ψ"),
        (OnTheWorld, "on a subgroup (ranks [0, 1] of a 3-rank world"),
        (OnTheWorld, "a collective ran on the default group: pass group=self.group"),
        (OwnersByGlobalRank, "every owner must be a rank of the group, 0..1"),
        (EveryTensorOptimized, "self.optimizer holds 28 of the 28 parameters; this rank owns"),
        (OneRankOptimizesAll, "on rank 0 with AdamW: self.optimizer holds 28 of the 28"),
        (StepFailsOnOneRank, "on rank 1 with AdamW: step() raised: RuntimeError: rank 1 gave"),
        (Broken, "with AdamW: step() raised: NotImplementedError: TODO: write step()"),
    ],
)
def test_owned_tensors_rejects_wrong_answers_saying_why(wrong, message):
    with pytest.raises(CheckFailed) as e:
        check_owned_tensors(wrong, 2)
    assert message in str(e.value), str(e.value)
