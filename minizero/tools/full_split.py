"""The loss over a whole split: every character predicted once, no sampling noise.

``train``'s evaluations (and nanoGPT's) average ``eval_iters`` batches of random windows: 20 x 12
windows of 64 characters, 15,360 of the validation split's 111,539 predictions, so the number moves
with the draw (about 0.01 nats between seeds of the same model). At the end of a run
:func:`full_split_loss` cuts the split into consecutive windows of ``block_size`` characters and
scores every target once. A target's context is then 0 to ``block_size - 1`` characters of its
window, uniformly, as in a random window: the same quantity the estimate samples, computed whole.
The split's last ``(n - 1) % block_size`` targets are scored in one more window that ends at the
split's end (only its last positions counted).

``logits_fn(x)`` maps ``x`` (B, T) to logits (B, T, V): ``TinyGPT(x)``, or nanoGPT's
``GPT(x, x)[0]`` (its forward returns every position's logits only when given targets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100  # a target not scored (torch's cross_entropy default ignore_index)


def windows(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``, each (W, block_size) int64: consecutive windows of ``ids`` whose targets ``y``
    cover ``ids[1:]`` exactly once (the others are ``IGNORE``)."""
    n = len(ids) - 1  # targets: ids[1:]
    if n < block_size:
        raise ValueError(f"block_size {block_size} is longer than the split ({len(ids)} ids)")
    full = n // block_size
    starts = list(range(0, full * block_size, block_size))
    tail = n - full * block_size
    if tail:
        starts.append(n - block_size)  # ends at the split's end; its first positions are scored
    idx = torch.tensor(starts)[:, None] + torch.arange(block_size + 1)  # (W, T + 1)
    rows = ids[idx].long()
    x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
    if tail:
        y[-1, : block_size - tail] = IGNORE  # already scored by the window before
    return x, y


@torch.no_grad()
def split_sums(logits_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
               block_size: int, *, rank: int = 0, world: int = 1, device=None,
               batch: int = 64) -> torch.Tensor:  # fmt: skip
    """(2,) float64: this rank's sum of cross-entropies and its number of targets. The windows
    are dealt in equal contiguous shares (padded with unscored copies); every rank runs the same
    number of ``batch``-window forwards, since a ZeRO-3 forward gathers from every rank."""
    device = device or torch.device("cpu")
    x, y = windows(ids, block_size)  # (W, T)
    per = -(-len(x) // world)  # windows per rank, rounded up
    calls = -(-per // batch)
    pad = per * world - len(x)
    x = torch.cat([x, x[:pad]])  # unscored copies: every rank holds ``per`` windows
    y = torch.cat([y, torch.full_like(y[:pad], IGNORE)])
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, targets)
    for c in range(calls):
        xb = x[c * batch : (c + 1) * batch].to(device)
        yb = y[c * batch : (c + 1) * batch].to(device)
        logits = logits_fn(xb).float()  # (b, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")  # fmt: skip
        total += torch.stack([loss.double(), (yb != IGNORE).sum().double()])
    return total


def full_split_loss(logits_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                    block_size: int, *, rank: int = 0, world: int = 1, group=None,
                    device=None, batch: int = 64) -> float:  # fmt: skip
    """The mean cross-entropy (nats per character) over every target of ``ids``: each rank's
    :func:`split_sums`, all-reduced over ``group`` in float64 (collective where a process group
    is initialised and ``world`` > 1)."""
    total = split_sums(logits_fn, ids, block_size, rank=rank, world=world, device=device,
                       batch=batch)  # fmt: skip
    if world > 1 and dist.is_initialized():
        dist.all_reduce(total, group=group)
    return float(total[0] / total[1])


def model_logits(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``logits_fn`` for ``TinyGPT`` and minizero's wrappers of it (eval mode while it runs is
    the caller's: see :func:`eval_full`)."""
    return lambda x: model(x)


def eval_full(model: torch.nn.Module, ids: torch.Tensor, block_size: int, *, rank: int = 0,
              world: int = 1, group=None, device=None) -> float:  # fmt: skip
    """:func:`full_split_loss` of a minizero model (wrapped or not), in eval mode."""
    was = model.training
    model.eval()
    try:
        return full_split_loss(model_logits(model), ids, block_size, rank=rank, world=world,
                               group=group, device=device)  # fmt: skip
    finally:
        model.train(was)
