"""``bench nanogpt``'s options and what it prints: the table of runs and, over several seeds, each
run's spread and Welch's t against nanoGPT's own runs (``minizero/tools/bench_nanogpt.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

JSON = "runs/bench_nanogpt.json"  # where the bench writes its figures, and train reads them
# the TrainConfig fields that make an iteration's work: the bench records them, so that train
# sets its step beside nanoGPT's iteration only when both ran the same model on the same batches
SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
         "dropout", "precision")  # fmt: skip


def parse(argv: list[str], description: str) -> argparse.Namespace:
    from minizero.tools.cli import Parser, positive_int

    p = Parser(prog="minizero bench nanogpt", description=description)
    p.add_argument(
        "--max-iters",
        type=positive_int,
        default=2000,
        help="iterations of every run (default 2000, nanoGPT's README's CPU run)",
    )
    p.add_argument("--nprocs", type=positive_int, default=2, help="minizero's ranks (default 2)")
    p.add_argument(
        "--nanogpt-threads",
        type=positive_int,
        default=None,
        help="OMP_NUM_THREADS for nanoGPT (default: unset, torch's own choice)",
    )
    p.add_argument(
        "--no-fed",
        dest="fed",
        action="store_false",
        help="skip the run of nanoGPT's train.py on minizero's batches",
    )
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the one-process reference (plain PyTorch, 1 thread)",
    )
    p.add_argument("--stages", default="0,3", help="minizero's stages (default 0,3)")
    p.add_argument(
        "--seeds",
        default="1337",
        help="comma-separated seeds; every run is repeated at each (default 1337, "
        "nanoGPT's): with several, each run's mean and spread and Welch's t",
    )
    p.add_argument(
        "--json",
        default=JSON,
        help="where to write the results ('' for nowhere)",
    )
    p.add_argument("--timeout", type=positive_int, default=3600,
                   help="seconds each run may take (default 3600)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        a.stages = sorted({int(s) for s in a.stages.split(",")})
        assert a.stages and set(a.stages) <= {0, 1, 2, 3}
    except (ValueError, AssertionError):
        p.error(f"--stages takes a comma-separated subset of 0,1,2,3, got {a.stages!r}")
    try:
        a.seeds = [int(s) for s in a.seeds.split(",")]
        assert len(set(a.seeds)) == len(a.seeds)
    except (ValueError, AssertionError):
        p.error(f"--seeds takes distinct comma-separated whole numbers, got {a.seeds!r}")
    if 12 % a.nprocs:
        p.error(f"--nprocs {a.nprocs} does not divide nanoGPT's batch of 12: use 1, 2, 3, 4 or 6")
    return a


def largest_difference(row: dict, ref: dict | None) -> str:
    """The largest relative difference of ``row``'s evaluations (train and val) from the
    one-process reference's of the same seed; blank where the row draws other batches."""
    if ref is None or row is ref or not (row.get("fed") or "stage" in row["name"]):
        return "" if row is ref or ref is None else "own batches"
    pairs = [(a, b) for r, q in zip(row["evals"], ref["evals"], strict=True)
             for a, b in zip(r[1:], q[1:], strict=True)]  # fmt: skip
    return f"{max(abs(a - b) / abs(b) for a, b in pairs):.1e}"


