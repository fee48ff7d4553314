"""A parameter without a gradient, the habits around it, and ``p.grad`` after backward.

* a parameter unused in a backward: refused unless ``find_unused_parameters=True`` (as torch DDP);
  with it, a parameter no rank used is not stepped (as torch DDP and FSDP2);
* ``optimizer.step()`` with no backward since ``zero_grad()``: nothing is stepped, as in torch;
* ``p.grad`` after backward where no rank holds it whole (stages 1-3, fp16): a
  :class:`~minizero.habits.sharded_grad.ShardedGrad` until the next forward, so that torch's
  ``clip_grad_norm_`` works; ``p.grad = None`` by hand then means: do not step ``p`` (all of
  them: ``zero_grad()``);
* a second backward before the next forward (``retain_graph=True``) accumulates into what
  backward sees;
* ``optimizer.zero_grad()`` of an optimizer over some of the parameters clears only theirs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.habits.sharded_grad import GradNorms, ShardedGrad


class GradGuards:
    """Which parameters got a gradient since ``zero_grad()``, and ``p.grad`` between backward and
    the next forward, for ``wrapper``: ``used`` is filled by ``Habits.grad_accumulated``, which
    the core calls before the stage's own hook (``DataParallel.register_hooks``)."""

    def __init__(self, wrapper, norms: GradNorms) -> None:
        self.wrapper, self.norms = wrapper, norms
        self.used: set[int] = set()  # id(p) of parameters that got a gradient since zero_grad
        self.grads_none = True  # zero_grad(set_to_none=True) (or none yet): every p.grad None
        self.hidden = False  # p.grad is a ShardedGrad until the next forward

    def backward_end(self) -> None:
        """A synchronised backward is over: every parameter got a gradient (unless
        ``find_unused_parameters``); hide them where no rank holds them whole."""
        w = self.wrapper
        if not w.find_unused_parameters:
            for p in w.params:
                if id(p) not in self.used:
                    raise RuntimeError(
                        f"parameter {w.param_names[id(p)]!r} got no gradient in this backward "
                        f"on rank {w.rank}. If some parameters are unused in some steps, pass "
                        f"find_unused_parameters=True to minizero.parallelize (as with torch DDP)."
                    )
        if w.sharded.state or w.precision.loss_scale:  # no whole averaged p.grad on any rank
            for p in w.params:
                p.grad = ShardedGrad(p, self.norms) if id(p) in self.used else None
            self.hidden = True

    def show(self) -> None:
        """Before a forward or a second backward: ``p.grad`` back to what backward sees."""
        if not self.hidden:
            return
        w = self.wrapper
        cleared = self.cleared_by_hand()
        if cleared and len(cleared) == len(self.used):  # `p.grad = None` for every p:
            return w.zero_grad(set_to_none=True)  # the habit that means zero_grad()
        for p in w.params:
            if id(p) in cleared:
                w.clear_grad(p)
            p.grad = None if id(p) in cleared else w.visible_grad(p)
        self.hidden = False

    def cleared_by_hand(self) -> set[int]:
        """id(p) of parameters whose (sharded) gradient the user replaced by None."""
        return {id(p) for p in self.wrapper.params if p.grad is None and id(p) in self.used}

    def params_without_grad(self) -> set[int] | None:
        """The parameters the step skips: None (every one) when no backward ran since
        ``zero_grad()``; else those no rank used (``find_unused_parameters``: one all-reduce)
        and those cleared by hand."""
        if self.grads_none and not self.used:
            return None
        w, unused = self.wrapper, set()
        if w.find_unused_parameters:
            used = torch.tensor([id(p) in self.used for p in w.params], dtype=torch.uint8)
            used = used.to(w.params[0].device)  # (P,) 1 where this rank saw a gradient
            nodes = [] if w.replicate_group is None else [w.replicate_group]  # HSDP: any node's
            for group in [w.group, *nodes]:
                C.all_reduce(used, op=dist.ReduceOp.MAX, group=group, tag="used params")
            unused = {id(p) for p, u in zip(w.params, used.tolist(), strict=True) if not u}
        if self.hidden:  # `p.grad = None` after backward: torch's optimizers skip p
            unused |= self.cleared_by_hand()
        return unused

    def zero_grad(self, set_to_none: bool) -> None:
        self.grads_none = set_to_none or (self.grads_none and not self.used)  # None stays None
        self.used.clear()
        self.hidden = False

    def zero_grad_of(self, ids: set[int], set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` of an optimizer over some of the trainable parameters (``ids``
        of them): as in torch, the others keep their gradients and accumulate into them."""
        for p in self.wrapper.params:
            if id(p) in ids and id(p) in self.used:
                self.wrapper.clear_grad(p)
                self.used.discard(id(p))
                if set_to_none:
                    p.grad = None
