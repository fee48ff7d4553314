"""``python -m minizero bench nanogpt``: nanoGPT's own ``train.py`` beside ``minizero train``.

The same run both ways on this machine: nanoGPT's README's CPU run (its command line, which
shrinks the "baby GPT" of ``config/train_shakespeare_char.py`` for a CPU:
``config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0``), one process, then ``python -m minizero train`` with the
same configuration at stages 0 and 3 on 2 gloo ranks, and one process in plain PyTorch (the
reference). Printed: the validation loss at the last iteration, the 20-batch estimate both print
(nanoGPT's README reports 1.88 at 2,000) and the final model over the whole validation split
(``minizero/tools/full_split.py``); each run's largest difference from one process; the wall
time of each as a ratio to nanoGPT's, the median iteration time, the peak resident memory of the
largest process and minizero's model states per rank. ``--seeds``: every run at each seed, then
each run's mean and spread and Welch's t against nanoGPT's own runs.

The two draw their batches differently (nanoGPT from torch's global generator, its evaluations
too; minizero each global batch from a stream of its own, and the same eval batches every time),
so their losses are two samples of one experiment. The bench therefore runs nanoGPT a second time
drawing minizero's batches (``--no-fed`` skips it): with the same data its model, initialisation
(the same seed, drawn in the same order) and loop trace minizero's curve, so what remains between
the first two rows is the sample alone.

nanoGPT is not shipped with minizero. The bench looks for a checkout in ``$MINIZERO_NANOGPT``,
else ``~/.cache/minizero/nanoGPT``; where there is none it tries ``git clone`` into the latter and,
offline, stops with a message saying how to place one. nanoGPT's data step
(``data/shakespeare_char/prepare.py``) downloads the text; the bench writes the same files
(``train.bin``, ``val.bin``, ``meta.pkl``) from minizero's copy instead, into a temporary
directory where nanoGPT runs.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEEDED = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
REPO = "https://github.com/karpathy/nanoGPT"
PUBLISHED_VAL = 1.88  # nanoGPT's README, its CPU run at 2,000 iterations
# maximum RSS of the largest descendant that has exited (Linux: ru_maxrss in KiB)
PEAK = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
        "print('MINIZERO_PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(rc)")  # fmt: skip


def nanogpt_dir() -> Path:
    """Where the bench looks for nanoGPT: ``$MINIZERO_NANOGPT``, else the cache."""
    env = os.environ.get("MINIZERO_NANOGPT")
    return Path(env) if env else Path.home() / ".cache" / "minizero" / "nanoGPT"


def find_nanogpt(fetch: bool = True) -> tuple[Path | None, str]:
    """``(checkout, "")``, or ``(None, why)`` with what to do."""
    where = nanogpt_dir()
    if all((where / f).is_file() for f in NEEDED):
        return where, ""
    tried = ""
    if fetch and not where.exists() and shutil.which("git"):
        where.parent.mkdir(parents=True, exist_ok=True)
        try:
            out = subprocess.run(["git", "clone", "--depth", "1", REPO, str(where)],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            if out.returncode == 0 and all((where / f).is_file() for f in NEEDED):
                return where, ""
            tried = f" (git clone {REPO} failed: {out.stderr.strip().splitlines()[-1:]})"
        except subprocess.TimeoutExpired:
            tried = f" (git clone {REPO} timed out)"
        shutil.rmtree(where, ignore_errors=True)
    missing = [f for f in NEEDED if not (where / f).is_file()]
    return None, (
        f"nanoGPT not found in {where}: {missing} missing{tried}. Place a checkout there "
        f"(git clone {REPO} {where}), or point MINIZERO_NANOGPT at one, and run the bench again."
    )


def write_nanogpt_data(dest: Path) -> None:
    """``data/shakespeare_char/{train,val}.bin, meta.pkl`` as nanoGPT's prepare.py writes them
    (uint16 ids; the vocabulary as stoi/itos), from minizero's copy of the text."""
    from minizero.tools import shakespeare

    data = shakespeare.load()
    out = dest / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    out.joinpath("train.bin").write_bytes(data.train.numpy().astype("uint16").tobytes())
    out.joinpath("val.bin").write_bytes(data.val.numpy().astype("uint16").tobytes())
    meta = {"vocab_size": data.vocab_size, "itos": dict(enumerate(data.chars)),
            "stoi": {c: i for i, c in enumerate(data.chars)}}  # fmt: skip
    out.joinpath("meta.pkl").write_bytes(pickle.dumps(meta))


