"""minizero: data parallelism and ZeRO stages 1-3, built from scratch and measured.

Layers, lowest first: core <- habits <- parallelize <- analysis <- package <- tools <- course <-
cli. A module imports its own layer and those below, never above, and no import cycle
(``tests/library/test_layout.py`` draws the import graph and holds both):

* core: the library a student reads, the files at the top of ``minizero/`` (the table below; all
  but parallelize), ``launcher/`` (run a function on N ranks; torchrun) and ``checkpoint/`` (save,
  load, reshard, consolidate). The stages form the paper's chain, each class extending the one
  before: ``DataParallel`` (what every stage shares) <- ``DDP`` <- ``ZeRO1`` (P_os) <- ``ZeRO2``
  (+g) <- ``ZeRO3`` (+p); each stage's file is the delta and opens with the moments it
  overrides. ZeRO++ (``zeropp.py``) is a subclass of ZeRO3; HSDP is a stage's option, its
  replicate group, which ``hsdp.py`` makes from a mesh.
* habits: ``minizero/habits/``, the habits of a PyTorch loop a wrapper must notice (a parameter
  without gradient, ``clip_grad_norm_`` on ``p.grad``, double backward, the wrapped model's
  attributes, ...). The core calls them only through ``seams.Extension``'s methods.
* parallelize: ``parallelize.py``, the one module that composes them (``extension=Habits``, the
  bucket rebuild among the habits); importing a module composes nothing.
* analysis: ``minizero/analysis/`` (the ledger of collectives, memory meters, a step's memory
  budget, the timeline, ZeRO's Table 1 simulated); it watches the collectives
  (``collectives.recorder``), and the core imports none of it.
* package: this file's names; tools: ``minizero/tools/`` (``bench``, ``demo``, ``doctor``, ...);
  course: ``minizero/course/`` (notebooks built from ``course/*.py``, grading, the check cells
  ``checks/lessonNN.py``, the lessons' figures); cli: ``__main__``.

Where each piece is taught (lessons/ holds the exercises, solutions/ the same notebooks solved):

======================  ==============================  =====================================
name                    file                            lesson
======================  ==============================  =====================================
launch, plan            minizero/launcher/__init__.py   00_collectives
(the ranks' processes)  minizero/launcher/ranks.py      00_collectives
all_reduce, broadcast   minizero/collectives.py         00_collectives
CommLedger, name_group  minizero/analysis/ledger.py     00_collectives
ring_bytes              minizero/analysis/topology.py   08_beyond_one_node (nodes, rings)
Bucket                  minizero/bucket.py              01_ddp
DataParallel            minizero/data_parallel.py       what every stage shares (01 .. 04)
Face, Extension         minizero/seams.py               what is read of a stage; the seam to habits/
DDP                     minizero/ddp.py                 01_ddp
NaiveDDP                minizero/naive_ddp.py           01_ddp
Rebuild                 minizero/optimizer/state.py     01_ddp (buckets cut in ready order)
profile_step            minizero/analysis/timeline.py   01_ddp
ZeRO1                   minizero/zero1.py               02_zero1
Precision               minizero/precision.py           02_zero1
attach                  minizero/optimizer/__init__.py  the optimizer around a stage (02 ..)
ZeRO2                   minizero/zero2.py               03_zero2
ShardedGrad             minizero/habits/sharded_grad.py 03_zero2
ZeRO3                   minizero/zero3.py               04_zero3
select_units            minizero/units.py               04_zero3
model_state_bytes       minizero/analysis/memory.py     02_zero1 .. 05_all_stages
step_budget             minizero/analysis/budget.py     05_all_stages
simulate                minizero/analysis/simulate.py   05_all_stages
fit, sweep (α-β)        minizero/analysis/link.py       00_collectives, 01_ddp
Links, predict          minizero/analysis/cost.py       08_beyond_one_node
Scenario                minizero/analysis/scenario.py   08_beyond_one_node (at scale)
parallelize             minizero/parallelize.py         every lesson
MLP, TinyGPT, data      minizero/models.py              every lesson
save/load_checkpoint    minizero/checkpoint/            07_checkpoints
======================  ==============================  =====================================
"""

__version__ = "0.1.0"

from minizero.analysis.ledger import CommLedger, CommRecord  # noqa: E402
from minizero.analysis.memory import (  # noqa: E402
    PAPER_TABLE1,
    MemoryMeter,
    format_bytes,
    model_state_bytes,
    model_state_report,
    paper_model_state_bytes,
)
from minizero.analysis.simulate import FlatModel, simulate, table1  # noqa: E402
from minizero.bucket import Bucket  # noqa: E402
from minizero.checkpoint import (  # noqa: E402
    CheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
)
from minizero.collectives import (  # noqa: E402
    all_gather,
    all_reduce,
    broadcast,
    reduce_scatter,
)
from minizero.ddp import DDP  # noqa: E402
from minizero.habits import Habits  # noqa: E402  (parallelize composes it: extension=Habits)
from minizero.launcher import LaunchError, LaunchTimeout, launch  # noqa: E402
from minizero.models import (  # noqa: E402
    MLP,
    GPTConfig,
    TinyGPT,
    count_params,
    synthetic_batch,  # noqa: E402
)
from minizero.naive_ddp import NaiveDDP
from minizero.parallelize import (  # noqa: E402
    consolidate_state_dict,
    full_state_dict,
    parallelize,
)
from minizero.precision import Precision  # noqa: E402
from minizero.units import ShardedParameterError  # noqa: E402
from minizero.zero1 import ZeRO1  # noqa: E402
from minizero.zero2 import ZeRO2  # noqa: E402
from minizero.zero3 import ZeRO3  # noqa: E402

__all__ = [
    "CommLedger", "CommRecord", "all_gather", "all_reduce", "broadcast", "reduce_scatter",
    "LaunchError", "LaunchTimeout", "launch", "Bucket", "DDP", "NaiveDDP", "ZeRO1", "ZeRO2",
    "ZeRO3", "full_state_dict", "consolidate_state_dict", "parallelize", "PAPER_TABLE1",
    "MemoryMeter", "format_bytes",
    "model_state_bytes", "model_state_report", "paper_model_state_bytes", "MLP", "GPTConfig",
    "TinyGPT", "count_params", "synthetic_batch", "FlatModel", "simulate", "table1", "Precision",
    "save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError",
    "ShardedParameterError", "Habits",
]  # fmt: skip