def print_rows(rows: list[dict], a: argparse.Namespace) -> None:
    from minizero.analysis.memory import format_bytes

    own = [r for r in rows if r["name"].startswith("nanoGPT train.py") and not r.get("fed")]
    base = {r["seed"]: r["wall_s"] for r in own}
    iters = {r["seed"]: r.get("iter_ms") for r in own}  # nanoGPT's median iteration, this run
    refs = {r["seed"]: r for r in rows if r.get("reference")}
    cores = os.cpu_count()
    threads = a.nanogpt_threads or "torch's default"
    print(f"\nnanoGPT's README's CPU run (4 layers, 4 heads, n_embd 128, block 64), "
          f"on Tiny Shakespeare, {a.max_iters} iterations, CPU ({cores} cores); threads: nanoGPT "
          f"{threads}, minizero 1 per rank")  # fmt: skip
    head = (f"{'run':<38}{'seed':>5}{'val':>8}{'val all':>8}{'train':>8}{'diff':>13}"
            f"{'wall s':>8}{'/ nanoGPT':>10}{'iter ms':>8}{'/ nanoGPT':>10}{'peak RSS':>11}"
            f"{'states':>11}"
            f"{'load':>5}")  # fmt: skip
    print(head)
    for r in rows:
        r["ratio"] = r["wall_s"] / base[r["seed"]] if r["seed"] in base else None
        r["diff"] = largest_difference(r, refs.get(r["seed"]))
        ms = f"{r['iter_ms']:.1f}" if r.get("iter_ms") else ""
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else ""
        r["iter_ratio"] = (r["iter_ms"] / iters[r["seed"]]
                           if r.get("iter_ms") and iters.get(r["seed"]) else None)  # fmt: skip
        per_iter = f"{r['iter_ratio']:.2f}" if r["iter_ratio"] else ""
        states = format_bytes(r["states"]) if r.get("states") else ""
        print(f"{r['name']:<38}{r['seed']:>5}{r['val']:>8.4f}{r['val_full']:>8.4f}"
              f"{r['train']:>8.4f}{r['diff']:>13}{r['wall_s']:>8.1f}{ratio:>10}{ms:>8}"
              f"{per_iter:>10}{format_bytes(r['peak']):>11}{states:>11}"
              f"{r['load']:>5.1f}")  # fmt: skip
    print("val: the 20-batch estimate at the last iteration (nanoGPT's README: 1.88 at 2,000); "
          "val all: the final model over the whole validation split (111,539 characters, each "
          "predicted once); train: the 20-batch estimate on the training split; diff: the "
          "largest relative difference of the evaluations from the one-process run of the same "
          "seed; iter ms: the median iteration, and its ratio to nanoGPT's own run's in this "
          "bench (the figure that does not count start-up or evaluations); peak RSS: the "
          "largest process (minizero: its largest rank); states: model "
          "states per rank at the end of a backward (the largest rank); wall: the whole "
          f"command, start-up and evaluations included; load: the 1-minute load average as the "
          f"run ended, on {cores} cores (above that the runs shared the machine and their times "
          "mean little)")  # fmt: skip


def welch(x: list[float], y: list[float]) -> tuple[float, float]:
    """Welch's t of mean(x) - mean(y) and its Welch-Satterthwaite degrees of freedom."""
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    t = (statistics.mean(x) - statistics.mean(y)) / math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    return t, df


def print_seeds(rows: list[dict]) -> None:
    """Each run's mean and sample standard deviation over the seeds, and Welch's t of its mean
    against nanoGPT's own runs (a |t| above about 2.3-2.8 at 4-8 degrees of freedom: a gap
    beyond the seeds' spread, at the 5% level)."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    own = [r for r in rows if r["name"] == names[0]]
    print(f"\nover {len(own)} seeds: mean ± standard deviation; t: Welch's t against "
          f"{names[0]} (df: its degrees of freedom)")  # fmt: skip
    for key, what in (("val", "val (20 batches)"), ("val_full", "val (whole split)")):
        print(what)
        base = [r[key] for r in own]
        for name in names:
            vals = [r[key] for r in rows if r["name"] == name]
            line = f"  {name:<38}{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f}"
            if name != names[0]:
                t, df = welch(vals, base)
                line += f"   t {t:+.2f} (df {df:.1f})"
            print(line)


def beside_nanogpt(cfg, step_ms: float, where: dict, path: str | Path = JSON) -> str | None:
    """``train``'s line beside nanoGPT: its median step over nanoGPT's median iteration as
    ``bench nanogpt`` last measured it (``path``) on this machine with ``cfg``'s model and batch;
    else how to measure that. None on GPUs (the bench runs nanoGPT on the CPU)."""
    if where["backend"] != "gloo":
        return None
    how = "python -m minizero bench nanogpt measures its iteration here, and train then prints "
    how += "the ratio"
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return f"beside nanoGPT: {how}"
    own = [r["iter_ms"] for r in rec.get("rows", [])
           if r.get("name") == "nanoGPT train.py" and r.get("iter_ms")]  # fmt: skip
    if not own or rec.get("machine") is None:  # (a bench of before it recorded them)
        return f"beside nanoGPT: {path} records no nanoGPT iteration and machine; {how}"
    if rec["machine"] != where["device"]:
        return f"beside nanoGPT: {path} was measured on another machine; {how}"
    if rec.get("config") != {k: getattr(cfg, k) for k in SHAPE}:
        return f"beside nanoGPT: {path} was measured with another configuration; {how}"
    ms = statistics.median(own)
    return (f"beside nanoGPT: {step_ms / ms:.2f}x its median iteration ({ms:.1f} ms: its own "
            f"train.py in one process, this configuration, timed by bench nanogpt on this machine "
            f"on {rec.get('date', '?')}; bench nanogpt times both in one sitting)")  # fmt: skip
