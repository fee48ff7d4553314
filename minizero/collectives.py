"""The collectives every stage calls. Taught in lesson 0 (lessons/00_collectives.ipynb).

Thin wrappers over ``torch.distributed``: ``all_reduce``, ``reduce_scatter``, ``all_gather``,
``broadcast`` (and ZeRO++'s ``all_to_all``). Every stage of minizero talks to the other ranks
through these functions only, so a ``CommLedger`` opened around a training step sees every byte
the step moves.

What a call moves, in the ZeRO paper's accounting (§7.1): an all-reduce of ``n`` elements moves
``2n`` (it is a reduce-scatter then an all-gather), a reduce-scatter or an all-gather of a full
tensor of ``n`` elements moves ``n``, a broadcast moves ``n``. The instrument that counts it, times
it and orders it against the step (``CommLedger``) is minizero/analysis/ledger.py: while a ledger
is open each call goes through its ``recorder``; otherwise nothing but torch.distributed runs.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives and warns on the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Recorder(Protocol):
    """What watches the calls while a ``CommLedger`` is open (analysis/ledger.py's)."""

    def issue(self, op: str, fn, payload: torch.Tensor, numel: int, group, async_op: bool,
              tag: str, src: int = 0): ...  # fmt: skip
    def mark(self, label: str) -> None: ...


recorder: Recorder | None = None  # set while a ledger is open; None: no bookkeeping at all


def mark(label: str) -> None:
    """Label the timeline of every open ledger (no-op when none is open)."""
    if recorder is not None:
        recorder.mark(label)


def _run(op: str, fn, io: tuple[torch.Tensor, ...], group, async_op: bool, tag: str, src=0):
    """``fn(async_op)``; ``io``: the call's tensors, ``io[0]`` the one a ledger records."""
    if dist.get_backend(group) == "gloo":  # a clean exit (below)
        fn = partial(released, fn, io)
    if recorder is None:
        return fn(async_op)
    return recorder.issue(op, fn, io[0], io[0].numel(), group, async_op, tag, src)


# -- a clean exit (a script that trained to the end must exit 0, not abort): gloo runs a
# collective on a worker thread, which lets go of its work (and so of the work's tensors) a moment
# after wait() has returned. A tensor the caller dropped by
# then (a temporary: a chunk view, a shard) is freed on that thread, which takes the GIL; at the
# end of a script the group outlives destroy_process_group() (torch's own modules hold it), and a
# free during the interpreter's finalisation aborts the process after training finished
# ("terminate called without an active exception", SIGABRT). So on gloo every collective returns,
# or its wait() returns, only once the worker holds none of its tensors.
SETTLE_S = 0.2  # at most this long per collective (measured: microseconds; a view made of
# a tensor while its collective runs holds a reference of its own, which ends the wait here)


def released(fn, tensors: tuple[torch.Tensor, ...], async_op: bool):
    """``fn`` issued async: its :class:`ReleasedWork`, or (synchronous) None once waited for."""
    work = ReleasedWork(fn, tensors)
    if async_op:
        return work
    work.wait()


class ReleasedWork:
    """A gloo collective's work, whose ``wait()`` returns once gloo's worker has let go of it."""

    def __init__(self, fn, tensors: tuple[torch.Tensor, ...]) -> None:
        self.counts = [(t, t._use_count()) for t in tensors]  # C++ references before the work's
        self.work = fn(True)

    def wait(self, *args, **kwargs):
        out = True if self.work is None else self.work.wait(*args, **kwargs)
        self.work = None  # this Python handle's references first, then the worker's
        deadline = time.monotonic() + SETTLE_S  # settle: no tensor held by more than before
        while any(t._use_count() > n for t, n in self.counts) and time.monotonic() < deadline:
            time.sleep(0)  # let the worker thread run
        return out

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.__dict__["work"], name)


def all_reduce(
    tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, tag: str = ""
):
    """In-place all-reduce of ``tensor``. S = tensor.numel(); paper volume 2S."""
    fn = lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a)
    return _run("all_reduce", fn, (tensor,), group, async_op, tag)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    tag: str = "",
):
    """``output`` (shard,) gets chunk r of the sum of every rank's ``input`` (world * shard,).
    S = input.numel(). gloo runs it as an all-reduce of the whole input (its wall time too)."""
    fn = lambda a: _reduce_scatter(output, input, op=op, group=group, async_op=a)
    return _run("reduce_scatter", fn, (input, output), group, async_op, tag)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, tag: str = ""
):
    """``output`` (world * shard,) gets every rank's ``input`` (shard,), rank r's at chunk r.

    S = output.numel(), the full size.
    """
    fn = lambda a: _all_gather(output, input, group=group, async_op=a)
    return _run("all_gather", fn, (output, input), group, async_op, tag)


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, tag: str = ""
):
    """``output`` (world, ...) gets row r of every rank's ``input`` (world, ...) at row r' = that
    rank: rank j's row r lands in rank r's row j. S = input.numel(); each rank keeps 1/N of it
    and sends the rest straight to its owners (qgZ's reduce-scatter, ZeRO++ §3.3)."""
    fn = lambda a: dist.all_to_all_single(output, input, group=group, async_op=a)
    return _run("all_to_all", fn, (input, output), group, async_op, tag)


def broadcast(
    tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False, tag: str = ""
):
    """Copy ``tensor`` from group rank ``src`` to every rank. S = tensor.numel()."""
    global_src = src if group is None else dist.get_global_rank(group, src)
    fn = lambda a: dist.broadcast(tensor, src=global_src, group=group, async_op=a)
    return _run("broadcast", fn, (tensor,), group, async_op, tag, src)
