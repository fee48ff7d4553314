"""The models every lesson trains: a nanoGPT-like ``TinyGPT`` and a small, awkwardly sized ``MLP``;
and ``EncoderLM``, the same kind of LM from torch's own ``nn.TransformerEncoderLayer`` (benchmarks).

Used from lesson 01_ddp onwards; the parameter count ``count_params`` is the paper's Ψ (ZeRO §3.1).

One calling convention for both models, so a training step reads ``loss = model(*batch)``:

* ``model(inputs)`` returns the outputs (GPT: logits ``(B, T, vocab_size)``; MLP: ``(B, out)``);
* ``model(inputs, targets)`` returns the scalar mean loss (GPT: cross-entropy; MLP: MSE).

Both build on any device, the meta device included (``with torch.device("meta"): TinyGPT(cfg)``):
construction runs no data-dependent op, so a 1T-parameter model can be "built" to be measured.

The data they train on is here too: ``synthetic_batch`` (end of this file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a ``TinyGPT``. Validates itself on construction."""

    vocab_size: int  # number of token ids; the tied embedding / lm_head is (vocab_size, n_embd)
    block_size: int  # longest sequence the position embedding covers
    n_layer: int  # number of transformer blocks
    n_head: int  # attention heads per block; must divide n_embd
    n_embd: int  # model width C
    bias: bool = True  # biases in Linear and LayerNorm layers
    dropout: float = 0.0  # dropout probability (0 keeps every run deterministic)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """~0.11M parameters, fast enough for every test. The vocabulary (101) is prime, so the
        flat buffers of ZeRO need padding at any world size > 1."""
        return cls(
            **{**dict(vocab_size=101, block_size=32, n_layer=2, n_head=2, n_embd=64), **overrides}
        )

    @classmethod
    def small(cls, **overrides) -> GPTConfig:
        """~3.7M parameters, for benchmarks and the memory lessons."""
        base = dict(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256)
        return cls(**{**base, **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        C = config.n_embd
        self.ln_1 = nn.LayerNorm(C, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(C, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(C, 4 * C, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * C, C, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class TinyGPT(nn.Module):
    """A nanoGPT-like decoder. ``lm_head.weight`` IS ``wte.weight`` (one tensor, counted once).

    Initialisation (deterministic given ``torch.manual_seed``): N(0, 0.02) for Linear and embedding
    weights, zeros for biases, and N(0, 0.02/sqrt(2 n_layer)) for the residual projections.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # (V, C), shared with lm_head
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # (block_size, C)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two uses
        self.apply(self._init_weights)
        resid_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp[2].weight, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: (B, T) int64 token ids, T <= block_size. Returns logits (B, T, V), or the mean
        cross-entropy (a 0-d tensor) when ``targets`` (B, T) is given."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


class EncoderLM(nn.Module):
    """A causal LM built from torch's own transformer modules: ``nn.TransformerEncoder`` of
    ``n_layer`` ``nn.TransformerEncoderLayer`` (post-norm, or pre-norm with ``norm_first``), a final
    LayerNorm, and an ``lm_head`` tied to the token embedding. Its ``nn.MultiheadAttention`` reads
    ``out_proj.weight`` without calling ``out_proj``: the model that ZeRO-3 units must gather whole.
    The same calling convention as ``TinyGPT``; ``blocks`` is ``encoder.layers`` (FSDP2's units).

    Initialisation: GPT-2's (N(0, 0.02) weights, zero biases, as nanoGPT), not torch's default:
    with N(0, 1) embeddings the key bias, whose gradient is exactly zero in exact arithmetic,
    gets rounding noise as large as Adam's eps, and two correct implementations drift apart.
    """

    def __init__(self, config: GPTConfig, *, norm_first: bool = False) -> None:
        super().__init__()
        self.config = config
        C = config.n_embd
        self.tok_emb = nn.Embedding(config.vocab_size, C)  # (V, C), shared with lm_head
        self.pos_emb = nn.Embedding(config.block_size, C)  # (block_size, C)
        layer = nn.TransformerEncoderLayer(
            C, config.n_head, 4 * C, dropout=config.dropout, batch_first=True,
            norm_first=norm_first, bias=config.bias,
        )  # fmt: skip
        # the encoder deep-copies ``layer`` into ``encoder.layers``, an nn.ModuleList
        self.encoder = nn.TransformerEncoder(
            layer, config.n_layer, norm=nn.LayerNorm(C, bias=config.bias),
            enable_nested_tensor=False,
        )  # fmt: skip
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, two uses
        self.apply(_gpt2_init)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layers

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: (B, T) token ids. Returns logits (B, T, V), or the mean cross-entropy when
        ``targets`` (B, T) is given."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)  # (T, T)
        x = self.encoder(x, mask=mask, is_causal=True)  # (B, T, C), final LayerNorm applied
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def _gpt2_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.MultiheadAttention):  # its q, k, v projection is no nn.Linear
        nn.init.normal_(module.in_proj_weight, mean=0.0, std=0.02)
        if module.in_proj_bias is not None:
            nn.init.zeros_(module.in_proj_bias)


