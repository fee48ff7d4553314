"""The ``train`` command: options, a progress bar with the live loss, the report, the loss plot.

    python -m minizero train                        # nanoGPT's CPU run, stage 0, 2 CPU ranks
    python -m minizero train --stage 3 --nprocs 2   # the same at ZeRO-3
    python -m minizero train --stage 2 --nprocs 3 --resume runs/train/ckpt --max-iters 3000
    python -m minizero run -m minizero train --stage 3   # under torchrun (multi-node: its options)

The loop itself is ``minizero/tools/train.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from dataclasses import asdict, fields
from pathlib import Path

from minizero.launcher.progress import Progress
from minizero.tools.train import TrainConfig

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}


class LiveProgress(Progress):
    """Rank 0 ticks once per iteration with its loss; the parent's bar shows both."""

    def tick(self, n: int = 1, loss: float | None = None) -> None:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
        if loss is not None:
            Path(self.path + ".loss").write_text(f"{loss:.4f}")
        super().tick(n)


class PrintProgress:
    """Under torchrun (no parent to draw a bar): rank 0 prints the loss every ``every`` ticks."""

    def __init__(self, every: int, start: int):
        self.every, self.it = every, start

    def tick(self, n: int = 1, loss: float | None = None) -> None:
        import torch.distributed as dist

        if dist.get_rank() == 0 and self.it % self.every == 0:
            print(f"iter {self.it}: loss {loss:.4f}", flush=True)
        self.it += n


def launch_live(fn, nprocs: int, *args, total: int, timeout: float, backend: str = "auto") -> list:
    """``minizero.launch(fn, nprocs, *args, progress=...)`` with a tqdm bar that follows rank 0's
    iterations and shows its last loss (this rank's rows, as nanoGPT prints its master's)."""
    from tqdm.auto import tqdm

    from minizero.launcher import launch

    with tempfile.TemporaryDirectory(prefix="minizero-train-") as tmp:
        progress = LiveProgress(os.path.join(tmp, "ticks"))
        bar = tqdm(total=total, desc="iters")
        stop = threading.Event()

        def follow() -> None:
            while True:
                done = stop.wait(0.25)
                ticks = os.path.getsize(progress.path) if os.path.exists(progress.path) else 0
                bar.update(min(ticks, total) - bar.n)
                try:
                    bar.set_postfix_str(f"loss {Path(progress.path + '.loss').read_text()}")
                except OSError:
                    pass
                if done:
                    return

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        try:
            return launch(fn, nprocs, *args, progress=progress, timeout=timeout,
                          backend=backend, verbose=False)  # fmt: skip
        finally:
            stop.set()
            watcher.join()
            bar.close()


def train(cfg: TrainConfig, nprocs: int, timeout: float = 3600.0, quiet: bool = False,
          backend: str = "auto") -> list:  # fmt: skip
    """Run ``cfg`` on ``nprocs`` ranks (``backend`` "auto": gloo CPU ranks, or one per GPU over
    NCCL); return every rank's history (see ``minizero.tools.train.train_rank``). ``quiet``: no
    progress bar."""
    from minizero.launcher import launch
    from minizero.tools.train import train_rank

    total = cfg.max_iters  # a resumed run's bar starts at its checkpoint's iteration
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        return launch(train_rank, nprocs, cfg, progress=PrintProgress(10, 0), timeout=timeout,
                      verbose=not quiet)  # fmt: skip
    if quiet:
        return launch(train_rank, nprocs, cfg, timeout=timeout, backend=backend, verbose=False)
    return launch_live(train_rank, nprocs, cfg, total=total, timeout=timeout, backend=backend)


def curve(results: list) -> list[float]:
    """The loss of each global batch: the mean of the ranks' means (equal shares of the rows),
    after the curve a resumed run's checkpoint carried ("prior")."""
    mine = [sum(losses) / len(results) for losses in zip(*(r["loss"] for r in results))]
    return results[0].get("prior", []) + mine


def cfg_val_targets() -> int:
    """The characters the whole-split loss predicts: every one of the split but the first."""
    from minizero.tools import shakespeare

    return len(shakespeare.load().val) - 1


