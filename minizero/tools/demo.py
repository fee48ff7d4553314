"""The README's main demo: ``python -m minizero demo [--nprocs N] [--stage S]``. Lessons 01-05.

Trains a TinyGPT for a few steps with ``minizero.parallelize(model, stage, AdamW)`` on 2 gloo
ranks on the CPU, or on one rank per GPU over NCCL, and prints three measurements:

(a) equivalence: the largest parameter difference against one process trained on the whole global
    batch, and against ``torch.nn.parallel.DistributedDataParallel`` on the same ranks; and the
    global gradient norm of the first step against the one process (Adam's update all but ignores
    a constant factor on the gradients, so a missing 1/N barely shows in the parameters);
(b) communication: the elements this rank moved in one step (``CommLedger``), in units of Ψ, next
    to the ZeRO paper's 2Ψ (DDP, stages 1 and 2) or 3Ψ (stage 3) (§7);
(c) memory: model-state bytes this rank holds at the end of backward, next to the paper's formula
    (§3.1, §5) for fp32 Adam: params 4Ψ, grads 4Ψ, optimizer K=8 (m and v), divided by N as the
    stage partitions them.
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
PAPER_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}  # Ψ moved per step (ZeRO §7.2)
STEPS, GLOBAL_BATCH, LR = 5, 16, 1e-3  # GLOBAL_BATCH: rounded up to a multiple of the ranks
TOLERANCE = 1e-5  # fp32: different summation orders, a few AdamW steps


def _rank(stage: int, global_batch: int, progress=None) -> dict:
    """One rank: train minizero, torch DDP and (here too) one process on the global batch."""
    from torch.nn.parallel import DistributedDataParallel

    from minizero.analysis.ledger import CommLedger
    from minizero.analysis.memory import model_state_bytes
    from minizero.launcher import rank_device as device
    from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch
    from minizero.parallelize import full_state_dict, parallelize
    from minizero.tools.report import measured_on

    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    base = TinyGPT(cfg).to(dev)
    adamw = lambda params: torch.optim.AdamW(params, lr=LR)
    model, opt = parallelize(copy.deepcopy(base), stage, adamw)
    ref = copy.deepcopy(base)  # one process, the whole global batch
    ref_opt = adamw(ref.parameters())
    ids = None if dev.index is None else [dev.index]
    tddp = DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    tddp_opt = adamw(tddp.parameters())
    shape = dict(vocab_size=cfg.vocab_size, seq_len=cfg.block_size, device=dev)
    batch = lambda s, r, n: synthetic_batch("gpt", global_batch, s, rank=r, world=n, **shape)
    losses, ref_losses, ledger, states = [], [], CommLedger(), {}
    t0 = time.perf_counter()
    for s in range(STEPS):
        mine = batch(s, rank, world)  # this rank's rows of step s's global batch
        with ledger if s == STEPS - 1 else nullcontext():  # the last step: a steady state
            loss = model(*mine)
            loss.backward()
            if s == 0:  # the global gradient norm: the stage's own, sharded or not
                norms = [opt.clip_grad_norm_(float("inf")).item()]  # scales by 1: changes nothing
            if s == STEPS - 1:
                states = model_state_bytes(model, opt)  # end of backward: every state alive
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())  # mean over this rank's rows
        for m, o, b in ((ref, ref_opt, batch(s, 0, 1)), (tddp, tddp_opt, mine)):
            loss = m(*b)
            loss.backward()
            if m is ref:
                ref_losses.append(loss.item())
                norms.append(torch.stack([p.grad.norm() for p in m.parameters()]).norm().item())
            o.step()
            o.zero_grad()
        if progress is not None:
            progress.tick()
    seconds = time.perf_counter() - t0
    full = full_state_dict(model)  # collective for ZeRO: every rank calls it
    diff = lambda other: max((full[k].cpu() - v.detach().float().cpu()).abs().max().item()
                             for k, v in other.state_dict().items())  # fmt: skip
    return dict(where=measured_on(), psi=count_params(base), losses=losses, ref_losses=ref_losses,
                states=states, by_op=ledger.by_op(), volume=ledger.volume_elements,
                seconds=seconds, diff_ref=diff(ref), diff_torch=diff(tddp.module),
                torch_ref=max((a - b).abs().max().item() for a, b in
                              zip(tddp.module.state_dict().values(), ref.state_dict().values())),
                norm_rel_diff=abs(norms[0] - norms[1]) / norms[1])  # fmt: skip


def global_batch(n: int, batch: int | None) -> int:
    """``batch``, checked to split evenly over ``n`` ranks; None: 16 rounded up to a multiple."""
    if batch is None:
        return -(-GLOBAL_BATCH // n) * n  # 16, or the next multiple of n
    if batch < 1 or batch % n:
        fix = n * max(1, round(batch / n))
        raise ValueError(f"--batch {batch} does not split evenly over {n} ranks: use --batch {fix}")
    return batch


def demo(nprocs: int | None = None, stage: int = 0, batch: int | None = None) -> int:
    """Run the demo; print (a) equivalence, (b) volume per step, (c) memory. 0 when (a) passes.

    ``batch``: global batch in sequences, a multiple of the ranks (default: 16, rounded up to one).
    """
    from minizero.analysis.memory import format_bytes, paper_model_state_bytes
    from minizero.tools.report import ranks, run_ranks

    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (ZeRO), got {stage!r}")
    if nprocs is not None and (not isinstance(nprocs, int) or nprocs < 1):
        raise ValueError(f"nprocs must be a whole number >= 1, got {nprocs!r}")
    n = ranks(nprocs)
    batch = global_batch(n, batch)
    t0 = time.perf_counter()
    print(f"minizero demo: stage {stage} ({STAGE_NAMES[stage]}), minizero next to torch DDP and "
          f"one process, {STEPS} steps on {n} ranks ...", flush=True)  # fmt: skip
    res = run_ranks(_rank, n, 300, stage, batch, total=STEPS, desc="steps")
    if os.environ.get("RANK", "0") != "0":  # under torchrun every rank has the results
        return 0
    where, psi = res[0]["where"], res[0]["psi"]
    world = where["world"]
    print(f"minizero demo: stage {stage} = {STAGE_NAMES[stage]}, {world} ranks, "
          f"{where['backend']} on {where['device']}, torch {where['torch']}")  # fmt: skip
    print(f"model: TinyGPT tiny, Ψ = {psi:,} parameters; global batch {batch} sequences "
          f"({batch // world} per rank); AdamW lr {LR:g}; fp32; {STEPS} steps")  # fmt: skip
    print(f"\n{'step':>6}{'loss, minizero':>17}{'loss, 1 process':>18}")
    for s in range(STEPS):
        mean = sum(r["losses"][s] for r in res) / world  # equal slices: mean of means = mean
        print(f"{s:>6}{mean:>17.6f}{res[0]['ref_losses'][s]:>18.6f}")

    print(f"\n(a) equivalence, max over ranks{'difference':>40}{'tolerance':>11}")
    ok = True
    # torch DDP itself differs from one process by rounding (a mean over 3 ranks is inexact),
    # which AdamW magnifies for parameters whose gradients are near 0: minizero may too, twice.
    torch_ref = max(r["torch_ref"] for r in res)
    checks = (
        (f"params after {STEPS} steps vs one process on the global batch", "diff_ref",
         max(TOLERANCE, 2 * torch_ref)),
        (f"params after {STEPS} steps vs torch DistributedDataParallel", "diff_torch", TOLERANCE),
        ("gradient norm at step 0 vs one process (relative)", "norm_rel_diff", TOLERANCE),
    )  # fmt: skip
    for label, key, tol in checks:
        d = max(r[key] for r in res)
        ok &= d <= tol
        verdict = "PASS" if d <= tol else "FAIL"
        print(f"    {label:<59}{d:>8.1e}{tol:>11.1e}   {verdict}")
    print(f"    (torch DDP vs one process: {torch_ref:.1e}; the first tolerance is the larger of "
          f"{TOLERANCE:.0e} and twice that)\n    (AdamW all but ignores a constant factor on "
          "gradients; the norm shows a missing 1/N)")  # fmt: skip

    vol = res[0]["volume"] / psi
    print("\n(b) communication in one step, rank 0 (CommLedger; all-reduce of S counts 2S)")
    for op, elements in res[0]["by_op"].items():
        print(f"    {op:<16}{elements:>12,} elements = {elements / psi:.2f} Ψ")
    if max(r["volume"] for r in res) != min(r["volume"] for r in res):
        print("    (ranks moved different volumes: " + ", ".join(f"{r['volume'] / psi:.3f} Ψ"
                                                          for r in res) + ")")  # fmt: skip
    print(f"    moved {vol:.2f} Ψ per step, paper: {PAPER_VOLUME[stage]}Ψ")

    paper = paper_model_state_bytes(psi, world, stage, "fp32")
    per = {"params": 4, "grads": 4, "optimizer": 8}
    cut = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    print("\n(c) model states per rank at the end of backward (max over ranks), fp32 Adam")
    print(f"    {'':12}{'measured':>14}{'paper':>14}{'formula':>10}{'measured/paper':>16}")
    got_total = 0
    for cat in ("params", "grads", "optimizer"):
        got = max(r["states"][cat] for r in res)
        got_total += got
        formula = f"{per[cat]}Ψ" + (f"/{world}" if cut[cat] else "")
        print(f"    {cat:<12}{format_bytes(got):>14}{format_bytes(paper[cat]):>14}{formula:>10}"
              f"{got / paper[cat]:>16.3f}")  # fmt: skip
    want = sum(paper.values())
    print(f"    {'total':<12}{format_bytes(got_total):>14}{format_bytes(want):>14}{'':>10}"
          f"{got_total / want:>16.3f}")  # fmt: skip
    print(f"\n{'PASS' if ok else 'FAIL'}: {world} ranks x {STEPS} steps in "
          f"{max(r['seconds'] for r in res):.1f} s of training, {time.perf_counter() - t0:.1f} s "
          "in all")  # fmt: skip
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero demo [--nprocs N] [--stage S] [--batch B]``."""
    from minizero.tools.cli import Parser, add_nprocs, positive_int
    from minizero.tools.report import ranks

    p = Parser(
        prog="minizero demo",
        description="Train a small GPT for a few steps with one of minizero's stages, next to "
        "PyTorch's DistributedDataParallel and one process on the whole batch, and print (a) "
        "whether they agree, (b) the communication volume per step against the ZeRO paper, "
        "(c) the model states each rank holds against the paper's formula. Exit code 0 when (a) "
        "passes.",
    )

    add_nprocs(p)
    p.add_argument(
        "--stage",
        type=int,
        default=0,
        choices=list(STAGE_NAMES),
        help="0: DDP, 1: ZeRO-1 (optimizer states sharded), 2: ZeRO-2 (+ gradients), "
        "3: ZeRO-3 (+ parameters); default 0",
    )
    p.add_argument("--batch", type=positive_int, default=None,
                   help=f"global batch in sequences, a multiple of the ranks (default "
                   f"{GLOBAL_BATCH}, rounded up to one)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        global_batch(ranks(a.nprocs), a.batch)
    except ValueError as e:
        p.error(str(e))
    return demo(a.nprocs, a.stage, a.batch)
