"""Run a function on N ranks with ``torch.distributed`` set up. Taught in lesson 0 (00_collectives).

``launch(fn, nprocs, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` once per rank and returns the
ranks' return values in rank order. ``fn`` may be defined in a notebook cell or in ``__main__``.

How the ranks are started (``mechanism``):

- ``"fork"`` (default for gloo on CPU): the parent forks one child per rank. Children inherit
  ``fn`` directly, so nothing is pickled on the way in; each runs one OpenMP thread (forking a
  process that has used libgomp deadlocks otherwise). Rendezvous: a ``FileStore`` in the
  launch's own temporary directory, so launches running side by side never clash (no ports).
- ``"torchrun"`` (default for NCCL): ``(fn, args, kwargs)`` go through cloudpickle, which carries
  notebook and ``__main__`` functions by value, to ``python -m torch.distributed.run --standalone``
  (free port chosen by torchrun). Fresh processes, so CUDA is safe in every rank.

Either way each rank writes its stdout/stderr, its pid and its result (or its traceback) into a
private temporary directory; the parent relays the output line by line, prefixed ``[rank r]``, into
its own ``sys.stdout``/``sys.stderr`` (so prints show up in a notebook cell), and stops every rank
when one fails, when ``timeout`` passes, or when the parent itself is interrupted. If the parent is
killed outright (SIGKILL: no chance to clean up), its ranks and torchrun stop by themselves within
a second: each asks the kernel for a parent-death signal (Linux), or watches its parent (elsewhere).

Already inside a torchrun worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` set),
``launch`` starts nothing: it runs ``fn`` on this rank and all-gathers the results, so a script
that calls ``launch`` runs unchanged under ``torchrun`` (multi-node too). There ``nprocs`` is
ignored in favour of ``WORLD_SIZE`` (with a note when they differ).

This file is what the caller meets: ``launch``, ``plan``, the errors, and the parent's side of a
launch (watch the ranks, relay their output, name the rank that failed). The ranks' processes
(starting them by fork or torchrun, what each runs, stopping them) are in
:mod:`minizero.launcher.ranks`.
"""

from __future__ import annotations

import multiprocessing
import numbers
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minizero.launcher.ranks import GRACE, POLL, Ranks, gpu_count, start_fork, start_torchrun

_STARTUP = 120.0  # seconds allowed for starting the ranks, on top of the timeout
_JOIN = 60.0  # seconds the started ranks have to join the process group, before fn runs
_NOTICE = 10.0  # after this many seconds without every rank joined, say so (stderr)
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class LaunchError(RuntimeError):
    """A rank failed. ``rank`` is the failing rank (None if no rank is to blame), ``traceback``
    its traceback text (or the stack it was stuck in, for a timeout)."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback


class _NotJoined(LaunchError):
    """The ranks did not all join the process group within ``_JOIN`` seconds (fn never ran)."""


class LaunchTimeout(LaunchError, TimeoutError):
    """Some ranks had not finished after ``timeout`` seconds; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int], traceback: str = ""):
        super().__init__(message, rank=ranks[0] if ranks else None, traceback=traceback)
        self.ranks = ranks


def default_nprocs() -> int:
    """One rank per GPU where there are at least two GPUs, else 2 ranks on the CPU (gloo)."""
    n = gpu_count()
    return n if n >= 2 else 2


