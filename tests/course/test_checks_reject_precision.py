"""Lessons 02-04 in every precision: the ZeRO checks train the student's class in bf16, fp16 and
bf16 reduced in fp32 against minizero's class in the same policy, bit for bit
(``compare_zero.compare_precision``). Each class below is a lesson's solution with one mistake
that only a 16-bit policy shows: dividing twice, dividing never, a bucket in the parameter's dtype
where the policy reduces in another. The check must fail, naming the policy and the factor."""

from __future__ import annotations

import pytest
import torch

from minizero.collectives import reduce_scatter
from minizero.course.checks import CheckFailed, lesson02, lesson03
from minizero.precision import divides_before_sum
from minizero.zero1 import ZeRO1
from minizero.zero2 import ZeRO2

pytestmark = pytest.mark.slow


def _rejects(check, wrong, *has: str) -> str:
    with pytest.raises(CheckFailed) as e:
        check(wrong, 2)
    msg = str(e.value)
    for part in has:
        assert part in msg, msg
    return msg


# -- lesson 02: MyZeRO1.finish_grad_sync -----------------------------------------------------------
class _ZeRO1Twice(ZeRO1):
    """Divides before the sum in fp16, as it should, and after it in every dtype."""

    def finish_grad_sync(self):
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        for flat, chunk in zip(self.grad_buffers, chunks, strict=True):
            if divides_before_sum(flat):
                flat.div_(self.world)
            reduce_scatter(chunk, flat, group=self.group)
            chunk.div_(self.world)
        return chunks


class _ZeRO1Never(ZeRO1):
    """Divides after the sum where it should, and forgets the fp16 division before it."""

    def finish_grad_sync(self):
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        for flat, chunk in zip(self.grad_buffers, chunks, strict=True):
            reduce_scatter(chunk, flat, group=self.group)
            if not divides_before_sum(flat):
                chunk.div_(self.world)
        return chunks


class _ZeRO1AfterInFp16(ZeRO1):
    """Divides after the sum in every dtype: right in value, one fp16 rounding off (and an fp16
    sum of N loss-scaled gradients can overflow)."""

    def finish_grad_sync(self):
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        for flat, chunk in zip(self.grad_buffers, chunks, strict=True):
            reduce_scatter(chunk, flat, group=self.group)
            chunk.div_(self.world)
        return chunks


def test_zero1_rejects_dividing_twice_in_fp16():
    _rejects(
        lesson02.check_zero1,
        _ZeRO1Twice,
        "under precision='fp16', step 0, rank 0, bucket 0: your gradient shards are 0.33x "
        "minizero's (1/3): divided by the world twice?",
        "divides_before_sum",
    )


def test_zero1_rejects_dividing_never_in_fp16():
    _rejects(
        lesson02.check_zero1,
        _ZeRO1Never,
        "under precision='fp16'",
        "your gradient shards are 3.00x minizero's: divided by the world never?",
    )


def test_zero1_rejects_dividing_after_the_fp16_sum():
    _rejects(
        lesson02.check_zero1,
        _ZeRO1AfterInFp16,
        "under precision='fp16'",
        "1.00x minizero's, but not bit for bit",
        "fp16's rounding",
        "flat.div_(self.world) before the reduce-scatter",
    )


# -- lesson 03: MyZeRO2 ----------------------------------------------------------------------------
class _ZeRO2Twice(ZeRO2):
    """Lesson 03's solution as it was: divides the reduced chunk in every dtype, although
    reduce_bucket (inherited) divided an fp16 bucket before the sum."""

    def finish_in_flight(self):
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            self.grad_shards[b.index].add_(out.div_(self.world))
            self.in_flight = None


class _ZeRO2BufferInParamDtype(ZeRO2):
    """The bucket made in p.grad's dtype (bf16), where the policy reduces in fp32."""

    def post_accumulate_grad_hook(self, p):
        b = self.bucket_of(p)
        self.queue_backward_end()
        buf = self.filling[b.index]
        if buf is None:
            buf = torch.zeros(b.padded, dtype=p.grad.dtype, device=p.grad.device)
            self.filling[b.index] = buf
        b.view(buf, p).copy_(p.grad)
        p.grad = None
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_bucket(b)


def test_zero2_rejects_dividing_an_fp16_bucket_twice():
    _rejects(
        lesson03.check_zero2,
        _ZeRO2Twice,
        "under precision='fp16', step 0, rank 0, bucket 0: your gradient shards are 0.33x "
        "minizero's (1/3): divided by the world twice?",
        "divide out by self.world only if not divides_before_sum(out)",
    )


def test_zero2_rejects_a_bucket_in_the_parameters_dtype_where_the_policy_reduces_in_fp32():
    _rejects(
        lesson03.check_zero2,
        _ZeRO2BufferInParamDtype,
        "under precision='bf16 reduced in fp32'",
        "1.00x minizero's, but not bit for bit",
        "self.precision.reduce_dtype",
    )
