"""Two autograd habits the stages' gradient hooks must not see: double backward and sparse
gradients. Both run from the core's per-parameter hooks (``DataParallel.register_hooks``) before
the stage's: ``Habits.before_accumulate`` shows the gradients to a second backward
(``GradGuards.show``), ``Habits.grad_accumulated`` calls :func:`densify`."""

from __future__ import annotations

import torch
from torch import nn


def densify(p: nn.Parameter) -> None:
    """``nn.Embedding(sparse=True)``: its sparse gradient is made dense before the stage's hook
    sees it. The buckets are dense, and SGD or Adagrad step a dense gradient exactly as its
    sparse form (SparseAdam, which needs the sparse one, is refused)."""
    if p.grad is not None and p.grad.layout != torch.strided:
        p.grad = p.grad.to_dense()
