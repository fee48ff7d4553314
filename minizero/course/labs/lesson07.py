"""Lesson 07's experiments (``course/07_checkpoints.py``): a sharded checkpoint, measured.

``state_sizes`` (section 1) what each rank's optimizer holds and how its state_dict numbers it;
``save_one`` / ``show_files`` / ``show_chunks`` (section 2) one checkpoint on disk, and DCP's
metadata of it; ``log_loss``, ``run_that_dies``, ``read_logs``, ``plot_resume`` (section 3) the
run killed mid-save and resumed elsewhere; ``bytes_per_stage`` (section 4) bytes per rank.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import minizero
from minizero.checkpoint import CheckpointError, checkpoint_bytes
from minizero.course import hint
from minizero.course.checks import lesson07
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.launcher import LaunchError
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "GPT", "PSI", "TinyGPT", "dist", "lesson07"]
__all__ += ["shutil", "synthetic_batch", "tempfile", "Path"]

GPT = GPTConfig.tiny()
PSI = count_params(TinyGPT(GPT))


def nanogpt_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: weight decay on the >= 2-D parameters only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay, rest = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))


def gpt_batch(step: int):
    """Inside a rank: its slice of step ``step``'s global batch of 12 rows (12 divides by 1-4)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return synthetic_batch(
        "gpt", 12, step, rank=rank, world=world, seq_len=GPT.block_size, device=rank_device()
    )


def _state_sizes(stage: int) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    model, opt = minizero.parallelize(model, stage, nanogpt_adamw(model))
    model(*gpt_batch(0)).backward()
    opt.step()
    held = sum(st["exp_avg"].numel() for st in opt.state.values())
    # torch's own numbering of what this optimizer steps (minizero's state_dict() renumbers it
    # by parameter, marks each entry's element range, and warns that it holds one shard)
    raw = torch.optim.Optimizer.state_dict(opt)
    return held, len(opt.state), len(raw["state"])


def state_sizes(nprocs: int, stage: int = 2) -> list[tuple]:
    """Section 1: after one step of TinyGPT at ``stage``, each rank's ``(elements behind Adam's
    exp_avg, tensors in optimizer.state, entries of torch's own optimizer state dict)``."""
    return minizero.launch(_state_sizes, nprocs, stage)


def show_state_sizes(per_rank: list[tuple]) -> None:
    for rank, (held, tensors, entries) in enumerate(per_rank):
        print(
            f"rank {rank}: exp_avg covers {held:,} of Ψ = {PSI:,} elements, in {tensors} "
            f"tensors; torch's state dict of them has {entries} entries, numbered from 0"
        )


def _save_one(stage: int, path: Path, precision: str, bucket_cap_mb: float | None) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    cap = None if stage == 3 else bucket_cap_mb  # stage 3 cuts by units, not buckets
    opt = nanogpt_adamw(model)
    model, opt = minizero.parallelize(model, stage, opt, precision=precision, bucket_cap_mb=cap)
    model(*gpt_batch(0)).backward()
    opt.step()
    opt.zero_grad()
    minizero.save_checkpoint(path, model, opt, extra={"step": 1})


def save_one(
    nprocs: int, stage: int, path: Path, precision: str = "fp32", bucket_cap_mb: float | None = None
) -> Path:
    """Sections 2 and 4: TinyGPT, nanoGPT's AdamW, one step at ``stage``, saved to ``path``."""
    minizero.launch(_save_one, nprocs, stage, path, precision, bucket_cap_mb, verbose=False)
    return path


def show_files(path: Path) -> None:
    """The checkpoint's files, and what its commit record says of the model."""
    for f in sorted(path.iterdir()):
        print(f"{f.name:16} {f.stat().st_size:>9,} bytes")
    record = json.loads((path / "minizero.json").read_text())
    print("saved with", record["saved_with"], "| optimizer", record["optimizer"])
    stored = {k[0]: k[2] for k in record["keys"] if k[1] == "param"}
    print(
        "wte.weight:",
        record["params"]["wte.weight"],
        "| lm_head.weight is stored as",
        stored["lm_head.weight"],
    )


def show_chunks(path: Path, show: int = 3) -> None:
    """DCP's metadata: the chunks of a few parameters split between ranks, in which file."""
    meta = FileSystemReader(path).read_metadata()
    tensors = meta.state_dict_metadata
    split = [
        k
        for k, v in tensors.items()
        if k.startswith("model/") and len(getattr(v, "chunks", [])) > 1
    ]
    for key in [*split[:show], f"optim/{split[0][len('model/') :]}/exp_avg", "model/ln_f.weight"]:
        stored = tensors[key]
        files = {i.offset[0]: w.relative_path for i, w in meta.storage_data.items() if i.fqn == key}
        pieces = [
            f"[{c.offsets[0]:,}, {c.offsets[0] + c.sizes[0]:,}) in {files[c.offsets[0]]}"
            for c in stored.chunks
        ]
        print(f"{key} ({stored.size[0]:,} elements): " + ", ".join(pieces))
    print(
        f"{len(split)} parameters are split between ranks; the others lie whole in one rank's file"
    )


