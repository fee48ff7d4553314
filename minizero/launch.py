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
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

_GRACE = 2.0  # seconds between SIGTERM and SIGKILL when stopping ranks
_POLL = 0.02  # seconds between looks at the ranks
_STARTUP = 120.0  # seconds allowed for starting the ranks, on top of the timeout
_JOIN = 60.0  # seconds the started ranks have to join the process group, before fn runs
_NOTICE = 10.0  # after this many seconds without every rank joined, say so (stderr)
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
_WORKER = "import sys; from minizero.launch import _torchrun_worker as w; sys.exit(w(sys.argv[1]))"
_AGENT = "import sys; from minizero.launch import _torchrun_agent as a; sys.exit(a(sys.argv[1:]))"


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


def gpu_count() -> int:
    """GPUs visible to this process, counted through NVML so that CUDA is NOT initialised here
    (a parent that initialised CUDA cannot fork ranks that use it)."""
    import torch

    if not hasattr(torch._C, "_cuda_getDeviceCount"):  # CPU-only build
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    name = "_device_count_amdsmi" if torch.version.hip else "_device_count_nvml"
    n = getattr(torch.cuda, name, lambda: -1)()  # private, but the only fork-safe count
    if n >= 0:
        return n
    # NVML unusable: ask a throwaway process, so that this one stays fork-safe.
    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0)


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
    start = _start_fork if mechanism == "fork" else _start_torchrun
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


def _supervise(ranks: _Ranks, tmp: Path, n: int, timeout: float) -> list[Any]:
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
            ranks.stop(wait=_GRACE)  # let them leave on their own first
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
        ranks.wait(_POLL)


def _unjoined(tmp: Path, n: int) -> str:
    """Which ranks have not joined the process group yet, and whether they have started at all."""
    late = [r for r in range(n) if not (tmp / f"{r}.started").exists()]
    dead = [r for r in late if not (tmp / f"{r}.pid").exists()]
    text = f"ranks {late} had not joined the process group"
    return text + (f" (ranks {dead} had not started)" if dead else "")


def _blame(ranks: _Ranks, tmp: Path, n: int, results: dict, relay: _Relay) -> LaunchError:
    """Stop everything and name the rank that failed first. A rank that died without raising is
    the cause (its peers then fail with "Connection reset by peer"); else the earliest traceback."""
    ranks.settle()
    errs = [r for r in range(n) if (tmp / f"{r}.err").exists()]
    crashed = ranks.crashed(done=set(results) | set(errs))
    ranks.stop()
    relay.pump(final=True)
    errs = sorted(
        (r for r in range(n) if (tmp / f"{r}.err").exists()),
        key=lambda r: ((tmp / f"{r}.err").stat().st_mtime_ns, r),
    )
    crashed = {r: why for r, why in crashed.items() if r not in errs}
    if not crashed and not errs:  # e.g. torchrun itself was stopped from outside
        crashed = {min(set(range(n)) - set(results)): "ended"}
    r = min(crashed) if crashed else errs[0]
    others = [q for q in range(n) if q != r and q not in results]
    stopped = f"; the other unfinished ranks {others} were stopped" if others else ""
    if r in crashed:
        return LaunchError(f"rank {r} {crashed[r]} without returning a result{stopped}", r)
    tb = (tmp / f"{r}.err").read_text()
    return LaunchError(f"rank {r} failed{stopped}. Its traceback:\n{tb}", r, tb)


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


class _Ranks:
    """The running ranks, however they were started."""

    def __init__(self, tmp: Path, n: int):
        self.tmp, self.n = tmp, n

    def pids(self) -> dict[int, int]:
        out = {}
        for r in range(self.n):
            try:
                out[r] = int((self.tmp / f"{r}.pid").read_text())
            except (FileNotFoundError, ValueError):
                pass
        return out

    def dump_stacks(self, late: list[int]) -> str:
        """Ask the hung ranks for their Python stacks (faulthandler, on SIGUSR1)."""
        for r, pid in self.pids().items():
            if r in late:
                _signal(pid, signal.SIGUSR1)
        stacks, end = {}, time.monotonic() + _GRACE
        for r in late:
            f = self.tmp / f"{r}.stack"
            while not (f.exists() and f.stat().st_size) and time.monotonic() < end:
                time.sleep(_POLL)
            time.sleep(_POLL)  # let it finish writing
            text = f.read_text(errors="replace") if f.exists() else ""
            text = text.split("_rank_main")[0].rpartition("\n")[0]  # drop the launcher's frames
            stacks[r] = text or "(no stack: the rank had not started)"
        return "".join(f"rank {r}: {text}\n" for r, text in stacks.items())