def rank_device() -> torch.device:
    """Inside a rank: this rank's GPU under NCCL (the launcher has set it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "auto",
    timeout: float | timedelta = 300.0,
    mechanism: str = "auto",
    verbose: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks; return their results in rank order.

    backend: "auto" (NCCL when every rank can have its own GPU, else gloo), "nccl" or "gloo".
    timeout: seconds (or a timedelta) a rank may run, counted once all ranks have started; also
        the process group's timeout. Finite and positive: there is no "wait forever" (a hung
        collective would never be reported); pass a large number to wait long.
    mechanism: "auto" (fork for gloo, torchrun for NCCL), "fork" or "torchrun". Forked ranks
        cannot use CUDA if this process has initialised it: use "torchrun" for that.
    verbose: print one line saying how the ranks run.
    Raises LaunchError naming the first failing rank with its traceback; LaunchTimeout on timeout.
    Return values must be picklable. ``backend``, ``timeout``, ``mechanism`` and ``verbose`` are
    taken by launch and never passed on to ``fn``.
    """
    timeout = _seconds(timeout)
    if all(k in os.environ for k in _ENV):
        return _launch_here(fn, nprocs, args, kwargs, backend, timeout, verbose)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
    if mechanism not in ("auto", "fork", "torchrun"):
        raise ValueError(f"unknown mechanism {mechanism!r}: use 'auto', 'fork' or 'torchrun'")
    # Import here, in full, all that the ranks import: a fork taken while another thread is half
    # way through importing a module leaves the child waiting forever on that module's lock.
    import cloudpickle  # noqa: F401
    import torch.distributed as dist  # noqa: F401

    backend, mechanism, _ = plan(nprocs, backend, mechanism)
    if verbose:
        where = "one GPU per rank" if backend == "nccl" else "CPU"
        ranks = f"{nprocs} rank{'s' * (nprocs != 1)}"
        print(f"minizero.launch: {ranks}, {backend} on {where} ({mechanism})")
    start = start_fork if mechanism == "fork" else start_torchrun
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="minizero-launch-") as tmp:
            ranks = start(Path(tmp), fn, args, kwargs, nprocs, backend, timeout)
            try:
                return _supervise(ranks, Path(tmp), nprocs, timeout)
            except LaunchError as e:
                # A connection refused while the ranks meet (seen under heavy load) is retried
                # once, but only when no rank has started fn: fn never runs twice.
                setup = type(e) is _NotJoined or (type(e) is LaunchError and e.traceback)
                if attempt == 2 or not setup or any(Path(tmp).glob("*.started")):
                    raise
                why = e.traceback.strip().splitlines()[-1]
                if type(e) is _NotJoined:
                    why = str(e).partition(":")[0]
                print(f"minizero.launch: the ranks could not connect ({why}); trying again",
                      file=sys.stderr)  # fmt: skip
            finally:
                ranks.stop()
    raise AssertionError("unreachable")


