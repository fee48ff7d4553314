"""The optimizers a user brings, and which of them can step flat shards of the parameters.

At stages 1-3 (and in mixed precision) each rank steps flat fragments of the parameters: only an
elementwise optimizer gives the same result there as on whole tensors, and SparseAdam would see
no sparse gradient. ``parallelize`` refuses the others, by name, before it wraps anything.
"""

from __future__ import annotations

import inspect

import torch

# Optimizers whose update of element i reads only element i of the parameter, its gradient and its
# states: only those give the same result on a flat shard as on the whole tensor. Subclasses count.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)  # fmt: skip


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that mix elements: they cannot run on a flat shard of the parameters."""
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise TypeError(
            f"minizero steps each rank's flat shard of the parameters, which gives the same result "
            f"as the whole model only for elementwise optimizers ({names}, or subclasses). "
            f"{type(optimizer).__name__} is not one of them; use one of those, or stage=0 with "
            f"precision='fp32' (plain DDP: the optimizer sees whole parameters)."
        )
    base = next(c for c in type(optimizer).__mro__ if c in ELEMENTWISE)  # the nearest one
    check_step_is_elementwise(optimizer, base)


def check_step_is_elementwise(optimizer: torch.optim.Optimizer, base: type) -> None:
    """A subclass of an elementwise optimizer is elementwise only if it keeps the base's
    ``step``: LAMB written on Adam (or LARS on SGD) overrides it with per-tensor norms, which on
    a flat shard would be norms of fragments. A subclass that is elementwise anyway says so with
    ``minizero_elementwise = True``."""
    cls = type(optimizer)
    if getattr(cls, "minizero_elementwise", False):
        return
    want = inspect.unwrap(base.step)  # torch wraps step with profiling hooks; compare the code
    for c in cls.__mro__[: cls.__mro__.index(base)]:
        step = None if c.__dict__.get("minizero_wraps_step") else c.__dict__.get("step")
        if step is not None and inspect.unwrap(step) is not want:
            raise TypeError(
                f"{cls.__name__}.step overrides {base.__name__}.step: at stages 1-3 (and in mixed "
                f"precision) each rank steps flat fragments of the parameters, so a step that "
                f"uses per-tensor norms (LAMB, LARS) would compute them over fragments. Use "
                f"stage=0 with precision='fp32', or, if your step is elementwise, set "
                f"{cls.__name__}.minizero_elementwise = True"
            )


def refuse_sparse_adam(optimizer: torch.optim.Optimizer) -> None:
    """SparseAdam updates only the rows present in a sparse gradient; minizero's gradients are
    dense (a bucket holds every element), so it would see none of its kind."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError(
            "SparseAdam needs sparse gradients, and minizero makes every gradient dense (its "
            "buckets are flat dense buffers; nn.Embedding(sparse=True) works, with a dense "
            "gradient). Use an optimizer that takes dense gradients: SGD or Adagrad step a dense "
            "gradient exactly as its sparse form; Adam or AdamW also update the moments of rows "
            "not in the batch, which SparseAdam skips."
        )
