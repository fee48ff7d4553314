"""The habits of a PyTorch training loop that a data-parallel wrapper must notice, in one place.

Each guard stands for one habit that would otherwise train a different model without a word, or
hang (the README's "What a PyTorch user expects" says, habit by habit, what happens). A guard
either makes the habit mean what it means with torch DDP and FSDP2, or refuses it with one message
that names the habit and says what works instead.

    guards.py        a parameter without a gradient (unused, cleared by hand, no backward since
                     zero_grad); p.grad after backward; an optimizer over some parameters
    sharded_grad.py  p.grad where no rank holds it whole: clip_grad_norm_ and norms on shards
    autograd.py      double backward, sparse gradients
    module.py        the wrapped model: one wrapper per model, fp32 only, frozen flags fixed,
                     its attributes and its state dict; every rank arriving at a collective
    optimizer.py     the optimizer: elementwise ones only at stages 1-3, no SparseAdam
                     (parallelize asks it; the others are Habits' guards, below)

                     the first backward made the gradients ready

The core (data_parallel.py and the stages) imports none of this: it calls the extension points
of :class:`~minizero.data_parallel.Extension`, one per moment. :class:`Habits` implements them,
and importing this package (``import minizero`` does) makes it every wrapper's extension.
"""

from __future__ import annotations

from minizero.data_parallel import DataParallel, Extension
from minizero.habits import autograd, module
from minizero.rebuild import Rebuild
from minizero.habits.guards import GradGuards
from minizero.habits.sharded_grad import GradNorms
from minizero.precision import full_dtype


class Habits(Extension):
    """The habit guards of one wrapper, at the core's extension points."""

    def __init__(self, wrapper: DataParallel) -> None:
        super().__init__(wrapper)
        model, names = wrapper.module, wrapper.param_names
        trainable = [p for p in model.parameters() if p.requires_grad]
        module.refuse_dtypes(trainable, names, full_dtype(wrapper.precision))
        module.refuse_second_wrapper(model, type(wrapper).__name__)  # before any hook
        self.flags = module.FrozenFlags(model, names)
        self.arrival = module.ArrivalCheck(wrapper.group, wrapper.world)
        self.norms = GradNorms(wrapper)
        self.grads = GradGuards(wrapper, self.norms)  # its hook first: it counts the used ones
        autograd.install(trainable, self.grads.show)
        self.buckets = Rebuild(wrapper)  # notes the ready order (stages 0-2)
        # model.zero_grad() on the user's module clears the stage's gradients too; the module's
        # own load_state_dict refreshes the masters, its state_dict is full fp32
        model.zero_grad = wrapper.zero_grad  # type: ignore[method-assign]
        module.full_module_load_state_dict(wrapper)  # and stage 3's shards, 16-bit masters
        model.register_state_dict_post_hook(module.full_module_state_dict(wrapper))

    def before_forward(self) -> None:
        self.buckets.before_forward()  # first: p.grad still says whether gradients are held
        self.flags.check()
        self.grads.show()

    def after_backward(self) -> None:
        self.grads.after_backward()

    def params_without_grad(self) -> set[int] | None:
        return self.grads.params_without_grad()

    def zero_grad(self, set_to_none: bool) -> None:
        self.grads.zero_grad(set_to_none)
        self.buckets.at_zero_grad()  # before the stage's reset_grads: on the new buffers

    def state_dict(self, destination: dict | None, prefix: str) -> dict:
        return module.full_state_dict(self.wrapper, destination, prefix)

    def load_state_dict(self, state_dict: dict, strict: bool):
        return module.load_full_state_dict(self.wrapper, state_dict, strict)

    def missing_attribute(self, name: str):
        return module.forward_attribute(self.wrapper, name)


DataParallel.extension = Habits  # every wrapper built from now on composes the habits
