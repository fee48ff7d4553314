"""``python -m minizero bench nanogpt``: nanoGPT's own ``train.py`` beside ``minizero train``.

The same run both ways on this machine: nanoGPT's CPU "baby GPT" (its README's command line:
``config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0``), one process, then ``python -m minizero train`` with the
same configuration at stages 0 and 3 on 2 gloo ranks. Printed: the validation loss at the last
iteration (nanoGPT's README reports 1.88 at 2,000), the wall time of each as a ratio to
nanoGPT's, the median iteration time and the peak resident memory of the largest process.

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
PUBLISHED_VAL = 1.88  # nanoGPT's README, the CPU baby GPT at 2,000 iterations
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
    return _minizero.get_batch(_minizero_data, split, batch_size, block_size, k, seed=1337)
"""
ESTIMATE = "@torch.no_grad()\ndef estimate_loss"
FEED = {"X, Y = get_batch(split)": "X, Y = _minizero_batch(split, -1 - k)",
        "X, Y = get_batch('train')": "X, Y = _minizero_batch('train')",
        ESTIMATE: FED + ESTIMATE}  # fmt: skip


def fed_minizero_batches(train_py: Path) -> Path | None:
    """A copy of nanoGPT's ``train.py`` whose batches are minizero's, or None where its text no
    longer has the lines this replaces."""
    text = train_py.read_text()
    if any(old not in text for old in FEED):
        return None
    for old, new in FEED.items():
        text = text.replace(old, new)
    fed = train_py.with_name("train_minizero_batches.py")
    fed.write_text(text)
    return fed


def run_nanogpt(src: Path, work: Path, iters: int, timeout: float, threads: int | None,
                fed: bool = False) -> dict | None:  # fmt: skip
    """nanoGPT's train.py with its README's CPU configuration (``fed``: drawing minizero's
    batches; None where this train.py cannot be fed)."""
    for f in NEEDED:
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / f, work / f)
    write_nanogpt_data(work)
    script = fed_minizero_batches(work / "train.py") if fed else work / "train.py"
    if script is None:
        return None
    args = [script.name, "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
            "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
            "--n_layer=4", "--n_head=4", "--n_embd=128", f"--max_iters={iters}",
            f"--lr_decay_iters={iters}", "--dropout=0.0", f"--out_dir={work / 'out'}",
            f"--eval_interval={eval_interval(iters)}"]  # fmt: skip
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = work / f"{script.stem}.log"
    wall, peak, text, load = _run([sys.executable, *args], work, timeout, log, env)
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", text)
    times = [float(t) for t in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", text)]
    it, tr, va = evals[-1]
    name = "nanoGPT train.py" + (", minizero's batches" if fed else "")
    name += "" if threads is None else f", {threads} thread(s)"
    return {"name": name, "iter": int(it), "val": float(va),
            "wall_s": wall, "iter_ms": statistics.median(times[1:]), "peak": peak, "load": load,
            "evals": [[int(i), float(t), float(v)] for i, t, v in evals]}  # fmt: skip


def run_minizero(stage: int, nprocs: int, work: Path, iters: int, timeout: float) -> dict:
    out = work / f"minizero_stage{stage}"
    cmd = [sys.executable, "-m", "minizero", "train", "--stage", str(stage), "--nprocs",
           str(nprocs), "--max-iters", str(iters), "--out-dir", str(out), "--sample-tokens", "0",
           "--backend", "gloo", "--eval-interval", str(eval_interval(iters))]  # fmt: skip
    wall, peak, _, load = _run(cmd, Path.cwd(), timeout, work / f"minizero_stage{stage}.log")
    h = json.loads((out / "history.json").read_text())
    it, _, va = h["evals"][-1]
    return {"name": f"minizero train, stage {stage}, {nprocs} ranks", "iter": it, "val": va,
            "wall_s": wall, "iter_ms": h["step_ms"], "peak": max(h["rss"]), "load": load,
            "evals": h["evals"]}  # fmt: skip


def main(argv: list[str]) -> int:
    from minizero.analysis.memory import format_bytes
    from minizero.tools.cli import Parser, positive_int
    from minizero.tools.report import write_json

    p = Parser(prog="minizero bench nanogpt", description=__doc__.split("\n\n")[1].replace(
        "``", ""))  # fmt: skip
    p.add_argument(
        "--max-iters",
        type=positive_int,
        default=2000,
        help="iterations of every run (default 2000, nanoGPT's baby GPT)",
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
    p.add_argument("--stages", default="0,3", help="minizero's stages (default 0,3)")
    p.add_argument(
        "--json",
        default="runs/bench_nanogpt.json",
        help="where to write the results ('' for nowhere)",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=3600,
        help="seconds each run may take (default 3600)",
    )
    a = p.parse_args(argv)
    try:
        stages = sorted({int(s) for s in a.stages.split(",")})
        assert stages and set(stages) <= {0, 1, 2, 3}
    except (ValueError, AssertionError):
        p.error(f"--stages takes a comma-separated subset of 0,1,2,3, got {a.stages!r}")
    if 12 % a.nprocs:
        p.error(f"--nprocs {a.nprocs} does not divide nanoGPT's batch of 12: use 1, 2, 3, 4 or 6")
    src, why = find_nanogpt()
    if src is None:
        print(f"minizero bench nanogpt: skipped: {why}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="minizero-nanogpt-") as tmp:
        work = Path(tmp)
        print(f"nanoGPT ({src}): {a.max_iters} iterations, 1 process on the CPU ...", flush=True)
        rows.append(run_nanogpt(src, work, a.max_iters, a.timeout, a.nanogpt_threads))
        if a.fed:
            print("nanoGPT again, drawing minizero's batches ...", flush=True)
            fed = run_nanogpt(src, work, a.max_iters, a.timeout, a.nanogpt_threads, fed=True)
            if fed is None:
                print("  skipped: this train.py lacks the lines that draw its batches")
            else:
                rows.append(fed)
        for s in stages:
            print(f"minizero train --stage {s} --nprocs {a.nprocs} ...", flush=True)
            rows.append(run_minizero(s, a.nprocs, work, a.max_iters, a.timeout))
    base = rows[0]["wall_s"]
    cores = os.cpu_count()
    threads = a.nanogpt_threads or "torch's default"
    print(f"\nnanoGPT's baby GPT on Tiny Shakespeare, {a.max_iters} iterations, CPU ({cores} "
          f"cores); threads: nanoGPT {threads}, minizero 1 per rank")  # fmt: skip
    print(f"{'run':<36}{'val loss':>9}{'wall s':>9}{'/ nanoGPT':>11}{'iter ms':>9}"
          f"{'peak RSS':>12}{'load':>6}")  # fmt: skip
    for r in rows:
        r["ratio"] = r["wall_s"] / base
        print(f"{r['name']:<36}{r['val']:>9.4f}{r['wall_s']:>9.1f}{r['ratio']:>11.2f}"
              f"{r['iter_ms']:>9.1f}{format_bytes(r['peak']):>12}{r['load']:>6.1f}")  # fmt: skip
    print(f"(nanoGPT's README: val loss {PUBLISHED_VAL} at 2000 iterations; peak RSS: the "
          "largest process, for minizero its largest rank; wall: the whole command, start-up "
          f"and evaluations included; load: the 1-minute load average at the run's end, on "
          f"{cores} cores: above that, the runs shared the machine and their times mean "
          "little)")  # fmt: skip
    if a.json:
        write_json(a.json, {"max_iters": a.max_iters, "nprocs": a.nprocs, "cores": cores,
                            "published_val": PUBLISHED_VAL, "rows": rows})  # fmt: skip
    return 0
