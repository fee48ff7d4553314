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
* :func:`local_step_seconds`: the wrapped step with every collective of minizero/collectives.py
  replaced by a local stand-in (:class:`NoComm`): everything the step does but communicate.

``local_step_seconds - micro x compute_seconds - optimizer_seconds`` is then the wrappers' own
work, measured; ``local_step_seconds + the model's communication`` is the prediction with
nothing left out but the interaction between communication and compute.
"""

from __future__ import annotations

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


@contextmanager
def no_communication():
    """Inside, minizero's collectives move nothing (:class:`NoComm`); outside, as before."""
    before, C.recorder = C.recorder, NoComm()
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


def local_step_seconds(step: Callable[[], None], repeats: int = REPEATS) -> float:
    """``step()`` with its collectives replaced (:func:`no_communication`), every rank at once.
    The step's numbers are then wrong (nothing is reduced): time it after the real steps."""
    with no_communication():
        step()  # warm-up: buffers sized, no first-call costs in the timing
        return fastest_seconds(step, repeats)
