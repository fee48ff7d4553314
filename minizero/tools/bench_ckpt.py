"""Checkpoint benchmark: save and load time, bytes per rank, per stage. Lesson 07.

``python -m minizero bench checkpoints [--model small] [--precision bf16] [--nprocs N] [--dir DIR]``

The bench model of ``python -m minizero bench`` (TinyGPT, AdamW) is trained one step at each
stage, then saved and loaded ``--repeat`` times; times are medians of the slowest rank, bytes are
what each rank wrote (:func:`minizero.checkpoint.checkpoint_bytes`) beside the formula, a rank's
share of (P + K)Ψ. Every figure is printed with the backend, device and file system it came from.
Under gloo the ranks are processes on one machine writing to one disk; under NCCL each rank also
copies its shards from its GPU first, and the few collectives of the save (plans, markers) are
tiny either way: the time is the file system's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minizero.analysis.memory import format_bytes
from minizero.tools import report as bench
from minizero.tools.cli import Parser, add_nprocs, positive_float, positive_int

HELP = (
    "minizero.save_checkpoint / load_checkpoint at each stage on the bench model (TinyGPT, "
    "AdamW, one step trained): save and load time (median of --repeat, slowest rank) and the "
    "bytes each rank wrote, beside the formula (P + K)Ψ/N. Every figure names the backend, "
    "device and file system it came from."
)


def stage_list(text: str) -> list[int]:
    """argparse type: a comma-separated subset of 0,1,2,3, e.g. '0,3'."""
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        stages = [-1]
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"a comma-separated subset of 0,1,2,3, got {text!r}")
    return list(dict.fromkeys(stages))


def _rank(stages: list[int], model_name: str, precision: str, repeat: int, root: str,
          progress=None) -> dict:  # fmt: skip
    import minizero
    from minizero.models import GPTConfig, TinyGPT, count_params

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"where": bench.measured_on(), "stages": {}}
    for stage in stages:
        torch.manual_seed(0)
        model = TinyGPT(getattr(GPTConfig, model_name)())  # GPTConfig.tiny() or .small()
        psi = count_params(model)
        model, opt = minizero.parallelize(
            model, stage, lambda p: torch.optim.AdamW(p, lr=1e-3), precision=precision
        )
        x, y = minizero.synthetic_batch("gpt", 2 * world, 0, rank=rank, world=world,
                                        seq_len=model.module.config.block_size,
                                        vocab_size=model.module.config.vocab_size)  # fmt: skip
        model(x, y).backward()  # one step: the optimizer has its states
        opt.step()
        opt.zero_grad()
        path = f"{root}/stage{stage}"
        saves, loads = [], []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            minizero.save_checkpoint(path, model, opt)
            dist.barrier()  # a save is done when every rank's part is committed
            t1 = time.perf_counter()
            minizero.load_checkpoint(path, model, opt)
            dist.barrier()
            saves.append(t1 - t0)
            loads.append(time.perf_counter() - t1)
            if progress is not None:
                progress.tick()  # one save + load done
        out["stages"][stage] = {"save": saves, "load": loads, "psi": psi}
    return out


def bench_checkpoint(argv: list[str] | None = None) -> dict:
    p = Parser(prog="minizero bench checkpoints", description=HELP)
    add_nprocs(p)
    p.add_argument(
        "--model",
        default="small",
        choices=["tiny", "small"],
        help="TinyGPT tiny (~0.11M parameters) or small (~3.7M) (default small)",
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["fp32", "bf16", "fp16"],
        help="the precision policy: fp32 saves 4 + 8 bytes per element, bf16/fp16 2 + 12 "
        "(default bf16)",
    )
    p.add_argument(
        "--stages",
        type=stage_list,
        default=[0, 1, 2, 3],
        help="comma-separated subset of 0,1,2,3 (default: all four)",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=3, help="saves and loads per stage (default 3)"
    )
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=900,
        help="seconds the ranks may run (default 900)",
    )
    p.add_argument(
        "--json", default="runs/bench_checkpoints.json",
        help="where to write the results ('' for nowhere; default runs/bench_checkpoints.json)",
    )  # fmt: skip
    a = p.parse_args(argv)
    from minizero.checkpoint import checkpoint_bytes

    stages = a.stages
    root = Path(a.dir or tempfile.mkdtemp(prefix="minizero-bench-ckpt-"))
    try:
        n, total = bench.ranks(a.nprocs), len(stages) * a.repeat
        per_rank = bench.run_ranks(_rank, n, a.timeout, stages, a.model, a.precision, a.repeat,
                                   str(root), total=total, desc="save + load")  # fmt: skip
        where = per_rank[0]["where"]
        world = where["world"]
        p_bytes, k_bytes = (4, 8) if a.precision == "fp32" else (2, 12)  # params, K (Adam)
        rows = []
        for stage in stages:
            psi = per_rank[0]["stages"][stage]["psi"]
            save = statistics.median(max(r["stages"][stage]["save"][i] for r in per_rank)
                                     for i in range(a.repeat))  # fmt: skip
            load = statistics.median(max(r["stages"][stage]["load"][i] for r in per_rank)
                                     for i in range(a.repeat))  # fmt: skip
            rows.append(dict(stage=stage, psi=psi, save_s=save, load_s=load,
                             formula=(p_bytes + k_bytes) * psi / world,
                             ranks=checkpoint_bytes(root / f"stage{stage}")))  # fmt: skip
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out = dict(where=where, model=a.model, precision=a.precision, dir=str(root), rows=rows)
    if bench.printer():
        print(bench.header("checkpoint", where))
        print(f"model: TinyGPT {a.model}, Ψ = {rows[0]['psi']:,}; AdamW; {a.precision} "
              f"(P + K = {p_bytes} + {k_bytes} bytes per element); written to {root} "
              f"({_filesystem(root)}); medians of {a.repeat}, slowest rank")  # fmt: skip
        print(
            f"\n{'stage':>5}{'save(ms)':>10}{'load(ms)':>10}{'(P+K)Ψ/N':>12}   "
            "per rank: shards written / file bytes"
        )
        for r in rows:
            ranks = "  ".join(f"{format_bytes(x['shards'])}/{format_bytes(x['files'])}"
                              for x in r["ranks"])  # fmt: skip
            print(f"{r['stage']:>5}{r['save_s'] * 1e3:>10.1f}{r['load_s'] * 1e3:>10.1f}"
                  f"{format_bytes(r['formula']):>12}   {ranks}")  # fmt: skip
    if a.json:
        bench.write_json(a.json, out)
    return out


def _filesystem(path: Path) -> str:
    """The file system type of ``path`` (Linux: from /proc/mounts), e.g. 'ext4', 'tmpfs'."""
    try:
        mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "file system unknown"
    best = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]),
               default=None)  # fmt: skip
    return best[2] if best else "file system unknown"


if __name__ == "__main__":
    bench_checkpoint()
