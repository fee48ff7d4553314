"""Wrong answers that only a world of 3 ranks, a subgroup, or the ledger's timeline can expose.

Every check runs the student's code on 3 ranks (a hard-coded 2 then differs from the world size)
and, where the exercise takes a process group, again on the subgroup [0, 1] of those 3 ranks
(rank 2 outside it), under ``CommLedger(only_group=group)``: a collective on the default group is
refused before it is issued. Each wrong answer below is the solved exercise with one mistake
written in; the check must fail and name that mistake.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from minizero.bucket import make_buckets
from minizero.collectives import all_gather, all_reduce, broadcast, mark, reduce_scatter
from minizero.course.checks import CheckFailed, lesson00, lesson01

TWO_RANKS = "your code assumed 2 ranks: use self.world / dist.get_world_size(group)"
NO_GROUP = "a collective ran on the default group: pass group=self.group"


def _rejects(check, wrong, *has: str) -> str:
    with pytest.raises(CheckFailed) as e:
        check(wrong, 2)  # NPROCS = 2, as on a CPU: the check itself runs on 3 ranks
    msg = str(e.value)
    for part in has:
        assert part in msg, msg
    return msg


# -- lesson 00 -------------------------------------------------------------------------------------
def _rs_ag(t, group=None, *, world=None, pass_group=True, divide=False):
    """The solution of lesson 00, with one mistake selectable."""
    world = world or dist.get_world_size(group)
    n = t.numel()
    shard = -(-n // world)
    flat = torch.zeros(world * shard, dtype=t.dtype, device=t.device)
    flat[:n] = t.reshape(-1)
    chunk = torch.empty(shard, dtype=t.dtype, device=t.device)
    g = {"group": group} if pass_group else {}
    reduce_scatter(chunk, flat, **g)
    all_gather(flat, chunk, **g)
    t.copy_(flat[:n].view_as(t))
    if divide:
        t.div_(world)
    return t


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_rs_ag_solution_passes(capsys):
    lesson00.check_all_reduce_via_rs_ag(_rs_ag, 2)
    assert "on the subgroup [0, 1]" in capsys.readouterr().out


def test_rs_ag_rejects_a_hard_coded_two():
    # it raises: no evidence of a 2 (a result off by 3/2 would be), so the check asks
    _rejects(lesson00.check_all_reduce_via_rs_ag, lambda t, group=None: _rs_ag(t, group, world=2),
             "world size 3", "if your code assumes 2, use self.world")  # fmt: skip


def test_rs_ag_rejects_a_dropped_group():
    _rejects(
        lesson00.check_all_reduce_via_rs_ag,
        lambda t, group=None: _rs_ag(t, group, pass_group=False),
        "on a subgroup (ranks [0, 1] of a 3-rank world",
        NO_GROUP,
    )


def test_rs_ag_averaging_gets_a_hint_about_averaging_not_padding():
    msg = _rejects(
        lesson00.check_all_reduce_via_rs_ag,
        lambda t, group=None: _rs_ag(t, group, divide=True),
        "Yours is the average",
        "all-reduce SUMS",
    )
    assert "pad" not in msg, msg


# -- lesson 01, naive DDP --------------------------------------------------------------------------
def _naive(model, group=None, *, world=None, pass_group=True):
    world = world or dist.get_world_size(group)
    for p in model.parameters():
        if pass_group:
            all_reduce(p.grad, group=group)
        else:
            all_reduce(p.grad)
        p.grad.div_(world)


def test_naive_ddp_rejects_a_hard_coded_two():
    _rejects(lesson01.check_allreduce_gradients, lambda m, group=None: _naive(m, group, world=2),
             "Yours is 1.50x the reference (= 3/2)", TWO_RANKS)  # fmt: skip


def test_naive_ddp_rejects_a_dropped_group():
    wrong = lambda m, group=None: _naive(m, group, pass_group=False)
    _rejects(lesson01.check_allreduce_gradients, wrong, "on a subgroup", NO_GROUP)


# -- lesson 01, bucketed DDP -----------------------------------------------------------------------
class _Buckets(torch.nn.Module):
    """The solution of lesson 01's BucketedDDP; subclasses below write one mistake each."""

    def __init__(self, module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world = self.world_size(group)
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in params:
                broadcast(p.detach(), src=0, group=group, tag="initial weights")
        self.buckets = make_buckets(params, bucket_cap_mb)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.flat = [torch.zeros(b.numel, device=b.params[0].device) for b in self.buckets]
        self.pending = [len(b.params) for b in self.buckets]
        self.works = []
        self._finish_queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self.post_accumulate_grad_hook)

    def world_size(self, group) -> int:
        return dist.get_world_size(group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def start(self, flat: torch.Tensor, b):
        return all_reduce(flat, group=self.group, async_op=True, tag=f"bucket {b.index}")

    def post_accumulate_grad_hook(self, param) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self.bucket_of[param]
        b.view(self.flat[b.index], param).copy_(param.grad)
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.works.append((b, self.start(self.flat[b.index], b)))

    def _finish(self) -> None:
        self._finish_queued = False
        mark("backward end")
        for b, work in self.works:
            work.wait()
            flat = self.flat[b.index].div_(self.world)
            for p in b.params:
                p.grad.copy_(b.view(flat, p))
        self.works.clear()
        self.pending = [len(b.params) for b in self.buckets]


class _TwoRanks(_Buckets):
    def world_size(self, group) -> int:
        return 2  # "the world is 2 ranks": it is on a laptop


class _NoGroup(_Buckets):
    def start(self, flat, b):
        return all_reduce(flat, async_op=True, tag=f"bucket {b.index}")  # group= left out


class _WaitsAtOnce(_Buckets):
    def start(self, flat, b):
        work = all_reduce(flat, group=self.group, async_op=True, tag=f"bucket {b.index}")
        work.wait()  # right after issuing: backward stops here until the bucket is reduced
        return work


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_bucketed_ddp_solution_passes():
    lesson01.check_bucketed_ddp(_Buckets, 2)


@pytest.mark.parametrize(
    ("wrong", "has"),
    [
        (_TwoRanks, ("Yours is 1.50x", TWO_RANKS)),
        (_NoGroup, ("on a subgroup", NO_GROUP)),
        (_WaitsAtOnce, ("you wait for each all-reduce right after issuing it", "wait in the "
                        "backward-end hook")),
    ],
)  # fmt: skip
def test_bucketed_ddp_rejects(wrong, has):
    _rejects(lesson01.check_bucketed_ddp, wrong, *has)


# -- lesson 02 (fp16 step) and lesson 03 (clipping): functions given a group ---------------------
def _fp16_step(optimizer, masters, scale, group=None, *, pass_group=True):
    found = torch.zeros(1, device=masters[0].device)
    for m in masters:
        m.grad.div_(scale)
        found += (~torch.isfinite(m.grad)).sum()
    all_reduce(found, **({"group": group} if pass_group else {}))
    if found.item() == 0:
        optimizer.step()
        return scale
    return scale / 2


def _clip(shards, valid, max_norm, group=None, *, pass_group=True):
    sq = sum(s[:n].float().pow(2).sum() for s, n in zip(shards, valid, strict=True)).reshape(1)
    all_reduce(sq, **({"group": group} if pass_group else {}))
    norm = sq.sqrt()
    for s in shards:
        s.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_fp16_step_and_clip_solutions_pass(capsys):
    from minizero.course.checks import lesson02, lesson03

    lesson02.check_fp16_step(_fp16_step, 2)
    lesson03.check_clip_grad_norm(_clip, 2)
    out = capsys.readouterr().out
    assert out.count("and the subgroup [0, 1]") == 2, out


def test_fp16_step_rejects_a_dropped_group():
    from minizero.course.checks import lesson02

    wrong = lambda o, m, s, group=None: _fp16_step(o, m, s, group, pass_group=False)
    _rejects(lesson02.check_fp16_step, wrong, "on a subgroup", NO_GROUP)


def test_clip_rejects_a_dropped_group():
    from minizero.course.checks import lesson03

    wrong = lambda sh, v, mx, group=None: _clip(sh, v, mx, group, pass_group=False)
    _rejects(lesson03.check_clip_grad_norm, wrong, "on a subgroup", NO_GROUP)
