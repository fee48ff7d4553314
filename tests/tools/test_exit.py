"""A clean exit under plain torchrun, run after run (issue 32): a script that destroys its
process group itself (nanoGPT's train.py, PyTorch's tutorials) or leaves it to the interpreter's
exit exits 0 at every stage (each stage once, the two exits in turn; the soak tier: every path,
10 runs of 10) and trains what one process trains (tests/tools/exit_script.py). What aborted
before: a gloo worker thread releasing a collective's temporaries during the interpreter's
finalisation (minizero/collectives.py's ``ReleasedWork``), the group outliving
destroy_process_group() because torch's own modules hold it."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import minizero
from minizero.collectives import all_reduce

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "tools" / "exit_script.py"
RUNS = int(os.environ.get("MINIZERO_EXIT_RUNS", "10"))
HOWS = ("destroy", "leave")  # the script destroys its group itself, or leaves it to the exit


def reference() -> dict[str, torch.Tensor]:
    """exit_script.py's training in one process: the whole batch, the same clip and optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def launch(stage: int, how: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "STAGE": str(stage),
           "EXIT": how, "OUT": str(out)}  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
    ]  # fmt: skip  (torchrun itself)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def exits_0_and_trains(stage: int, how: str, tmp: Path, runs: int) -> None:
    """``runs`` launches of exit_script.py at ``stage``, 4 at a time (a busy machine, as where it
    aborted): each exits 0, with no abort, having trained what one process trains."""
    want = reference()
    outs = [tmp / str(i) for i in range(runs)]
    for o in outs:
        o.mkdir()
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda o: launch(stage, how, o), outs))
    for i, (d, o) in enumerate(zip(done, outs, strict=True)):
        what = f"stage {stage}, {how}, run {i + 1} of {runs}"
        assert d.returncode == 0, f"{what}: exit {d.returncode}\n{d.stderr[-3000:]}"
        assert "terminate called" not in d.stderr, f"{what}\n{d.stderr[-3000:]}"
        for rank in range(2):
            got = torch.load(o / f"{rank}.pt")
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=f"{what} {k}")


PATHS = pytest.mark.parametrize(("stage", "how"), [(s, h) for s in range(4) for h in HOWS])


@pytest.mark.parametrize(("stage", "how"), [(s, HOWS[s % 2]) for s in range(4)])
def test_every_stage_and_exit_exits_0_under_torchrun(stage, how, tmp_path):
    """Once per stage, the two exits taken in turn (stages 0 and 2 destroy their group, 1 and 3
    leave it to the exit); the soak tier runs all eight paths, again and again."""
    exits_0_and_trains(stage, how, tmp_path, 1)


@pytest.mark.soak
@PATHS
def test_every_exit_path_exits_0_every_time_under_torchrun(stage, how, tmp_path):
    """The rate: 10 runs of 10 (the abort was seen in about 1 run of 3; stage 3 was never seen
    to abort, so 2 runs there). Soak tier: the fast tier runs each stage once, with one exit."""
    exits_0_and_trains(stage, how, tmp_path, RUNS if stage < 3 else 2)


def released_rank() -> list[int]:
    """Temporaries (views made for the call, as the stages' chunks are) through minizero's
    collectives, sync and async: when the call (or wait()) returns, no gloo thread holds them."""
    counts = []
    base = torch.ones(64)
    for i in range(200):
        view = base[: 32 + i % 32]  # a new tensor each time, as a chunk view is
        if i % 2:
            all_reduce(view, tag="exit test")
        else:
            all_reduce(view, async_op=True, tag="exit test").wait()
        counts.append(view._use_count())  # 1: its Python object alone
    return counts


def test_no_gloo_thread_holds_a_collectives_tensors_once_it_returned():
    for counts in minizero.launch(released_rank, 2, verbose=False):
        assert set(counts) == {1}, sorted(set(counts))
