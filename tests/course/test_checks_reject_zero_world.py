"""Lessons 02-04: wrong answers that need 3 ranks, a subgroup, or the all-gathers' structure.

Each class below is the lesson's solution with one mistake written in (a hard-coded 2, a dropped
``group=``, a blocking all-gather, a prefetch before the unit needed now); the check must fail
and name that mistake. The checks run on 3 ranks, then on the subgroup [0, 1] (rank 2 outside).
"""

from __future__ import annotations

import pytest
import torch

from minizero.collectives import all_gather, reduce_scatter
from minizero.course.checks import CheckFailed, lesson02, lesson03, lesson04
from minizero.precision import divides_before_sum
from minizero.zero1 import ZeRO1
from minizero.zero2 import ZeRO2
from minizero.zero3 import ZeRO3

pytestmark = pytest.mark.slow

TWO_RANKS = "your code assumed 2 ranks: use self.world / dist.get_world_size(group)"
NO_GROUP = "a collective ran on the default group: pass group=self.group"


def _rejects(check, wrong, *has: str) -> str:
    with pytest.raises(CheckFailed) as e:
        check(wrong, 2)
    msg = str(e.value)
    for part in has:
        assert part in msg, msg
    return msg


# -- lesson 02: MyZeRO1 ----------------------------------------------------------------------------
class _ZeRO1(ZeRO1):
    """The solution of lesson 02's MyZeRO1; ``world``/``rs_group``/``ag_group``: the mistakes."""

    def world_(self):
        return self.world

    def rs_group(self):
        return {"group": self.group}

    ag_group = rs_group

    def finish_grad_sync(self):
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        for flat, chunk in zip(self.grad_buffers, chunks, strict=True):
            before = divides_before_sum(flat)  # fp16
            if before:
                flat.div_(self.world_())
            reduce_scatter(chunk, flat, **self.rs_group())
            if not before:
                chunk.div_(self.world_())
        return chunks

    def after_step(self):
        with torch.no_grad():
            for b, master, flat in zip(
                self.buckets, self.optim_params, self.flat_params, strict=True
            ):
                own = b.chunk(flat, self.rank)
                if self.precision.master:
                    own.copy_(master)
                all_gather(flat, own, **self.ag_group())


class _ZeRO1TwoRanks(_ZeRO1):
    def world_(self):
        return 2


class _ZeRO1NoGroupRS(_ZeRO1):
    def rs_group(self):
        return {}


class _ZeRO1NoGroupAG(_ZeRO1):
    def ag_group(self):
        return {}


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_zero1_solution_passes(capsys):
    lesson02.check_zero1(_ZeRO1, 2)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "has"),
    [
        (_ZeRO1TwoRanks, ("Yours is 1.50x", TWO_RANKS)),
        (_ZeRO1NoGroupRS, ("on a subgroup", "reduce_scatter", NO_GROUP)),
        (_ZeRO1NoGroupAG, ("on a subgroup", "all_gather", NO_GROUP)),
    ],
)
def test_zero1_rejects(wrong, has):
    _rejects(lesson02.check_zero1, wrong, *has)


# -- lesson 03: MyZeRO2 ----------------------------------------------------------------------------
class _ZeRO2TwoRanks(ZeRO2):
    def finish_in_flight(self):
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            self.grad_shards[b.index].add_(out.div_(2))  # "two GPUs on my desk"
            self.in_flight = None


class _ZeRO2NeverWaits(ZeRO2):
    def finish_in_flight(self):
        if self.in_flight is not None:
            b, _work, _buf, out = self.in_flight  # the reduce-scatter is never waited for
            self.grad_shards[b.index].add_(out / self.world)
            self.in_flight = None


class _ZeRO2(ZeRO2):
    """Lesson 03's finish_in_flight, dividing in place before the add (a right answer)."""

    def finish_in_flight(self):
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            if not divides_before_sum(out):  # fp16: reduce_bucket divided before the sum
                out.div_(self.world)
            self.grad_shards[b.index].add_(out)
            self.in_flight = None


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_zero2_solution_passes(capsys):
    lesson03.check_zero2(_ZeRO2, 2)
    assert "PASS" in capsys.readouterr().out