def eval_interval(iters: int) -> int:
    """nanoGPT's 250, unless the run would then not end on an evaluation (nanoGPT evaluates only
    at multiples of its eval_interval)."""
    return 250 if iters % 250 == 0 else iters


def _run(cmd: list[str], cwd: Path, timeout: float, log: Path, env: dict | None = None) -> tuple:
    """Run ``cmd`` under the peak-memory wrapper; ``(wall s, peak bytes, output, load)``."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEAK, *cmd], cwd=cwd, capture_output=True,
                         text=True, timeout=timeout, env=env)  # fmt: skip
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]  # the 1-minute load average as the run ends: a busy machine shows
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({out.returncode}); see {log}:\n"
                           + (out.stdout + out.stderr)[-2000:])  # fmt: skip
    peak = int(re.findall(r"MINIZERO_PEAK_KIB (\d+)", out.stdout)[-1]) * 1024
    return wall, peak, out.stdout, load


# nanoGPT's train.py drawing minizero's batches (``shakespeare.get_batch``: training batch ``it``
# from the run's own stream, the fixed eval batches -1, -2, ...): with them nanoGPT's model and
# loop must trace minizero's curve, so a difference between the two runs is the sample, not the code
FED = """
from minizero.tools import shakespeare as _minizero
_minizero_data, _minizero_it = _minizero.load(), [0]
def _minizero_batch(split, k=None):
    if k is None:  # training: the next global batch
        k, _minizero_it[0] = _minizero_it[0], _minizero_it[0] + 1
    return _minizero.get_batch(_minizero_data, split, batch_size, block_size, k, seed=SEED)
"""
ESTIMATE = "@torch.no_grad()\ndef estimate_loss"
FEED = {"X, Y = get_batch(split)": "X, Y = _minizero_batch(split, -1 - k)",
        "X, Y = get_batch('train')": "X, Y = _minizero_batch('train')",
        ESTIMATE: FED + ESTIMATE}  # fmt: skip
SEED = "torch.manual_seed(1337 + seed_offset)"  # nanoGPT's seed: the weights and its batches
# the final model over the whole validation split, with nanoGPT's own model.py (run in its dir)
VAL_FULL = """
import sys, torch
from model import GPT, GPTConfig
from minizero.tools import shakespeare
from minizero.tools.full_split import full_split_loss
ck = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
model = GPT(GPTConfig(**ck["model_args"]))
model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
model.eval()
loss = full_split_loss(lambda x: model(x, x)[0], shakespeare.load().val, model.config.block_size)
print("MINIZERO_VAL_FULL", ck["iter_num"], repr(loss))
"""


def patched_train_py(train_py: Path, seed: int, fed: bool) -> Path | None:
    """A copy of nanoGPT's ``train.py`` seeded with ``seed`` (in place of its 1337) and, where
    ``fed``, drawing minizero's batches; None where its text no longer has the lines replaced."""
    text = train_py.read_text()
    swaps = {SEED: SEED.replace("1337", str(seed))}
    if fed:
        swaps |= {k: v.replace("seed=SEED", f"seed={seed}") for k, v in FEED.items()}
    if any(old not in text for old in swaps):
        return None
    for old, new in swaps.items():
        text = text.replace(old, new)
    out = train_py.with_name(f"train_{'minizero_batches' if fed else 'own'}_seed{seed}.py")
    out.write_text(text)
    return out


