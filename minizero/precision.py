"""Precision policies and the checks every stage shares. Taught in lesson 02 (02_zero1).

Mixed precision (ZeRO §3.1): parameters and gradients in 16 bits (2Ψ + 2Ψ bytes), and the optimizer
keeps an fp32 master copy of the parameters beside its states: K = 4 + 4 + 4 = 12 bytes per
parameter for Adam. In fp32 the parameters are their own master copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Optimizers whose update of element i reads only element i of the parameter, its gradient and its
# states. Only those give the same result on a flat shard as on the whole tensor.
ELEMENTWISE = (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop",
    "ASGD",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How a stage stores parameters and gradients.

    name: "fp32", "bf16" or "fp16".
    param_dtype: dtype of the working parameters and of the gradients that are communicated.
    master: whether the optimizer keeps a separate fp32 master copy of (its shard of) the params.
    loss_scale: whether gradients are scaled up in backward to keep fp16 from underflowing.
    """

    name: str
    param_dtype: torch.dtype
    master: bool
    loss_scale: bool


POLICIES = {
    "fp32": Precision(name="fp32", param_dtype=torch.float32, master=False, loss_scale=False),
    "bf16": Precision(name="bf16", param_dtype=torch.bfloat16, master=True, loss_scale=False),
    "fp16": Precision(name="fp16", param_dtype=torch.float16, master=True, loss_scale=True),
}


def resolve(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in POLICIES:
        raise ValueError(f"precision must be one of {sorted(POLICIES)}, got {precision!r}")
    return POLICIES[precision]


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that mix elements: they cannot run on a flat shard of the parameters."""
    name = type(optimizer).__name__
    if name not in ELEMENTWISE:
        raise TypeError(
            f"minizero runs the optimizer on a flat 1-D shard of the parameters, which gives the "
            f"same result as the whole model only for elementwise optimizers "
            f"({', '.join(ELEMENTWISE)}). "
            f"{name} is not one of them; use one of those, or stage=0 with precision='fp32'."
        )


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018), applied without touching the loop.

    The stage registers :meth:`scale_grad` as a hook on the model's output, so the gradient that
    enters backward is multiplied by ``scale``; the step divides it out, and skips the update when
    any rank saw an inf or a NaN (then halves the scale). After ``growth_interval`` good steps in a
    row the scale doubles.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._good_steps = 0

    def scale_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2