def log_loss(path: Path, step: int, loss: torch.Tensor) -> None:
    """Inside a rank: rank 0 appends the global batch's loss (the mean of the ranks' means)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "loss": mean.item() / dist.get_world_size()}) + "\n")


def run_that_dies(fn, *args, **kwargs) -> None:
    """Section 3: launch ``fn`` on gloo ranks, expecting a rank to die in a save; say where the
    save stopped, what is left on disk, and what ``consolidate`` says of the unfinished save."""
    log = Path(args[2])
    try:
        minizero.launch(fn, *args, backend="gloo", **kwargs)
    except LaunchError as e:
        print(
            "the run died:", next(ln for ln in str(e).splitlines() if "save_checkpoint fail" in ln)
        )
    print(sorted(p.name for p in log.iterdir()))
    for p in sorted(log.glob("*.incomplete")):
        try:
            minizero.consolidate(p.with_suffix(""))
        except CheckpointError as e:
            print(f"{p.with_suffix('').name}:", e)


def latest_checkpoint(folder: Path) -> Path:
    """The last committed checkpoint (one with its record, ``minizero.json``) under ``folder``."""
    done = [p for p in folder.iterdir() if (p / "minizero.json").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]))


def read_logs(folder: Path, names: list[str]) -> dict[str, dict[int, float]]:
    """Each run's ``{step: loss}``, from ``folder/NAME.jsonl``."""
    rows = lambda name: (folder / f"{name}.jsonl").read_text().splitlines()
    return {n: {r["step"]: r["loss"] for r in map(json.loads, rows(n))} for n in names}


def plot_resume(logs: dict, labels: dict[str, str], resumed_from: int) -> None:
    """The runs' losses on one axis; the reference drawn wide and pale beneath."""
    fig, ax = plt.subplots(figsize=(8, 4))
    styles = {
        "reference": dict(color="k", lw=3, alpha=0.25),
        "crashed": dict(marker="o"),
        "resumed": dict(marker="x", ls="--"),
    }
    for name, label in labels.items():
        ax.plot(*zip(*logs[name].items(), strict=True), label=label, **styles.get(name, {}))
    ax.axvline(resumed_from - 0.5, color="gray", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss of the global batch")
    ax.legend(fontsize=8)
    ax.set_title("a run killed and resumed on another world size and stage (gloo, CPU)", fontsize=9)
    fig.tight_layout()
    plt.show()
    resumed, reference = logs["resumed"], logs["reference"]
    gap = max(abs(resumed[s] - reference[s]) for s in resumed)
    print(f"resumed vs reference, steps {min(resumed)}-{max(resumed)}: max |Δloss| = {gap:.1e}")


def _save_each(root: Path, stages) -> dict:
    for s in stages:
        _save_one(s, root / f"s{s}", "bf16", None)
    return run_info()


def bytes_per_stage(nprocs: int, root: Path, stages=(0, 1, 2, 3)) -> dict:
    """Section 4: TinyGPT in bf16 with AdamW, one step, saved at each stage; per stage, each
    rank's ``checkpoint_bytes`` (shards, elements, files)."""
    info = minizero.launch(_save_each, nprocs, root, stages, verbose=False)[0]
    return dict(bytes={s: checkpoint_bytes(root / f"s{s}") for s in stages}, info=info)


def plot_bytes_per_stage(got: dict, per_rank: float, one_rank: float) -> None:
    """One panel per stage, a bar per rank: its shards, and the rest of its files above them;
    ``per_rank`` (the formula's share) and ``one_rank`` (everything on one rank) as lines."""
    stages = list(got["bytes"])
    fig, axes = plt.subplots(1, len(stages), figsize=(10, 3.8), sharey=True)
    for ax, s in zip(axes, stages, strict=True):
        ranks = range(len(got["bytes"][s]))
        shards = [b["shards"] / 2**20 for b in got["bytes"][s]]
        rest = [(b["files"] - b["shards"]) / 2**20 for b in got["bytes"][s]]
        ax.bar(ranks, shards, color="tab:blue", label="shards")
        ax.bar(ranks, rest, bottom=shards, color="tab:blue", alpha=0.3, label="rest of the files")
        ax.axhline(per_rank / 2**20, color="k", ls="--", lw=1, label="(2 + K)Ψ / N")
        ax.axhline(one_rank / 2**20, color="r", ls=":", lw=1, label="(2 + K)Ψ: all on one rank")
        ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks], fontsize=8)
        ax.set_title("stage 0 (DDP)" if s == 0 else f"stage {s}", fontsize=9)
    axes[0].set_ylabel("MiB written")
    axes[0].set_ylim(0, 1.15 * one_rank / 2**20)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"checkpoint bytes per rank, TinyGPT bf16 AdamW: {describe(got['info'])}", fontsize=9
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    plt.show()


def show_bytes_per_stage(got: dict) -> None:
    for s, per_rank in got["bytes"].items():
        print(
            f"stage {s}: "
            + ", ".join(
                f"rank {r} {b['shards']:,} B of shards ({b['elements']:,} elements), "
                f"{b['files']:,} B of files"
                for r, b in enumerate(per_rank)
            )
        )