def _seconds(timeout: Any) -> float:
    """``timeout`` in seconds, finite and positive; else a one-line error saying what to do."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or a timedelta, got {timeout!r}: "
            "pass e.g. timeout=600 (there is no unlimited timeout)"
        )
    if not 0 < seconds < float("inf"):  # also refuses nan
        raise ValueError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r}: pass a large "
            "number (e.g. timeout=24 * 3600) to wait long; a hung rank is then still reported"
        )
    return float(seconds)


def plan(nprocs: int, backend: str = "auto", mechanism: str = "auto") -> tuple[str, str, str]:
    """``(backend, mechanism, why)``: what ``launch(fn, nprocs, backend=..., mechanism=...)`` uses
    on this machine, and one line saying why. ValueError where the choice cannot run here."""
    import torch.distributed as dist

    gpus = gpu_count()
    nccl_ok = dist.is_nccl_available()
    have = f"{gpus} GPU{'s' * (gpus != 1)} found" + ("" if nccl_ok else ", NCCL not available")
    if backend == "nccl" and (gpus < nprocs or not nccl_ok):
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: nprocs={nprocs} but {have}. "
            f"Use backend='gloo' (CPU) or nprocs <= {gpus}."
        )
    if backend == "auto":
        backend = "nccl" if nccl_ok and 0 < nprocs <= gpus else "gloo"
        why = f"{have}; NCCL needs one GPU per rank, nprocs={nprocs}"
    else:
        why = f"backend={backend!r} asked for ({have})"
    fork_ok = "fork" in multiprocessing.get_all_start_methods()
    if mechanism == "auto":
        mechanism = "fork" if backend == "gloo" and fork_ok else "torchrun"
        why += "; " + (
            "gloo ranks are forked from this process" if mechanism == "fork"
            else "NCCL ranks start fresh under torchrun (CUDA cannot be forked)" if fork_ok
            else "this platform cannot fork"
        )  # fmt: skip
    return backend, mechanism, why


# ---------------------------------------------------------------- the parent: watch, relay, stop


def _supervise(ranks: Ranks, tmp: Path, n: int, timeout: float) -> list[Any]:
    """Relay output and wait for all results; raise for the first rank that fails or hangs."""
    import cloudpickle

    relay = _Relay(tmp, n)
    # The clock starts once every rank is up (torchrun takes seconds to start its workers).
    t0 = time.monotonic()
    deadline, started = t0 + timeout + _STARTUP, False
    # Joining (rendezvous and a barrier) takes a second: a rank stuck before it (a lock inherited
    # through fork, a worker that never starts) is reported within seconds, not after `timeout`.
    join_by, joined, noticed = deadline, False, False
    results: dict[int, Any] = {}
    while True:
        if not started and len(ranks.pids()) == n:
            deadline, started = time.monotonic() + timeout, True
            join_by = min(deadline, time.monotonic() + _JOIN)
        if not joined:
            joined = all((tmp / f"{r}.started").exists() for r in range(n))
            if not joined and not noticed and time.monotonic() - t0 > _NOTICE:
                noticed = True
                print(f"minizero.launch: {_unjoined(tmp, n)} after {_NOTICE:g} s; waiting "
                      f"{join_by - time.monotonic():.0f} s more", file=sys.stderr)  # fmt: skip
        exited = ranks.exited()  # look before reading results: a result may land just before exit
        relay.pump()
        for r in range(n):
            if r not in results and (tmp / f"{r}.ok").exists():
                results[r] = cloudpickle.loads((tmp / f"{r}.ok").read_bytes())
        if any((tmp / f"{r}.err").exists() for r in range(n)) or set(exited) - set(results):
            raise _blame(ranks, tmp, n, results, relay)
        if len(results) == n:
            ranks.stop(wait=GRACE)  # let them leave on their own first
            relay.pump(final=True)
            return [results[r] for r in range(n)]
        if not joined and time.monotonic() > join_by and time.monotonic() <= deadline:
            waiting = _unjoined(tmp, n)
            late = [r for r in range(n) if not (tmp / f"{r}.started").exists()]
            stacks = ranks.dump_stacks(late)
            ranks.stop()
            relay.pump(final=True)
            raise _NotJoined(
                f"{waiting} after {time.monotonic() - t0:.0f} s: the ranks never met, so fn "
                f"never ran. Where they were:\n{stacks}",
                late[0] if late else None,
                stacks,
            )
        if time.monotonic() > deadline:
            late = [r for r in range(n) if r not in results]
            stacks = ranks.dump_stacks(late)
            ranks.stop()
            relay.pump(final=True)
            raise LaunchTimeout(
                f"timeout: ranks {late} had not finished after {timeout:g} s "
                f"(raise timeout=... if they need longer). Where they were:\n{stacks}",
                late,
                stacks,
            )
        ranks.wait(POLL)


def _unjoined(tmp: Path, n: int) -> str:
    """Which ranks have not joined the process group yet, and whether they have started at all."""
    late = [r for r in range(n) if not (tmp / f"{r}.started").exists()]
    dead = [r for r in late if not (tmp / f"{r}.pid").exists()]
    text = f"ranks {late} had not joined the process group"
    return text + (f" (ranks {dead} had not started)" if dead else "")


# What a rank raises when a peer failed or left first: its connection to that peer broke. Such an
# error is a consequence; a rank's own error, when there is one, is the cause to report.
_BROKEN = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|connectFullMesh failed|Connection refused|"
    r"remote process exited|NCCL communicator was aborted|Socket Timeout"
)
_CAUSE_WAIT = 3.0  # seconds to wait for a rank's own error once only broken connections are seen


def broken_connection(traceback_text: str) -> bool:
    """Whether a rank's traceback ends in a broken connection to a peer (see :data:`_BROKEN`)."""
    return bool(_BROKEN.search((traceback_text.strip().splitlines() or [""])[-1]))