def report(cfg: TrainConfig, results: list, out_dir: Path | None) -> dict:
    """Print the evaluations, memory, step time and sample; write the plot and the JSON."""
    from minizero.analysis.memory import format_bytes
    from minizero.tools.bench_nanogpt_report import beside_nanogpt

    r0, world = results[0], len(results)
    where = r0["where"]
    print(f"\nminizero train: stage {cfg.stage} = {STAGE_NAMES[cfg.stage]}, {world} ranks, "
          f"{where['backend']} on {where['device']}, torch {where['torch']}, {cfg.precision}"
          + (f", mesh {cfg.mesh} (replicate, shard)" if cfg.mesh else ""))  # fmt: skip
    for it, tr, va in r0["evals"]:
        print(f"step {it}: train loss {tr:.4f}, val loss {va:.4f}")
    if "val_full" in r0:
        n_val = cfg_val_targets()
        print(f"val loss over the whole validation split ({n_val:,} characters, each predicted "
              f"once): {r0['val_full']:.4f} (the estimate above: {cfg.eval_iters} batches of "
              f"{cfg.batch_size} x {cfg.block_size})")  # fmt: skip
    steps = [max(r["step_s"][i] for r in results) for i in range(len(r0["step_s"]))]
    step_ms = 1e3 * statistics.median(steps[1:] or steps) if steps else float("nan")
    print(f"time: {r0['seconds']:.1f} s for iterations {r0['start']}-{cfg.max_iters} "
          f"(evaluations included); median step {step_ms:.1f} ms (slowest rank)")  # fmt: skip
    if (line := beside_nanogpt(cfg, step_ms, where)) is not None:
        print(line)
    states = r0.get("states", {})
    if states:
        per = [format_bytes(sum(r["states"].values())) for r in results]
        print(
            "model states at the end of a backward, per rank: "
            + ", ".join(f"rank {i}: {b}" for i, b in enumerate(per))
            + f"; peak RSS {format_bytes(max(r['rss'] for r in results))} (largest rank)"
        )
    if "cuda_peak" in r0:
        print("peak CUDA memory allocated per rank: "
              + ", ".join(format_bytes(r["cuda_peak"]) for r in results))  # fmt: skip
    if r0.get("sample"):
        print(f"\n--- sample ({len(r0['sample'])} characters, temperature 0.8, top_k 200) ---\n"
              f"{r0['sample']}\n---")  # fmt: skip
    if r0.get("checkpoint"):
        print(f"checkpoint: {r0['checkpoint']} (resume at any stage or world size: --resume)")
    summary = {"config": asdict(cfg), "world": world, "where": where, "evals": r0["evals"],
               "val_full": r0.get("val_full"),
               "loss": curve(results), "step_ms": step_ms, "sample": r0.get("sample"),
               "states": [r.get("states") for r in results],
               "rss": [r["rss"] for r in results]}  # fmt: skip
    if out_dir is not None:
        from minizero.tools.report import write_json

        write_json(out_dir / "history.json", summary)
        plot(summary, out_dir / "loss.png")
    return summary


