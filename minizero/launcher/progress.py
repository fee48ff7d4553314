"""A progress bar over a launch: rank 0 ticks, the caller's tqdm bar follows (lessons, benchmarks).

``launch_with_progress(fn, nprocs, *args, total=T, desc="steps")`` passes ``fn`` a ``progress``
keyword; rank 0 calls ``progress.tick()`` after each unit of work and the bar (a widget in Jupyter,
text elsewhere) moves. The ticks go through a file in a temporary directory: same machine only.
"""

from __future__ import annotations

import os
import tempfile
import threading

import torch.distributed as dist

from minizero.launcher import launch


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
