"""What every lesson's check cells share, and the helpers the lessons' own code calls.

The contract of a check (the checks themselves are in ``lessonNN.py``, one file per lesson): it
runs the student's code on real ranks (``minizero.launch``, gloo on CPU or one rank per GPU over
NCCL), next to the reference implementations: ``torch.distributed`` itself, PyTorch's
``DistributedDataParallel``, minizero's own classes, and one process on the whole batch. It prints
``PASS`` with what was compared, or raises :class:`CheckFailed` saying what differs: which tensor,
which parameter, which step, on which rank, by how much, and what usually causes that.

Each rank catches the student's exceptions and returns them as data, so that the check can say
"your function raised NotImplementedError on rank 0" instead of showing the launcher's traceback.

The lessons' own cells use the rest: how many ranks (:func:`default_nprocs`), this rank's device
(:func:`rank_device`), where a measurement was made, for figure titles (:func:`run_info`,
:func:`describe`), and a progress bar over a launch (:func:`launch_with_progress`).
"""

from __future__ import annotations

import os
import tempfile
import threading
import traceback

import torch
import torch._dynamo  # noqa: F401  imported once here: forked ranks inherit it (else seconds each)
import torch.distributed as dist

from minizero.launch import LaunchError, gpu_count, launch

TIMEOUT = 120.0  # seconds: a student's hung collective becomes a CheckFailed, not a stuck cell


class CheckFailed(AssertionError):
    """A lesson exercise does not match the reference; the message says where and by how much."""


# -- what every lesson uses ------------------------------------------------------------------------
def default_nprocs() -> int:
    """One rank per GPU where there are at least two GPUs, else 2 ranks on the CPU (gloo)."""
    n = gpu_count()
    return n if n >= 2 else 2


def rank_device() -> torch.device:
    """Inside a rank: this rank's GPU under NCCL (the launcher has set it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_info() -> dict:
    """Inside a rank: where the measurement is made, for figure titles (see :func:`describe`)."""
    dev = rank_device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {
        "backend": dist.get_backend(),
        "device": f"{dev.type} ({name})",
        "world": dist.get_world_size(),
    }


def describe(info: dict) -> str:
    """``"gloo · cpu (CPU) · world 2"``: what every figure's title names."""
    return f"{info['backend']} · {info['device']} · world {info['world']}"


class Progress:
    """Passed to a rank function as ``progress``: rank 0 calls ``progress.tick()`` after each unit
    of work and the notebook's bar (see :func:`launch_with_progress`) moves. Same machine only."""

    def __init__(self, path: str):
        self.path = path

    def tick(self, n: int = 1) -> None:
        if dist.get_rank() == 0:
            with open(self.path, "ab") as f:
                f.write(b"." * n)


def launch_with_progress(fn, nprocs: int, *args, total: int, desc: str = "", **kwargs) -> list:
    """``minizero.launch(fn, nprocs, *args, progress=Progress(...), **kwargs)`` with a tqdm bar
    (a widget in Jupyter, text elsewhere) that follows rank 0's ``progress.tick()`` calls."""
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="minizero-progress-") as tmp:
        progress = Progress(os.path.join(tmp, "ticks"))
        bar = tqdm(total=total, desc=desc)
        stop = threading.Event()

        def follow() -> None:  # a thread of the parent: the launch itself runs in the caller
            while True:
                done = stop.wait(0.2)
                ticks = os.path.getsize(progress.path) if os.path.exists(progress.path) else 0
                bar.update(min(ticks, total) - bar.n)
                if done:
                    return

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        try:
            return launch(fn, nprocs, *args, progress=progress, **kwargs)
        finally:
            stop.set()
            watcher.join()
            bar.close()


def guard(fn, *args, **kwargs):
    """Run student code; return (value, None) or (None, short error text naming the line)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]  # drop this frame
        where = f" (at line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        return None, f"{type(e).__name__}: {e}{where}"


def launch_check(fn, nprocs: int | None, *args, timeout: float = TIMEOUT) -> list:
    """``launch(fn, nprocs, *args)`` for a check: a hang or a crash becomes a CheckFailed."""
    nprocs = nprocs or default_nprocs()
    try:
        return launch(fn, nprocs, *args, timeout=timeout, verbose=False)
    except LaunchError as e:
        raise CheckFailed(
            f"the ranks did not finish: {str(e).splitlines()[0]}\nEvery rank must issue the same "
            "collectives in the same order, or they wait for each other forever."
        ) from e


def report_pass(msg: str) -> None:
    """What a check prints when everything matched."""
    print(f"PASS  {msg}")