class MLP(nn.Module):
    """A small MLP with awkward sizes: no layer size divides by 2 or 3, nor does any parameter's
    element count, nor (with the defaults) the total, 1837, so flat buffers split across 2, 3 or 4
    ranks need padding. Activation: tanh between layers; the output is multiplied elementwise by
    ``gain`` (sizes[-1],), initialised to ones: a biased Linear with an odd fan-in always has an
    even element count, b * (a + 1), and this odd one-dimensional parameter makes the total odd.

    ``frozen_first``: the first layer's weight has ``requires_grad=False`` (a parameter that
    is held but neither has a gradient nor an optimizer state).
    ``tied``: inserts two extra (h, h) layers after the first, ``tie_a`` and ``tie_b``, whose
    weights are ONE Parameter (h = sizes[1]); their biases are separate.
    """

    def __init__(
        self,
        sizes: tuple[int, ...] = (13, 37, 29, 7),
        *,
        frozen_first: bool = False,
        bias: bool = True,
        tied: bool = False,
    ) -> None:
        super().__init__()
        if len(sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"MLP sizes must be at least two positive ints, got {sizes!r}")
        self.sizes = tuple(sizes)
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        )
        self.gain = nn.Parameter(torch.ones(sizes[-1]))  # (out,)
        self.tie_a = self.tie_b = None
        if tied:
            h = sizes[1]
            self.tie_a = nn.Linear(h, h, bias=bias)
            self.tie_b = nn.Linear(h, h, bias=bias)
            self.tie_b.weight = self.tie_a.weight  # one Parameter used by two layers
        if frozen_first:
            self.layers[0].weight.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: (B, sizes[0]). Returns (B, sizes[-1]), or the MSE against ``y`` when given."""
        for i, layer in enumerate(self.layers):
            x = layer(x)  # (B, sizes[i + 1])
            if i == 0 and self.tie_a is not None:
                x = self.tie_b(torch.tanh(self.tie_a(torch.tanh(x))))  # (B, sizes[1])
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        x = x * self.gain  # (B, out) * (out,)
        if y is None:
            return x
        return F.mse_loss(x, y)


def count_params(model: nn.Module) -> int:
    """Ψ: the number of unique trainable parameters (tied weights counted once, frozen ones not)."""
    # parameters() yields a shared Parameter once, so tied weights are counted once.
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- data
# Deterministic synthetic data: nothing is downloaded. Used from lesson 01_ddp onwards.
#
# ``synthetic_batch(kind, global_batch, step, rank=r, world=n)`` returns rank r's slice of the
# global batch of that step. Every rank builds the same global batch from ``(seed, step)`` and keeps
# rows ``[r * B/n, (r + 1) * B/n)``, so concatenating the slices of ranks 0..n-1 along dim 0 gives
# exactly what one process gets with ``world=1``: that is how every equivalence test compares a
# data-parallel run with a single process.
#
# The data is learnable, so loss curves go down:
#
# * ``"gpt"``: each row counts through the vocabulary with a per-row stride,
#   ``x[t] = (start + t * stride) % vocab_size`` with stride in {1, 2, 3}; targets are the inputs
#   shifted by one. Returns ``(idx, targets)``, both (B/n, seq_len) int64.
# * ``"mlp"``: ``x ~ N(0, 1)`` of shape (B/n, in_features), ``y = tanh(x @ W)`` for a fixed
#   teacher ``W`` drawn from ``seed`` alone. Returns ``(x, y)`` in float32.
#
# Either way ``loss = model(*batch)`` (see ``minizero.models``).


def _generator(seed: int, step: int) -> torch.Generator:
    # One independent stream per (seed, step), the same on every rank.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def synthetic_batch(
    kind: str,
    global_batch: int,
    step: int,
    *,
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    vocab_size: int = 101,
    seq_len: int = 32,
    in_features: int = 13,
    out_features: int = 7,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice ``(inputs, targets)`` of step ``step``'s global batch.

    ``kind="gpt"`` uses ``vocab_size`` and ``seq_len`` (defaults match ``GPTConfig.tiny()``);
    ``kind="mlp"`` uses ``in_features`` and ``out_features`` (defaults match ``MLP()``).
    """
    if kind not in ("gpt", "mlp"):
        raise ValueError(f"synthetic_batch kind must be 'gpt' or 'mlp', got {kind!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world); got rank={rank}, world={world}")
    if global_batch < 1 or global_batch % world:
        fix = world * max(1, global_batch // world)
        raise ValueError(
            f"global_batch ({global_batch}) must be a positive multiple of world ({world}): "
            f"every rank takes global_batch / world rows; pick e.g. {fix}"
        )
    per_rank = global_batch // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's rows of the global batch
    g = _generator(seed, step)
    if kind == "gpt":
        start = torch.randint(0, vocab_size, (global_batch, 1), generator=g)  # (B, 1)
        stride = torch.randint(1, 4, (global_batch, 1), generator=g)  # (B, 1)
        t = torch.arange(seq_len + 1)  # (T+1,)
        seq = (start + t * stride) % vocab_size  # (B, T+1) int64
        idx, targets = seq[rows, :-1], seq[rows, 1:]  # each (B/n, T)
    else:
        teacher = torch.randn(
            in_features, out_features, generator=_generator(seed, -1)
        )  # (in, out), no step
        x = torch.randn(global_batch, in_features, generator=g)  # (B, in)
        y = torch.tanh(x @ teacher / in_features**0.5)  # (B, out)
        idx, targets = x[rows], y[rows]  # each (B/n, ·)
    return idx.contiguous().to(device), targets.contiguous().to(device)
