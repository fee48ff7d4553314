"""The ranks' processes behind ``minizero.launch``: started by fork or by torchrun, what each rank
runs, and how the parent stops them. Taught in lesson 0 (00_collectives); the overview is in
:mod:`minizero.launcher`.

- ``start_fork``: one forked child per rank; they meet through a ``FileStore`` in the launch's own
  temporary directory.
- ``start_torchrun``: ``python -m torch.distributed.run --standalone`` in a session of its own;
  ``(fn, args, kwargs)`` reach the workers through cloudpickle.
- ``Ranks`` (``Forked``, ``Torchrun``): the running ranks as the parent sees them: their pids,
  which exited and how, their Python stacks on demand (faulthandler, SIGUSR1), and stopping them
  (SIGTERM, then SIGKILL after ``GRACE`` seconds).
- Inside a rank: capture stdout/stderr into files, join the process group, run fn, leave its
  result or its traceback in the launch's directory; die with the parent (``die_with_parent``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

GRACE = 2.0  # seconds between SIGTERM and SIGKILL when stopping ranks
POLL = 0.02  # seconds between looks at the ranks
# What torchrun's process and each of its workers run (python -c): torchrun_agent, torchrun_worker.
AGENT = "import sys, minizero.launcher.ranks as m; sys.exit(m.torchrun_agent(sys.argv[1:]))"
WORKER = "import sys, minizero.launcher.ranks as m; sys.exit(m.torchrun_worker(sys.argv[1]))"


# ---------------------------------------------------------------- the running ranks


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


class Ranks:
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
        stacks, end = {}, time.monotonic() + GRACE
        for r in late:
            f = self.tmp / f"{r}.stack"
            while not (f.exists() and f.stat().st_size) and time.monotonic() < end:
                time.sleep(POLL)
            time.sleep(POLL)  # let it finish writing
            text = f.read_text(errors="replace") if f.exists() else ""
            text = text.split("_rank_main")[0].rpartition("\n")[0]  # drop the launcher's frames
            stacks[r] = text or "(no stack: the rank had not started)"
        return "".join(f"rank {r}: {text}\n" for r, text in stacks.items())


class Forked(Ranks):
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
            p.join(GRACE)
            if p.is_alive():
                p.kill()
                p.join()


class Torchrun(Ranks):
    def __init__(self, tmp: Path, n: int, proc: subprocess.Popen):
        super().__init__(tmp, n)
        self.proc = proc

    def pids(self) -> dict[int, int]:  # only pids still running this launch's workers
        return {r: pid for r, pid in super().pids().items() if _runs(pid, str(self.tmp))}

    def exited(self) -> list[int]:
        return list(range(self.n)) if self.proc.poll() is not None else []

    def settle(self) -> None:
        self.wait(GRACE)  # torchrun notices a failed worker, stops the rest and reports

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
            self.wait(GRACE)
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


def start_fork(tmp, fn, args, kwargs, n, backend, timeout) -> Forked:
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush(), sys.stderr.flush()  # or buffered text would print twice
    ranks = Forked(tmp, n, [])
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


def start_torchrun(tmp, fn, args, kwargs, n, backend, timeout) -> Torchrun:
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
    cmd = [sys.executable, "-c", AGENT, str(os.getpid()), "--standalone", "--nnodes=1",
           f"--nproc-per-node={n}", "--monitor-interval=0.05", "--no-python",
           sys.executable, "-c", WORKER, str(tmp)]  # fmt: skip
    with open(tmp / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    return Torchrun(tmp, n, proc)


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
    die_with_parent()
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
        _wait_for_peers(tmp, world)
        return True
    except BaseException as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        _put(tmp / f"{rank}.err", tb.encode())
        return False
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_for_peers(tmp: Path, world: int) -> None:
    """Keep this rank's connections up until every rank has returned or raised. A rank that left
    early would break a peer still in a collective with it (a subgroup being connected, say):
    the peer's "Connection closed by peer" would then hide what really went wrong. A peer that
    never finishes is the parent's to stop (its timeout)."""
    while not all((tmp / f"{r}.ok").exists() or (tmp / f"{r}.err").exists() for r in range(world)):
        time.sleep(POLL)


def _put(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # the parent never sees half a file


def die_with_parent(parent: int | None = None) -> None:
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


def torchrun_agent(argv: list[str]) -> int:
    """What a launch's torchrun process runs (``AGENT``): ``argv`` is the launching process's pid,
    then torchrun's arguments. Torchrun, killed when the launching process dies; its workers die
    with it (each calls ``die_with_parent``)."""
    die_with_parent(int(argv[0]))
    from torch.distributed.run import main

    main(argv[1:])  # raises (exit code 1, traceback in torchrun.log) when a worker failed
    return 0


def torchrun_worker(tmp: str) -> int:
    """What each torchrun worker runs (``WORKER``)."""
    setup = pickle.loads(Path(tmp, "setup.pkl").read_bytes())
    sys.path[:] = setup["sys_path"]  # before unpickling fn: its module may live on that path
    env = os.environ
    init = (setup["backend"], int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
            None, setup["timeout"])  # fmt: skip
    ok = _rank_main(Path(tmp), init, Path(tmp, "job.pkl"))
    return 0 if ok else 1  # a failed worker makes torchrun stop the others


# ---------------------------------------------------------------- python -m minizero run
