"""Precision policies, loss scaling and the optimizer check every stage shares. Lessons 02, 03.

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

from minizero import collectives as C
from minizero.habits import check_step_is_elementwise

# Optimizers whose update of element i reads only element i of the parameter, its gradient and its
# states: only those give the same result on a flat shard as on the whole tensor. Subclasses count.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
)  # fmt: skip

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
    """The dtype of the parameters a model hands in and of the optimizer's masters: fp32, or
    fp64 under the "fp64" policy (a 16-bit working copy always has fp32 masters)."""
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


# -- block-wise int8 quantisation: ZeRO++'s qwZ (Wang et al., arXiv 2306.10209, §3.1) -------------
QUANT_BLOCK = 256  # elements per block, each with its own scale


def quantize_blockwise(
    x: torch.Tensor, block: int = QUANT_BLOCK, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of the 1-D ``x`` in blocks of ``block`` elements (the last
    one may be shorter). Returns ``q`` (n,) int8 in [-L, L], L = 2^(bits-1) - 1 (127 for int8;
    7 for ``bits=4``, still one int8 per element: not packed), and ``scales`` (ceil(n / block),)
    fp32, with x ≈ q * scale of its block; scale = absmax(block) / L."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be 2..8, got {bits}")
    levels = 2 ** (bits - 1) - 1
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block)  # (blocks, block)
    scales = rows.abs().amax(dim=1) / levels  # (blocks,) fp32
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: q = 0
    q = torch.round(rows / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q.view(-1)[:n], scales


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: int = QUANT_BLOCK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`, row by row: ``q`` (rows, n) int8 and ``scales``
    (rows, ceil(n / block)), e.g. every rank's quantised shard after an all-gather. Writes into
    ``out`` (rows, n) (any float dtype) when given; returns (rows, n)."""
    q2 = q if q.dim() == 2 else q.view(1, -1)  # (rows, n) int8
    s2 = scales if scales.dim() == 2 else scales.view(1, -1)  # (rows, blocks) fp32
    rows, n = q2.shape
    blocks = s2.shape[1]
    full = torch.zeros(rows, blocks * block, dtype=torch.float32, device=q.device)
    full[:, :n] = q2
    deq = (full.view(rows, blocks, block) * s2[:, :, None]).view(rows, -1)[:, :n]
    if out is None:
        return deq
    out.view(rows, n).copy_(deq)
    return out


def quantization_error(x: torch.Tensor, block: int = QUANT_BLOCK) -> dict[str, float]:
    """How far int8 block quantisation moves ``x``: ``max_rel`` = max|x - x̂| / max|x| and
    ``rms_rel`` = ||x - x̂|| / ||x|| (0 for an all-zero x)."""
    x = x.detach().reshape(-1).float()
    q, s = quantize_blockwise(x, block)
    err = dequantize_blockwise(q, s, block).view(-1) - x
    big, norm = float(x.abs().max()) if x.numel() else 0.0, float(x.norm())
    return {
        "max_rel": float(err.abs().max()) / big if big else 0.0,
        "rms_rel": float(err.norm()) / norm if norm else 0.0,
    }
