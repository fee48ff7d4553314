"""Training steps side by side: ``bench ddp`` and ``bench stages``. Lessons 01, 05.

Each minizero stage runs next to its PyTorch peer on the same ranks, the same model, the same
batches: 0 vs ``DistributedDataParallel``, 1 vs DDP + ``ZeroRedundancyOptimizer``, 2 vs FSDP2
(``reshard_after_forward=False``), 3 vs FSDP2 (``True``). Each contender's memory is measured
alone (peak of one step, model states at the end of backward), then the two take turns, k steps
each, for the step times. Times are per-rank medians, then the slowest rank.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from minizero.launcher import rank_device as device
from minizero.tools.cli import Parser, add_nprocs, positive_float, positive_int
from minizero.tools.report import (
    COMMANDS,
    header,
    measured_on,
    printer,
    ranks,
    run_ranks,
    sync,
    write_json,
)

Build = Callable[[torch.nn.Module], tuple[torch.nn.Module, torch.optim.Optimizer]]

MODELS = {  # --model -> (model class name in minizero.models, GPTConfig preset, what it is)
    "tiny": ("TinyGPT", "tiny", "TinyGPT tiny"),
    "small": ("TinyGPT", "small", "TinyGPT small"),
    "encoder-tiny": ("EncoderLM", "tiny", "EncoderLM tiny (torch nn.TransformerEncoderLayer)"),
    "encoder": ("EncoderLM", "small", "EncoderLM small (torch nn.TransformerEncoderLayer)"),
}


def _config(name: str):
    from minizero.models import GPTConfig

    if name not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    return getattr(GPTConfig, MODELS[name][1])()


def _build_model(name: str) -> torch.nn.Module:
    from minizero import models

    return getattr(models, MODELS[name][0])(_config(name))


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _minizero(stage: int, precision: str, bucket_cap_mb: float) -> Build:
    from minizero.parallelize import parallelize

    cap = None if stage == 3 else bucket_cap_mb  # stage 3's buckets are its units
    return lambda m: parallelize(m, stage, _adamw, precision=precision, bucket_cap_mb=cap)


def _torch_ddp(zero_optimizer: bool, bucket_cap_mb: float) -> Build:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    def build(m):
        dev = device()
        ids = [dev.index] if dev.type == "cuda" else None
        ddp = DistributedDataParallel(m.to(dev), device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        if zero_optimizer:  # optimizer states sharded: ZeRO-1's peer
            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
        return ddp, _adamw(ddp.parameters())

    return build


def _fsdp2(reshard_after_forward: bool, precision: str) -> Build:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def build(m):
        dev = device()
        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
        if precision != "fp32":
            low = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        m.to(dev)
        for block in m.blocks:  # one all-gather / reduce-scatter unit per transformer block
            fully_shard(block, **kw)
        fully_shard(m, **kw)  # the rest: embeddings (tied with lm_head), final LayerNorm
        return m, _adamw(m.parameters())

    return build


class _Held:
    """A (model, optimizer) pair seen by ``minizero.analysis.memory`` as one owner of model
    states, with DTensors (FSDP2) replaced by this rank's local shard."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, getattr(optimizer, "optim", optimizer)  # ZeRO-1 peer

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        from minizero.analysis.memory import state_tensors

        local = lambda t: t.to_local() if isinstance(t, DTensor) else t
        cats = state_tensors(self.model, self.optimizer)
        return {c: [local(t) for t in ts] for c, ts in cats.items()}


