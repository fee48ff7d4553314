"""Naive DDP: one all-reduce per parameter once backward is over. Taught in lesson 01 (01_ddp).

The baseline that ddp.py's bucketed, overlapped DDP improves on; not a link of the paper's chain.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.bucket import trainable_parameters
from minizero.data_parallel import DataParallel
from minizero.seams import Extension


class NaiveDDP(DataParallel):
    """After backward, all-reduce every gradient, one collective per parameter, then average.

    Correct and slow: Ψ elements cross the network only after backward has finished, in as many
    small messages as there are parameters. fp32 only; use :class:`DDP` for mixed precision.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        extension: type[Extension] = Extension,
    ):
        super().__init__(
            module,
            process_group=process_group,
            find_unused_parameters=find_unused_parameters,
            extension=extension,
        )
        self.params = trainable_parameters(module)
        # DataParallel's post_accumulate_grad_hook queues backward's end: all-reduce all there
        self.register_hooks(self.params)

    def backward_end(self) -> None:
        if not self.require_sync:
            return
        for p in self.params:
            if p.grad is None:  # unused on this rank: it still takes part in the average
                p.grad = torch.zeros_like(p)
            C.all_reduce(p.grad, group=self.group, tag="naive")
            p.grad.div_(self.world)

    def reset_grads(self, set_to_none: bool) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
