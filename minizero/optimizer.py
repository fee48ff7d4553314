"""The optimizer that ``parallelize`` returns: the user's own, with the stage around its step.

Taught in lesson 02 (02_zero1). The user's ``optimizer_fn`` builds a normal torch optimizer on the
tensors this rank updates (the whole model for DDP in fp32, flat fp32 master shards for ZeRO). We
keep that object, so ``param_groups``, ``state_dict()`` and LR schedulers work as usual, and put a
small class in front of its own, so that ``step()`` and ``zero_grad()`` also do the stage's part:

    before_step()  reduce / unscale / copy gradients to the master tensors  (False: skip, fp16 inf)
    <the user's optimizer step on this rank's tensors>
    after_step()   copy masters back to the working parameters, all-gather them (ZeRO)
"""

from __future__ import annotations

from typing import Protocol

import torch


class Stage(Protocol):
    def before_step(self) -> bool: ...
    def after_step(self) -> None: ...
    def end_step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...


class StageStep:
    """Mixin placed before the user's optimizer class; ``self._stage`` is the wrapper."""

    _stage: Stage

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(
                "minizero optimizers take no closure: compute the loss, call "
                "loss.backward(), then optimizer.step()"
            )
        if self._stage.before_step():
            super().step()
        self._stage.after_step()
        self._stage.end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._stage.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global L2 norm is at most ``max_norm``; return the norm."""
        return self._stage.clip_grad_norm_(max_norm)

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = [p for g in self.param_groups for p in g["params"]]  # masters (or the params)
        for st in self.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return {"optimizer": tensors}


def attach(optimizer: torch.optim.Optimizer, stage: Stage) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` and ``zero_grad()`` run ``stage``'s part too; return it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(optimizer)}")
    cls = type(optimizer)
    optimizer.__class__ = type(cls.__name__, (StageStep, cls), {"__module__": cls.__module__})
    optimizer._stage = stage
    return optimizer
