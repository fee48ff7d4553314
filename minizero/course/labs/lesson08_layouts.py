"""Lesson 08's layouts (``course/08_beyond_one_node.py``, sections 2-3): flat ZeRO-3, HSDP at
stages 1-3, FSDP2's own HSDP, hpZ, no resharding and qwZ on the same ranks labelled as nodes.

``layouts`` trains each for a few steps and measures, on every rank: the bytes it moves per group
in the paper's accounting, the bytes it sends inside its node and across (the ring model), the
bytes it holds from forward to backward beyond what it held before forward, and its loss; and one
process's loss on the whole batch, the reference. ``show_layouts`` puts each beside its formula;
``plot_layouts`` (and ``rank_panels``, which section 1's figure shares) draws what each rank sends.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.ledger import PAPER_VOLUME, CommLedger
from minizero.analysis.memory import format_bytes, model_state_bytes
from minizero.course.labs import describe, launch_with_progress, run_info
from minizero.models import GPTConfig, TinyGPT, synthetic_batch

TORCH = "fully_shard"  # a layout's stage that means torch's FSDP2, not minizero
adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)


def _build(cfg: GPTConfig, options: dict, meshes: dict):
    """``options``: ``stage`` (0-3, or "fully_shard": torch's FSDP2 on each block, then the root),
    ``mesh`` (a (replicate, shard) shape, or absent) and parallelize's other options."""
    from torch.distributed.fsdp import fully_shard

    options = dict(options)
    stage, shape = options.pop("stage"), options.pop("mesh", None)
    mesh = meshes[shape] if shape else None
    torch.manual_seed(0)
    net = TinyGPT(cfg)
    if stage == TORCH:
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        return model, adamw(model.parameters())
    return minizero.parallelize(net, stage, adamw, **({"mesh": mesh} if mesh else {}), **options)


def _held(model) -> int:
    """Bytes this rank holds in model states and collective buffers right now (the meter's
    categories; a gathered stage-3 unit counts under "comm", hpZ's secondary shards under
    "params")."""
    return sum(model_state_bytes(model, include_comm=True).values())


def paper_bytes(ledger: CommLedger) -> dict[str, int]:
    """Bytes per group in the paper's accounting (an all-reduce of S counts 2S)."""
    out: dict[str, int] = {}
    for r in ledger.records:
        out[r.group] = out.get(r.group, 0) + PAPER_VOLUME[r.op] * r.nbytes
    return out


def _layouts(cfg: GPTConfig, layouts: dict, node: int, steps: int, progress) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = {o["mesh"] for o in layouts.values() if o.get("mesh")}
    names = ("replicate", "shard")
    meshes = {s: init_device_mesh("cpu", s, mesh_dim_names=names) for s in sorted(shapes)}
    out = {"info": run_info()}
    for name, options in layouts.items():
        model, opt = _build(cfg, options, meshes)
        minizero_run = options["stage"] != TORCH
        losses, held = [], 0
        for step in range(steps):
            x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world)
            with CommLedger(node_size=node) as ledger:
                before = _held(model) if minizero_run else 0
                loss = model(x, y)
                if minizero_run:  # between forward and backward, beyond the step's start
                    held = max(held, _held(model) - before)
                loss.backward()
                opt.step()
                opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # equal local batches: the mean of the means is the global mean
            losses.append(mean.item() / world)
        nb = ledger.node_bytes()["total"]
        out[name] = dict(
            groups=paper_bytes(ledger),
            inside=nb["inside"],
            across=nb["across"],
            held=held if minizero_run else None,
            losses=losses,
            on_ledger=minizero_run,  # torch's collectives do not go through minizero's
        )
        progress.tick()
    return out