def _blame(ranks: Ranks, tmp: Path, n: int, results: dict, relay: _Relay) -> LaunchError:
    """Stop everything and name the rank that failed first. A rank that died without raising is
    the cause (its peers then fail with "Connection reset by peer"); else the earliest traceback
    that is a rank's own error, not a broken connection to a peer (waiting a moment for one when
    only broken connections have come in); the ranks that failed after it are named as its
    consequences. A rank whose result came since the parent last looked (``ok``) is finished."""
    ranks.settle()
    ok = lambda: set(results) | {r for r in range(n) if (tmp / f"{r}.ok").exists()}  # noqa: E731
    end = time.monotonic() + _CAUSE_WAIT
    while True:  # until a crash, a rank's own error, every rank answered, or the wait is over
        errs = [r for r in range(n) if (tmp / f"{r}.err").exists()]
        crashed = ranks.crashed(done=ok() | set(errs))
        cause = crashed or not all(_broken(tmp, r) for r in errs) or len(errs) + len(ok()) == n
        if cause or time.monotonic() >= end:
            break
        ranks.wait(POLL)
    ranks.stop()
    relay.pump(final=True)
    errs = sorted(
        (r for r in range(n) if (tmp / f"{r}.err").exists()),
        key=lambda r: (_broken(tmp, r), (tmp / f"{r}.err").stat().st_mtime_ns, r),
    )
    crashed = {r: why for r, why in crashed.items() if r not in errs}
    if not crashed and not errs:  # e.g. torchrun itself was stopped from outside
        crashed = {min(set(range(n)) - ok()): "ended"}
    r = min(crashed) if crashed else errs[0]
    others = [q for q in range(n) if q != r and q not in ok()]
    after = [q for q in errs if q != r and _broken(tmp, q)]
    stopped = [q for q in others if q not in after]
    said = f"; the other unfinished ranks {stopped} were stopped" if stopped else ""
    if after:
        lasts = "; ".join(f"rank {q}: {_last_line(tmp, q)[:200]}" for q in after)
        said += (
            f"; ranks {after} then failed as a consequence, their connection to a failed rank "
            f"broken ({lasts})"
        )
    if r in crashed:
        return LaunchError(f"rank {r} {crashed[r]} without returning a result{said}", r)
    tb = (tmp / f"{r}.err").read_text()
    return LaunchError(f"rank {r} failed{said}. Its traceback:\n{tb}", r, tb)


def _broken(tmp: Path, rank: int) -> bool:
    return broken_connection(_last_line(tmp, rank))


def _last_line(tmp: Path, rank: int) -> str:
    return ((tmp / f"{rank}.err").read_text(errors="replace").strip().splitlines() or [""])[-1]


class _Relay:
    """Copies each rank's ``{r}.out`` / ``{r}.err.log`` into this process's stdout / stderr."""

    def __init__(self, tmp: Path, n: int):
        self.files = [(r, tmp / f"{r}.{s}", s) for r in range(n) for s in ("out", "err.log")]
        self.pos = {f: 0 for _, f, _ in self.files}
        self.partial = {f: b"" for _, f, _ in self.files}

    def pump(self, final: bool = False) -> None:
        for r, f, s in self.files:
            try:
                with open(f, "rb") as fh:
                    fh.seek(self.pos[f])
                    data = fh.read()
            except FileNotFoundError:
                continue
            self.pos[f] += len(data)
            lines = (self.partial[f] + data).split(b"\n")
            self.partial[f] = lines.pop()  # an unfinished line waits for its end
            if final and self.partial[f]:
                lines.append(self.partial[f])
                self.partial[f] = b""
            stream = sys.stdout if s == "out" else sys.stderr
            for line in lines:
                stream.write(f"[rank {r}] {line.decode(errors='replace')}\n")
            stream.flush()


# ---------------------------------------------------------------- already under torchrun


def _launch_here(fn, nprocs, args, kwargs, backend, timeout, verbose) -> list[Any]:
    """This process is one torchrun worker: run fn here and all-gather every rank's result."""
    import torch
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    created = not dist.is_initialized()
    if created:
        if backend == "auto":
            gpus = torch.cuda.device_count()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            backend = "nccl" if dist.is_nccl_available() and local_world <= gpus else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    if verbose and rank == 0:
        note = f"; nprocs={nprocs} ignored" if nprocs != world else ""
        print(f"minizero.launch: under torchrun, {world} ranks, {dist.get_backend()}{note}")
    try:
        try:
            mine = ("ok", fn(*args, **kwargs))
        except Exception as e:
            mine = ("err", "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
    finally:
        if created:
            dist.destroy_process_group()
    for r, (kind, value) in enumerate(every):
        if kind == "err":
            raise LaunchError(f"rank {r} failed. Its traceback:\n{value}", r, value)
    return [value for _, value in every]
