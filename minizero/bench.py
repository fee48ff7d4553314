"""Benchmarks: ``python -m minizero bench collectives|ddp|stages [options]``. Lessons 00, 01, 05.

Every figure is measured here and printed with the backend, device, world size and torch version it
came from; nothing is compared with a hard-coded hardware peak. Each command writes JSON for plots.

* ``collectives``: an nccl-tests-like table per collective (size, count, type, time, algbw, busbw),
  run through ``minizero.collectives`` and timed by a ``CommLedger``; the same call made on
  ``torch.distributed`` directly, interleaved call by call, gives the ratio column (wrapper cost).
* ``ddp``: minizero's DDP against ``torch.nn.parallel.DistributedDataParallel``, same model, same
  process group, alternating k steps each; median step time and per-rank memory of each.
* ``stages``: each stage against its PyTorch peer the same way: 0 vs DDP, 1 vs DDP +
  ZeroRedundancyOptimizer, 2 vs FSDP2 (reshard_after_forward=False), 3 vs FSDP2 (True).

Times are per-rank medians, then the slowest rank (a step ends when every rank has ended it).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from minizero import collectives as C

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch < 2.13
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------- shared pieces


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _where() -> dict:
    """Inside a rank: what these figures were measured on."""
    dev = _device()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = "CPU"
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            name = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
        name = f"{name}, {os.cpu_count()} cores"
    return dict(backend=dist.get_backend(), device=name, world=dist.get_world_size(),
                torch=torch.__version__)  # fmt: skip


def _header(title: str, where: dict) -> str:
    return (f"minizero bench {title}: {where['world']} ranks, {where['backend']} on "
            f"{where['device']}, torch {where['torch']}")  # fmt: skip


def _printer() -> bool:
    """Under torchrun every rank gets the results; only global rank 0 prints them."""
    return os.environ.get("RANK", "0") == "0"


def _write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}")


def _launch(fn: Callable, nprocs: int | None, timeout: float, *args) -> list:
    from minizero.launch import gpu_count, launch

    gpus = gpu_count()
    n = nprocs or (gpus if gpus >= 2 else 2)
    if n > gpus:  # gloo ranks are forked from this process: import once here what they all need
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # first one imports torch._dynamo
    return launch(fn, n, *args, timeout=timeout, verbose=False)


# ---------------------------------------------------------------- collectives


def _pair(op: str, count: int, dtype: torch.dtype, dev: torch.device, world: int):
    """(minizero call, torch call) of ``op`` on S = ``count`` elements, on the same buffers."""
    full = torch.zeros(count, dtype=dtype, device=dev)  # (S,) zeros: sums never overflow
    shard = torch.zeros(count // world, dtype=dtype, device=dev)  # (S/n,) one rank's chunk
    if op == "all_reduce":
        return lambda: C.all_reduce(full), lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: C.reduce_scatter(shard, full), lambda: _RS(shard, full)
    if op == "all_gather":
        return lambda: C.all_gather(full, shard), lambda: _AG(full, shard)
    return lambda: C.broadcast(full, src=0), lambda: dist.broadcast(full, src=0)


def _collectives_rank(sizes: list[int], ops: list[str], iters: int, warmup: int, dtype_name: str):
    dtype, dev, world = getattr(torch, dtype_name), _device(), dist.get_world_size()
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for size in sizes:
        count = max(world, size // esize // world * world)  # divisible by n for the sharded ops
        for op in ops:
            ours, theirs = _pair(op, count, dtype, dev, world)
            for _ in range(warmup):
                ours(), theirs()
            torch_s = []
            with C.CommLedger() as ledger:
                for i in range(iters):
                    if i % 2:  # alternate which goes first
                        ours()
                    _sync(dev)
                    t0 = time.perf_counter()
                    theirs()
                    _sync(dev)
                    torch_s.append(time.perf_counter() - t0)
                    if not i % 2:
                        ours()
            ours_s = [r.seconds for r in ledger.records]
            rows.append(dict(op=op, count=count, nbytes=count * esize,
                             seconds=statistics.median(ours_s),
                             mean_seconds=statistics.fmean(ours_s),
                             torch_seconds=statistics.median(torch_s)))  # fmt: skip
    return dict(where=_where(), rows=rows)


def bench_collectives(argv: list[str]) -> int:
    """nccl-tests-like bandwidth table of the four collectives, through minizero and torch."""
    p = argparse.ArgumentParser(prog="minizero bench collectives", description=__doc__)
    p.add_argument("--nprocs", type=int, default=None, help="default: GPUs if >= 2, else 2")
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=64 * 2**20)
    p.add_argument("--step-factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS)
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default="runs/bench_collectives.json")
    a = p.parse_args(argv)
    ops = a.ops.split(",")
    if bad := [o for o in ops if o not in OPS]:
        p.error(f"unknown op(s) {bad}; choose from {','.join(OPS)}")
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= max(2, a.step_factor)
    per_rank = _launch(
        _collectives_rank, a.nprocs, a.timeout, sizes, ops, a.iters, a.warmup, a.dtype
    )
    where, rows = per_rank[0]["where"], per_rank[0]["rows"]
    for i, row in enumerate(rows):  # the slowest rank's median
        row["seconds"] = max(r["rows"][i]["seconds"] for r in per_rank)
        row["torch_seconds"] = max(r["rows"][i]["torch_seconds"] for r in per_rank)
        row["algbw"] = row["nbytes"] / row["seconds"]
        row["busbw"] = row["algbw"] * C.BUSBW_FACTOR[row["op"]](where["world"])
        row["ratio"] = row["seconds"] / row["torch_seconds"]
    if not _printer():
        return 0
    print(_header("collectives", where))
    print(f"{a.iters} timed calls per row after {a.warmup} warmup; time = median over calls, "
          f"slowest rank. S = full size (nccl-tests), busbw = algbw x factor(n)")  # fmt: skip
    print("torch(us): the same call on torch.distributed directly, interleaved with minizero's")
    for op in ops:
        gloo_rs = op == "reduce_scatter" and where["backend"] == "gloo"
        print(f"\n# {op}" + ("   (gloo: reduce-scatter is built on all-reduce, so it costs about "
                            "as much as an all-reduce of S)" if gloo_rs else ""))  # fmt: skip
        print(f"{'size(B)':>12}{'count':>12}{'type':>10}{'time(us)':>11}{'algbw(GB/s)':>13}"
              f"{'busbw(GB/s)':>13}{'torch(us)':>11}{'minizero/torch':>16}")  # fmt: skip
        for r in (r for r in rows if r["op"] == op):
            print(f"{r['nbytes']:>12}{r['count']:>12}{a.dtype:>10}{r['seconds'] * 1e6:>11.1f}"
                  f"{r['algbw'] / 1e9:>13.3f}{r['busbw'] / 1e9:>13.3f}"
                  f"{r['torch_seconds'] * 1e6:>11.1f}{r['ratio']:>16.2f}")  # fmt: skip
    ratios = [r["ratio"] for r in rows]
    print(
        f"\nminizero/torch over all rows: median {statistics.median(ratios):.3f}, "
        f"min {min(ratios):.3f}, max {max(ratios):.3f}"
    )
    if a.json:
        _write_json(a.json, dict(where=where, dtype=a.dtype, iters=a.iters, warmup=a.warmup,
                                 rows=rows))  # fmt: skip
    return 0


# ---------------------------------------------------------------- training steps, side by side

Build = Callable[[torch.nn.Module], tuple[torch.nn.Module, torch.optim.Optimizer]]


def _config(name: str):
    from minizero.models import GPTConfig

    if name not in ("tiny", "small"):
        raise ValueError(f"--model must be tiny or small, got {name!r}")
    return GPTConfig.tiny() if name == "tiny" else GPTConfig.small()


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _minizero(stage: int, precision: str, bucket_cap_mb: float) -> Build:
    from minizero.parallelize import parallelize

    return lambda m: parallelize(m, stage, _adamw, precision=precision, bucket_cap_mb=bucket_cap_mb)


def _torch_ddp(zero_optimizer: bool, bucket_cap_mb: float) -> Build:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    def build(m):
        dev = _device()
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
        dev = _device()
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
    """A (model, optimizer) pair seen by ``minizero.memory`` as one owner of model states, with
    DTensors (FSDP2) replaced by this rank's local shard."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, getattr(optimizer, "optim", optimizer)  # ZeRO-1 peer

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        from minizero.memory import state_tensors

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
    from minizero.memory import MemoryMeter, model_state_bytes

    dev = _device()
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
               warmup: int, rounds: int, k: int) -> dict:  # fmt: skip
    """Inside a rank: for each group of contenders, memory alone, then alternating timed steps."""
    from minizero.data import synthetic_batch
    from minizero.models import TinyGPT, count_params

    dev, world, rank = _device(), dist.get_world_size(), dist.get_rank()
    cfg = _config(model_name)
    torch.manual_seed(0)
    base = TinyGPT(cfg)
    batches = [synthetic_batch("gpt", batch, s, rank=rank, world=world, vocab_size=cfg.vocab_size,
                               seq_len=cfg.block_size, device=dev) for s in range(4)]  # fmt: skip
    groups = []
    for group_names, group_builds in zip(names, builds, strict=True):
        memory = [_memory(b, base, batches) for b in group_builds]
        gc.collect()
        live = [b(copy.deepcopy(base)) for b in group_builds]
        times: list[list[float]] = [[] for _ in live]  # wall seconds per timed step
        cpu: list[list[float]] = [[] for _ in live]  # CPU seconds of this process (all threads)
        done = [0] * len(live)
        for r in range(-1, rounds):  # round -1 is the warmup
            order = list(range(len(live)))[:: 1 if r % 2 else -1]  # flip who goes first
            for i in order:
                for _ in range(warmup if r < 0 else k):
                    _sync(dev)
                    t0, c0 = time.perf_counter(), time.process_time()
                    _step(*live[i], batches[done[i] % len(batches)])
                    _sync(dev)
                    done[i] += 1
                    if r >= 0:
                        times[i].append(time.perf_counter() - t0)
                        cpu[i].append(time.process_time() - c0)
        full = [_full_params(m) for m, _ in live]
        diff = max((full[0][n] - full[1][n]).abs().max().item() for n in full[0])
        groups.append(dict(names=group_names, times=times, cpu=cpu, memory=memory,
                           max_param_diff=diff, steps=done[0]))  # fmt: skip
        del live, full
    return dict(where=_where(), psi=count_params(base), groups=groups)