def reference_losses(cfg: GPTConfig, world: int, steps: int) -> list[float]:
    """One process, the whole global batch of each step (4 rows a rank): its losses."""
    torch.manual_seed(0)
    one = TinyGPT(cfg)
    opt = adamw(one.parameters())
    out = []
    for step in range(steps):
        x, y = synthetic_batch("gpt", 4 * world, step)
        loss = one(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def layouts(cfg: GPTConfig, layouts: dict[str, dict], world: int, node: int, steps: int) -> dict:
    """Each of ``layouts`` (``{name: options}``, see :func:`_build`) on ``world`` gloo ranks in
    nodes of ``node``, ``steps`` steps of TinyGPT(``cfg``) fp32 under a ledger, and one process
    on the same batches. ``{"ranks": [{name: {groups, inside, across, held, losses, on_ledger}}
    per rank], "one": [losses], "world", "node", "steps", "info"}``: bytes of the last step,
    ``held`` the most over the steps (None for torch's FSDP2: its buffers are not the meter's)."""
    ranks = launch_with_progress(
        _layouts,
        world,
        cfg,
        layouts,
        node,
        steps,
        total=len(layouts),
        desc="ranks",
        backend="gloo",
        verbose=False,
    )
    one = reference_losses(cfg, world, steps)
    return dict(ranks=ranks, one=one, world=world, node=node, steps=steps, info=ranks[0]["info"])


def show_layouts(runs: dict, formula: dict[str, dict], held: dict[str, float], psi_bytes: float):
    """Rank 0's bytes per group, measured (``formula``: ``{layout: {group: bytes}}``), in units of
    ``psi_bytes`` (Ψ); inside and across; held from forward to backward (``held``'s formula, 0
    where it names none); the largest gap between the loss and one process's over the steps."""
    rank0 = runs["ranks"][0]
    print(f"rank 0, per step ({runs['steps']} steps; Ψ = {psi_bytes:,.0f} B)")
    print(
        f"{'layout':20}{'group: measured (formula) in Ψ':46}{'inside':>12}{'across':>12}"
        f"{'held (formula)':>26}{'|loss - one|':>13}"
    )
    for name, r in rank0.items():
        if name == "info":
            continue
        want = formula.get(name, {})
        groups = ", ".join(
            f"{g} {v / psi_bytes:.3f}" + (f" ({want[g] / psi_bytes:.3f})" if g in want else "")
            for g, v in sorted(r["groups"].items())
        )
        if not r["on_ledger"]:
            groups = "(torch's collectives: not on the ledger)"
        kept = "-" if r["held"] is None else format_bytes(r["held"])
        kept += f" ({format_bytes(held.get(name, 0))})" if r["held"] is not None else ""
        gap = max(abs(a - b) for a, b in zip(r["losses"], runs["one"], strict=True))
        inside, across = (
            format_bytes(r[k]) if r["on_ledger"] else "-" for k in ("inside", "across")
        )
        print(f"{name:20}{groups:46}{inside:>12}{across:>12}{kept:>26}{gap:>13.2e}")
    print(
        "(|loss - one|: the largest gap from one process's loss on the whole batch, over the steps)"
    )


def rank_panels(panels: dict[str, list[dict]], node: int, ylabel: str, title: str) -> None:
    """Small multiples: one panel per name, one bar per rank (ranks of a node side by side, a gap
    between nodes), each split into what it sends inside its node and across. ``panels``:
    ``{name: [{"inside": bytes, "across": bytes} per rank]}``; a shared y axis in MB, 10% above
    the tallest bar."""
    n = len(panels)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(2.3 * cols + 0.6, 2.4 * rows + 0.6), sharey=True, squeeze=False
    )
    top = max(r["inside"] + r["across"] for ranks in panels.values() for r in ranks) / 1e6
    for ax, (name, ranks) in zip(axes.flat, panels.items()):
        xs = [r + 0.4 * (r // node) for r in range(len(ranks))]  # a gap between nodes
        inside = [r["inside"] / 1e6 for r in ranks]
        ax.bar(xs, inside, 0.8, color="tab:blue", label="inside its node")
        ax.bar(
            xs,
            [r["across"] / 1e6 for r in ranks],
            0.8,
            bottom=inside,
            color="tab:red",
            label="across nodes",
        )
        ax.set_xticks(xs, [str(r) for r in range(len(ranks))], fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 1.1 * top)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel(f"rank (nodes of {node})", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, 0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    plt.show()


def plot_layouts(runs: dict) -> None:
    """What each rank sends in the last step, per layout on minizero's ledger (torch's FSDP2 is
    left out: its collectives do not go through the ledger)."""
    names = [n for n, r in runs["ranks"][0].items() if n != "info" and r["on_ledger"]]
    panels = {n: [ranks[n] for ranks in runs["ranks"]] for n in names}
    title = f"TinyGPT fp32, one step, ring model: {describe(runs['info'])}"
    rank_panels(panels, runs["node"], "MB sent per rank", title)