def _step(model, optimizer, batch) -> None:
    model(*batch).backward()  # the model returns the mean loss when given targets
    optimizer.step()
    optimizer.zero_grad()


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, full and fp32, by the user's model's names (collective for sharded ones)."""
    from torch.distributed.tensor import DTensor

    from minizero.data_parallel import DataParallel

    if isinstance(model, DataParallel):
        sd = model.full_state_dict()
    else:
        sd = getattr(model, "module", model).state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
            for k, v in sd.items()}  # fmt: skip


def _memory(build: Build, base: torch.nn.Module, batches: list) -> dict:
    """This contender alone: peak bytes over one steady-state step, and model-state bytes at the
    end of its backward (every gradient present, the optimizer states of earlier steps alive)."""
    from minizero.analysis.memory import MemoryMeter, model_state_bytes

    dev = device()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    model, opt = build(copy.deepcopy(base))
    _step(model, opt, batches[0])  # creates the optimizer states
    held = _Held(model, opt)
    with MemoryMeter(held, device=dev) as meter:
        meter.reset_peak()
        model(*batches[1]).backward()
        states = model_state_bytes(held)
        opt.step()
        opt.zero_grad()
        peak = meter.mark("after step")["peak"]
    del model, opt, held, meter
    return dict(peak=peak, states=states)


def _duel_rank(names: list[list[str]], builds: list[list[Build]], model_name: str, batch: int,
               warmup: int, rounds: int, k: int, progress=None) -> dict:  # fmt: skip
    """Inside a rank: for each group of contenders, memory alone, then alternating timed steps.
    ``progress.tick()`` after each contender's memory and after each of its rounds."""
    tick = progress.tick if progress is not None else lambda: None
    from minizero.models import count_params, synthetic_batch

    dev, world, rank = device(), dist.get_world_size(), dist.get_rank()
    cfg = _config(model_name)
    torch.manual_seed(0)
    base = _build_model(model_name)
    batches = [synthetic_batch("gpt", batch, s, rank=rank, world=world, vocab_size=cfg.vocab_size,
                               seq_len=cfg.block_size, device=dev) for s in range(4)]  # fmt: skip
    groups = []
    for group_names, group_builds in zip(names, builds, strict=True):
        memory = []
        for b in group_builds:
            memory.append(_memory(b, base, batches))
            tick()
        gc.collect()
        live = [b(copy.deepcopy(base)) for b in group_builds]
        times: list[list[float]] = [[] for _ in live]  # wall seconds per timed step
        cpu: list[list[float]] = [[] for _ in live]  # CPU seconds of this process (all threads)
        done = [0] * len(live)
        for r in range(-1, rounds):  # round -1 is the warmup
            order = list(range(len(live)))[:: 1 if r % 2 else -1]  # flip who goes first
            for i in order:
                for _ in range(warmup if r < 0 else k):
                    sync(dev)
                    t0, c0 = time.perf_counter(), time.process_time()
                    _step(*live[i], batches[done[i] % len(batches)])
                    sync(dev)
                    done[i] += 1
                    if r >= 0:
                        times[i].append(time.perf_counter() - t0)
                        cpu[i].append(time.process_time() - c0)
                tick()
        full = [_full_params(m) for m, _ in live]
        diff = max((full[0][n] - full[1][n]).abs().max().item() for n in full[0])
        groups.append(dict(names=group_names, times=times, cpu=cpu, memory=memory,
                           max_param_diff=diff, steps=done[0]))  # fmt: skip
        del live, full
    return dict(where=measured_on(), psi=count_params(base), groups=groups)


