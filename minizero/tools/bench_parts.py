"""``python -m minizero bench parts``: where a training step's time goes, stage by stage.

The capstone's step (``python -m minizero train``'s defaults: nanoGPT's README's CPU run, 4
layers, n_embd 128, 0.8M parameters, AdamW, clipping at 1.0) at stages 0-3 on the same ranks,
interleaved: each round runs ``--steps`` steps of every stage in turn, after a barrier, so that
drift in what else the machine runs reaches every stage alike. Printed per stage, the mean over
the timed steps of each part of the step, in ms on the slowest rank:

    forward, backward        the model's (stage 3 gathers its units inside them; backward ends
                             with the stage's ``backward_end``: DDP and stage 2 wait there for
                             the collectives started in backward)
    clip                     ``clip_grad_norm_`` (stages 1-2: it makes the step's gradients, so
                             stage 1's reduce-scatter runs inside it; one all-reduce of the norms)
    optimizer.step           the user's optimizer and the stage's ``after_step`` (the all-gather
                             of stages 1-2)
    zero_grad
    of which: reduce at the step, all-gather after it, waiting on collectives

and the median step with its ratio to stage 0's, and one step's collectives per kind (a
``CommLedger``; stage 3's module-order check, a small all-gather per unit, is outside it).
Four more columns, run in the same rounds (``--no-peers``: without them): **alone**, each rank
training its rows with no communication at all (the step's compute on these ranks: what DDP
would take if its collectives were free), and PyTorch's own implementations on the same ranks,
the peers each stage is held to: **torch DDP** (stage 0's), **DDP + ZRO** (DDP with
``ZeroRedundancyOptimizer``, stage 1's) and **FSDP2** (``fully_shard`` of the whole model, one
unit as ``train`` groups this model at stage 3; FSDP2 keeps its root gathered from forward to the
end of backward, 2Ψ a step: stage 3's ``--no-reshard-root``), the peer of stages 2 and 3; the row
"/ peer" divides each stage's median step by its peer's. Between alone and the peers lies what
data parallelism costs on this machine, whoever implements it; between the peers and the stages,
what minizero adds.
Lesson 09 trains this model; docs/results.md holds the figures, before and after the changes
they led to.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.tools.cli import Parser, add_nprocs, positive_int
from minizero.tools.report import header, measured_on, printer, ranks, run_ranks, write_json

PARTS = ("forward", "backward", "clip", "optimizer.step", "zero_grad")
INSIDE = ("finish_grad_sync", "after_step", "waits")  # timed inside the parts above


def _timed(acc: dict, key, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    return timed


PEERS = ("alone", "torch DDP", "DDP + ZRO", "FSDP2")  # beside the stages (--no-peers: none)
PEER_OF = {0: "torch DDP", 1: "DDP + ZRO", 2: "FSDP2", 3: "FSDP2"}  # PyTorch's own, per stage


def _peer(name: str, model: torch.nn.Module, cfg) -> tuple:
    """A peer column's (model, optimizer): no wrapper ("alone"), or PyTorch's own; train's AdamW
    (``cfg``: a TrainConfig) in each."""
    from minizero.tools.train import make_optimizer

    if name == "alone":
        return model, make_optimizer(model, cfg)
    if name == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return model, make_optimizer(model, cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # its defaults, as stage 0's
    if name == "DDP + ZRO":  # the same AdamW groups, each rank stepping its partition
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
                  for g in make_optimizer(model, cfg).param_groups]  # fmt: skip
        return ddp, ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=cfg.learning_rate,
                                            betas=(cfg.beta1, cfg.beta2))  # fmt: skip
    return ddp, make_optimizer(model, cfg)


def _rank(stages: list, rounds: int, steps: int, reshard_root: bool = True, progress=None) -> dict:
    from minizero.analysis.ledger import CommLedger
    from minizero.models import TinyGPT
    from minizero.parallelize import parallelize
    from minizero.tools import shakespeare
    from minizero.tools.train import TrainConfig, make_optimizer, train_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, data = TrainConfig(), shakespeare.load()
    acc: dict = collections.defaultdict(float)  # (stage, part) -> seconds
    now = [0]  # the stage running
    runs = {}
    for s in stages:
        torch.manual_seed(cfg.seed)
        model = TinyGPT(cfg.gpt(data.vocab_size))
        if s in PEERS:
            runs[s] = _peer(s, model, cfg)
            continue
        reshard = reshard_root if s == 3 else True  # a stage 3 option (train refuses it elsewhere)
        options = replace(cfg, stage=s, reshard_root=reshard).stage_options()
        wrapped, opt = parallelize(model, s, make_optimizer(model, cfg), **options)
        for moment in ("finish_grad_sync", "after_step"):  # the stage's moments, per instance
            setattr(wrapped, moment, _timed(acc, (s, moment), getattr(wrapped, moment)))
        runs[s] = wrapped, opt
    waits = C.ReleasedWork.wait  # gloo's works (the only backend timed here)

    def wait(work, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return waits(work, *args, **kwargs)
        finally:
            acc[(now[0], "waits")] += time.perf_counter() - t0

    C.ReleasedWork.wait = wait
    it = [0]

    def step(s: int) -> None:
        model, opt = runs[s]
        x, y = train_batch(data, cfg, it[0], rank, world, None)
        it[0] += 1
        t = [time.perf_counter()]

        def lap(part: str) -> None:
            t.append(time.perf_counter())
            acc[(s, part)] += t[-1] - t[-2]

        loss = model(x, y)
        lap("forward")
        loss.backward()
        lap("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lap("clip")
        opt.step()
        lap("optimizer.step")
        opt.zero_grad(set_to_none=True)
        lap("zero_grad")

    try:
        for s in stages:  # warm-up: Adam's states, DDP's bucket rebuild, stage 3's order
            now[0] = s
            for _ in range(3):
                step(s)
        counts = {}
        for s in stages:  # (the ledger sees minizero's collectives only: none for the peers)
            now[0] = s
            if s in PEERS:
                counts[s] = None
                continue
            with CommLedger() as ledger:
                step(s)
            counts[s] = dict(collections.Counter(r.op for r in ledger.records))
        acc.clear()
        times: dict[int | str, list[float]] = {s: [] for s in stages}
        for _ in range(rounds):
            for s in stages:
                now[0] = s
                dist.barrier()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step(s)
                    times[s].append(time.perf_counter() - t0)
            if progress is not None:
                progress.tick()
    finally:
        C.ReleasedWork.wait = waits
    n = rounds * steps
    return {
        s: {
            "median_ms": statistics.median(times[s]) * 1e3,
            **{p: acc[(s, p)] / n * 1e3 for p in PARTS + INSIDE},
            "collectives": counts[s],
        }
        for s in stages
    }


def bench_parts(argv: list[str]) -> int:
    p = Parser(prog="minizero bench parts", description=__doc__.split("\n\n")[1])
    p.add_argument("--rounds", type=positive_int, default=8, help="rounds of every stage (8)")
    p.add_argument("--steps", type=positive_int, default=10, help="steps per stage a round (10)")
    p.add_argument("--stages", default="0,1,2,3", help="which stages (0,1,2,3)")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="without the columns 'alone' (no collectives), 'torch DDP', 'DDP + "
                        "ZRO' (ZeroRedundancyOptimizer) and 'FSDP2'")  # fmt: skip
    p.add_argument("--no-reshard-root", dest="reshard_root", action="store_false",
                   help="stage 3 as train --no-reshard-root: its root unit kept gathered from "
                        "forward to the end of backward (2Ψ a step)")  # fmt: skip
    p.add_argument("--json", default="runs/bench-parts.json",
                   help="where to write the figures ('' for nowhere)")  # fmt: skip
    add_nprocs(p)
    a = p.parse_args(argv)
    stages = [s.strip() for s in a.stages.split(",")]
    if any(s not in ("0", "1", "2", "3") for s in stages):
        p.error(f"--stages takes stages 0-3, comma-separated, got {a.stages!r}")
    stages = [*(PEERS if a.peers else ()), *map(int, stages)]
    n = ranks(a.nprocs)

    def body(progress=None):
        return _rank(stages, a.rounds, a.steps, a.reshard_root, progress), measured_on()

    results = run_ranks(body, n, 1800.0, total=a.rounds, desc="rounds")
    where = results[0][1]
    # per stage and part, the slowest rank's mean (the step waits for it)
    table = {s: {k: max(r[0][s][k] for r in results) for k in ("median_ms",) + PARTS + INSIDE}
             for s in stages}  # fmt: skip
    if printer():
        kept = "" if a.reshard_root else "; stage 3's root unit kept gathered through backward"
        print(header("parts", where) + ", the capstone's model (0.8M parameters), fp32" + kept)
        print(format_table(table, results[0][0]))
    if printer() and a.json:
        per = {str(s): dict(table[s], collectives=results[0][0][s]["collectives"])
               for s in stages}  # fmt: skip
        write_json(a.json, {"where": where, "reshard_root": a.reshard_root, "stages": per})
    return 0


def format_table(table: dict, rank0: dict) -> str:
    """A column per stage (and peer: its moments and the ledger's counts are "-")."""
    stages = list(table)
    base = table[0]["median_ms"] if 0 in table else None
    rows = [["ms per step (mean; slowest rank)"] + [s if s in PEERS else f"stage {s}"
                                                    for s in stages]]  # fmt: skip
    for k in PARTS + INSIDE:
        label = k if k in PARTS else f"  of which {k.replace('_', ' ')}"
        ours = k in INSIDE  # minizero's moments and works: not in a peer
        rows.append([label] + ["-" if s in PEERS and ours else f"{table[s][k]:.1f}"
                               for s in stages])  # fmt: skip
    rows.append(["median step"] + [f"{table[s]['median_ms']:.1f}" for s in stages])
    if base:
        rows.append(["/ stage 0"] + [f"{table[s]['median_ms'] / base:.2f}" for s in stages])
    peer = {s: table[PEER_OF[s]]["median_ms"] for s in stages if PEER_OF.get(s) in table}
    if peer:  # each stage's median step over its PyTorch peer's
        rows.append(["/ peer"] + [f"{table[s]['median_ms'] / peer[s]:.2f}" if s in peer else "-"
                                  for s in stages])  # fmt: skip
    counted = [s for s in stages if rank0[s]["collectives"] is not None]
    for op in sorted({op for s in counted for op in rank0[s]["collectives"]}):
        rows.append([f"{op} per step"] + [str(rank0[s]["collectives"].get(op, 0))
                                          if s in counted else "-" for s in stages])  # fmt: skip
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width)))
        for r in rows
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("parts", help="the capstone's step at stages 0-3, part by part",
                   add_help=False)  # fmt: skip
