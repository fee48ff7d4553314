"""``python -m minizero run`` at stages 1 and 2 exits 0, run after run (issue 17 saw a script abort
at exit, "terminate called without an active exception", in about 1 run of 3). Each run trains
the harness's MLP on 2 ranks (tests/library/multinode_script.py) and is checked against one
process, so a run that exits 0 having trained wrong fails too. The script leaves its process group
to the interpreter's exit, as many scripts do."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import ATOL, assert_same_run, reference

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "library" / "multinode_script.py"
RUNS = 5  # the soak tier's; the fast tier runs it once


def exits_0_and_trains(tmp_path: Path, runs: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    want = reference("mlp", "adam")
    for i in range(runs):
        out = tmp_path / str(i)
        out.mkdir()
        cmd = [sys.executable, "-m", "minizero", "run", "--nproc-per-node", "2", str(SCRIPT),
               str(out), "train", "12", "exit"]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"run {i} of {runs}: exit {done.returncode}\n{done.stderr}"
        assert "terminate called" not in done.stderr, done.stderr
        for rank in range(2):
            # parallelize's atexit handler destroyed the group the script left to the exit
            assert (out / f"{rank}.exit").read_text() == "False", f"run {i} rank {rank}"
            got = torch.load(out / f"{rank}.pt", weights_only=False)
            for spec in ("stage1", "stage2"):
                assert_same_run(got[spec], want, ATOL["mlp", "adam"], f"run {i} {spec} {rank}")


def test_stage_1_and_2_scripts_exit_0_under_minizero_run(tmp_path):
    exits_0_and_trains(tmp_path, 1)


@pytest.mark.soak
def test_stage_1_and_2_scripts_exit_0_every_time_under_minizero_run(tmp_path):
    exits_0_and_trains(tmp_path, RUNS)
