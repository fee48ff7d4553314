"""The memory budget of one training step, per rank: model states, activations, buffers. Lesson 05.

At the peak of a step a rank holds (bytes; Ψ parameters, N ranks, mixed-precision AdamW):

* **model states**: ``paper_model_state_bytes(Ψ, N, stage)``, 16Ψ for DDP down to 16Ψ/N at stage 3
  (ZeRO §3.1, §5). ZeRO partitions these, and only these.
* **activations**: what autograd saved in forward for backward. Per transformer layer, in 16 bits
  with dropout and the attention scores stored, Korthikanti et al. 2022 (*Reducing Activation
  Recomputation in Large Transformer Models*, arXiv 2205.05198, §4.1, eq. 1): ``sbh(34 + 5as/h)``
  for sequence length s, micro-batch b, width h and a heads (:func:`layer_activation_bytes`).
  Every rank runs the whole model on its own micro-batch, so N does not divide them.
* **activation checkpointing** keeps only each layer's input, ``2sbh`` (the same paper's count
  for full recomputation), and recomputes one layer at a time in backward
  (:func:`checkpoint_blocks`).
* **the output layer**: logits and the loss's temporaries, proportional to s·b·V.
* **stage 3's working set**: the units gathered at once (current and prefetched) and the full
  gradient of the unit being reduce-scattered (:func:`zero3_floor_bytes`): with the activations,
  what stays when 16Ψ/N goes to zero.

:func:`measure_activations` measures them at small scale in this process with PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (it tracks every storage, on CPU and GPU);
:func:`step_budget` adds the parts up for any shape, as the calculator in ``plots`` does.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minizero.analysis.memory import paper_model_state_bytes
from minizero.models import GPTConfig, TinyGPT

GB = 1e9  # the paper's GB


# -- parameters and units of a TinyGPT, by formula ------------------------------------------------
def gpt_params(cfg: GPTConfig) -> int:
    """Ψ of ``TinyGPT(cfg)`` without building it: the tied embedding V·h, the positions T·h, per
    layer 12h² of weights plus 13h of biases and LayerNorms (2h without biases), the final
    LayerNorm 2h (h without a bias)."""
    return sum(gpt_units(cfg))


def gpt_units(cfg: GPTConfig) -> list[int]:
    """Elements of each ZeRO-3 unit of ``TinyGPT(cfg)`` in minizero, largest first: one unit per
    block (its two LayerNorms, attention and MLP), and the root's unit with the rest (the two
    embeddings, the final LayerNorm; the output layer is tied to the token embedding)."""
    h, c = cfg.n_embd, int(cfg.bias)
    norm = h + c * h  # LayerNorm: weight, and bias if any
    block = 2 * norm + (3 * h * h + c * 3 * h) + (h * h + c * h) + (4 * h * h + c * 4 * h)
    block += 4 * h * h + c * h
    root = cfg.vocab_size * h + cfg.block_size * h + norm
    return sorted([root] + [block] * cfg.n_layer, reverse=True)


# -- formulas -------------------------------------------------------------------------------------
def layer_activation_bytes(
    s: int, b: int, h: int, a: int, *, dropout: bool = True, flash: bool = False
) -> int:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, eq. 1).

    ``dropout=True, flash=False`` is the paper's ``sbh(34 + 5as/h)``: 16-bit values, 1-byte dropout
    masks, the attention scores stored (softmax output 2as²b, its dropout mask as²b and output
    2as²b). Without dropout the masks go (two of sbh, one of as²b) and the softmax output is the
    only s² tensor: ``32sbh + 2as²b``. ``flash=True``: the kernel recomputes the scores in
    backward (Dao et al. 2022), so no s² term is stored at all.
    """
    base = 34 if dropout else 32
    scores = 0 if flash else (5 if dropout else 2)
    return s * b * h * base + scores * a * s * s * b


def checkpointed_layer_bytes(s: int, b: int, h: int) -> int:
    """A checkpointed layer keeps only its 16-bit input, 2sbh (Korthikanti et al. 2022, full
    recomputation)."""
    return 2 * s * b * h


def zero3_floor_bytes(
    units: list[int], *, live: int = 3, param_bytes: int = 2, grad_bytes: int = 2
) -> int:
    """Stage 3's working set beyond 16Ψ/N: the ``live`` largest units gathered at once (the
    root's, gathered through forward and backward, the block computing and the prefetched one)
    in ``param_bytes``, and the full gradient of the largest
    unit before its reduce-scatter in ``grad_bytes``. It does not shrink with N."""
    if live < 1 or not units:
        raise ValueError(f"need at least one unit and live >= 1, got {len(units)} units, {live=}")
    largest = sorted(units, reverse=True)
    return param_bytes * sum(largest[:live]) + grad_bytes * largest[0]