def plot(summary: dict, path: Path) -> None:
    """The training curve (each iteration's global batch) and the evaluations, to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(summary["loss"])), summary["loss"], lw=0.6, alpha=0.6, label="train batch")
    ev = summary["evals"]
    ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", label="train (eval)")
    ax.plot([e[0] for e in ev], [e[2] for e in ev], "s-", label="val (eval)")
    cfg, w = summary["config"], summary["where"]
    ax.set(xlabel="iteration", ylabel="cross-entropy (nats/char)",
           title=f"stage {cfg['stage']}, {summary['world']} ranks, {w['backend']}")  # fmt: skip
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def mesh_arg(text: str) -> tuple[int, int]:
    """argparse type: ``R,S`` (replicate x shard ranks), both >= 1."""
    try:
        r, s = (int(v) for v in text.split(","))
    except ValueError:
        r = s = 0
    if r < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"give REPLICATE,SHARD, e.g. 2,2 (got {text!r})")
    return r, s


def parser() -> argparse.ArgumentParser:
    from minizero.tools.cli import Parser, add_nprocs, positive_float, positive_int

    d = TrainConfig()
    p = Parser(
        prog="minizero train",
        description="Train nanoGPT's character-level Shakespeare model (its README's CPU "
        "configuration) on Tiny Shakespeare (characters, shipped with minizero) at a ZeRO "
        "stage, on gloo CPU ranks or one rank per GPU over NCCL: a progress bar with the live "
        "loss, train and val loss at each evaluation, a checkpoint to resume "
        "from at any stage or world size, generated text at the end, and the loss plot in "
        "--out-dir; at the end, the loss over the whole validation split.",
    )
    add_nprocs(p)
    p.add_argument(
        "--stage",
        type=int,
        default=0,
        choices=list(STAGE_NAMES),
        help="0: DDP, 1: ZeRO-1, 2: ZeRO-2, 3: ZeRO-3 (default 0)",
    )
    ints = {"n-layer": "transformer blocks", "n-head": "attention heads per block",
            "n-embd": "model width", "block-size": "characters of context",
            "batch-size": "the global batch in sequences, split evenly over the ranks",
            "gradient-accumulation-steps": "micro-batches per step, each a global batch",
            "max-iters": "optimizer steps", "warmup-iters": "iterations of linear warm-up",
            "eval-interval": "iterations between evaluations",
            "eval-iters": "batches per split in an evaluation"}  # fmt: skip
    for flag, what in ints.items():
        p.add_argument(f"--{flag}", type=positive_int, default=getattr(d, flag.replace("-", "_")),
                       help=f"{what} (default %(default)s)")  # fmt: skip
    more = [  # (flag, argparse keywords, help)
        ("--learning-rate", {"type": positive_float, "default": d.learning_rate},
         "peak learning rate (default %(default)s)"),
        ("--min-lr", {"type": positive_float, "default": d.min_lr},
         "learning rate at the end of the decay (default %(default)s)"),
        ("--lr-decay-iters", {"type": positive_int, "default": None},
         "where the cosine decay reaches --min-lr (default: --max-iters)"),
        ("--dropout", {"type": float, "default": d.dropout}, "dropout (default 0.0)"),
        ("--precision", {"choices": ["fp32", "bf16", "fp16"], "default": "fp32"},
         "parameter and gradient precision of the wrapper (default fp32)"),
        ("--min-unit-params", {"type": int, "default": d.min_unit_params},
         "stage 3: a block with fewer parameters joins the unit around it (default %(default)s;"
         " 0: every block a unit)"),
        ("--no-reshard-root", {"dest": "reshard_root", "action": "store_false"},
         "stage 3: keep the root unit (this model: all of it) gathered from forward to the end "
         "of backward, as FSDP2 does its root: 2Ψ a step instead of 3Ψ"),
        ("--mesh", {"type": mesh_arg, "default": None, "metavar": "R,S"},
         "HSDP: R replicas of S ranks that shard (R x S = the ranks); no checkpoint"),
        ("--out-dir", {"default": "runs/train"},
         "checkpoint, history.json and loss.png go here (default runs/train)"),
        ("--resume", {"default": None, "metavar": "CKPT"},
         "continue from this checkpoint, at any stage and world size"),
        ("--sample-tokens", {"type": int, "default": d.sample_tokens},
         "characters generated at the end (default %(default)s; 0: none)"),
        ("--seed", {"type": int, "default": d.seed}, "data and weights seed (default 1337)"),
        ("--backend", {"choices": ["auto", "gloo", "nccl"], "default": "auto"},
         "auto: one rank per GPU over NCCL where each rank has a GPU, else gloo"),
        ("--timeout", {"type": positive_float, "default": 7200.0},
         "seconds the ranks may run before they are stopped (default 7200)"),
    ]  # fmt: skip
    for flag, kw, what in more:
        p.add_argument(flag, help=what, **kw)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero train [options]``."""
    from minizero.launcher import LaunchError
    from minizero.tools.report import printer, ranks

    p = parser()
    a = p.parse_args(argv)
    n = ranks(a.nprocs)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        n = int(os.environ["WORLD_SIZE"])  # under torchrun: its ranks
    if a.batch_size % n:
        fix = n * max(1, round(a.batch_size / n))
        p.error(f"--batch-size {a.batch_size} does not split evenly over {n} ranks: pass "
                f"--batch-size {fix}, or --nprocs dividing {a.batch_size}")  # fmt: skip
    if a.mesh is not None and min(a.mesh) < 2:
        p.error(
            f"--mesh {a.mesh[0]},{a.mesh[1]}: HSDP needs at least 2 replicas of at least 2 "
            "ranks; with 1 it is flat: leave --mesh out (--stage 3 shards over every rank)"
        )
    if a.mesh is not None and a.mesh[0] * a.mesh[1] != n:
        p.error(f"--mesh {a.mesh[0]},{a.mesh[1]} covers {a.mesh[0] * a.mesh[1]} ranks, not the "
                f"{n} ranks running (--nprocs)")  # fmt: skip
    if a.resume is not None and not Path(a.resume).is_dir():
        p.error(f"--resume {a.resume}: no such checkpoint directory")
    kw = {f.name: getattr(a, f.name) for f in fields(TrainConfig) if hasattr(a, f.name)}
    try:
        cfg = TrainConfig(**kw)
    except ValueError as e:
        p.error(str(e))
    if cfg.resume:
        cfg.out_dir = cfg.out_dir or str(Path(cfg.resume).parent)
    if printer():
        print(f"minizero train: stage {cfg.stage} ({STAGE_NAMES[cfg.stage]}) on {n} ranks, "
              f"{cfg.max_iters} iterations, global batch {cfg.batch_size} x {cfg.block_size} "
              f"characters ({cfg.batch_size // n} sequences per rank)", flush=True)  # fmt: skip
    try:
        results = train(cfg, n, a.timeout, backend=a.backend)
    except LaunchError as e:
        print(f"minizero train: {e}", file=sys.stderr)
        return 1
    if printer():
        report(cfg, results, Path(cfg.out_dir) if cfg.out_dir else None)
    return 0
