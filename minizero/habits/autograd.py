"""Two autograd habits the stages' gradient hooks must not see: double backward and sparse
gradients. Each parameter gets two hooks, registered before the stage's own (so they run first)."""

from __future__ import annotations

import torch
from torch import nn

from minizero.units import UncopiedHook


def densify(p: nn.Parameter) -> None:
    """``nn.Embedding(sparse=True)``: its sparse gradient is made dense before the stage's hook
    sees it. The buckets are dense, and SGD or Adagrad step a dense gradient exactly as its
    sparse form (SparseAdam, which needs the sparse one, is refused)."""
    if p.grad is not None and p.grad.layout != torch.strided:
        p.grad = p.grad.to_dense()


def install(params: list[nn.Parameter], show_grads) -> None:
    """``show_grads`` runs as a gradient reaches a parameter, before autograd adds it into
    ``p.grad``: after a backward, stages 1-3 (and fp16) leave a ``ShardedGrad`` in ``p.grad``
    until the next forward; a second backward before it (``retain_graph=True``, as FSDP2
    allows) accumulates into what backward sees instead. (``UncopiedHook``: a deepcopy of the
    model drops it.) Then ``densify``, after accumulation."""
    for p in params:
        p.register_hook(UncopiedHook(lambda grad: show_grads()))
        p.register_post_accumulate_grad_hook(densify)
