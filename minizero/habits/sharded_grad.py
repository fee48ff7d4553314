"""``p.grad`` when a rank holds only its shard of the averaged gradient (ZeRO 1-3, fp16). Lesson 03.

After backward, stages 1-3 keep each gradient as this rank's fragments of a flat shard: there is no
full averaged ``p.grad`` on any rank. PyTorch habits still reach for it:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and ``clip_grad_value_``. Leaving ``p.grad
= None`` would make the norm 0 and clip nothing, silently; so until the next forward, ``p.grad`` is
a :class:`ShardedGrad`: a tensor of the right shape, dtype and device that owns no memory (one
element, expanded) and answers the few operations those functions use by working on the shards (one
all-reduce for the norms of every parameter at once: :class:`GradNorms`, which also serves
``optimizer.clip_grad_norm_``). Any other use raises an error that says what to do instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.habits.module import expect_every_rank

_META = {  # attribute reads and metadata that need no values
    "shape", "dtype", "device", "layout", "is_sparse", "is_cuda", "is_meta", "ndim", "size",
    "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "requires_grad",
    "grad_fn", "is_leaf", "__len__", "is_nested", "names", "is_mkldnn", "is_quantized",
    "__hash__", "__eq__", "_is_view", "is_sparse_csr", "data_ptr", "untyped_storage",
}  # fmt: skip


# elementwise in-place ops (foreach or not) that clip_grad_norm_ / clip_grad_value_ use: applied to
# this rank's fragments of the gradient, which is the same as applying them to the whole gradient
_INPLACE = {
    "_foreach_mul_": "mul_", "mul_": "mul_", "_foreach_clamp_min_": "clamp_min_",
    "_foreach_clamp_max_": "clamp_max_", "clamp_": "clamp_", "clamp_min_": "clamp_min_",
    "clamp_max_": "clamp_max_",
}  # fmt: skip


class ShardedGrad(torch.Tensor):
    """Stands in for ``param.grad`` at stages 1-3 between backward and the next forward."""

    _param: nn.Parameter
    _owner: GradNorms  # the wrapper's norms

    @staticmethod
    def __new__(cls, param: nn.Parameter, owner: GradNorms) -> ShardedGrad:
        empty = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        t = torch.Tensor._make_subclass(cls, empty)
        t._param, t._owner = param, owner
        return t

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002
        return f"ShardedGrad(shape={tuple(self.shape)}, stage={self._owner.stage})"

    def __deepcopy__(self, memo) -> None:  # copy.deepcopy(model) after backward: the copy has
        return None  # no gradient (there is no full one to copy)

    def __reduce_ex__(self, protocol):  # pickled (torch.save, a copy through pickle): None too
        return (type(None), ())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        first = args[0] if args else None
        if func in (torch._foreach_norm, torch.linalg.vector_norm, torch.norm, torch.Tensor.norm):
            grads = list(first) if isinstance(first, (list, tuple)) else [first]
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2.0))
            ord_ = 2.0 if ord_ in ("fro", None) else ord_  # p.grad.norm(): Frobenius = 2-norm
            if len(args) > 2 or kwargs.get("dim") is not None:
                raise RuntimeError(
                    f"{name}(dim=...) of a sharded gradient: only whole-tensor norms are "
                    "supported at ZeRO stages 1-3 (p.grad.norm(), clip_grad_norm_)"
                )
            norms = [g._owner.grad_norm(g._param, ord_) for g in _mine(grads)]
            return norms if isinstance(first, (list, tuple)) else norms[0]
        if name in _INPLACE:
            grads = list(first) if isinstance(first, (list, tuple)) else [first]
            op = getattr(torch.Tensor, _INPLACE[name])  # the per-tensor in-place op
            for g in _mine(grads):
                g._owner.grad_apply_(g._param, op, args[1:], kwargs)
            return first
        raise RuntimeError(
            f"{name or func}: at ZeRO stage 1-3 no rank holds the full averaged gradient of a "
            f"parameter, only its shard. torch.nn.utils.clip_grad_norm_ and clip_grad_value_ work "
            f"on p.grad; for anything else use optimizer.clip_grad_norm_(max_norm), or "
            f"model.extension.norms.grad_fragments(p) for this rank's ranges of the averaged "
            f"gradient (fp32 views). An update written by hand cannot step shards: use a "
            f"torch.optim optimizer (minizero adopts one built over model.parameters() at its "
            f"first step)."
        )


class GradNorms:
    """Gradients seen whole while each rank holds only its ranges: per-parameter norms from
    partial sums and one all-reduce (``optimizer.clip_grad_norm_``, and torch's own through
    :class:`ShardedGrad`). The norms are kept while this step's gradients (``step_grads()``) are,
    until an in-place op changes them."""

    def __init__(self, wrapper) -> None:
        self.wrapper = wrapper
        self.norms: dict[float, dict[int, torch.Tensor]] = {}  # ord -> id(p) -> global norm

    @property
    def stage(self) -> int:
        return self.wrapper.stage

    def grad_fragments(self, p: nn.Parameter) -> list[torch.Tensor]:
        """This rank's fragments of p's averaged fp32 gradient (views, possibly none)."""
        if not self.wrapper.has_step_grads:  # this step's gradients are not made yet: the norms
            self.norms.clear()  # are of another step's
        grads = self.wrapper.step_grads()
        return [grads[f.bucket][f.offset : f.offset + f.numel]
                for f in self.wrapper.fragments_of.get(id(p), [])
                if grads[f.bucket] is not None]  # fmt: skip

    def grad_norm(self, p: nn.Parameter, ord_: float) -> torch.Tensor:
        """The norm of p's whole averaged gradient; the first call of a step computes every
        parameter's at once (partial sums over fragments, one all-reduce)."""
        w, ord_ = self.wrapper, float(ord_)
        self.grad_fragments(p)  # (forgets the norms of another step)
        if ord_ not in self.norms:
            if ord_ not in (2.0, float("inf")):
                raise RuntimeError(
                    f"minizero's sharded gradients support norm 2 and inf, not {ord_}"
                )
            inf = ord_ == float("inf")
            dtype = torch.promote_types(w.params[0].dtype, torch.float32)  # fp32, or fp64
            part = torch.zeros(len(w.params), dtype=dtype, device=w.params[0].device)
            # (P,) this rank's part of each parameter's norm: every fragment's norm in one
            # foreach call, gathered into its parameter's slot (one fragment per parameter and
            # bucket here; a parameter with none keeps 0)
            slots, frags = [], []
            for i, q in enumerate(w.params):
                for g in self.grad_fragments(q):
                    slots.append(i)
                    frags.append(g)
            if frags:
                idx = torch.tensor(slots, device=part.device)
                each = torch.stack(torch._foreach_norm(frags, ord_)).to(dtype)  # (fragments,)
                if inf:
                    part.scatter_reduce_(0, idx, each, "amax")
                else:
                    part.index_add_(0, idx, each.square())
            if w.sharded.state:  # disjoint ranges: one all-reduce (DDP owns every element)
                what = "a gradient norm (p.grad.norm(), clip_grad_norm_)"  # a rank that logs
                expect_every_rank(w, what, "print or save on rank 0 only")  # alone: an error
                op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                C.all_reduce(part, op=op, group=w.group, tag="grad norm")
            norms = part if inf else part.sqrt()
            self.norms[ord_] = {id(q): norms[i] for i, q in enumerate(w.params)}
        return self.norms[ord_][id(p)]

    def grad_apply_(self, p: nn.Parameter, op, args, kwargs) -> None:
        for g in self.grad_fragments(p):
            op(g, *args, **kwargs)
        self.norms.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm is at most ``max_norm``; return the norm."""
        norms = torch.stack([self.grad_norm(p, norm_type) for p in self.wrapper.params])
        total = norms.max() if float(norm_type) == float("inf") else norms.pow(2).sum().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in (g for g in self.wrapper.step_grads() if g is not None):
            g.mul_(coef)
        self.norms.clear()
        return total


def _mine(grads: list) -> list[ShardedGrad]:
    for g in grads:
        if not isinstance(g, ShardedGrad):
            raise RuntimeError(
                "a list mixing minizero's sharded gradients with ordinary tensors: pass only the "
                "wrapped model's parameters (model.parameters())"
            )
    return grads
