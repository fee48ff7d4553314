"""The seam between the core and minizero/habits/: :class:`Extension`, one method per moment.

The core (data_parallel.py, the stages, the optimizer, checkpoints, parallelize) calls the habits
only as ``wrapper.habits.<method>(...)``, a method of :class:`Extension`, at the moment its
docstring names; this class is the plain behaviour (nothing, or torch's own). ``parallelize``
composes ``minizero.habits.Habits``; a wrapper built directly gets its constructor's
``extension=`` (this class by default). Importing a module composes nothing (test_layout.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Extension:
    """Every call the core makes on ``wrapper.habits``, each with its plain behaviour."""

    def __init__(self, wrapper: nn.Module) -> None:  # a data_parallel.DataParallel
        """At construction, before any hook of the stage: may refuse the model."""
        self.wrapper = wrapper

    @classmethod
    def refuse_optimizer(cls, optimizer: Any, sharded: bool) -> None:
        """``parallelize``, before wrapping: refuse an optimizer by its class (``sharded``: each
        rank steps flat fragments, stages 1-3 or mixed precision). Here: none."""

    def check_optimizer(self, optimizer: Any) -> None:
        """``parallelize``, once wrapped, before ``attach``: refuse one by what it holds."""

    def attached(self, optimizer: Any) -> Any:
        """``parallelize``, after ``attach``: the optimizer the user gets. Here: it."""
        return optimizer

    def adopt(self, optimizer: Any) -> bool:
        """``load_checkpoint``: make an optimizer built after wrapping this wrapper's; True when it
        is. Here: only one already attached to it."""
        return optimizer in self.wrapper.optimizers

    def adopt_on_first_step(self) -> None:
        """``parallelize``, once wrapped: adopt an optimizer built afterwards at its first step
        (FSDP2's order). Here: none."""

    def before_forward(self) -> None:
        """At the start of every forward, after the bucket rebuild's moment."""

    def before_accumulate(self) -> None:
        """A gradient reaches a parameter, before autograd adds it into ``p.grad``."""

    def grad_accumulated(self, p: nn.Parameter) -> None:
        """Autograd accumulated ``p.grad``; before the stage's ``on_grad_ready(p)``."""

    def after_backward(self) -> None:
        """Once a synchronised backward is over, after the stage's ``backward_end()``."""

    def params_without_grad(self) -> set[int] | None:
        """At the step: id(p) of the parameters the optimizer skips; None: every one."""
        return set()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``optimizer.clip_grad_norm_``: here torch's, on this rank's ``p.grad``."""
        grads = [p for p in self.wrapper.module.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)

    def zero_grad(self, set_to_none: bool) -> None:
        """At ``zero_grad()``, before the stage's ``reset_grads``."""

    def zero_grad_of(self, ids: set[int], set_to_none: bool = True) -> None:
        """``zero_grad()`` of an optimizer over some parameters (``ids``): clear only theirs."""
        for p in self.wrapper.module.parameters():
            if id(p) in ids and p.requires_grad:
                self.wrapper.clear_grad(p)
                if set_to_none:
                    p.grad = None

    def state_dict(self, destination: dict | None, prefix: str) -> dict:
        """``model.state_dict()``: here nn.Module's."""
        return nn.Module.state_dict(self.wrapper, destination=destination, prefix=prefix)

    def load_state_dict(self, state_dict: dict, strict: bool):
        """``model.load_state_dict(sd)``: here nn.Module's."""
        return nn.Module.load_state_dict(self.wrapper, state_dict, strict)

    def missing_attribute(self, name: str) -> Any:
        """An attribute the wrapper does not have: return one, or raise AttributeError."""
        raise AttributeError(f"{type(self.wrapper).__name__!r} object has no attribute {name!r}")
