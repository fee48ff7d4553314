"""The lessons' experiments: what a lesson measures, as functions named for what they measure.

A lesson's measurement cell states, as data, what runs and what it is compared with, then calls
one function here to measure and one to show. Each function returns plain data (rows: lists of
dicts, or a dataclass); ``show_*`` prints it as a table, ``plot_*`` draws it. One module per
lesson, ``labs/lessonNN.py`` for ``course/NN_name.py``; what several lessons share is here.

Every lesson opens with one import line and one setup call::

    from minizero.course.labs.lesson00 import *  # torch, dist, minizero, hint, lab, lesson00

    NPROCS, INFO = setup()

The star import brings exactly the module's ``__all__``: the libraries the lesson's own code uses
(``torch``, ``dist``, ``minizero``, ...), ``hint``, the lesson's checks (``lesson00``, from
:mod:`minizero.course.checks`), and the lab itself as ``lab`` (``lab.bandwidth(...)``).
"""

from __future__ import annotations

import torch

import minizero
from minizero.course.checks.common import describe, run_info
from minizero.launcher import default_nprocs, rank_device
from minizero.launcher.progress import launch_with_progress

__all__ = [
    "default_nprocs",
    "describe",
    "launch_with_progress",
    "rank_device",
    "run_info",
    "setup",
]


def setup(nprocs: int | None = None, **about) -> tuple[int, dict]:
    """How many ranks a lesson's cells launch (one per GPU where there are two or more, else two
    CPU ranks) and where they measure (``run_info`` of rank 0); prints both, with ``about``'s
    ``name=value`` pairs (e.g. the model's Ψ)."""
    n = nprocs or default_nprocs()
    info = minizero.launch(run_info, n)[0]
    extra = "".join(
        f" | {k} = {v:,}" if isinstance(v, int) else f" | {k} = {v}" for k, v in about.items()
    )
    print(f"minizero {minizero.__version__}, torch {torch.__version__} | {describe(info)}{extra}")
    return n, info
