"""The collectives every stage calls. Taught in lesson 0 (lessons/00_collectives.ipynb).

Thin wrappers over ``torch.distributed`` (``all_reduce``, ``reduce_scatter``, ``all_gather``,
``broadcast``, ZeRO++'s ``all_to_all``): every stage talks to the other ranks through these only,
so a ``CommLedger`` (minizero/analysis/ledger.py, which counts, times and orders the calls in the
ZeRO paper's volumes) opened around a step sees every byte it moves. While a ledger is open each
call goes through its ``recorder``; otherwise nothing but torch.distributed runs. On gloo,
``reduce_scatter`` sends each chunk to its owner, who sums: PyTorch's ProcessGroupGloo
all-reduces a clone of the input instead, twice the bytes (lesson 00 measures both); and
``all_gather`` sends this rank's chunk to every other rank and receives theirs in place, the same
bytes as gloo's own ``all_gather_into_tensor`` in 0.4-0.9 of its time. Both are sends and
receives (:func:`_exchange`); docs/results.md has the measurements.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives and warns on the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# While a ledger is open: analysis/ledger.py's OpenLedgers (its issue(op, fn, payload, numel, group,
# async_op, tag, src) and mark(label)); None: no bookkeeping at all.
recorder = None


def mark(label: str) -> None:
    """Label the timeline of every open ledger (no-op when none is open)."""
    if recorder is not None:
        recorder.mark(label)


def _run(op: str, fn, io: tuple, group, async_op: bool, tag: str, src=0, then=None):
    """``fn(async_op)``, then ``then()`` (gloo); ``io``: its tensors, ``io[0]`` the one recorded."""
    if dist.get_backend(group) == "gloo":  # a clean exit (below)
        fn = partial(released, fn, io, then=then)
    if recorder is None:
        return fn(async_op)
    return recorder.issue(op, fn, io[0], io[0].numel(), group, async_op, tag, src)


# -- a clean exit (a script that trained to the end must exit 0, not abort): gloo's worker thread
# lets go of a collective's tensors a moment after wait() has returned. A tensor the caller dropped
# by then (a temporary: a chunk view, a shard) is freed on that thread, which takes the GIL; at the
# end of a script the group outlives destroy_process_group() (torch's own modules hold it), and a
# free during the interpreter's finalisation aborts the finished process ("terminate called without
# an active exception", SIGABRT). So on gloo a collective (or its wait()) returns only once the
# worker holds none of its tensors.
SETTLE_S = 0.2  # at most this long per collective (measured: microseconds; a view made of
# a tensor while its collective runs holds a reference of its own, which ends the wait here)


def released(fn, tensors: tuple[torch.Tensor, ...], async_op: bool, then=None):
    """``fn`` issued async: its :class:`ReleasedWork`, or (synchronous) None once waited for."""
    work = ReleasedWork(fn, tensors, then)
    if async_op:
        return work
    work.wait()


class ReleasedWork:
    """A gloo collective's work, whose ``wait()`` returns once gloo's worker has let go of it."""

    def __init__(self, fn, tensors: tuple[torch.Tensor, ...], then=None) -> None:
        self.counts = [(t, t._use_count()) for t in tensors]  # C++ references before the work's
        self.work, self.then = fn(True), then  # then(): run once, after the work, by wait()

    def wait(self, *args, **kwargs):
        out = True if self.work is None else self.work.wait(*args, **kwargs)
        if self.then is not None:
            self.then = self.then()  # (None: it runs once)
        self.work = None  # this Python handle's references first, then the worker's
        deadline = time.monotonic() + SETTLE_S  # settle: no tensor held by more than before
        while any(t._use_count() > n for t, n in self.counts) and time.monotonic() < deadline:
            time.sleep(0)  # let the worker thread run
        return out

    def is_completed(self) -> bool:
        return self.work is None or (self.work.is_completed() and bool(self.wait()))  # + then()

    def __getattr__(self, name: str):
        return getattr(self.__dict__["work"], name)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op=False, tag=""):
    """In-place all-reduce of ``tensor``. S = tensor.numel(); paper volume 2S."""
    fn = lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a)
    return _run("all_reduce", fn, (tensor,), group, async_op, tag)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                   async_op: bool = False, tag: str = ""):  # fmt: skip
    """``output`` (shard,) gets chunk r of the sum of every rank's ``input`` (world * shard,).
    S = input.numel(). On gloo each chunk goes to its owner, who sums: half torch's bytes."""
    n = dist.get_world_size(group)  # NCCL, and on gloo an op or sizes the fold cannot take: torch's
    plain = input.is_contiguous() and n > 1 and input.numel() == n * output.numel()
    if dist.get_backend(group) != "gloo" or op not in _FOLD or not plain:
        fn = lambda a: _reduce_scatter(output, input, op=op, group=group, async_op=a)
        return _run("reduce_scatter", fn, (input, output), group, async_op, tag)  # (its error)
    r, rows = dist.get_rank(group), list(input.view(n, -1))  # (N, shard): row j goes to rank j
    got = input.new_empty(n - 1, output.numel())  # (N-1, shard): row k-1 from rank r - k
    fn = lambda a: _exchange([(rows[(r + k) % n], got[k - 1]) for k in range(1, n)], group, r)
    then = partial(_fold, output, rows[r], got, op)
    return _run("reduce_scatter", fn, (input, output, got, *rows), group, async_op, tag, then=then)