def _duel_options(prog: str, json_default: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"minizero bench {prog}", description=__doc__)
    p.add_argument("--nprocs", type=int, default=None, help="default: GPUs if >= 2, else 2")
    p.add_argument("--model", default="small", choices=["tiny", "small"],
                   help="TinyGPT config: tiny ~0.11M params, small ~3.7M")  # fmt: skip
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences of block_size)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender")
    p.add_argument("--steps", type=int, default=30, help="timed steps per contender")
    p.add_argument("--k", type=int, default=3, help="steps in a row before switching contender")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=json_default)
    return p


def _run_duels(a, title: str, names: list[list[str]], builds: list[list[Build]],
               notes: list[str]) -> dict:  # fmt: skip
    from minizero.memory import format_bytes as fb

    rounds = max(1, a.steps // a.k)
    per_rank = _launch(_duel_rank, a.nprocs, a.timeout, names, builds, a.model, a.batch, a.warmup,
                       rounds, a.k)  # fmt: skip
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
    if not _printer():
        return out
    print(_header(title, where))
    print(f"model: TinyGPT {a.model}, Ψ = {psi:,} params; global batch {a.batch} sequences of "
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
        _write_json(a.json, out)
    return out


def bench_ddp(argv: list[str]) -> int:
    """minizero DDP against torch DDP: median step-time ratio and per-rank memory."""
    p = _duel_options("ddp", "runs/bench_ddp.json")
    a = p.parse_args(argv)
    builds = [[_minizero(0, "fp32", a.bucket_cap_mb), _torch_ddp(False, a.bucket_cap_mb)]]
    notes = ["precision fp32; torch DDP with its defaults (gradient_as_bucket_view=False)"]
    out = _run_duels(a, "ddp", [["minizero DDP", "torch DDP"]], builds, notes)
    if _printer():
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
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated subset of 0,1,2,3")
    a = p.parse_args(argv)
    try:
        stages = [int(s) for s in a.stages.split(",")]
    except ValueError:
        stages = [-1]
    if any(s not in PEERS for s in stages):
        p.error(f"--stages takes a comma-separated subset of 0,1,2,3, got {a.stages!r}")
    cap, prec = a.bucket_cap_mb, a.precision
    peers = {0: _torch_ddp(False, cap), 1: _torch_ddp(True, cap), 2: _fsdp2(False, prec),
             3: _fsdp2(True, prec)}  # fmt: skip
    names = [[f"minizero stage {s}", PEERS[s][0]] for s in stages]
    builds = [[_minizero(s, prec, cap), peers[s]] for s in stages]
    notes = [f"peer of stage {s}: {PEERS[s][1]}" for s in stages]
    if prec == "fp32":
        notes.append("precision fp32 everywhere")
    else:
        notes.append(
            f"precision: minizero {prec} with fp32 masters; FSDP2 MixedPrecisionPolicy("
            f"{prec}); torch has no public mixed-precision DDP, so DDP peers run fp32"
        )
    _run_duels(a, "stages", names, builds, notes)
    return 0
