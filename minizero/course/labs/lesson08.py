"""Lesson 08's experiments (``course/08_beyond_one_node.py``): what crosses a node boundary, and
what a step costs.

``setup`` the lesson's gloo ranks, labelled as nodes;
``on_nodes`` (sections 1, 4, 5) one launch: every stage flat, timed, under a ledger that knows
the nodes; HSDP, hpZ and qwZ untimed; the plain model's compute and optimizer; two sweeps;
``show_node_bytes`` / ``plot_node_bytes`` / ``show_against_model`` (section 1) bytes per rank
inside and across, and beside the formula and the cost model.
Sections 2-3's layouts: :mod:`.lesson08_layouts`; sections 4-5's link model and step:
:mod:`.lesson08_links`; sections 6-7 and exercise 4's scenario: :mod:`.lesson08_scale` (the
calculator itself: :mod:`minizero.analysis.scenario`). All reach the lesson from here.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

# torch.optim imports torch's compiler on first use (~10 s per process). The ranks of a CPU launch
# are forked from this kernel: importing it once here saves every launch below that time.
import torch._dynamo  # noqa: F401
import torch.distributed as dist

import minizero
from minizero import collectives as C
from minizero.analysis import cost, scenario
from minizero.analysis import step_parts as parts
from minizero.analysis.ledger import CommLedger, name_group
from minizero.analysis.memory import format_bytes
from minizero.course import hint
from minizero.course.checks import lesson08
from minizero.course.labs import describe, launch_with_progress, run_info
from minizero.course.labs.lesson08_layouts import layouts as layouts
from minizero.course.labs.lesson08_layouts import plot_layouts as plot_layouts
from minizero.course.labs.lesson08_layouts import rank_panels
from minizero.course.labs.lesson08_layouts import show_layouts as show_layouts
from minizero.course.labs.lesson08_links import NAMES, config
from minizero.course.labs.lesson08_links import busbw as busbw
from minizero.course.labs.lesson08_links import fit_links as fit_links
from minizero.course.labs.lesson08_links import plot_step_parts as plot_step_parts
from minizero.course.labs.lesson08_links import show_links as show_links
from minizero.course.labs.lesson08_links import show_step_parts as show_step_parts
from minizero.course.labs.lesson08_links import show_validation as show_validation
from minizero.course.labs.lesson08_links import show_zeropp as show_zeropp
from minizero.course.labs.lesson08_links import step_parts as step_parts
from minizero.course.labs.lesson08_links import zeropp_across as zeropp_across
from minizero.course.labs.lesson08_scale import calculator as calculator
from minizero.course.labs.lesson08_scale import plot_scale as plot_scale
from minizero.course.labs.lesson08_scale import show_choice as show_choice
from minizero.course.labs.lesson08_scale import show_scale as show_scale
from minizero.course.labs.lesson08_scale import show_sensitivity as show_sensitivity
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "dist", "C", "cost", "scenario"]
__all__ += ["lesson08", "GPT", "PSI", "GPTConfig", "CommLedger"]

GPT = GPTConfig.tiny()  # the model measured here
PSI = count_params(TinyGPT(GPT))
adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)


def setup(nprocs: int, node: int) -> tuple[int, dict]:
    """Where the lesson measures: ``nprocs`` gloo ranks on this machine, read as nodes of ``node``
    consecutive ranks (a labelling: every link is the same loopback). Prints it; returns
    ``nprocs`` and ``run_info`` of rank 0, as every lesson's ``setup`` does."""
    if nprocs % node:
        raise ValueError(f"world ({nprocs}) must be a multiple of the node size ({node})")
    info = minizero.launch(run_info, nprocs, backend="gloo", verbose=False)[0]
    print(f"{nprocs} gloo ranks as {nprocs // node} nodes × {node} | TinyGPT Ψ = {PSI:,}")
    print(f"minizero {minizero.__version__}, torch {torch.__version__} | {describe(info)}")
    return nprocs, info


