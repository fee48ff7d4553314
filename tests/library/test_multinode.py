"""Two torchrun agents on 127.0.0.1 (c10d rendezvous, one rank each) act as two nodes: every stage
trains what one process trains, HSDP (two ranks each) too, and a node killed mid-run ends the
other with an error within seconds. Every subprocess has a timeout: a hang fails the test, it
never blocks the suite."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import ATOL, assert_same_run, reference

pytestmark = pytest.mark.timeout(240)
SCRIPT = Path(__file__).with_name("multinode_script.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(out: Path, port: int, *script_args: str, nproc: int = 1) -> subprocess.Popen:
    """One torchrun agent (a "node" of ``nproc`` ranks), in its own session (torchrun puts its
    workers in another); its output in ``out/agent-<i>.log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-conf", "join_timeout=60", "--max-restarts", "0",
           str(SCRIPT), str(out), *script_args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(out / f"agent-{len(list(out.glob('agent-*')))}.log", "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def kill_node(agent: subprocess.Popen, worker: int) -> None:
    """SIGKILL a node: its agent and its worker (torchrun starts each worker in its own session,
    so the agent's process group does not hold it)."""
    for pid in (agent.pid, worker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=30)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers(out: Path) -> list[int]:
    """The workers' pids, rank order, from their ``.ready`` files."""
    return [int(f.read_text()) for f in sorted(out.glob("*.ready"))]


def stop(procs: list[subprocess.Popen], out: Path) -> None:
    for pid in workers(out):  # a worker still running this test's script (not a reused pid)
        try:
            if str(out) in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def logs(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("agent-*")))


def test_two_nodes_train_what_one_process_trains_at_every_stage(tmp_path):
    port = free_port()
    nodes = [start_node(tmp_path, port, "train", "0123") for _ in range(2)]
    try:
        codes = [p.wait(timeout=180) for p in nodes]
    finally:
        stop(nodes, tmp_path)
    assert codes == [0, 0], logs(tmp_path)
    want = reference("mlp", "adam")
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert sorted(got) == ["stage0", "stage1", "stage2", "stage3"]
        for spec, run in got.items():
            assert_same_run(run, want, ATOL["mlp", "adam"], f"{spec} rank {rank} of 2 nodes")


def test_two_nodes_of_two_ranks_train_hsdp_what_one_process_and_fsdp2_train(tmp_path):
    """HSDP across the two agents: mesh (2 nodes, 2 ranks), "shard" inside an agent (torchrun
    numbers an agent's ranks consecutively), "replicate" across; minizero's stage 3 with the mesh
    and FSDP2's HSDP against one process."""
    port = free_port()
    nodes = [start_node(tmp_path, port, "train", "hsdp3,fsdp2_hsdp", nproc=2) for _ in range(2)]
    try:
        codes = [p.wait(timeout=180) for p in nodes]
    finally:
        stop(nodes, tmp_path)
    assert codes == [0, 0], logs(tmp_path)
    want = reference("mlp", "adam")
    for rank in range(4):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert sorted(got) == ["fsdp2_hsdp", "hsdp3"]
        for spec, run in got.items():
            assert_same_run(run, want, ATOL["mlp", "adam"], f"{spec} rank {rank} of 2 nodes x 2")


def test_a_killed_node_ends_the_other_with_an_error_within_seconds(tmp_path):
    port = free_port()
    nodes = [start_node(tmp_path, port, "wait") for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.ready"))) < 2:  # both ranks are in the all-reduce loop
            assert time.monotonic() < deadline, "the two nodes never met:\n" + logs(tmp_path)
            assert all(p.poll() is None for p in nodes), logs(tmp_path)
            time.sleep(0.2)
        worker = [pid for pid in workers(tmp_path) if parent(pid) == nodes[1].pid]
        assert len(worker) == 1, (worker, logs(tmp_path))
        survivors = [pid for pid in workers(tmp_path) if pid != worker[0]]
        kill_node(nodes[1], worker[0])
        killed = time.monotonic()
        code = nodes[0].wait(timeout=90)
        took = time.monotonic() - killed
    finally:
        stop(nodes, tmp_path)
    log = logs(tmp_path)
    assert code != 0, log
    # torchrun's report: its worker failed (gloo lost its peer), or, when the killed node held
    # the rendezvous store, the store is gone; either way the survivor stops with it
    assert "ChildFailedError" in log or "RendezvousConnectionError" in log, log
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in survivors if Path(f"/proc/{pid}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not alive, f"the surviving node's worker outlived its agent:\n{log}"
    print(f"the surviving node exited with {code}, {took:.1f} s after the kill")
