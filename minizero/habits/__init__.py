"""The habits of a PyTorch training loop that a data-parallel wrapper must notice, in one place.

Each guard stands for one habit that would otherwise train a different model without a word, or
hang (docs/package.md, "What a PyTorch user expects", says, habit by habit, what happens). A guard
either makes the habit mean what it means with torch DDP and FSDP2, or refuses it with one message
that names the habit and says what works instead.

    guards.py        a parameter without a gradient (unused, cleared by hand, no backward since
                     zero_grad); p.grad after backward; an optimizer over some parameters
    sharded_grad.py  p.grad where no rank holds it whole: clip_grad_norm_ and norms on shards
    autograd.py      double backward, sparse gradients
    module.py        the wrapped model: one wrapper per model, fp32 only, frozen flags fixed,
                     its attributes and its state dict; every rank arriving at a collective
    optimizer.py     the optimizer: elementwise ones only at stages 1-3, no SparseAdam
                     (parallelize asks it through Extension; adopted after wrapping)

The core (data_parallel.py, the stages, the optimizer, checkpoints) imports none of this: it calls
the methods of :class:`~minizero.seams.Extension`, one per moment, on ``wrapper.extension``.
:class:`Habits` implements them; ``parallelize`` composes it (``extension=Habits``), and a wrapper
built directly gets it only when its constructor is told so. Importing this package changes
nothing.
"""

from __future__ import annotations

import torch

from minizero.data_parallel import DataParallel
from minizero.habits import autograd, module
from minizero.habits import optimizer as optimizer_habits
from minizero.habits.guards import GradGuards
from minizero.habits.sharded_grad import GradNorms
from minizero.optimizer.state import Rebuild
from minizero.precision import full_dtype
from minizero.seams import Extension


class Habits(Extension):
    """The habit guards of one wrapper, and torch DDP's bucket rebuild (``Rebuild``: cut again in
    the first backward's ready order), at the core's extension points."""

    def __init__(self, wrapper: DataParallel) -> None:
        super().__init__(wrapper)
        model, names = wrapper.module, wrapper.param_names
        trainable = [p for p in model.parameters() if p.requires_grad]
        module.refuse_dtypes(trainable, names, full_dtype(wrapper.precision))
        module.refuse_second_wrapper(model, type(wrapper).__name__)  # before any hook
        self.flags = module.FrozenFlags(model, names)
        self.arrival = module.ArrivalCheck(wrapper.group, wrapper.world)
        self.norms = GradNorms(wrapper)
        self.grads = GradGuards(wrapper, self.norms)
        self.rebuild = Rebuild(wrapper)  # (a no-op where the stage keeps its buckets)
        # model.zero_grad() on the user's module clears the stage's gradients too; the module's
        # own load_state_dict refreshes the masters, its state_dict is full fp32
        model.zero_grad = wrapper.zero_grad  # type: ignore[method-assign]
        module.full_module_load_state_dict(wrapper)  # and stage 3's shards, 16-bit masters
        model.register_state_dict_post_hook(module.full_module_state_dict(wrapper))

    @classmethod
    def refuse_optimizer(cls, optimizer: torch.optim.Optimizer, sharded: bool) -> None:
        optimizer_habits.refuse_optimizer(optimizer, sharded)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer_habits.check_optimizer(optimizer, self.wrapper.module)

    def attached(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer_habits.keep_scheduler_step(optimizer)  # a scheduler built before

    def adopt(self, optimizer: torch.optim.Optimizer) -> bool:
        return optimizer_habits.adopt(optimizer, self.wrapper)

    def adopt_on_first_step(self) -> None:
        optimizer_habits.adopt_on_first_step(self.wrapper)

    def bucket_order(self) -> list[str] | None:
        return self.rebuild.order()

    def cut_as(self, names: list[str]) -> None:
        self.rebuild.rebuild_as(names)

    def before_forward(self) -> None:
        self.rebuild.when_due(forward=True)  # first: p.grad still says whether any is held
        self.flags.check()
        self.grads.show()

    def before_accumulate(self) -> None:
        self.grads.show()  # a second backward accumulates into what backward sees

    def grad_accumulated(self, p) -> None:
        self.grads.used.add(id(p))  # first: which parameters got a gradient
        autograd.densify(p)
        self.rebuild.note(p)

    def backward_end(self) -> None:
        self.grads.backward_end()

    def params_without_grad(self) -> set[int] | None:
        return self.grads.params_without_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.norms.clip_grad_norm_(max_norm, norm_type)

    def zero_grad(self, set_to_none: bool) -> None:
        self.grads.zero_grad(set_to_none)
        self.rebuild.when_due(forward=False)  # before the stage's reset_grads: it clears them

    def zero_grad_of(self, ids: set[int], set_to_none: bool = True) -> None:
        self.grads.zero_grad_of(ids, set_to_none)

    def state_dict(self, destination: dict | None, prefix: str) -> dict:
        return module.full_state_dict(self.wrapper, destination, prefix)

    def load_state_dict(self, state_dict: dict, strict: bool):
        return module.load_full_state_dict(self.wrapper, state_dict, strict)

    def missing_attribute(self, name: str):
        return module.forward_attribute(self.wrapper, name)