# _fold(out, own, got, op): out = the chunks folded by op in the order gloo's ring all-reduce adds
# them where its chunks are the shards: rank r+1's (got[N-2]) first, ..., rank r's own last (a test
# compares). Folded in got, written to out by the last op only: out may be own (in place).
_FOLD = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PRODUCT: torch.mul,
         ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}  # fmt: skip


def _fold(out: torch.Tensor, own: torch.Tensor, got: torch.Tensor, op) -> None:
    acc = got[-1]  # (shard,) rank r+1's chunk r
    for k in range(len(got) - 2, -1, -1):  # ranks r+2 .. r+N-1
        _FOLD[op](acc, got[k], out=acc)
    _FOLD[op](acc, own, out=out)
    if op == ReduceOp.AVG:
        out.div_(len(got) + 1)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False, tag=""):
    """``output`` (world * shard,) gets every rank's ``input`` (shard,), rank r's at chunk r.
    S = output.numel(), the full size. On gloo, N - 1 sends and receives (:func:`_exchange`)."""
    n = dist.get_world_size(group)
    plain = output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype
    plain = plain and n > 1 and output.numel() == n * input.numel()
    if dist.get_backend(group) != "gloo" or not plain:
        fn = lambda a: _all_gather(output, input, group=group, async_op=a)  # NCCL's, or torch's
        return _run("all_gather", fn, (output, input), group, async_op, tag)  # (and its error)
    r, rows = dist.get_rank(group), list(output.view(n, -1))  # (N, shard): row j is rank j's
    if rows[r].data_ptr() != input.data_ptr():  # (ZeRO's own chunk is a view of it already)
        rows[r].copy_(input.view(-1))
    fn = lambda a: _exchange([(rows[r], rows[(r - k) % n]) for k in range(1, n)], group, r)
    return _run("all_gather", fn, (output, input, *rows), group, async_op, tag)


class _Works:
    """A reduce-scatter's or all-gather's sends and receives, waited as one. gloo completes them
    only in ``wait()``, so ``is_completed()`` waits: a loop that polls it cannot spin forever."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, *args, **kwargs) -> bool:
        for w in self.works:
            w.wait(*args, **kwargs)
        self.works = []
        return True

    def is_completed(self) -> bool:
        return self.wait()


def _exchange(pairs: list, group, r: int, tag: int = 1) -> _Works:
    """Round k = 1 .. N-1: ``pairs[k-1]`` = (what goes to rank r + k, where rank r - k's lands);
    (N-1)/N of S each way. On 2 ranks gloo's all-gather took 1.2-2.8x this, its all-to-all (our
    reduce-scatter's before) 1.4-1.7x from 14.8 MB (docs/results.md)."""
    n = len(pairs) + 1
    ops = []
    for k, (send, recv) in enumerate(pairs, start=1):  # round k: a pair of ranks per round
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=(r + k) % n, tag=tag))
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - k) % n, tag=tag))
    return _Works(dist.batch_isend_irecv(ops))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, async_op=False, tag=""):
    """``output`` (world, ...) gets row r of every rank's ``input`` (world, ...) at row r' = that
    rank: rank j's row r lands in rank r's row j. S = input.numel(); each rank keeps 1/N of it
    and sends the rest straight to its owners (qgZ's reduce-scatter, ZeRO++ §3.3)."""
    fn = lambda a: dist.all_to_all_single(output, input, group=group, async_op=a)
    return _run("all_to_all", fn, (input, output), group, async_op, tag)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op=False, tag=""):
    """Copy ``tensor`` from group rank ``src`` to every rank. S = tensor.numel()."""
    global_src = src if group is None else dist.get_global_rank(group, src)
    fn = lambda a: dist.broadcast(tensor, src=global_src, group=group, async_op=a)
    return _run("broadcast", fn, (tensor,), group, async_op, tag, src)
