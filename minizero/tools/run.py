"""``python -m minizero run``: torchrun with two defaults, for scripts that use torch.distributed
(multi-node included). Its ranks meet as torchrun's always do; ``minizero.launch`` inside such a
script joins the group torchrun made (see minizero/launcher)."""

from __future__ import annotations

import re
import subprocess
import sys

from minizero.launcher import gpu_count

RUN_HELP = """usage: python -m minizero run [torchrun options] SCRIPT [script args]

Run SCRIPT on every rank under torchrun (PyTorch's launcher): one rank per GPU over NCCL, on one
machine or many. Inside SCRIPT, minizero.launch(fn, nprocs) sees that it already runs under
torchrun and calls fn on this rank. minizero adds two defaults to torchrun:

  --standalone             unless --nnodes, --standalone, --rdzv-* or --master-* is given
                           (one machine, a free port chosen for you)
  --nproc-per-node N       unless given: the number of GPUs here, or 2 without GPUs

Every other option is torchrun's, passed on unchanged. For example, 2 machines with 8 GPUs each
(run on both):
  python -m minizero run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 train.py
"""


def torchrun_main(argv: list[str]) -> int:
    """``python -m minizero run``: torchrun with ``--standalone`` and ``--nproc-per-node`` defaults
    (see ``RUN_HELP``). Returns torchrun's exit code."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            print("minizero run: error: give the script to run, e.g. python -m minizero run "
                  "train.py (--help: every option)", file=sys.stderr)  # fmt: skip
            return 2
        print(RUN_HELP + "\ntorchrun's own options:")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--help"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        options = out[out.find("options:") + len("options:") :] if "options:" in out else out
        print(options.lstrip("\n"), end="")
        return 0
    given = lambda pattern: any(re.match(rf"--({pattern})\b", a) for a in argv)
    extra = [] if given(r"nnodes|standalone|rdzv[-_]\w+|master[-_]\w+") else ["--standalone"]
    if not given(r"nproc[-_]per[-_]node"):
        extra.append(f"--nproc-per-node={gpu_count() or 2}")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", *extra, *argv])
