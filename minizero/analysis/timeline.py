"""When each collective really ran: one training step seen through the profiler. Lesson 01 (01_ddp).

A :class:`~CommLedger` times an asynchronous collective from its issue to the
end of its ``wait()``. DDP waits for every bucket at the end of backward, so those times show the
order in which buckets were issued, not when their all-reduce ran. The backend knows when it ran:

* gloo runs each collective on a worker thread, which the profiler records as ``gloo:<op>``, from
  the moment the thread starts it to the moment it completes;
* NCCL runs each collective as a kernel on the GPU (``nccl...Kernel...``), on the device's clock,
  which the profiler aligns with the host's.

:func:`profile_step` runs a step under PyTorch's profiler and returns its timeline: the ledger's
marks (``"forward start"``, ``"backward start"``, ``"backward end"``, ...), and for each collective
when it was issued, when the backend started it and when it completed, in milliseconds since the
first mark. :func:`hidden_fraction` says how much of the communication ran while backward was
still computing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd.profiler import profile, record_function

from minizero.analysis.ledger import CommLedger

_MARK = "minizero mark: "
# torch.distributed's host-side op names (the call that issues the collective), per ledger op
_ISSUE = {
    "all_reduce": ("c10d::allreduce_",),
    "reduce_scatter": ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_"),
    "all_gather": ("c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced_"),
    "broadcast": ("c10d::broadcast_",),
}


class _MarkingLedger(CommLedger):
    """A ledger whose marks also appear in the profiler's trace, as zero-length ranges."""

    def mark(self, label: str) -> None:
        super().mark(label)
        with record_function(_MARK + label):
            pass


@contextmanager
def _quiet_stderr():
    """The profiler's start and stop print a line each on stderr (file descriptor 2): hide them."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _runs_comm(event, backend: str) -> bool:
    if backend == "gloo":
        return event.name.startswith("gloo:")
    return "nccl" in event.name.lower() and "kernel" in event.name.lower()


def profile_step(step: Callable[[], object]) -> dict:
    """Inside a rank: run ``step()`` under the profiler, with a ledger open; return its timeline.

    ``{"marks": {label: ms}, "comm": [{"op", "tag", "numel", "issued", "start", "end"}, ...]}``,
    times in milliseconds since the first mark (call ``minizero.collectives.mark`` inside ``step``,
    e.g. ``mark("forward start")`` first). ``issued``: the host called the collective; ``start`` and
    ``end``: the backend ran it (gloo's worker thread, or NCCL's kernel on the GPU).
    """
    backend = dist.get_backend()
    cuda = backend == "nccl"
    # autograd's profiler is what torch.profiler.profile runs underneath; called directly it does
    # not import torch._inductor on its first start (seconds in every rank)
    prof = profile(use_cpu=True, use_device="cuda" if cuda else None, use_kineto=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        with _MarkingLedger() as ledger:
            step()
        if cuda:
            torch.cuda.synchronize()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = list(prof.function_events)
    marks = sorted(
        (e.time_range.start, e.name[len(_MARK) :]) for e in events if e.name.startswith(_MARK)
    )
    if not marks:
        raise ValueError("profile_step: step() made no mark; call mark('forward start') first")
    t0 = marks[0][0]
    issue_names = {n for names in _ISSUE.values() for n in names}
    issued = sorted(e.time_range.start for e in events if e.name in issue_names)
    ran = sorted((e.time_range.start, e.time_range.end) for e in events if _runs_comm(e, backend))
    if not len(issued) == len(ran) == len(ledger.records):
        raise RuntimeError(
            f"profile_step: the ledger saw {len(ledger.records)} collectives, the profiler "
            f"{len(issued)} issued and {len(ran)} run: they cannot be paired"
        )
    comm = [
        {
            "op": r.op,
            "tag": r.tag,
            "numel": r.numel,
            "issued": (i - t0) / 1e3,
            "start": (s - t0) / 1e3,
            "end": (e - t0) / 1e3,
        }
        for r, i, (s, e) in zip(ledger.records, issued, ran, strict=True)
    ]
    return {"marks": {label: (t - t0) / 1e3 for t, label in marks}, "comm": comm}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def hidden_fraction(
    timeline: dict, start: str = "backward start", end: str = "backward end"
) -> tuple[float, float, float]:
    """``(hidden, total, exposed)`` for one timeline: ``total`` ms during which some collective
    ran, ``hidden`` ms of those between the marks ``start`` and ``end`` (while backward computed),
    and ``exposed`` ms from ``end`` until the last collective completed (what the step waited)."""
    lo, hi = timeline["marks"][start], timeline["marks"][end]
    runs = _union([(c["start"], c["end"]) for c in timeline["comm"]])
    total = sum(b - a for a, b in runs)
    hidden = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in runs)
    last = max((b for _, b in runs), default=hi)
    return hidden, total, max(0.0, last - hi)
