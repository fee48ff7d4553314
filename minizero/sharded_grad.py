"""``p.grad`` when a rank holds only its shard of the averaged gradient (ZeRO 1-3). Lesson 03.

After backward, stages 1-3 keep each gradient as this rank's fragments of a flat shard: there is
no full averaged ``p.grad`` on any rank. PyTorch habits still reach for it:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and ``clip_grad_value_``. Leaving
``p.grad = None`` would make the norm 0 and clip nothing, silently; so until the next forward,
``p.grad`` is a :class:`ShardedGrad`: a tensor of the right shape, dtype and device that owns no
memory (one element, expanded) and answers the few operations those functions use by working on the
shards (one all-reduce for the norms of every parameter at once). Any other use raises an error
that says what to do instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from minizero.data_parallel import DataParallel

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
    _owner: DataParallel

    @staticmethod
    def __new__(cls, param: nn.Parameter, owner: DataParallel) -> ShardedGrad:
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
            norms = [g._owner._grad_norm(g._param, ord_) for g in _mine(grads)]
            return norms if isinstance(first, (list, tuple)) else norms[0]
        if name in _INPLACE:
            grads = list(first) if isinstance(first, (list, tuple)) else [first]
            op = getattr(torch.Tensor, _INPLACE[name])  # the per-tensor in-place op
            for g in _mine(grads):
                g._owner._grad_apply_(g._param, op, args[1:], kwargs)
            return first
        raise RuntimeError(
            f"{name or func}: at ZeRO stage 1-3 no rank holds the full averaged gradient of a "
            f"parameter, only its shard. torch.nn.utils.clip_grad_norm_ and clip_grad_value_ work "
            f"on p.grad; for anything else use optimizer.clip_grad_norm_(max_norm), or "
            f"minizero.full_grads(model) (collective) to read whole gradients."
        )


def _mine(grads: list) -> list[ShardedGrad]:
    for g in grads:
        if not isinstance(g, ShardedGrad):
            raise RuntimeError(
                "a list mixing minizero's sharded gradients with ordinary tensors: pass only the "
                "wrapped model's parameters (model.parameters())"
            )
    return grads