def step_budget(
    cfg: GPTConfig,
    *,
    world: int,
    stage: int,
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: bool = False,
    flash: bool = True,
    dropout: bool = False,
    logit_bytes: float = 6.0,
    precision: str = "bf16",
) -> dict[str, float]:
    """Bytes per rank at the peak of a step of ``TinyGPT(cfg)``, by part (formulas above).

    ``logit_bytes``: bytes per logit alive at the peak (the 16-bit logits, the loss's log-softmax
    and the logits' gradient; lesson 05 measures about 6 in bf16). Stage 3 adds
    :func:`zero3_floor_bytes`.
    """
    s, b, h, a = seq_len or cfg.block_size, micro_batch, cfg.n_embd, cfg.n_head
    states = paper_model_state_bytes(gpt_params(cfg), world, stage, precision)
    full = layer_activation_bytes(s, b, h, a, dropout=dropout, flash=flash)
    if checkpointing:  # every layer's input, plus one layer recomputed in backward
        layers = cfg.n_layer * checkpointed_layer_bytes(s, b, h) + full
    else:
        layers = cfg.n_layer * full
    return {
        "params": states["params"],
        "grads": states["grads"],
        "optimizer": states["optimizer"],
        "activations": float(layers),
        "logits": logit_bytes * s * b * cfg.vocab_size,
        "stage 3 working set": float(zero3_floor_bytes(gpt_units(cfg))) if stage == 3 else 0.0,
    }


# -- activation checkpointing ---------------------------------------------------------------------
class Checkpointed(nn.Module):
    """``inner`` run under ``torch.utils.checkpoint``: forward keeps only the input; backward runs
    ``inner`` again to rebuild what it needs (non-reentrant, the variant PyTorch recommends)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def checkpoint_blocks(model: TinyGPT) -> TinyGPT:
    """Wrap every transformer block of ``model`` in :class:`Checkpointed`, in place; returns it."""
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Checkpointed):
            model.blocks[i] = Checkpointed(block)
    return model


# -- measuring, in this process -------------------------------------------------------------------
def _snapshot(tracker, kind: str = "current") -> dict[str, int]:
    """``{"Parameter": ..., "Gradient": ..., "Activation": ..., "Temp": ..., "Total": ...}`` of the
    one device tracked (MemTracker keys its categories by an enum whose values are these names)."""
    (snap,) = tracker.get_tracker_snapshot(kind).values()  # {device: {category: bytes}}
    return {getattr(k, "value", k): v for k, v in snap.items()}


def _total(tracker) -> int:
    return _snapshot(tracker)["Total"]


def measure_activations(
    cfg: GPTConfig,
    micro_batch: int,
    *,
    seq_len: int | None = None,
    checkpointing: bool = False,
    math_attention: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """One forward and backward of ``TinyGPT(cfg)`` in ``dtype`` on the CPU, under PyTorch's
    ``MemTracker``. Bytes:

    * ``layers``: per transformer block, what its forward left alive (saved tensors and output);
    * ``forward``: every activation alive at the end of forward (the loss included);
    * ``peak``: the highest total during forward and backward, less the parameters and the
      gradients alive at that moment: activations and temporaries at the peak;
    * ``params``: the parameters. ``math_attention``: PyTorch's reference attention kernel, which
      stores the scores, instead of the default (a flash kernel that recomputes them).
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = seq_len or cfg.block_size
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(dtype)
    if checkpointing:
        checkpoint_blocks(model)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, s))  # (b, s) token ids
    tracker = MemTracker()
    tracker.track_external(model)
    marks: list[int] = []  # tracker totals before and after each block's forward
    hooks = []
    for block in model.blocks:
        hooks.append(block.register_forward_pre_hook(lambda m, a: marks.append(_total(tracker))))
        hooks.append(block.register_forward_hook(lambda m, a, o: marks.append(_total(tracker))))
    attention = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()
    with warnings.catch_warnings(), attention:
        warnings.simplefilter("ignore")  # MemTracker notes tensors it cannot see (None grads)
        with tracker:
            start = _total(tracker)
            loss = model(idx, idx)
            forward = _total(tracker) - start
            loss.backward()
    for hook in hooks:
        hook.remove()
    at_peak = _snapshot(tracker, "peak")
    held = at_peak["Parameter"] + at_peak["Gradient"] + at_peak["Buffer"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = [marks[i + 1] - marks[i] for i in range(0, len(marks), 2)][: cfg.n_layer]
    return dict(layers=layers, forward=forward, peak=at_peak["Total"] - held, params=params,
                s=s, b=micro_batch, h=cfg.n_embd, a=cfg.n_head, V=cfg.vocab_size)  # fmt: skip
