"""Deterministic synthetic data: nothing is downloaded. Used from lesson 01_ddp onwards.

``synthetic_batch(kind, global_batch, step, rank=r, world=n)`` returns rank r's slice of the
global batch of that step. Every rank builds the same global batch from ``(seed, step)`` and keeps
rows ``[r * B/n, (r + 1) * B/n)``, so concatenating the slices of ranks 0..n-1 along dim 0 gives
exactly what one process gets with ``world=1``: that is how every equivalence test compares a
data-parallel run with a single process.

The data is learnable, so loss curves go down:

* ``"gpt"``: each row counts through the vocabulary with a per-row stride,
  ``x[t] = (start + t * stride) % vocab_size`` with stride in {1, 2, 3}; targets are the inputs
  shifted by one. Returns ``(idx, targets)``, both (B/n, seq_len) int64.
* ``"mlp"``: ``x ~ N(0, 1)`` of shape (B/n, in_features), ``y = tanh(x @ W)`` for a fixed
  teacher ``W`` drawn from ``seed`` alone. Returns ``(x, y)`` in float32.

Either way ``loss = model(*batch)`` (see ``minizero.models``).
"""

from __future__ import annotations

import torch


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