def library_options(options: dict, mesh, node: int) -> dict:
    """``minizero.parallelize``'s options for a ``cost.Config``'s: ``hsdp`` -> the 2-D mesh,
    ``hpz`` -> ``reshard_after_forward=node``, ``qwz`` -> ``quantize_weights=True``."""
    out = {}
    if options.get("hsdp"):
        out["mesh"] = mesh
    if options.get("hpz"):
        out["reshard_after_forward"] = node
    if options.get("qwz"):
        out["quantize_weights"] = True
    return out


def _one_step(model, opt, stage: int, x, y, micro: int) -> None:
    """One optimizer step of ``micro`` micro-batches: stages 0-1 keep all but the last one's
    gradients without communicating (``no_sync``); stages 2-3 reduce after every backward."""
    for m in range(micro):
        model.set_requires_gradient_sync(stage >= 2 or m == micro - 1)
        model(x, y).backward()
    opt.step()
    opt.zero_grad()


def _on_nodes(node: int, micro: int, more: dict, repeats: int, sizes, progress) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = [list(range(k, k + node)) for k in range(0, world, node)]
    nodes = [name_group(dist.new_group(b), "node") for b in blocks]  # every rank makes each
    mesh = init_device_mesh("cpu", (world // node, node), mesh_dim_names=("replicate", "shard"))
    x, y = synthetic_batch("gpt", 4 * world, 0, rank=rank, world=world)  # (4, T) this rank's
    out = {"stages": {}, "more": {}, "info": run_info()}
    for key, options in [(s, dict(stage=s)) for s in range(4)] + list(more.items()):
        stage = options["stage"]
        torch.manual_seed(0)
        model, opt = minizero.parallelize(
            TinyGPT(GPT),
            stage,
            adamw,
            bucket_cap_mb=None if stage == 3 else 25,
            **library_options(options, mesh, node),
        )
        step = functools.partial(_one_step, model, opt, stage, x, y, micro)
        step()  # warm-up (stage 3 records the order of its units)
        with CommLedger(node_size=node) as ledger:
            step()
        res = dict(
            node_bytes=ledger.node_bytes()["total"],
            sizes=[b.padded for b in model.buckets],  # elements per bucket (stage 3: per unit)
            payload=_payload_by_group(ledger),
            collectives=len(ledger.records),
        )
        if key in more:
            out["more"][key] = res
            continue
        # the step, and for section 5 the same step with its collectives replaced by local
        # stand-ins and by barriers, interleaved (last: the model's numbers are wrong after it)
        out["stages"][key] = dict(res, **parts.step_variants(step, repeats))
        progress.tick()
    progress.tick()
    plain = TinyGPT(GPT)  # section 5: what the cost model is fed, timed on every rank at once
    out["compute_s"] = parts.compute_seconds(plain, x, y, repeats)
    out["barrier_s"] = parts.barrier_seconds()  # one barrier alone, on the flat group
    out["optimizer_s"] = {
        "all": parts.optimizer_seconds(list(plain.parameters()), adamw, repeats),  # stage 0
        "shard": parts.optimizer_seconds(parts.flat_shard(PSI, world), adamw, repeats),
    }
    timed = min(repeats, 3)  # calls per payload, the median kept
    out["intra"] = cost.sweep(sizes, repeats=timed, group=nodes[rank // node])  # a node's ring
    progress.tick()
    out["inter"] = cost.sweep(sizes, repeats=timed)  # the ring over every node
    progress.tick()
    out["load"] = os.getloadavg()[0]  # the 1-minute load average: other work on this machine
    return out


def _payload_by_group(ledger: CommLedger) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger.records:
        out[r.group] = out.get(r.group, 0) + r.nbytes
    return out


SWEEP = cost.SIZES  # bytes: 4 KiB (latency-bound) to 64 MiB (bandwidth-bound)


def on_nodes(
    world: int, node: int, micro: int, more: dict[str, dict], repeats: int = 10, sweep=SWEEP
) -> dict:
    """Sections 1, 4 and 5, one launch of ``world`` gloo ranks in nodes of ``node``: each stage,
    flat, ``micro`` micro-batches per step of TinyGPT fp32 under ``CommLedger(node_size=node)``,
    then timed (the fastest of ``repeats``) as it is, without its collectives and with a barrier
    for each (analysis/step_parts.py), interleaved; each of ``more`` (``cost.Config``'s options:
    stage, hsdp, hpz, qwz) the same, untimed; the plain model's forward + backward, AdamW's step
    and one barrier; collective sweeps (payloads of ``sweep`` bytes) over each node's ring and
    over all ranks. ``{"ranks": [one dict per rank], "world", "node",
    "micro", "more", "info"}``."""
    total = 4 + 1 + 2
    ranks = launch_with_progress(
        _on_nodes,
        world,
        node,
        micro,
        more,
        repeats,
        list(sweep),
        total=total,
        desc="ranks",
        backend="gloo",
        verbose=False,
    )
    return dict(ranks=ranks, world=world, node=node, micro=micro, more=more, info=ranks[0]["info"])


def show_node_bytes(run: dict) -> None:
    """Bytes each rank sends in one step, inside its node and across, per stage."""
    world = run["world"]
    print(f"bytes each rank sends in one step ({run['micro']} micro-batches, fp32), flat groups")
    print(f"{'':8}" + "".join(f"{'rank ' + str(r) + ' in/across':>22}" for r in range(world)))
    for s in range(4):
        cells = [run["ranks"][r]["stages"][s]["node_bytes"] for r in range(world)]
        row = "".join(
            f"{format_bytes(c['inside']):>11}{format_bytes(c['across']):>11}" for c in cells
        )
        print(f"{NAMES[s]:8}{row}")


def plot_node_bytes(run: dict) -> None:
    """One panel per stage: each rank's bytes sent, inside its node and across."""
    panels = {
        NAMES[s]: [run["ranks"][r]["stages"][s]["node_bytes"] for r in range(run["world"])]
        for s in range(4)
    }
    where = describe(run["info"])
    title = f"flat groups, one step of {run['micro']} micro-batches, ring model: {where}"
    rank_panels(panels, run["node"], "MB sent per rank per step", title)


def show_against_model(run: dict, formula: dict[int, float]) -> None:
    """Section 1: each stage's bytes sent by rank 0 per step: ``formula`` (``{stage: elements
    per rank / Ψ}``, fp32), the cost model's collectives (the buckets the stage made) and the
    ledger; then, per group, the payload of each of ``run["more"]``: model | ledger."""
    rank0 = run["ranks"][0]
    for s in range(4):
        res = rank0["stages"][s]
        model = sum(c.wire() for c in cost.step_collectives(config(run, stage=s), res["sizes"]))
        ledger = sum(res["node_bytes"].values())
        want = formula[s] * 4 * PSI
        print(
            f"{NAMES[s]:8} formula {formula[s]:.2f} Ψ × 4 B = {want:>12,.0f} B   "
            f"model {model:>12,.0f} B   ledger {ledger:>12,.0f} B"
        )
    print(
        f"\npayload S per group, one step of {run['micro']} micro-batches (rank 0): model | ledger"
    )
    for name, options in run["more"].items():
        res = rank0["more"][name]
        want: dict[str, float] = {}
        for c in cost.step_collectives(config(run, **options), res["sizes"]):
            want[c.group] = want.get(c.group, 0) + c.times * c.nbytes
        got = res["payload"]
        cells = [f"{g} {want[g]:>10,.0f} | {got.get(g, 0):>10,.0f}" for g in sorted(want)]
        print(f"{name:16}" + "   ".join(cells))