def nanogpt_val_full(work: Path, ckpt: Path, timeout: float) -> tuple[int, float]:
    """(iteration, loss) of nanoGPT's checkpoint over the whole validation split."""
    out = subprocess.run([sys.executable, "-c", VAL_FULL, str(ckpt)], cwd=work, timeout=timeout,
                         capture_output=True, text=True)  # fmt: skip
    found = re.findall(r"MINIZERO_VAL_FULL (\d+) (\S+)", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"evaluating {ckpt} failed:\n{(out.stdout + out.stderr)[-2000:]}")
    return int(found[-1][0]), float(found[-1][1])


def run_nanogpt(src: Path, work: Path, iters: int, timeout: float, threads: int | None,
                fed: bool = False, seed: int = 1337) -> dict | None:  # fmt: skip
    """nanoGPT's train.py with its README's CPU configuration (``fed``: drawing minizero's
    batches; None where this train.py cannot be patched), its final checkpoint then evaluated
    over the whole validation split."""
    for f in NEEDED:
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / f, work / f)
    write_nanogpt_data(work)
    script = patched_train_py(work / "train.py", seed, fed)
    if script is None:
        return None
    out_dir = work / f"out_{script.stem}"
    args = [
        script.name,
        "config/train_shakespeare_char.py",
        "--device=cpu",
        "--compile=False",
        "--eval_iters=20",
        "--log_interval=1",
        "--block_size=64",
        "--batch_size=12",
        "--n_layer=4",
        "--n_head=4",
        "--n_embd=128",
        f"--max_iters={iters}",
        f"--lr_decay_iters={iters}",
        "--dropout=0.0",
        f"--out_dir={out_dir}",
        f"--eval_interval={eval_interval(iters)}",
        "--always_save_checkpoint=True",
    ]  # the last evaluation's model, not the best one
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = work / f"{script.stem}.log"
    wall, peak, text, load = _run([sys.executable, *args], work, timeout, log, env)
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", text)
    times = [float(t) for t in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", text)]
    it, tr, va = evals[-1]
    at, full = nanogpt_val_full(work, out_dir / "ckpt.pt", timeout)
    assert at == int(it), f"nanoGPT's checkpoint is from iteration {at}, not {it}"
    name = "nanoGPT train.py" + (", minizero's batches" if fed else "")
    name += "" if threads is None else f", {threads} thread(s)"
    return {"name": name, "seed": seed, "iter": int(it), "val": float(va), "train": float(tr),
            "val_full": full, "wall_s": wall, "iter_ms": statistics.median(times[1:]),
            "peak": peak, "load": load, "fed": fed,
            "evals": [[int(i), float(t), float(v)] for i, t, v in evals]}  # fmt: skip


def run_minizero(stage: int, nprocs: int, work: Path, iters: int, timeout: float,
                 seed: int = 1337) -> dict:  # fmt: skip
    out = work / f"minizero_stage{stage}_seed{seed}"
    cmd = [sys.executable, "-m", "minizero", "train", "--stage", str(stage), "--nprocs",
           str(nprocs), "--max-iters", str(iters), "--out-dir", str(out), "--sample-tokens", "0",
           "--backend", "gloo", "--eval-interval", str(eval_interval(iters)),
           "--seed", str(seed)]  # fmt: skip
    wall, peak, _, load = _run(cmd, Path.cwd(), timeout, out.with_suffix(".log"))
    h = json.loads((out / "history.json").read_text())
    it, tr, va = h["evals"][-1]
    states = max(sum(s.values()) for s in h["states"]) if all(h["states"]) else None
    return {"name": f"minizero train, stage {stage}, {nprocs} ranks", "seed": seed, "iter": it,
            "val": va, "train": tr, "val_full": h["val_full"], "wall_s": wall,
            "iter_ms": h["step_ms"], "peak": max(h["rss"]), "load": load, "states": states,
            "evals": h["evals"]}  # fmt: skip


# the one-process reference (plain PyTorch, 1 thread: ``minizero.tools.train.single_process``)
REFERENCE = """
import json, sys
from minizero.tools.train import TrainConfig, single_process
cfg = TrainConfig(max_iters=int(sys.argv[1]), eval_interval=int(sys.argv[2]), seed=int(sys.argv[3]),
                  sample_tokens=0)
h = single_process(cfg)
print("MINIZERO_REFERENCE", json.dumps({"evals": h["evals"], "val_full": h["val_full"]}))
"""


def run_reference(work: Path, iters: int, timeout: float, seed: int = 1337) -> dict:
    args = ["-c", REFERENCE, str(iters), str(eval_interval(iters)), str(seed)]
    log = work / f"reference_seed{seed}.log"
    wall, peak, text, load = _run([sys.executable, *args], Path.cwd(), timeout, log)
    h = json.loads(re.findall(r"MINIZERO_REFERENCE (.*)", text)[-1])
    it, tr, va = h["evals"][-1]
    return {"name": "one process (plain PyTorch, 1 thread)", "seed": seed, "iter": it, "val": va,
            "train": tr, "val_full": h["val_full"], "wall_s": wall, "iter_ms": None,
            "peak": peak, "load": load, "evals": h["evals"], "reference": True}  # fmt: skip


def main(argv: list[str]) -> int:
    from minizero.tools.bench_nanogpt_report import SHAPE, parse, print_rows, print_seeds
    from minizero.tools.report import cpu_name, write_json
    from minizero.tools.train import TrainConfig

    a = parse(argv, __doc__.split("\n\n")[1].replace("``", ""))
    src, why = find_nanogpt()
    if src is None:
        print(f"minizero bench nanogpt: skipped: {why}")
        return 0
    rows = []

    def done(row: dict | None) -> None:  # a long bench says what it has as it goes
        if row is not None:
            rows.append(row)
            print(
                f"  {row['name']}, seed {row['seed']}: val {row['val']:.4f} (20 batches), "
                f"{row['val_full']:.4f} (whole split), {row['wall_s']:.0f} s",
                flush=True,
            )

    with tempfile.TemporaryDirectory(prefix="minizero-nanogpt-") as tmp:
        work = Path(tmp)
        for seed in a.seeds:
            print(f"seed {seed}: nanoGPT ({src}), {a.max_iters} iterations, 1 process ...",
                  flush=True)  # fmt: skip
            done(run_nanogpt(src, work, a.max_iters, a.timeout, a.nanogpt_threads, seed=seed))
            if a.fed:
                print("nanoGPT again, drawing minizero's batches ...", flush=True)
                fed = run_nanogpt(src, work, a.max_iters, a.timeout, a.nanogpt_threads, fed=True,
                                  seed=seed)  # fmt: skip
                if fed is None:
                    print("  skipped: this train.py lacks the lines that draw its batches")
                else:
                    done(fed)
            if a.reference:
                print("one process, plain PyTorch (the reference) ...", flush=True)
                done(run_reference(work, a.max_iters, a.timeout, seed))
            for s in a.stages:
                print(f"minizero train --stage {s} --nprocs {a.nprocs} ...", flush=True)
                done(run_minizero(s, a.nprocs, work, a.max_iters, a.timeout, seed))
    print_rows(rows, a)
    if len(a.seeds) > 1:
        print_seeds(rows)
    if a.json:  # the machine, date and configuration: what train checks before its ratio
        shape = {k: getattr(TrainConfig(), k) for k in SHAPE}  # the runs' (train's defaults)
        write_json(a.json, {"max_iters": a.max_iters, "nprocs": a.nprocs, "cores": os.cpu_count(),
                            "machine": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                            "config": shape, "seeds": a.seeds, "published_val": PUBLISHED_VAL,
                            "rows": rows})  # fmt: skip
    return 0