class _Forked(_Ranks):
    def __init__(self, tmp: Path, n: int, procs: list):
        super().__init__(tmp, n)
        self.procs = procs

    def pids(self) -> dict[int, int]:  # our children: their pids stay ours until joined
        return {r: p.pid for r, p in enumerate(self.procs) if p.pid is not None}

    def exited(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.exitcode is not None]

    def settle(self) -> None:  # a rank that crashed may not be reaped yet when its peers fail
        end = time.monotonic() + 0.5
        while (alive := [p.sentinel for p in self.procs if p.exitcode is None]) and (
            left := end - time.monotonic()
        ) > 0:
            multiprocessing.connection.wait(alive, left)

    def crashed(self, done: set[int]) -> dict[int, str]:
        codes = {r: p.exitcode for r, p in enumerate(self.procs)}
        return {r: _exit_words(c) for r, c in codes.items() if c is not None and r not in done}

    def wait(self, seconds: float) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs], seconds)

    def stop(self, wait: float = 0.0) -> None:
        for p in self.procs:
            p.join(wait)
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(_GRACE)
            if p.is_alive():
                p.kill()
                p.join()


class _Torchrun(_Ranks):
    def __init__(self, tmp: Path, n: int, proc: subprocess.Popen):
        super().__init__(tmp, n)
        self.proc = proc

    def pids(self) -> dict[int, int]:  # only pids still running this launch's workers
        return {r: pid for r, pid in super().pids().items() if _runs(pid, str(self.tmp))}

    def exited(self) -> list[int]:
        return list(range(self.n)) if self.proc.poll() is not None else []

    def settle(self) -> None:
        self.wait(_GRACE)  # torchrun notices a failed worker, stops the rest and reports

    def crashed(self, done: set[int]) -> dict[int, str]:
        if self.proc.poll() is None:
            return {}
        log = (self.tmp / "torchrun.log").read_text(errors="replace")
        codes = {
            int(r): int(c)
            for r, c in re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
        }
        if not codes:  # torchrun reported no worker: say what it did say
            tail = f"torchrun exited with {self.proc.returncode}; its log ends:\n{log[-2000:]}"
            return {r: f"ended ({tail})" for r in range(self.n) if r not in done}
        # torchrun SIGTERMs the survivors of a failure: they are not the cause
        out = {r: _exit_words(c) for r, c in codes.items() if r not in done and c != -15}
        for r in out:  # died before its output was captured: torchrun's log has the reason
            if not (self.tmp / f"{r}.err.log").exists():
                out[r] += f" before starting (torchrun's log ends:\n{log[-3000:]})"
        return out

    def wait(self, seconds: float) -> None:
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, wait: float = 0.0) -> None:
        self.wait(wait)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # torchrun passes it on to its workers
            self.wait(_GRACE)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.pids().values():  # workers run in sessions of their own
            _signal(pid, signal.SIGKILL)


def _runs(pid: int, marker: str) -> bool:
    """Is ``pid`` alive and running a command line that contains ``marker``?"""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# ---------------------------------------------------------------- starting the ranks


def _start_fork(tmp, fn, args, kwargs, n, backend, timeout) -> _Forked:
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush(), sys.stderr.flush()  # or buffered text would print twice
    ranks = _Forked(tmp, n, [])
    # Rendezvous through a file in this launch's own directory: no server thread in the parent.
    # (A TCPStore's server thread can hold a libc lock, the resolver's while it logs a connection,
    # at the moment another launch in this process forks; that child then waits on it forever.)
    store = str(tmp / "store")
    try:
        for r in range(n):
            init = (backend, r, n, r, store, timeout)
            ranks.procs.append(ctx.Process(target=_rank_main, args=(tmp, init, (fn, args, kwargs))))
            ranks.procs[-1].start()
    except BaseException:
        ranks.stop()
        raise
    return ranks


