"""The optimizers a user brings, and which of them can step flat shards of the parameters.

At stages 1-3 (and in mixed precision) each rank steps flat fragments of the parameters: only an
elementwise optimizer gives the same result there as on whole tensors, and SparseAdam would see
no sparse gradient. ``parallelize`` refuses the others, by name, before it wraps anything, and
an optimizer that holds tensors that are not the model's (:func:`check_optimizer`). An optimizer
that already holds state (nanoGPT's resume loads it before wrapping) is taken as it is; state
that is not whole per parameter (one rank's shard, another model's) is refused by name.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from minizero.optimizer import ADOPTED, Adopted, StageStep, attach, regroup, wrapper_of
from minizero.optimizer.state import FIX

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


def refuse_optimizer(optimizer: torch.optim.Optimizer, sharded: bool) -> None:
    """What ``parallelize`` (and :func:`adopt`) refuse of an optimizer's class, before wrapping:
    SparseAdam; where each rank steps flat fragments (``sharded``: stages 1-3, mixed precision)
    one that is not elementwise."""
    refuse_sparse_adam(optimizer)
    if sharded:
        check_elementwise(optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """What ``parallelize`` (and :func:`adopt`) refuse of an optimizer's parameters, once the
    model is wrapped: one that holds a parameter twice, a tensor that is not ``module``'s, or
    state that is not whole (:func:`check_loaded_state`). Records which parameters it trains (its
    ``zero_grad()`` clears those) and each group's parameters as built."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in held}) != len(held):
        raise ValueError("a parameter appears in two param groups")
    known = {id(p) for p in module.parameters()}
    strangers = [p for p in held if id(p) not in known]
    if strangers:
        raise ValueError(
            f"the optimizer holds {len(strangers)} tensor(s) that are not parameters of the model "
            f"(first of shape {tuple(strangers[0].shape)}); build it over model.parameters() or "
            f"param groups of them, before parallelize"
        )
    check_loaded_state(optimizer, module)  # a resumed optimizer's state is taken as it is
    record = ADOPTED.setdefault(optimizer, Adopted())  # minizero's record (optimizer.py), not on it
    record.trains = {id(p) for p in held}  # StageStep.zero_grad reads it
    # each group's parameters as the user built it: a full state dict (consolidate_state_dict)
    # numbers them as a plain optimizer over them would (minizero/optimizer/__init__.py)
    record.params = [list(g["params"]) for g in optimizer.param_groups]


def check_loaded_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """An optimizer that holds state when adopted (nanoGPT's resume: built, loaded with
    ``optimizer.load_state_dict(ckpt["optimizer"])``, then the model wrapped) is taken as it is:
    :func:`regroup` gives each fragment its range of every per-element state. Refused, saying
    which and what to do: state that is not whole per parameter, i.e. loaded from one rank's
    shard (minizero's ``optimizer.state_dict()`` at stages 1-3 without ``consolidate_state_dict``)
    or from a model of other shapes."""
    names = {id(p): n for n, p in module.named_parameters()}
    for p, st in optimizer.state.items():
        if not isinstance(p, torch.Tensor) or id(p) not in names:
            continue
        if "minizero_fragment" in st:  # written by minizero: one rank's range of p
            raise ValueError(shard_resume_message(names[id(p)], st["minizero_fragment"]))
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                raise ValueError(
                    f"the optimizer's state {k!r} of parameter {names[id(p)]!r} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}: it was loaded from "
                    f"another model's state dict, or from one rank's shard. Load a whole "
                    f"optimizer state dict of this model (to save one at stages 1-3: {FIX}), "
                    f"or build the optimizer fresh"
                )


def shard_resume_message(name: str, fragment: tuple) -> str:
    """Why an optimizer loaded from rank 0's shard cannot resume, and the fix. ``fragment``:
    (start, end, numel, rank, world, stage), as minizero/optimizer/state.py writes it."""
    start, end, numel, rank, world, stage = fragment
    return (
        f"this optimizer was loaded from one rank's shard of a minizero optimizer state dict "
        f"(parameter {name!r}: elements [{start}, {end}) of {numel}, saved by rank {rank} of "
        f"{world} at stage {stage}): rank 0's optimizer.state_dict() at ZeRO stages 1-3 "
        f"holds only its own range of each state, and the other ranks' are not in the file, so it "
        f"cannot resume. Save a whole one: {FIX}. To go on from this checkpoint, load the model's "
        f"state dict and build the optimizer fresh"
    )


