"""What every benchmark shares: where it was measured, how it prints, its JSON, its ranks.

Used by ``bench.py`` (collectives, and the ``bench`` command line), ``bench_steps.py`` (ddp,
stages), ``bench_ckpt.py`` (checkpoints) and ``demo.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from minizero.checkpoint import files
from minizero.launcher import default_nprocs, gpu_count, rank_device
from minizero.launcher.progress import launch_with_progress

COMMANDS = {
    "checkpoints": "minizero.save_checkpoint / load_checkpoint at each stage: save and load time "
    "(median, slowest rank) and the bytes each rank wrote, beside (P + K)Ψ/N.",
    "collectives": "An nccl-tests-like table of all_reduce, reduce_scatter, all_gather and "
    "broadcast over message sizes (time, algbw, busbw), each through minizero and through "
    "torch.distributed directly, interleaved call by call.",
    "ddp": "minizero's DDP next to torch's DistributedDataParallel on the same model and ranks, "
    "alternating a few steps each: step time, CPU time, memory per rank, and whether both end "
    "with the same parameters.",
    "stages": "Each minizero stage next to its PyTorch peer, alternating a few steps each: "
    "stage 0 vs DistributedDataParallel, 1 vs DDP + ZeroRedundancyOptimizer, 2 vs FSDP2 "
    "(reshard_after_forward=False), 3 vs FSDP2 (True): step time and memory per rank.",
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measured_on() -> dict:
    """Inside a rank: what these figures were measured on (backend, device, world, torch)."""
    dev = rank_device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    return dict(backend=dist.get_backend(), device=name, world=dist.get_world_size(),
                torch=torch.__version__)  # fmt: skip


def cpu_name() -> str:
    """This machine's CPU as the benches name it: its model and core count."""
    name = "CPU"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def header(title: str, where: dict) -> str:
    return (f"minizero bench {title}: {where['world']} ranks, {where['backend']} on "
            f"{where['device']}, torch {where['torch']}")  # fmt: skip


def printer() -> bool:
    """Under torchrun every rank gets the results; only global rank 0 prints them."""
    return os.environ.get("RANK", "0") == "0"


def write_json(path: str | Path, data: dict) -> None:
    """Write a benchmark's results whole (the checkpoint's atomic writer), and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    files.write_json(Path(path), data)
    print(f"wrote {path}")


def ranks(nprocs: int | None) -> int:
    """``nprocs``, or the default: one rank per GPU with 2 or more GPUs, else 2 on the CPU."""
    return nprocs or default_nprocs()


def run_ranks(fn: Callable, n: int, timeout: float, *args, total: int, desc: str) -> list:
    """``launch(fn, n, *args)`` with a progress bar (stderr) that follows rank 0's ticks."""

    if n > gpu_count():  # gloo ranks are forked from this process: import once what they need
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # first one imports torch._dynamo
    return launch_with_progress(fn, n, *args, total=total, desc=desc, timeout=timeout,
                                verbose=False)  # fmt: skip