def test_zero2_rejects_a_hard_coded_two():
    _rejects(lesson03.check_zero2, _ZeRO2TwoRanks, "Yours is 1.50x", TWO_RANKS)


# -- lesson 04: MyZeRO3 (gather / free) and PrefetchZeRO3 ------------------------------------------
class _ZeRO3(ZeRO3):
    """The solution of lesson 04's MyZeRO3; ``start`` is where the mistakes go."""

    def start(self, i, flat):
        return all_gather(flat, self.param_shards[i], group=self.group, async_op=True,
                          tag=f"zero3 params {i}")  # fmt: skip

    def gather(self, i, wait=True):
        if not self.gathered[i]:
            flat = self.flat_params[i]
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            self.gather_works[i] = self.start(i, flat)
            self.gathered[i] = True
        if wait and self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None
        self.max_gathered = max(self.max_gathered, sum(self.gathered))

    def free(self, i):
        if self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None
        self.flat_params[i].untyped_storage().resize_(0)
        self.gathered[i] = False


class _Done:
    def wait(self):
        return True


class _BlockingGather(_ZeRO3):
    def start(self, i, flat):
        all_gather(flat, self.param_shards[i], group=self.group, tag=f"zero3 params {i}")
        return _Done()  # blocking: the hook that prefetches waits for it anyway


class _GatherNoGroup(_ZeRO3):
    def start(self, i, flat):
        return all_gather(flat, self.param_shards[i], async_op=True, tag=f"zero3 params {i}")


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_zero3_gather_solution_passes():
    lesson04.check_zero3_gather(_ZeRO3, 2)


@pytest.mark.parametrize(
    ("wrong", "has"),
    [
        (_BlockingGather, ("was blocking", "async_op=True")),
        (_GatherNoGroup, ("on a subgroup", NO_GROUP)),
    ],
)
def test_zero3_gather_rejects(wrong, has):
    _rejects(lesson04.check_zero3_gather, wrong, *has)


class _PrefetchFirst(ZeRO3):
    """Prefetch issued before the gather of the units the module needs now."""

    def pre_forward(self, m, args):
        if self.recording and m not in self.order:
            self.order.append(m)
        for i in self.neighbour(m, +self.prefetch):
            self.gather(i, wait=False)
        for i in self.units_of[m]:
            self.gather(i)

    def pre_backward(self, m):
        self.queue_backward_end()
        for i in self.neighbour(m, -self.prefetch):
            if not self.started[i]:
                self.gather(i, wait=False)
        for i in self.units_of[m]:
            self.gather(i)


class _PrefetchBlocking(_BlockingGather):
    pass


@pytest.mark.parametrize(
    ("wrong", "has"),
    [
        (_PrefetchFirst, ("was issued before", "the unit this module needs now")),
        (_PrefetchBlocking, ("was blocking", "async_op=True")),
    ],
)
def test_zero3_prefetch_rejects(wrong, has):
    _rejects(lesson04.check_zero3_prefetch, wrong, *has)


class _WastedBackwardGathers(ZeRO3):
    """Backward prefetches its neighbour without asking whether its backward is over."""

    def pre_backward(self, m):
        self.queue_backward_end()
        for i in self.units_of[m]:
            self.gather(i)
        for i in self.neighbour(m, -self.prefetch):
            self.gather(i, wait=False)  # self.started[i] not asked


def test_zero3_prefetch_rejects_wasted_backward_gathers():
    _rejects(
        lesson04.check_zero3_prefetch,
        _WastedBackwardGathers,
        "a model whose first layer runs twice",
        "gathered after its backward was over",
        "self.started[i]",
    )


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_zero3_prefetch_solution_passes(capsys):
    lesson04.check_zero3_prefetch(ZeRO3, 2)  # its pre_forward / pre_backward: the lesson's solution
    assert "PASS" in capsys.readouterr().out