def _duel_options(prog: str, json_default: str) -> argparse.ArgumentParser:
    p = Parser(prog=f"minizero bench {prog}", description=COMMANDS[prog])
    add_nprocs(p)
    p.add_argument(
        "--model",
        default="small",
        choices=list(MODELS),
        help="TinyGPT tiny (~0.11M parameters) or small (~3.7M), or EncoderLM (torch's "
        "nn.TransformerEncoderLayer, tied head) at the same sizes: encoder-tiny, encoder "
        "(default small)",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=16,
        help="global batch in sequences, a multiple of the ranks (default 16)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender (default 3)")
    p.add_argument(
        "--steps", type=positive_int, default=30, help="timed steps per contender (default 30)"
    )
    p.add_argument("--k", type=positive_int, default=3, help="steps in a row per turn (default 3)")
    p.add_argument(
        "--bucket-cap-mb",
        type=positive_float,
        default=25,
        help="gradient bucket size in MiB (bucket_cap_mb), for both contenders (default 25)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=900,
        help="seconds the ranks may run (default 900)",
    )
    p.add_argument("--json", default=None, help=f"where to write the results ('' for nowhere; "
                   f"default {json_default}, ..._MODEL.json for another --model)")  # fmt: skip
    p.set_defaults(json_stem=json_default.removesuffix(".json"))
    return p  # fmt: skip


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """Options that depend on each other; returns the number of ranks."""
    if a.json is None:  # one file per model: `--model encoder` keeps the plain run's results
        a.json = a.json_stem + ("" if a.model == "small" else "_" + a.model.replace("-", "_"))
        a.json += ".json"
    n = ranks(a.nprocs)
    if a.batch % n:
        fix = n * max(1, round(a.batch / n))
        p.error(f"--batch {a.batch} does not split evenly over {n} ranks: pass --batch {fix}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    return n


def _run_duels(a, title: str, names: list[list[str]], builds: list[list[Build]],
               notes: list[str]) -> dict:  # fmt: skip
    from minizero.analysis.memory import format_bytes as fb

    rounds = max(1, a.steps // a.k)
    n = ranks(a.nprocs)
    contenders = sum(len(g) for g in names)
    print(f"minizero bench {title}: {len(names)} pair{'s' * (len(names) > 1)} on {n} ranks, "
          f"{MODELS[a.model][2]}; each contender: memory alone, {a.warmup} warmup + {rounds * a.k} "
          "timed steps, taking turns", flush=True)  # fmt: skip
    per_rank = run_ranks(_duel_rank, n, a.timeout, names, builds, a.model, a.batch, a.warmup,
                         rounds, a.k, total=contenders * (2 + rounds), desc=title)  # fmt: skip
    where, psi = per_rank[0]["where"], per_rank[0]["psi"]
    out = dict(where=where, psi=psi, model=a.model, global_batch=a.batch, warmup=a.warmup,
               rounds=rounds, k=a.k, bucket_cap_mb=a.bucket_cap_mb, groups=[])  # fmt: skip
    for g, group in enumerate(per_rank[0]["groups"]):
        rows, per_round = [], []
        for i, name in enumerate(group["names"]):
            ts = [r["groups"][g]["times"][i] for r in per_rank]  # [rank][step] seconds
            cs = [r["groups"][g]["cpu"][i] for r in per_rank]
            mem = [r["groups"][g]["memory"][i] for r in per_rank]
            # round j = steps [j*k, (j+1)*k) of each contender; the slowest rank's time for it
            per_round.append([max(sum(t[j * a.k : (j + 1) * a.k]) for t in ts)
                              for j in range(rounds)])  # fmt: skip
            rows.append(dict(name=name, median_s=max(statistics.median(t) for t in ts),
                             min_s=max(min(t) for t in ts),
                             cpu_s=max(statistics.median(c) for c in cs), times_rank0=ts[0],
                             peak_bytes=max(m["peak"] for m in mem),
                             state_bytes={c: max(m["states"][c] for m in mem)
                                          for c in ("params", "grads", "optimizer")}))  # fmt: skip
        # Paired by round: each round of one contender against the other's round next to it, so
        # that the load of a shared machine, which drifts over seconds, cancels; then the median.
        ratio = statistics.median([x / y for x, y in zip(*per_round, strict=True)])
        r0, r1 = rows
        out["groups"].append(dict(rows=rows, ratio=ratio, steps=group["steps"],
                                  median_ratio=r0["median_s"] / r1["median_s"],
                                  min_ratio=r0["min_s"] / r1["min_s"],
                                  cpu_ratio=r0["cpu_s"] / r1["cpu_s"],
                                  max_param_diff=group["max_param_diff"]))  # fmt: skip
    if not printer():
        return out
    print(header(title, where))
    print(f"model: {MODELS[a.model][2]}, Ψ = {psi:,} params; global batch {a.batch} sequences of "
          f"{_config(a.model).block_size} ({a.batch // where['world']} per rank); AdamW; "
          f"bucket_cap_mb {a.bucket_cap_mb:g}")  # fmt: skip
    for n in notes:
        print(n)
    print(f"timing: {a.warmup} warmup steps each, then {rounds} rounds of {a.k} steps each, "
          "alternating; who goes first flips every round")  # fmt: skip
    print(
        "step = median wall time, slowest rank; min = fastest step; cpu = median CPU time of "
        "the rank's process, all threads (on a shared machine it moves less than wall time)"
    )
    print("memory, max over ranks: peak = live bytes during one step alone (CPU: MemoryMeter, "
          "CUDA: max_memory_allocated);\n  states = params + grads + optimizer at the end of "
          "backward, hidden flat buffers included")  # fmt: skip
    print(f"\n{'':24}{'step(ms)':>9}{'min(ms)':>9}{'cpu(ms)':>9}{'peak':>12}{'states':>12}"
          f"{'params':>12}{'grads':>12}{'optimizer':>12}")  # fmt: skip
    for grp in out["groups"]:
        for r in grp["rows"]:
            sb = r["state_bytes"]
            print(
                f"{r['name']:24}{r['median_s'] * 1e3:>9.1f}{r['min_s'] * 1e3:>9.1f}"
                f"{r['cpu_s'] * 1e3:>9.1f}{fb(r['peak_bytes']):>12}{fb(sum(sb.values())):>12}"
                + "".join(f"{fb(sb[c]):>12}" for c in ("params", "grads", "optimizer"))
            )
        a0, a1 = (r["name"] for r in grp["rows"])
        print(f"{'':4}{a0} / {a1}: {grp['ratio']:.3f} wall (median of per-round ratios), "
              f"{grp['min_ratio']:.3f} min, {grp['cpu_ratio']:.3f} cpu\n{'':4}same parameters "
              f"after {grp['steps']} steps: max|Δ| = {grp['max_param_diff']:.1e}\n")  # fmt: skip
    if a.json:
        write_json(a.json, out)
    return out


def bench_ddp(argv: list[str]) -> int:
    """minizero DDP against torch DDP: median step-time ratio and per-rank memory."""
    p = _duel_options("ddp", "runs/bench_ddp.json")
    a = p.parse_args(argv)
    _check(p, a)
    builds = [[_minizero(0, "fp32", a.bucket_cap_mb), _torch_ddp(False, a.bucket_cap_mb)]]
    notes = ["precision fp32; torch DDP with its defaults (gradient_as_bucket_view=False)"]
    out = _run_duels(a, "ddp", [["minizero DDP", "torch DDP"]], builds, notes)
    if printer():
        aim = "met" if out["groups"][0]["ratio"] <= 1.05 else "NOT met"
        print(f"aim minizero/torch <= 1.05: {aim}")
    return 0


PEERS = {  # stage -> (short name, what it is)
    0: ("torch DDP", "DistributedDataParallel + AdamW"),
    1: ("DDP + ZeroRedundancyOpt", "DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)"),
    2: ("FSDP2 no reshard", "fully_shard(reshard_after_forward=False) per block and root"),
    3: ("FSDP2 reshard", "fully_shard(reshard_after_forward=True) per block and root"),
}


def bench_stages(argv: list[str]) -> int:
    """Each minizero stage next to its PyTorch peer: step-time ratios and per-rank memory."""
    p = _duel_options("stages", "runs/bench_stages.json")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="minizero's precision policy; FSDP2 gets the same (default fp32)",
    )
    p.add_argument(
        "--stages", default="0,1,2,3", help="comma-separated subset of 0,1,2,3 (default: all four)"
    )
    a = p.parse_args(argv)
    _check(p, a)
    try:
        stages = [int(s) for s in a.stages.split(",")]
    except ValueError:
        stages = [-1]
    if any(s not in PEERS for s in stages):
        p.error(f"--stages takes a comma-separated subset of 0,1,2,3, got {a.stages!r}")
    stages = list(dict.fromkeys(stages))
    cap, prec = a.bucket_cap_mb, a.precision
    peers = {0: _torch_ddp(False, cap), 1: _torch_ddp(True, cap), 2: _fsdp2(False, prec),
             3: _fsdp2(True, prec)}  # fmt: skip
    names = [[f"minizero stage {s}", PEERS[s][0]] for s in stages]
    builds = [[_minizero(s, prec, cap), peers[s]] for s in stages]
    notes = [f"peer of stage {s}: {PEERS[s][1]}" for s in stages]
    if 3 in stages:
        notes.append("stage 3 frees the root's parameters after forward and gathers them again "
                     "in backward (3Ψ per step, the paper's); FSDP2 keeps its root gathered "
                     "(3Ψ - Ψ_root)")  # fmt: skip
    if prec == "fp32":
        notes.append("precision fp32 everywhere")
    else:
        notes.append(
            f"precision: minizero {prec} with fp32 masters; FSDP2 MixedPrecisionPolicy("
            f"{prec}); torch has no public mixed-precision DDP, so DDP peers run fp32"
        )
    _run_duels(a, "stages", names, builds, notes)
    return 0