def keep_scheduler_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """After :func:`attach`: an LR scheduler built before ``parallelize`` wrapped the *old*
    class's step on the instance; wrap the new one the same way, so that ``step()`` runs the
    stage and the scheduler sees it (no warning about the order of the two steps)."""
    if getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):

        def step(*args, **kwargs):
            optimizer._opt_called = True
            return type(optimizer).step(optimizer, *args, **kwargs)

        step._wrapped_by_lr_sched = True
        optimizer.step = step
    return optimizer


# -- an optimizer built after wrapping (FSDP2's order) ---------------------------------------------
def adopt(optimizer: torch.optim.Optimizer, wrapper) -> bool:
    """Make an optimizer built over ``wrapper.module``'s parameters *after* wrapping (FSDP2's
    ``fully_shard(model); opt = AdamW(model.parameters())``) the one ``parallelize`` would have
    returned: the same checks, :func:`regroup` and :func:`attach`. False when it holds none of
    this wrapper's parameters; an optimizer over some of them and other tensors (another model's,
    another wrapper's) is refused."""
    if isinstance(optimizer, StageStep):
        return wrapper_of(optimizer) is wrapper
    mine = {id(p) for p in wrapper.module.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    ours = sum(id(p) in mine for p in held)
    if ours == 0:
        return False
    if ours != len(held):
        raise ValueError(
            f"this {type(optimizer).__name__} holds {ours} parameter(s) of a model wrapped by "
            f"minizero.parallelize ({type(wrapper).__name__}) and {len(held) - ours} other "
            "tensor(s) (another model's, or another wrapper's): each wrapper steps its own "
            "parameters (its shards, at stages 1-3). Build one optimizer per wrapped model, over "
            "its model.parameters() or param groups of them"
        )
    refuse_optimizer(optimizer, sharded=wrapper.sharded.state or wrapper.precision.master)
    check_optimizer(optimizer, wrapper.module)
    if wrapper.separate_masters:
        regroup(optimizer, wrapper)
    keep_scheduler_step(attach(optimizer, wrapper))
    return True


def adopt_on_first_step(wrapper) -> RemovableHandle:
    """Adopt (:func:`adopt`) any torch optimizer over ``wrapper``'s parameters at its first
    ``step()``, through torch's optimizer step pre-hook. One hook per wrapper, holding it weakly
    and removed with it; an optimizer already adopted, or over other parameters, costs one check.

    When the hook runs, the first ``step()`` is already inside the class's own step, so for that
    call the stage's part runs around it here: the closure and ``before_step`` now, ``after_step``
    and ``end_step`` in a one-off step post-hook; :class:`StageStep` does it from the next call."""
    ref = weakref.ref(wrapper)

    def pre(optimizer, args, kwargs):
        s = ref()
        if s is None or isinstance(optimizer, StageStep) or not adopt(optimizer, s):
            return None
        return _first_step(optimizer, s, args, kwargs)

    handle = register_optimizer_step_pre_hook(pre)
    weakref.finalize(wrapper, handle.remove)
    return handle


def _first_step(optimizer, wrapper, args: tuple, kwargs: dict):
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None and ADOPTED[optimizer].closure_through:
        return None  # fp32 DDP with a closure (LBFGS): as StageStep.step, the class's own step
    if closure is not None:  # elementwise optimizers call the closure once, first: here
        with torch.enable_grad():
            loss = closure()
        args, kwargs = args[:1], {**kwargs, "closure": lambda: loss}
    wrapper.before_step()  # False (fp16 overflow): no fragment got a gradient, nothing steps

    def post(optimizer, args, kwargs) -> None:
        once.remove()
        wrapper.after_step()
        wrapper.end_step()

    once = optimizer.register_step_post_hook(post)
    return args, kwargs
