"""Every exercise's check rejects plausible wrong solutions, with a message naming what is wrong.

One or more wrong answers per exercise of lessons 00-04, each the mistake a student really makes
(a missing average, a local inf check, a copy where a view is needed, a free under an all-gather
in flight...); the check must raise ``CheckFailed`` and say that mistake. Lessons 00 and 01 have
more in ``test_notebooks.py``. Each check runs on 3 gloo ranks (NPROCS 2, raised to 3).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from minizero.bucket import Bucket
from minizero.collectives import all_gather, all_reduce, reduce_scatter
from minizero.course.checks import (
    CheckFailed,
    common_zero,
    compare_zero,
    lesson00,
    lesson01,
    lesson02,
    lesson03,
    lesson04,
)
from minizero.zero1 import ZeRO1
from minizero.zero2 import ZeRO2
from minizero.zero3 import ZeRO3


def _rejects(check, wrong, *, starts: str = "", has: tuple[str, ...] = ()) -> str:
    with pytest.raises(CheckFailed) as e:
        check(wrong, 2) if check is not lesson02.check_bucket else check(wrong)
    msg = str(e.value)
    assert msg.startswith(starts), msg
    for part in has:
        assert part in msg, msg
    return msg


# -- lesson 00 -------------------------------------------------------------------------------------
def _sum_not_in_place(t, group=None):
    out = t.clone()
    all_reduce(out, group=group)  # right sum, wrong place, and not via RS + AG either
    return out


def test_all_reduce_via_rs_ag_rejects_a_copy_that_leaves_t_unchanged():
    _rejects(
        lesson00.check_all_reduce_via_rs_ag,
        _sum_not_in_place,
        has=("returned the right sum", "left `t` unchanged", "in place"),
    )


# -- lesson 01 -------------------------------------------------------------------------------------
def _averages_the_weights(model, group=None):
    world = dist.get_world_size(group)
    for p in model.parameters():
        all_reduce(p.data, group=group)  # the parameter, not its gradient
        p.data.div_(world)


def test_naive_ddp_rejects_averaging_the_weights():
    _rejects(
        lesson01.check_allreduce_gradients,
        _averages_the_weights,
        starts="step 0, rank 0: parameters ['layers.0.weight'",
        has=("changed during backward", "Only gradients may be communicated"),
    )


class _BlockingBuckets(torch.nn.Module):
    """Buckets filled by the hooks, but each all-reduce blocks inside the hook."""

    def __init__(self, module, bucket_cap_mb=25, group=None):
        super().__init__()
        from minizero.bucket import make_buckets

        self.module, self.world = module, dist.get_world_size(group)
        self.buckets = make_buckets(list(module.parameters()), bucket_cap_mb)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.pending = [len(b.params) for b in self.buckets]
        self.queued = False
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args):
        return self.module(*args)

    def _hook(self, p):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self.bucket_of[p]
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            flat = torch.cat([q.grad.reshape(-1) for q in b.params])
            all_reduce(flat)  # blocking: backward stops until it is done
            for q in b.params:
                q.grad.copy_(b.view(flat, q) / self.world)

    def _finish(self):
        from minizero.collectives import mark

        self.queued = False
        mark("backward end")
        self.pending = [len(b.params) for b in self.buckets]


def test_bucketed_ddp_rejects_blocking_all_reduces():
    _rejects(lesson01.check_bucketed_ddp, _BlockingBuckets, has=("were blocking", "async_op=True"))


# -- lesson 02: the layout -------------------------------------------------------------------------
class _FloorShard(Bucket):
    def __init__(self, params, index, world=1):
        super().__init__(params, index, world)
        self.shard = self.numel // world  # rounds down: the last elements belong to no rank
        self.padded = self.shard * world


class _ChunkCopy(Bucket):
    def chunk(self, flat, rank):
        return flat[rank * self.shard : (rank + 1) * self.shard].clone()


class _NoPadding(Bucket):
    def flatten(self, tensors, dtype=None):
        return torch.cat([t.reshape(-1) for t in tensors]).to(dtype or tensors[0].dtype)


class _ViewNotShaped(Bucket):
    def view(self, flat, p):
        i = self._slot[id(p)]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()]


def test_bucket_layout_rejects_floor_copies_missing_padding_and_flat_views():
    _rejects(
        lesson02.check_bucket,
        _FloorShard,
        starts="shard = 612 for parameters of shapes",
        has=("expected ceil(1837 / 3) = 613", "rounded down", "round up"),
    )
    _rejects(
        lesson02.check_bucket,
        _ChunkCopy,
        starts="chunk(flat, 0) returned a copy",
        has=("return a slice",),
    )
    _rejects(
        lesson02.check_bucket,
        _NoPadding,
        starts="flatten(tensors) returned (1837,)",
        has=("expected (1839,)", "one (padded,) buffer"),
    )
    _rejects(
        lesson02.check_bucket,
        _ViewNotShaped,
        starts="view(flat, params[2]) has shape (203,)",
        has=("shaped like the parameter, (7, 29)",),
    )


# -- lesson 02: stage 1 ----------------------------------------------------------------------------
class _SumNotAverage(ZeRO1):
    def finish_grad_sync(self):
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        for flat, chunk in zip(self.grad_buffers, chunks, strict=True):
            reduce_scatter(chunk, flat, group=self.group)  # the sum: no division by N
        return chunks


class _NoMasterCopy(ZeRO1):
    def after_step(self):
        with torch.no_grad():
            for b, flat in zip(self.buckets, self.flat_params, strict=True):
                all_gather(flat, b.chunk(flat, self.rank), group=self.group)  # masters ignored


@pytest.mark.slow
def test_zero1_rejects_a_sum_and_a_forgotten_master():
    _rejects(
        lesson02.check_zero1,
        _SumNotAverage,
        starts="step 0, rank 0, bucket 0: the averaged gradient the optimizer stepped with",
        has=("Yours is 3.00x", "divide by 3"),
    )
    _rejects(
        lesson02.check_zero1,
        _NoMasterCopy,
        starts="bf16, step 0, rank 0: parameter",
        has=(
            "from the fp32 master the optimizer stepped",
            "separate fp32 master (self.optim_params[i])",
        ),
    )


# -- lesson 02: the fp16 step ----------------------------------------------------------------------
def _local_inf_check(optimizer, masters, scale, group=None):
    for m in masters:
        m.grad.div_(scale)
    if all(torch.isfinite(m.grad).all() for m in masters):  # this rank's shards only
        optimizer.step()
        return scale
    return scale / 2


def _isinf_only(optimizer, masters, scale, group=None):
    found = torch.zeros(1)
    for m in masters:
        m.grad.div_(scale)
        found += torch.isinf(m.grad).sum()  # a NaN is not an inf
    all_reduce(found, group=group)
    if found.item():
        return scale / 2
    optimizer.step()
    return scale


def _flag_per_shard(optimizer, masters, scale, group=None):
    found = 0.0
    for m in masters:
        m.grad.div_(scale)
        flag = (~torch.isfinite(m.grad)).sum().float().reshape(1)
        all_reduce(flag, group=group)  # one collective per shard
        found += flag.item()
    if found:
        return scale / 2
    optimizer.step()
    return scale


def _still_scaled(optimizer, masters, scale, group=None):
    found = torch.zeros(1)
    for m in masters:
        found += (~torch.isfinite(m.grad)).sum()
    all_reduce(found, group=group)
    if found.item():
        return scale / 2
    optimizer.step()  # with loss * scale's gradient
    return scale


def _never_halves(optimizer, masters, scale, group=None):
    found = torch.zeros(1)
    for m in masters:
        m.grad.div_(scale)
        found += (~torch.isfinite(m.grad)).sum()
    all_reduce(found, group=group)
    if not found.item():
        optimizer.step()
    return scale


def test_fp16_step_rejects_local_checks_isinf_many_collectives_scaled_grads_and_a_fixed_scale():
    _rejects(
        lesson02.check_fp16_step,
        _local_inf_check,
        starts="_local_inf_check issued no collective with every gradient finite",
        has=("the ranks must agree", "one all_reduce"),
    )
    _rejects(
        lesson02.check_fp16_step,
        _isinf_only,
        starts="_isinf_only with a NaN in rank 0's shard (rank 0 of 3",
        has=("stepped with a NaN", "torch.isinf does not see a NaN"),
    )
    _rejects(
        lesson02.check_fp16_step,
        _flag_per_shard,
        starts="_flag_per_shard issued ['all_reduce', 'all_reduce', 'all_reduce']",
        has=("all-reduce once",),
    )
    _rejects(
        lesson02.check_fp16_step,
        _still_scaled,
        has=("stepped with the scaled gradient", "divide every m.grad by scale"),
    )
    _rejects(
        lesson02.check_fp16_step,
        _never_halves,
        has=("returned scale 1024.0 with an inf in the last rank's shard", "halve it (512)"),
    )


# -- lesson 03: stage 2 ----------------------------------------------------------------------------
class _CopyNotAdd(ZeRO2):
    def finish_in_flight(self):
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            self.grad_shards[b.index].copy_(out.div_(self.world))  # the last backward wins
            self.in_flight = None


class _KeepsGrad(ZeRO2):
    def post_accumulate_grad_hook(self, p):
        b = self.bucket_of(p)
        self.queue_backward_end()
        buf = self.filling[b.index]
        if buf is None:
            buf = self.filling[b.index] = torch.zeros(b.padded, dtype=p.grad.dtype)
        b.view(buf, p).copy_(p.grad)  # p.grad kept: the full gradient stays alive
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_bucket(b)


class _Fp32Buffers(ZeRO2):
    def post_accumulate_grad_hook(self, p):
        b = self.bucket_of(p)
        self.queue_backward_end()
        buf = self.filling[b.index]
        if buf is None:
            buf = self.filling[b.index] = torch.zeros(b.padded)  # float32, whatever p.grad is
        b.view(buf, p).copy_(p.grad)
        p.grad = None
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_bucket(b)

    def finish_in_flight(self):
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            self.grad_shards[b.index].add_(out.div_(self.world).to(self.grad_shards[b.index]))
            self.in_flight = None


@pytest.mark.slow
def test_zero2_rejects_copy_for_add_a_kept_grad_and_fp32_buffers_in_bf16():
    _rejects(
        lesson03.check_zero2,
        _CopyNotAdd,
        starts="step 1, rank 0, bucket 0: the averaged gradient",
        has=("add, not copy",),
    )
    _rejects(
        lesson03.check_zero2,
        _KeepsGrad,
        starts="fp32, rank 0, backward 0: after their gradient hook",
        has=("still hold a full gradient in p.grad", "p.grad = None"),
    )
    _rejects(  # float64 gradients through float32 buffers: off by float32's rounding
        lesson03.check_zero2,
        _Fp32Buffers,
        has=("float32's rounding", "in the policy's reduce dtype (self.precision.reduce_dtype)"),
    )


# -- lesson 03: clipping ---------------------------------------------------------------------------
def _norm_with_padding(shards, valid, max_norm, group=None):
    sq = sum(s.pow(2).sum() for s in shards).reshape(1)  # padding included
    all_reduce(sq, group=group)
    norm = sq.sqrt()
    for s in shards:
        s.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _local_norm(shards, valid, max_norm, group=None):
    sq = sum(s[:n].pow(2).sum() for s, n in zip(shards, valid)).reshape(1)
    norm = sq.sqrt()
    all_reduce(torch.zeros(1), group=group)  # a collective, but not of the squares
    for s in shards:
        s.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _sum_of_norms(shards, valid, max_norm, group=None):
    norm = sum(s[:n].pow(2).sum() for s, n in zip(shards, valid)).sqrt().reshape(1)
    all_reduce(norm, group=group)  # norms do not add
    for s in shards:
        s.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _reduce_per_shard(shards, valid, max_norm, group=None):
    total = torch.zeros(1)
    for s, n in zip(shards, valid):
        sq = s[:n].pow(2).sum().reshape(1)
        all_reduce(sq, group=group)
        total += sq
    norm = total.sqrt()
    for s in shards:
        s.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def _always_scales(shards, valid, max_norm, group=None):
    sq = sum(s[:n].pow(2).sum() for s, n in zip(shards, valid)).reshape(1)
    all_reduce(sq, group=group)
    norm = sq.sqrt()
    for s in shards:
        s.mul_(max_norm / (norm + 1e-6))  # no clamp: scales up below max_norm
    return norm


def test_clip_rejects_padding_local_norms_summed_norms_many_collectives_and_scaling_up():
    _rejects(
        lesson03.check_clip_grad_norm,
        _norm_with_padding,
        starts="_norm_with_padding returned norm",
        has=("It counts the padding", "first valid[i] elements"),
    )
    _rejects(
        lesson03.check_clip_grad_norm,
        _local_norm,
        starts="_local_norm returned norm",
        has=("the norm of rank 0's own shards",),
    )
    _rejects(
        lesson03.check_clip_grad_norm,
        _sum_of_norms,
        has=("the sum of the ranks' norms", "squares do"),
    )
    _rejects(
        lesson03.check_clip_grad_norm,
        _reduce_per_shard,
        starts="_reduce_per_shard issued ['all_reduce', 'all_reduce'",
        has=("then one all_reduce",),
    )
    _rejects(
        lesson03.check_clip_grad_norm,
        _always_scales,
        has=("the norm is below max_norm", "min(1, max_norm / (norm + 1e-6))"),
    )


# -- lesson 04 -------------------------------------------------------------------------------------
class _FreeUnderAGather(ZeRO3):
    def free(self, i):
        self.flat_params[i].untyped_storage().resize_(0)  # the gather in flight is not waited
        self.gathered[i] = False
        self.gather_works[i] = None


class _WaitsOnlyForItsOwn(ZeRO3):
    def gather(self, i, wait=True):
        if not self.gathered[i]:
            flat = self.flat_params[i]
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            self.gather_works[i] = all_gather(flat, self.param_shards[i], group=self.group,
                                          async_op=True, tag=f"zero3 params {i}")  # fmt: skip
            self.gathered[i] = True
            if wait:  # a prefetched gather (started with wait=False) is never waited for here
                self.gather_works[i].wait()
                self.gather_works[i] = None
        self.max_gathered = max(self.max_gathered, sum(self.gathered))


class _NeverFills(ZeRO3):
    def gather(self, i, wait=True):
        if not self.gathered[i]:
            flat = self.flat_params[i]
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            flat.fill_(float("nan"))  # room made (as uninitialised memory), nothing gathered
            self.gathered[i] = True
        if wait and self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None
        self.max_gathered = max(self.max_gathered, sum(self.gathered))


@pytest.mark.slow
def test_zero3_gather_rejects_a_free_under_a_gather_and_an_unwaited_prefetch_and_nan():
    _rejects(
        lesson04.check_zero3_gather,
        _FreeUnderAGather,
        starts="rank 0: free(0) resized unit 0's storage to 0 bytes while its all-gather",
        has=("neither waited for nor kept", "Wait for self.gather_works[i] first"),
    )
    _rejects(
        lesson04.check_zero3_gather,
        _WaitsOnlyForItsOwn,
        has=("(wait=True) returned while unit 0's all-gather, started by a prefetch",),
    )
    _rejects(
        lesson04.check_zero3_gather,
        _NeverFills,
        starts="step 0, rank 0: the forward gave loss nan",
        has=("not finite", "all-gather self.param_shards[i] into self.flat_params[i]"),
    )


class _OnDemand(ZeRO3):
    def pre_forward(self, m, args):
        if self.recording and m not in self.order:
            self.order.append(m)
        for i in self.units_of[m]:
            self.gather(i)  # no prefetch

    def pre_backward(self, m):
        self.queue_backward_end()
        for i in self.units_of[m]:
            self.gather(i)


class _PrefetchesTheWrongWay(ZeRO3):
    def pre_backward(self, m):
        self.queue_backward_end()
        for i in self.units_of[m]:
            self.gather(i)
        for i in self.neighbour(m, +self.prefetch):  # forward's next: backward is over there
            self.gather(i, wait=False)


@pytest.mark.slow
def test_zero3_prefetch_rejects_gathering_on_demand_and_prefetching_finished_units():
    _rejects(
        lesson04.check_zero3_prefetch,
        _OnDemand,
        starts="step 1, forward of layers.0: its all-gather was on demand (minizero's ZeRO3: "
        "prefetched)",
    )
    _rejects(
        lesson04.check_zero3_prefetch,
        _PrefetchesTheWrongWay,
        starts="step 1, backward of layers.2: its all-gather was on demand",
        has=("the previous module in the recorded order: self.neighbour(m, -self.prefetch)",),
    )


# -- what the comparisons do with NaN --------------------------------------------------------------
def test_a_nan_loss_or_parameter_is_a_difference():
    assert not compare_zero.close(math.nan, 1.0, 1e-4, 1e-6)
    assert not compare_zero.close(1.0, math.inf, 1e-4, 1e-6)
    assert compare_zero.close(1.0 + 1e-7, 1.0, 1e-4, 1e-6)
    layout = [{"shard": 2, "params": [("w", 0, 3)]}]
    ref = {
        "loss": [1.0] * common_zero.STEPS,
        "seen": [[torch.ones(2)]] * common_zero.STEPS,
        "params": [{"w": torch.ones(3)}] * common_zero.STEPS,
        "layout": layout,
    }
    mine = {**ref, "loss": [math.nan] + [1.0] * (common_zero.STEPS - 1)}
    with pytest.raises(CheckFailed, match=r"^step 0, rank 0: the forward gave loss nan, ref 1:"):
        compare_zero.compare(mine, {"ref": ref}, "ref", 0, 2, shards="")
    mine = {**ref, "params": [{"w": torch.tensor([1.0, math.nan, 1.0])}] * common_zero.STEPS}
    with pytest.raises(CheckFailed, match=r"^step 0, rank 0, parameter 'w' after"):
        compare_zero.compare(mine, {"ref": ref}, "ref", 0, 2, shards="")
    mine = {**ref, "seen": [[torch.tensor([1.0, math.nan])]] * common_zero.STEPS}
    with pytest.raises(CheckFailed, match=r"chunk element 1 = element 1 of 'w': yours nan"):
        compare_zero.compare(mine, {"ref": ref}, "ref", 0, 2, shards="")