def _start_torchrun(tmp, fn, args, kwargs, n, backend, timeout) -> _Torchrun:
    import cloudpickle

    setup = dict(sys_path=sys.path, backend=backend, timeout=timeout)
    (tmp / "setup.pkl").write_bytes(pickle.dumps(setup))
    try:
        (tmp / "job.pkl").write_bytes(cloudpickle.dumps((fn, args, kwargs)))
    except Exception as e:
        raise TypeError(f"torchrun needs fn and its arguments picklable; they are not: {e}") from e
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = str(Path(__file__).resolve().parent.parent)  # so that the workers import this minizero
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # torchrun runs in a session of its own (so that stop() can signal its whole group), so it
    # would outlive this process if this one were killed: it is told whom to die with.
    cmd = [sys.executable, "-c", _AGENT, str(os.getpid()), "--standalone", "--nnodes=1",
           f"--nproc-per-node={n}", "--monitor-interval=0.05", "--no-python",
           sys.executable, "-c", _WORKER, str(tmp)]  # fmt: skip
    with open(tmp / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    return _Torchrun(tmp, n, proc)


# ---------------------------------------------------------------- inside a rank


def _rank_main(tmp: Path, init: tuple, job: tuple | Path) -> bool:
    """One rank: capture output, join the process group, run fn, leave the result in ``tmp``.

    ``init[4]``: for a forked rank, the path of the launch's FileStore; None under torchrun (the
    environment says where to meet).
    """
    backend, rank, world, local_rank, store_path, timeout = init
    if store_path is not None:
        # Forked: the parent's objects (a notebook kernel's sockets, threads' locks) are never
        # collected here, so their finalisers cannot block this rank.
        gc.freeze()
        import torch

        torch.set_num_threads(1)  # before anything else: libgomp deadlocks after fork otherwise
        os.environ["OMP_NUM_THREADS"] = "1"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us; it reports Ctrl-C
    _die_with_parent()
    (tmp / f"{rank}.pid").write_text(str(os.getpid()))
    for fd, name in ((1, "out"), (2, "err.log")):
        f = os.open(tmp / f"{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    stack = open(tmp / f"{rank}.stack", "w")  # open while the rank lives
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=False)
    import cloudpickle
    import torch
    import torch.distributed as dist

    try:
        # (fn, args, kwargs), or the file that holds them pickled
        fn, args, kwargs = cloudpickle.loads(job.read_bytes()) if isinstance(job, Path) else job
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        to = timedelta(seconds=timeout)
        if store_path is None:  # torchrun: MASTER_ADDR/MASTER_PORT in the environment
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=to)
        else:
            store = dist.FileStore(store_path, world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=to)
        # Every rank has joined (the group may set up lazily): fn starts now, and a failure
        # before this line may be retried.
        dist.barrier(device_ids=[local_rank] if backend == "nccl" else None)
        (tmp / f"{rank}.started").touch()
        value = fn(*args, **kwargs)
        try:
            data = cloudpickle.dumps(value)
        except Exception as e:
            raise TypeError(
                f"rank {rank} returned a {type(value).__name__} that cannot be pickled ({e}); "
                "return plain data (numbers, tensors, lists, dicts) from fn"
            ) from e
        _put(tmp / f"{rank}.ok", data)
        return True
    except BaseException as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        _put(tmp / f"{rank}.err", tb.encode())
        return False
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()


def _put(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # the parent never sees half a file


def _die_with_parent(parent: int | None = None) -> None:
    """Be SIGKILLed when ``parent`` (default: this process's parent) dies, so that nothing is
    orphaned: Linux's parent-death signal, or elsewhere a thread that watches the parent."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: sent when the parent dies
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it died before we asked: this process was re-parented already
        os._exit(1)


def _watch_parent(parent: int, every: float = 0.2) -> None:
    """Kill this process once it is no longer ``parent``'s child (the parent died)."""
    while os.getppid() == parent:
        time.sleep(every)
    os.kill(os.getpid(), signal.SIGKILL)


def _torchrun_agent(argv: list[str]) -> int:
    """What a launch's torchrun process runs (``_AGENT``): ``argv`` is the launching process's pid,
    then torchrun's arguments. Torchrun, killed when the launching process dies; its workers die
    with it (each calls ``_die_with_parent``)."""
    _die_with_parent(int(argv[0]))
    from torch.distributed.run import main

    main(argv[1:])  # raises (exit code 1, traceback in torchrun.log) when a worker failed
    return 0


def _torchrun_worker(tmp: str) -> int:
    """What each torchrun worker runs (``_WORKER``)."""
    setup = pickle.loads(Path(tmp, "setup.pkl").read_bytes())
    sys.path[:] = setup["sys_path"]  # before unpickling fn: its module may live on that path
    env = os.environ
    init = (setup["backend"], int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
            None, setup["timeout"])  # fmt: skip
    ok = _rank_main(Path(tmp), init, Path(tmp, "job.pkl"))
    return 0 if ok else 1  # a failed worker makes torchrun stop the others


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


RUN_HELP = """usage: python -m minizero run [torchrun options] SCRIPT [script args]

Run SCRIPT on every rank under torchrun (PyTorch's launcher): one rank per GPU over NCCL, on one
machine or many. Inside SCRIPT, minizero.launch(fn, nprocs) sees that it already runs under
torchrun and calls fn on this rank. minizero adds two defaults to torchrun:

  --standalone             unless --nnodes, --standalone, --rdzv-* or --master-* is given
                           (one machine, a free port chosen for you)
  --nproc-per-node N       unless given: the number of GPUs here, or 2 without GPUs

Every other option is torchrun's, passed on unchanged. For example, 2 machines with 8 GPUs each
(run on both):
  python -m minizero run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 train.py
"""


def torchrun_main(argv: list[str]) -> int:
    """``python -m minizero run``: torchrun with ``--standalone`` and ``--nproc-per-node`` defaults
    (see ``RUN_HELP``). Returns torchrun's exit code."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            print("minizero run: error: give the script to run, e.g. python -m minizero run "
                  "train.py (--help: every option)", file=sys.stderr)  # fmt: skip
            return 2
        print(RUN_HELP + "\ntorchrun's own options:")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--help"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        options = out[out.find("options:") + len("options:") :] if "options:" in out else out
        print(options.lstrip("\n"), end="")
        return 0
    given = lambda pattern: any(re.match(rf"--({pattern})\b", a) for a in argv)
    extra = [] if given(r"nnodes|standalone|rdzv[-_]\w+|master[-_]\w+") else ["--standalone"]
    if not given(r"nproc[-_]per[-_]node"):
        extra.append(f"--nproc-per-node={gpu_count() or 2}")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *extra, *argv])
