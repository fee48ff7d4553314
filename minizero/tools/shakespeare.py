"""Tiny Shakespeare, character level: what nanoGPT's Shakespeare model learns. ``train``, lesson 09.

The text ships inside the package (``minizero/data/shakespeare_char/``, its source and licence in
the README there): nothing is downloaded. The split and the vocabulary are nanoGPT's
(github.com/karpathy/nanoGPT, ``data/shakespeare_char/prepare.py``): the sorted set of the text's
characters (65), the first 90% for training, the rest for validation.

Batches are drawn as nanoGPT draws them (a random offset per row, ``block_size`` characters and
the same shifted by one), but from a generator seeded by ``(seed, step)`` rather than by the rank:
every rank draws the same global batch and keeps its own rows, so N ranks together see exactly the
rows one process sees, whatever N (the convention of ``minizero.models.synthetic_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "data" / "shakespeare_char" / "input.txt"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class CharText:
    """The text as token ids: ``train`` and ``val`` are 1-D uint8 tensors of ids in
    ``[0, len(chars))``; ``chars[i]`` is the character of id i."""

    chars: str
    train: torch.Tensor  # (1,003,854,) uint8
    val: torch.Tensor  # (111,540,) uint8

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        ids = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted({c for c in text if c not in ids})
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown!r}")
        return [ids[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@cache
def load(path: str | Path = TEXT) -> CharText:
    """The text at ``path`` (default: Tiny Shakespeare) split 90/10, as token ids."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: it ships with minizero (reinstall it, e.g. pip install -e .)"
        )
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))
    if len(chars) > 256:
        raise ValueError(f"{path}: {len(chars)} distinct characters, more than uint8 ids hold")
    table = torch.full((max(map(ord, chars)) + 1,), -1, dtype=torch.int64)
    table[torch.tensor([ord(c) for c in chars])] = torch.arange(len(chars))
    codes = torch.tensor([ord(c) for c in text], dtype=torch.int64)
    ids = table[codes].to(torch.uint8)  # (len(text),)
    n = int(len(ids) * 0.9)  # nanoGPT's split: the first 90% trains
    return CharText(chars=chars, train=ids[:n].clone(), val=ids[n:].clone())


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def get_batch(
    data: CharText,
    split: str,
    batch_size: int,
    block_size: int,
    step: int,
    *,
    rank: int = 0,
    world: int = 1,
    seed: int = 1337,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows ``(x, y)``, each ``(batch_size / world, block_size)`` int64, of the global
    batch number ``step`` of ``split``: row i is ``block_size`` characters from a random offset,
    and ``y`` the same shifted by one. Every rank draws the same global batch (from ``seed`` and
    ``step``) and keeps rows ``[rank * b, (rank + 1) * b)``, b = batch_size / world."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world); got rank={rank}, world={world}")
    if batch_size < 1 or batch_size % world:
        raise ValueError(
            f"the global batch ({batch_size}) must split evenly over {world} ranks: every rank "
            f"takes batch_size / world rows; pick a multiple of {world}"
        )
    ids = data.train if split == "train" else data.val
    if len(ids) <= block_size:
        raise ValueError(f"block_size {block_size} is longer than the {split} split")
    stream = 2 * step + (split == "val")  # train and val batches never share a stream
    g = _generator(seed, stream)
    starts = torch.randint(len(ids) - block_size, (batch_size,), generator=g)  # (B,)
    per = batch_size // world
    mine = starts[rank * per : (rank + 1) * per, None]  # (B/world, 1): this rank's rows
    rows = ids[mine + torch.arange(block_size + 1)].long()  # (B/world, T + 1)
    return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)
