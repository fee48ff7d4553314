"""Precision policies and loss scaling, which every stage shares. Lessons 02, 03.

Mixed precision (ZeRO §3.1): parameters and gradients in 16 bits (2Ψ + 2Ψ bytes), and the optimizer
keeps an fp32 master copy of the parameters beside its states: K = 4 + 4 + 4 = 12 bytes per
parameter for Adam. In fp32 the parameters are their own master copy.

The policy's fields carry the names of FSDP2's ``MixedPrecisionPolicy`` (``param_dtype``,
``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``), so a lesson can set the two side
by side.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map

from minizero import collectives as C

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How a stage stores parameters and gradients.

    name: "fp32", "fp64", "bf16", "fp16", or "custom". "fp64" is fp32's rule in float64: the
        course's checks train in it, where a different order of the same sums moves a result by
        about 1e-16 instead of 1e-7, so a check can compare with a reference almost exactly.
    param_dtype: dtype of the working parameters (the forward and backward compute dtype).
    reduce_dtype: dtype gradients are reduced and accumulated in (None: param_dtype). fp32 here
        costs 4Ψ instead of 2Ψ of gradient memory, as production bf16 training does.
    output_dtype: dtype the model's floating outputs are cast to (None: left as computed).
    cast_forward_inputs: cast floating inputs to ``param_dtype`` before the forward.
    master: whether the optimizer keeps a separate fp32 master copy of (its shard of) the params.
    loss_scale: dynamic loss scaling, to keep fp16 gradients from underflowing.
    """

    name: str = "custom"
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    master: bool | None = None  # None: whenever param_dtype is not fp32
    loss_scale: bool | None = None  # None: whenever param_dtype or reduce_dtype is fp16

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and dtype not in _DTYPES:
                raise ValueError(f"{field} must be one of {_DTYPES} or None, got {dtype}")
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        if self.master is None:
            object.__setattr__(self, "master", self.param_dtype in _HALF)
        if self.loss_scale is None:
            fp16 = torch.float16 in (self.param_dtype, self.reduce_dtype)
            object.__setattr__(self, "loss_scale", fp16)
        if self.param_dtype in _HALF and not self.master:
            raise ValueError("a 16-bit param_dtype needs fp32 master weights: leave master=None")


POLICIES = {
    "fp32": Precision(name="fp32", param_dtype=torch.float32),
    "fp64": Precision(name="fp64", param_dtype=torch.float64),
    "bf16": Precision(name="bf16", param_dtype=torch.bfloat16),
    # fp16: the output goes back to fp32, so the loss (and the scaled dL/dy) is computed in fp32
    "fp16": Precision(name="fp16", param_dtype=torch.float16, output_dtype=torch.float32),
}


def full_dtype(precision: Precision) -> torch.dtype:
    """The dtype of the masters (and of the parameters a model hands in): fp64 under "fp64"."""
    return torch.float64 if precision.param_dtype == torch.float64 else torch.float32


def resolve(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in POLICIES:
        raise ValueError(
            f"precision must be one of {sorted(POLICIES)} or a minizero.Precision(...), "
            f"got {precision!r}"
        )
    return POLICIES[precision]


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018), applied without touching the loop.

    The stage casts the model's output to fp32 and registers :meth:`scale_grad` on it, so the
    gradient that enters backward is ``scale`` times dL/dy, computed in fp32. The step divides it
    out, and skips the update when any rank saw an inf or a NaN (then halves the scale, without a
    floor, so any finite loss is eventually stepped). After ``growth_interval`` good steps in a row
    the scale doubles. ``warn_after`` skipped steps in a row raise a warning.
    """

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 1000, warn_after: int = 20
    ):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.warn_after = warn_after
        self._good_steps = 0
        self.skipped_in_a_row = 0

    def scale_backward(self, out) -> None:
        """Scale the gradient that enters backward through each floating tensor of ``out`` (the
        model's output, any nesting) that requires grad."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.scale_grad)

    def scale_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scale

    def unscale(self, grads: list, group: dist.ProcessGroup | None, device: torch.device) -> bool:
        """Divide ``grads`` by the scale in place; True when no rank of ``group`` saw an inf or
        NaN. Updates the scale (once per step: the stage calls it once)."""
        bad = torch.zeros(1, device=device)  # (1,) inf or NaN seen on some rank
        for g in (g for g in grads if g is not None):
            g.div_(self.scale)
            bad += (~torch.isfinite(g)).any()
        C.all_reduce(bad, group=group, tag="fp16 inf check")
        ok = bad.is_meta or not bad.item()  # meta (minizero.simulate): no values
        self.update(found_inf=not ok)
        return ok

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2
            self._good_steps = 0
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row == self.warn_after:
                warnings.warn(
                    f"fp16 loss scaling skipped {self.warn_after} steps in a row (scale now "
                    f"{self.scale:g}): the gradients overflow or are NaN. Look for a NaN loss, or "
                    f"train in bf16.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            self.skipped_in_a_row = 0
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])


def floating(t) -> bool:
    """Whether ``t`` is a floating-point tensor (what a precision policy casts)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def cast_floating(tree, dtype: torch.dtype):
    """``tree`` (tensors in tuples, lists, dicts) with every floating tensor cast to ``dtype``."""
    return tree_map(lambda t: t.to(dtype) if floating(t) else t, tree)


def divides_before_sum(t: torch.Tensor) -> bool:
    """Averaging a gradient over N ranks: an fp16 one is divided by N before the sum, so that the
    sum cannot overflow fp16; any other after it (one rounding fewer)."""
    return t.dtype == torch.float16
