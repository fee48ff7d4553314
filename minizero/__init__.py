"""minizero: data parallelism and ZeRO stages 1-3, built from scratch and measured.

Three layers, so that a reader finds the distributed code without the course's plumbing:

* the library a student reads: the files of ``minizero/`` in the table below (what a lesson
  teaches and calls). None of them imports ``minizero.course``.
* the course machinery, ``minizero/course/``: building the notebooks from ``course/*.py``, the
  students' copies, grading, the check cells' code (``checks/lessonNN.py`` for lesson NN), the
  lessons' figures and ``compare``. Its own docstring lists its files.
* tools, beside the library: ``bench.py`` and ``bench_steps.py`` (``python -m minizero bench``:
  each piece against PyTorch's own), ``demo.py``, ``doctor.py`` (is a lab machine ready),
  ``cli.py`` (what every command's parser shares) and ``__main__.py`` (the command list). No
  notebook needs them, so they are not course machinery; no lesson teaches them, so they are not in
  the table. They may use the course's helpers (a progress bar, the lessons' rank count).

``budget.py`` and ``timeline.py`` are library, not course: a lesson calls them as it calls
``memory.py`` (a step's memory budget; when each collective ran, from the profiler), and nothing
in them knows about notebooks.

Where each piece is taught (lessons/ holds the exercises, solutions/ the same notebooks solved):

name                   file                        lesson
=====================  ==========================  ============================================
launch                 minizero/launch.py          00_collectives
all_reduce, CommLedger minizero/collectives.py     00_collectives
NaiveDDP, DDP          minizero/ddp.py             01_ddp
Bucket                 minizero/bucket.py          01_ddp
ZeRO1                  minizero/zero1.py           02_zero1
ZeRO2                  minizero/zero2.py           03_zero2
ZeRO3                  minizero/zero3.py           04_zero3
select_units           minizero/units.py           04_zero3
ShardedParameterError  minizero/units.py           04_zero3
ShardedGrad            minizero/sharded_grad.py    03_zero2
Precision              minizero/precision.py       02_zero1
model_state_bytes      minizero/memory.py          02_zero1 .. 05_all_stages
simulate               minizero/simulate.py        05_all_stages
plots                  minizero/plots.py           05_all_stages, 06_myths
parallelize            minizero/parallelize.py     every lesson
save/load_checkpoint   minizero/checkpoint.py      07_checkpoints
consolidate            minizero/checkpoint.py      07_checkpoints
=====================  ==========================  ============================================
=======
======================  ==========================  ============================================
name                    file                        lesson
======================  ==========================  ============================================
launch, plan            minizero/launch.py          00_collectives
(the ranks' processes)  minizero/launch_ranks.py    00_collectives
all_reduce, CommLedger  minizero/collectives.py     00_collectives
NaiveDDP, DDP           minizero/ddp.py             01_ddp
Bucket                  minizero/bucket.py          01_ddp
profile_step            minizero/timeline.py        01_ddp
ZeRO1                   minizero/zero1.py           02_zero1
Precision               minizero/precision.py       02_zero1
ZeRO2                   minizero/zero2.py           03_zero2
ShardedGrad             minizero/sharded_grad.py    03_zero2
ZeRO3                   minizero/zero3.py           04_zero3
select_units            minizero/units.py           04_zero3
model_state_bytes       minizero/memory.py          02_zero1 .. 05_all_stages
step_budget             minizero/budget.py          05_all_stages
simulate                minizero/simulate.py        05_all_stages
DataParallel            minizero/data_parallel.py   what every stage shares (02_zero1 .. 04)
attach                  minizero/optimizer.py       the optimizer around a stage (02_zero1 ..)
parallelize             minizero/parallelize.py     every lesson
MLP, TinyGPT            minizero/models.py          every lesson
synthetic_batch         minizero/data.py            every lesson
save/load_checkpoint    minizero/checkpoint.py      07_checkpoints (layout: checkpoint_layout.py,
consolidate             minizero/checkpoint.py      files: checkpoint_files.py)
======================  ==========================  ============================================
"""

__version__ = "0.1.0"

# The functions are bound here, after their modules have loaded, so that the package attribute
# `minizero.launch` is the function even though `minizero/launch.py` is also a module.
from minizero.bucket import Bucket  # noqa: E402
from minizero.checkpoint import (  # noqa: E402
    CheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
)
from minizero.collectives import (  # noqa: E402
    CommLedger,
    CommRecord,
    all_gather,
    all_reduce,
    broadcast,
    reduce_scatter,
)
from minizero.data import synthetic_batch  # noqa: E402
from minizero.ddp import DDP, NaiveDDP  # noqa: E402
from minizero.launch import LaunchError, LaunchTimeout, launch  # noqa: E402
from minizero.memory import (  # noqa: E402
    PAPER_TABLE1,
    MemoryMeter,
    format_bytes,
    model_state_bytes,
    model_state_report,
    paper_model_state_bytes,
)
from minizero.models import MLP, GPTConfig, TinyGPT, count_params  # noqa: E402
from minizero.parallelize import full_state_dict, parallelize  # noqa: E402
from minizero.precision import Precision  # noqa: E402
from minizero.simulate import FlatModel, simulate, table1  # noqa: E402
from minizero.units import ShardedParameterError  # noqa: E402
from minizero.zero1 import ZeRO1  # noqa: E402
from minizero.zero2 import ZeRO2  # noqa: E402
from minizero.zero3 import ZeRO3  # noqa: E402

__all__ = [
    "CommLedger", "CommRecord", "all_gather", "all_reduce", "broadcast", "reduce_scatter",
    "LaunchError", "LaunchTimeout", "launch", "Bucket", "DDP", "NaiveDDP", "ZeRO1", "ZeRO2",
    "ZeRO3", "full_state_dict", "parallelize", "PAPER_TABLE1", "MemoryMeter", "format_bytes",
    "model_state_bytes", "model_state_report", "paper_model_state_bytes", "MLP", "GPTConfig",
    "TinyGPT", "count_params", "synthetic_batch", "FlatModel", "simulate", "table1", "Precision",
    "save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError",
    "ShardedParameterError",
]  # fmt: skip
