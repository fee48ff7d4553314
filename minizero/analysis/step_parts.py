"""What a step costs besides the collectives the cost model prices, measured (lesson 08 §5).

The cost model's step is ``micro_batches x compute_s + optimizer_s + communication``. On a
machine whose ranks share few cores, the step also pays what the model leaves out: the wrappers'
own work (copies into and out of flat buffers, hooks, stage 3's per-unit order check, which is
one small all-gather outside the ledger), and every part runs while the other ranks compete for
the same cores. This file measures those parts on every rank at once (a barrier before each
repeat, so the ranks contend as they do in a step):

* :func:`compute_seconds`: the plain model's forward + backward;
* :func:`optimizer_seconds`: a plain optimizer's ``step()`` + ``zero_grad()`` on this rank's
  share of the parameters (all of them at stage 0, a flat shard of Ψ/N at stages 1-3);
* :func:`step_variants`: the wrapped step three ways, interleaved: as it is; with every
  collective of minizero/collectives.py replaced by a local stand-in (:class:`NoComm`):
  everything the step does but communicate ("local"); and with every collective replaced by a
  barrier on its group (:class:`SyncOnly`): the local step, synchronised where the real one is.

``local - micro x compute - optimizer`` is then the wrappers' own work, and ``synced - local -
syncs x barrier_seconds`` the cost of synchronising the ranks (every rank waits, at each
collective, for the slowest; on shared cores, for the ones the scheduler left waiting), less
the barriers' own latency, which the cost model's α already prices. ``local + sync +`` the
model's communication is the prediction with nothing left out but how the bytes and the compute
slow each other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from minizero import collectives as C

REPEATS = 5  # timings per part; the fastest is kept


class _Done:
    """A finished Work: what an async collective returns under :class:`NoComm`."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class NoComm:
    """Stands in for the collectives while a step is timed without communication: no bytes move.
    An all-gather's output is zeroed (a real one writes all of it; zeros keep the arithmetic
    finite), the other ops leave their outputs as they are. Installed as ``C.recorder``, so only
    the calls of minizero/collectives.py are replaced."""

    def issue(self, op: str, fn, payload: torch.Tensor, numel: int, group, async_op: bool,
              tag: str, src: int = 0):  # fmt: skip
        if op == "all_gather":
            payload.zero_()
        return _Done() if async_op else None

    def mark(self, label: str) -> None:
        pass


class SyncOnly(NoComm):
    """Every collective becomes a barrier on its group: the ranks wait for each other where the
    step makes them, and no bytes move. ``calls`` counts the barriers."""

    def __init__(self) -> None:
        self.calls = 0

    def issue(self, op: str, fn, payload: torch.Tensor, numel: int, group, async_op: bool,
              tag: str, src: int = 0):  # fmt: skip
        dist.barrier(group=group)
        self.calls += 1
        return super().issue(op, fn, payload, numel, group, async_op, tag, src)


@contextmanager
def no_communication(recorder: NoComm | None = None):
    """Inside, minizero's collectives move nothing (:class:`NoComm`, or ``recorder``); outside,
    as before."""
    before, C.recorder = C.recorder, recorder or NoComm()
    try:
        yield
    finally:
        C.recorder = before


def fastest_seconds(fn: Callable[[], None], repeats: int = REPEATS, group=None) -> float:
    """The fastest of ``repeats`` timings of ``fn()``, each started after a barrier on ``group``
    (every rank of it calls this) where a process group is initialised. The fastest, not the
    median: on a machine shared with other work, noise only adds time, and every part of the
    step (and the step itself, in lesson 08) is read the same way."""
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def compute_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                    repeats: int = REPEATS) -> float:  # fmt: skip
    """Forward + backward of the plain ``model`` on ``(x, y)``, every rank at once."""

    def once() -> None:
        model(x, y).backward()

    once()  # warm-up
    return fastest_seconds(once, repeats)


def optimizer_seconds(params: list[torch.Tensor], make_opt, repeats: int = REPEATS) -> float:
    """``step()`` + ``zero_grad()`` of ``make_opt(params)`` with a gradient on every parameter
    (the first step, which creates the states, is not timed), every rank at once."""
    params = [p.detach().clone().requires_grad_(True) for p in params]
    opt = make_opt(params)

    def once() -> None:
        for p in params:
            p.grad = torch.full_like(p, 1e-3)  # (as the wrapped step finds them: one per param)
        opt.step()
        opt.zero_grad()

    once()
    return fastest_seconds(once, repeats)


def flat_shard(numel: int, world: int) -> list[torch.Tensor]:
    """One flat fp32 parameter of ``numel / world`` elements, rounded up: a ZeRO shard."""
    return [torch.zeros(-(-numel // world))]


def step_variants(step: Callable[[], None], repeats: int = REPEATS, group=None) -> dict:
    """``step()`` as it is, local (:class:`NoComm`) and synced (:class:`SyncOnly`), every rank
    at once and interleaved (one of each per round, each after a barrier: drift in what else the
    machine runs reaches all three alike); the fastest of ``repeats`` of each, seconds
    (``step_s``, ``local_s``, ``synced_s``), and ``syncs``: the collectives of one step. The
    step's numbers are wrong after it (nothing is reduced): time it after the real steps."""
    synced = SyncOnly()
    recorders = {"step_s": None, "local_s": NoComm(), "synced_s": synced}
    best = dict.fromkeys(recorders, float("inf"))
    for r in range(repeats + 1):  # round 0 warms each variant up, untimed
        for key, recorder in recorders.items():
            with no_communication(recorder) if recorder else contextlib.nullcontext():
                seconds = fastest_seconds(step, 1, group)
            if r:
                best[key] = min(best[key], seconds)
    return dict(best, syncs=synced.calls // (repeats + 1))


def barrier_seconds(group=None, repeats: int = 4 * REPEATS) -> float:
    """One barrier on ``group`` alone (no compute): the latency a synced step's barriers add."""
    dist.barrier(group=group)
    return fastest_seconds(lambda: dist.barrier(group=group), repeats, group)
