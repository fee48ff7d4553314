"""Run under torchrun (gloo, a rank per process): ``multinode_script.py OUT MODE [STAGES [END]]``.

Once joined, rank r writes its pid to ``OUT/r.ready``. MODE "train": for each stage in STAGES
(e.g. "0123"; or harness specs separated by commas, e.g. "hsdp3,fsdp2_hsdp": HSDP on a mesh of
(agents, ranks per agent), which needs ``--nproc-per-node 2``), the harness's MLP wrapped by
``minizero.parallelize`` and trained ``harness.STEPS`` steps on this rank's slice of each global
batch; rank r saves its full fp32 state after every step to ``OUT/r.pt`` (what
``harness.train_rank`` returns). MODE "wait":
all-reduce every 0.1 s until a peer dies (the test kills one node and expects this rank to fail
within seconds). END "destroy" (default) destroys the process group at the end, "exit" leaves
it to the interpreter's exit (and writes ``dist.is_initialized()`` at the very end of it to
``OUT/r.exit``). Every collective has a 30 s timeout, so nothing here can hang.
"""

import atexit
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared harness
import harness  # noqa: E402


def main(out: Path, mode: str, stages: str = "0123", end: str = "destroy") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    (out / f"{rank}.ready").write_text(str(os.getpid()))  # the test kills this pid with the node
    if end == "exit":  # atexit runs last-in first-out: this runs after parallelize's handler
        atexit.register(lambda: (out / f"{rank}.exit").write_text(str(dist.is_initialized())))
    if mode == "train":
        specs = [f"stage{s}" for s in stages] if stages.isdigit() else stages.split(",")
        if any("hsdp" in spec for spec in specs):  # the mesh's "shard" dim must be one agent
            assert int(os.environ["LOCAL_WORLD_SIZE"]) == harness.HSDP_NODE, os.environ
        res = harness.train_rank(specs, "mlp", "adam")
        torch.save(res, out / f"{rank}.pt")
    elif mode == "wait":
        t = torch.ones(4)
        while True:
            dist.all_reduce(t)
            time.sleep(0.1)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if end == "destroy":
        dist.destroy_process_group()
    # end "exit": leave the group to the interpreter's exit, as many scripts do


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
