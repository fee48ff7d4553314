"""A stage's two seams: the face it shows, and the extension it calls.

**The face** (:class:`Face`, with :class:`Sharded` and :class:`Fragment`): all that the modules
around the stages (the habits, the optimizer, optimizer/state.py, checkpoint/, analysis/,
ZeRO++) read of a wrapper, beside nn.Module's own: what is sharded, the fragments and what each
rank owns, the gradients the step reads, the tensors it holds, a fragment's range read and
written. docs/design.md's table says who reads which field; tests/library/test_layout.py fails
on any other wrapper attribute read outside the stage files, on a switch on a stage's number
and on a ``hasattr`` probe of a wrapper.

**The extension** (:class:`Extension`), the seam between the core and minizero/habits/, one
method per moment. The core (data_parallel.py, the stages, the optimizer, checkpoints,
parallelize) calls the habits only as ``wrapper.extension.<method>(...)``, a method of
:class:`Extension`, at the moment its docstring names; this class is the plain behaviour (nothing,
or torch's own). ``parallelize`` composes ``minizero.habits.Habits``; a wrapper built directly gets
its constructor's ``extension=`` (this class by default). Importing a module composes nothing
(test_layout.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from minizero.precision import LossScaler, Precision


@dataclass(frozen=True, eq=False)
class Fragment:
    """Elements [start, end) of ``param`` (flattened) that this rank owns, at [offset, offset +
    numel) of its range of bucket ``bucket``; ``tensor``: what the optimizer steps for them, a
    (numel,) view of the fp32 masters, or (fp32 DDP) the parameter itself."""

    name: str
    param: nn.Parameter
    bucket: int
    start: int
    end: int
    offset: int
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def is_flat_view(self) -> bool:
        """The optimizer steps a flat view, of the masters (fp32 ZeRO: of the working copy)."""
        return self.tensor is not self.param


@dataclass(frozen=True)
class Sharded:
    """What a stage partitions over the ranks of its group: the paper's P_os (the optimizer
    states, with their fp32 masters), P_g (the gradients), P_p (the parameters between uses)."""

    state: bool = False
    grads: bool = False
    params: bool = False


class Face(Protocol):
    """A stage's face: all that the modules around the stages (the habits, the optimizer,
    optimizer/state.py, the checkpoint, analysis/, ZeRO++) read of a wrapper, beside
    nn.Module's own. docs/design.md's table says who reads which; tests/library/test_layout.py
    fails on any other wrapper attribute read outside the stage files."""

    # what it wraps and over which ranks
    module: nn.Module  # the user's model
    params: list[nn.Parameter]  # trainable, registration order
    param_names: dict[int, str]  # id(param) -> its first name
    group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None  # HSDP: the same shards on every node (else None)
    world: int
    rank: int
    stage: int  # a label, for messages and records: what differs is read from ``sharded``
    precision: Precision
    scaler: LossScaler | None  # fp16's loss scale
    find_unused_parameters: bool
    require_sync: bool  # False inside no_sync()
    # what is sharded; the fragments and what each rank owns
    sharded: Sharded
    fragments: list[Fragment]  # what this rank's optimizer steps, one per parameter and range
    fragments_of: dict[int, list[Fragment]]  # id(param) -> its fragments on this rank
    buckets: list  # bucket.Bucket (stage 3: its units), which the fragments index
    # what is composed around it
    extension: Extension  # the seam to minizero/habits/ (below)
    rebuilds_buckets: bool  # whether its buckets are cut again in ready order
    optimizers: weakref.WeakKeyDictionary  # attach()ed optimizers -> optimizer.Adopted

    @property
    def separate_masters(self) -> bool:
        """True where the optimizer steps fp32 masters, not the parameters themselves."""

    def fragment_values(self, f: Fragment) -> torch.Tensor:
        """A fragment's range of the working copy, as this rank holds it (writes: load_param)."""

    def load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        """Write a full fp32 value of ``p`` into this rank's working copy and masters."""

    def params_written(self) -> None:
        """The working copy was written outside minizero: refresh the masters from it."""

    def full_params(self) -> dict[int, torch.Tensor]:
        """id(param) -> the whole parameter in fp32 (collective where sharded)."""

    def lay_out(self, ready: list[nn.Parameter]) -> None:
        """Cut the buckets over ``ready``, and all that sits on them (the rebuild)."""

    # the gradients the step reads
    def step_grads(self) -> list[torch.Tensor | None]:
        """This step's fp32 gradients, per bucket (owned,), made once a step."""

    @property
    def has_step_grads(self) -> bool:
        """Whether this step's gradients are made (a norm computed before belongs to them)."""

    def forget_step_grads(self) -> None:
        """This step's gradients, if any, were of other parameters (a load): make them again."""

    def holds_unsynced_grads(self) -> bool:
        """True while no_sync() backwards have left gradients that no rank has reduced."""

    def visible_grad(self, p: nn.Parameter) -> torch.Tensor | None: ...
    def clear_grad(self, p: nn.Parameter) -> None: ...

    # the step's moments, as the optimizer calls them
    def before_step(self) -> bool: ...
    def after_step(self) -> None: ...
    def end_step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def broadcast_from_rank0(self, t: torch.Tensor, tag: str) -> None: ...

    # the tensors it holds
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What it holds, by category: "params", "grads", "comm" (buffers alive for a
        collective)."""


class Extension:
    """Every call the core makes on ``wrapper.extension``, each with its plain behaviour."""

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

    def bucket_order(self) -> list[str] | None:
        """The names the buckets are cut over, where they are cut again in ready order (a
        checkpoint and an optimizer state dict record it). Here: None, they never are."""
        return None

    def cut_as(self, names: list[str]) -> None:
        """Loading a checkpoint or an optimizer state dict: cut the buckets over the saved run's
        ``bucket_order()``. Here: nothing."""

    def before_forward(self) -> None:
        """At the start of every forward."""

    def before_accumulate(self) -> None:
        """A gradient reaches a parameter, before autograd adds it into ``p.grad``."""

    def grad_accumulated(self, p: nn.Parameter) -> None:
        """Autograd accumulated ``p.grad``; before the stage's ``post_accumulate_grad_hook(p)``."""

    def backward_end(self) -> None:
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
