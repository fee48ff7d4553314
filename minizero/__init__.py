"""minizero: data parallelism and ZeRO stages 1-3, built from scratch and measured.

Where each piece is taught (lessons/ holds the exercises, solutions/ the same notebooks solved):

=====================  ==========================  ============================================
name                   file                        lesson
=====================  ==========================  ============================================
launch                 minizero/launch.py          00_collectives
all_reduce, CommLedger minizero/collectives.py     00_collectives
NaiveDDP, DDP          minizero/ddp.py             01_ddp
Bucket                 minizero/bucket.py          01_ddp
ZeRO1                  minizero/zero1.py           02_zero1
ZeRO2                  minizero/zero2.py           03_zero2
ZeRO3                  minizero/zero3.py           04_zero3
model_state_bytes      minizero/memory.py          02_zero1 .. 05_all_stages
simulate               minizero/simulate.py        05_all_stages
parallelize            minizero/parallelize.py     every lesson
=====================  ==========================  ============================================
"""

from importlib import import_module

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use, so `import minizero` stays cheap
# (the launcher forks ranks from a parent that may not need torch.distributed at all).
_WHERE = {
    "launch": "launch",
    "CommLedger": "collectives",
    "CommRecord": "collectives",
    "all_reduce": "collectives",
    "reduce_scatter": "collectives",
    "all_gather": "collectives",
    "broadcast": "collectives",
    "NaiveDDP": "ddp",
    "DDP": "ddp",
    "Bucket": "bucket",
    "ZeRO1": "zero1",
    "ZeRO2": "zero2",
    "ZeRO3": "zero3",
    "parallelize": "parallelize",
    "full_state_dict": "parallelize",
    "model_state_bytes": "memory",
    "MemoryMeter": "memory",
    "format_bytes": "memory",
    "model_state_report": "memory",
    "PAPER_TABLE1": "memory",
    "count_params": "models",
    "paper_model_state_bytes": "memory",
    "simulate": "simulate",
    "table1": "simulate",
    "FlatModel": "simulate",
    "TinyGPT": "models",
    "GPTConfig": "models",
    "MLP": "models",
    "synthetic_batch": "data",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(f"minizero.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
