"""Lesson 04's experiments (``course/04_zero3.py``): stage 3, P_os+g+p, measured.

``units`` (section 1) the units stage 3 cuts a model into;
``params_held`` (section 4) parameter bytes held as each unit's module runs, stages 2 and 3;
``stage3_floor`` (section 6) the peak of a step against the model states, N = 1..world;
``fsdp2_states`` (section 6) FSDP2's model states per rank beside the formula;
``step_comm`` (section 7) each stage's volume per step, per op and pass, and the units' gathers.
Section 5 uses :func:`minizero.course.labs.common.states_over_world`.
"""

from __future__ import annotations

import sys
from collections import Counter

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

import minizero
from minizero.analysis.memory import MemoryMeter, model_state_bytes
from minizero.collectives import all_gather, mark
from minizero.course import hint
from minizero.course.checks import lesson04
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.common import GPT, PSI, adam, gpt_batch
from minizero.course.labs.common import plot_states_over_world as plot_states_over_world
from minizero.course.labs.common import show_states_at_world as show_states_at_world
from minizero.course.labs.common import states_over_world as states_over_world  # section 5
from minizero.models import GPTConfig, TinyGPT, count_params
from minizero.units import assign_params, select_units
from minizero.zero3 import ZeRO3

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "GPTConfig", "PSI", "TinyGPT", "ZeRO3"]
__all__ += ["count_params", "all_gather", "dist", "lesson04", "nn"]


def units(model: nn.Module) -> list[dict]:
    """Section 1: the units stage 3 cuts ``model`` into (``select_units``), in order: the module,
    its elements and the names of its parameters."""
    names = {m: name or "(root)" for name, m in model.named_modules()}
    groups, owners, _ = assign_params(model, select_units(model))  # one group per unit
    out = []
    for params, module in zip(groups, owners, strict=True):
        held = [n for n, p in model.named_parameters() if any(p is q for q in params)]
        out.append(dict(module=names[module], numel=sum(p.numel() for p in params), params=held))
    return out


def show_units(rows: list[dict]) -> None:
    for unit, r in enumerate(rows):
        more = ", ..." if len(r["params"]) > 4 else ""
        print(
            f"unit {unit}: {r['module']:9} {r['numel']:6,} elements: "
            f"{', '.join(r['params'][:4])}{more}"
        )


def _params_held(cfg: GPTConfig, stage: int) -> dict:
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(cfg), stage, adam, precision="bf16")
    trace = []

    def sample(label):
        kept = model_state_bytes(model, opt)["params"]  # stage 3: the shards only
        # stage 3: the unit buffers gathered right now (0 bytes while freed)
        gathered = sum(f.untyped_storage().nbytes() for f in model.flat_params) if stage == 3 else 0
        trace.append((label, kept, gathered))

    def post(m, args, out, name):
        if out.requires_grad:
            out.register_hook(lambda grad: sample(f"bwd {name}"))

    picked = select_units(model.module)
    for step in range(2):
        if step == 1:  # registered after the stage's hooks: they run after its gathers
            for name, m in model.module.named_modules():
                if m in picked:
                    name = name or "(root)"
                    m.register_forward_pre_hook(lambda m, a, name=name: sample(f"fwd {name}"))
                    m.register_forward_hook(lambda m, a, out, name=name: post(m, a, out, name))
        sample("start")
        model(*gpt_batch(step)).backward()
        sample("end of backward")
        opt.step()
        opt.zero_grad()
    # the second step (the first sampled only "start" and "end of backward")
    return dict(trace=trace[2:], info=run_info())


def params_held(nprocs: int, cfg: GPTConfig, stages=(2, 3)) -> dict:
    """Section 4: TinyGPT(``cfg``) in bf16, two steps; in the second, rank 0's parameter bytes as
    each unit's module starts its forward and its backward: ``{stage: {"trace": [(label,
    kept, gathered)], "info"}}``, ``kept`` the parameters it keeps, ``gathered`` what stage 3
    holds gathered at that moment."""
    run = lambda s: minizero.launch(_params_held, nprocs, cfg, s, verbose=False)[0]
    return {s: run(s) for s in stages}


def plot_params_held(runs: dict, psi: int) -> None:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    two, three = runs[2]["trace"], runs[3]["trace"]
    xs = range(len(three))
    lines = {  # label: (bytes at each sample, style)
        "stage 2: all parameters": ([kept for _, kept, _ in two], dict(marker=".")),
        "stage 3: shards + gathered units": ([k + g for _, k, g in three], dict(marker=".")),
        "stage 3: shards (2Ψ/N)": ([kept for _, kept, _ in three], dict(color="k", ls="--", lw=1)),
    }
    for label, (ys, style) in lines.items():
        ax.step(xs, [y / psi for y in ys], where="mid", label=label, **style)
    ax.set_xticks(list(xs), [label for label, _, _ in three], rotation=90, fontsize=7)
    ax.set_ylim(0, 2.2)
    ax.set_ylabel(f"parameter bytes on rank 0 / Ψ (Ψ = {psi:,})")
    ax.legend(fontsize=8)
    where = describe(runs[3]["info"])
    ax.set_title(f"TinyGPT, 6 blocks, bf16, one step after the first: {where}", fontsize=9)
    fig.tight_layout()
    plt.show()
    peak = max(kept + g for _, kept, g in three)
    print(
        f"stage 3: at most {peak / psi:.2f}Ψ of parameters held at once; stage 2: 2.00Ψ throughout"
    )


def _floor() -> dict:
    rank, rows = dist.get_rank(), []
    for n in range(1, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))  # every rank calls new_group; ranks < n use it
        if rank < n:
            torch.manual_seed(0)
            model, opt = minizero.parallelize(
                TinyGPT(GPT), 3, adam, precision="bf16", process_group=group
            )
            for step in range(2):  # step 0 records the module order; step 1 is measured
                x, y = gpt_batch(step, group)
                with MemoryMeter(model, opt) as meter:
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad()
                    end = meter.mark("end of step")
            at = end["at_peak"]  # CPU: the split at the peak; CUDA: None (the allocator's peak)
            if at is None:
                states = sum(model_state_bytes(model, opt).values())
            else:
                states = sum(at[c] for c in ("params", "grads", "optimizer"))
            unit_bytes = sorted((b.padded * 2 for b in model.buckets), reverse=True)  # bf16
            rows.append(
                dict(n=n, peak=end["peak"], states=states, comm=at and at["comm"], units=unit_bytes)
            )
    return {"info": run_info(), "rows": rows}


def stage3_floor(world: int) -> dict:
    """Section 6: for N = 1..``world`` (the first N ranks, a group of their own), the peak of
    TinyGPT's second bf16 stage-3 step on rank 0, split into the model states held then, the
    gathered units and buckets (CPU only) and the rest; the units' bytes, largest first."""
    return minizero.launch(_floor, world, verbose=False)[0]


def plot_stage3_floor(floor: dict, psi: int = PSI) -> None:
    rows = floor["rows"]
    ns = [r["n"] for r in rows]
    states = [r["states"] / psi for r in rows]
    comm = [(r["comm"] or 0) / psi for r in rows]
    rest = [(r["peak"] - r["states"]) / psi - c for r, c in zip(rows, comm, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(ns, states, label="model states held (16Ψ/N)")
    if rows[0]["comm"] is not None:
        ax.bar(ns, comm, bottom=states, label="gathered units and gradient buckets")
    below = [a + b for a, b in zip(states, comm, strict=True)]
    ax.bar(ns, rest, bottom=below, label="activations and other temporaries")
    ax.set_xticks(ns)
    ax.set_xlabel("N: data-parallel ranks")
    ax.set_ylabel("peak bytes on rank 0 / Ψ")
    ax.legend(fontsize=8)
    i = floor["info"]
    where = f"{i['backend']} · {i['device']} · N = 1..{i['world']}"
    ax.set_title(f"TinyGPT, stage 3, bf16 Adam, peak of one step: measured on {where}", fontsize=9)
    plt.show()


def show_stage3_floor(floor: dict, psi: int = PSI) -> None:
    for r in floor["rows"]:
        split = f" (units and buckets {r['comm'] / psi:.2f}Ψ)" if r["comm"] is not None else ""
        print(
            f"N = {r['n']}: peak {r['peak'] / psi:.2f}Ψ = model states {r['states'] / psi:.2f}Ψ"
            f" + the rest {(r['peak'] - r['states']) / psi:.2f}Ψ{split}"
        )
    units = floor["rows"][0]["units"]
    print(
        f"largest units: {units[0]:,} and {units[1]:,} bytes (bf16), together "
        f"{(units[0] + units[1]) / psi:.2f}Ψ"
    )


def _fsdp2_states() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = rank_device()
    torch.manual_seed(0)
    model = TinyGPT(GPT).to(dev)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adam(model.parameters())
    model(*gpt_batch()).backward()
    opt.step()
    local = lambda t: t.to_local()  # this rank's (dim-0) shard of a DTensor
    nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)
    states = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    params = list(model.parameters())
    return {
        "params": (nbytes(params), params[0].dtype),
        "grads": (nbytes(p.grad for p in params), params[0].grad.dtype),
        "optimizer": (nbytes(states), states[0].dtype),
        "info": run_info(),
    }


def fsdp2_states(nprocs: int) -> dict:
    """Section 6: FSDP2 (``fully_shard`` per block and on the root, bf16 compute, fp32 reduction)
    on TinyGPT after one Adam step: rank 0's ``(bytes, dtype)`` of params, grads, optimizer."""
    return minizero.launch(_fsdp2_states, nprocs, verbose=False)[0]


def show_fsdp2_states(fsdp2: dict, ours: dict[str, float], psi: int = PSI) -> None:
    """FSDP2's states in Ψ/N beside ``ours``: minizero stage 3's bytes per parameter (× N)."""
    n = fsdp2["info"]["world"]
    print(f"TinyGPT, N = {n}, bf16, after one Adam step, rank 0 ({describe(fsdp2['info'])}):")
    for cat, theirs in ours.items():
        b, dtype = fsdp2[cat]
        print(
            f"  FSDP2 {cat:9} {b * n / psi:5.2f}Ψ/N ({str(dtype).replace('torch.', '')});"
            f"  minizero stage 3: {theirs:5.2f}Ψ/N"
        )
    total = sum(fsdp2[c][0] for c in ours) * n / psi
    print(f"  total: FSDP2 {total:.2f}Ψ/N, minizero {sum(ours.values()):.2f}Ψ/N")


def _step_comm(stages) -> dict:
    out = {}
    for stage in stages:
        torch.manual_seed(0)
        model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam)
        for step in range(2):  # step 0: stage 3 records the module order; step 1: it uses it
            with minizero.CommLedger() as ledger:
                mark("forward start")
                loss = model(*gpt_batch(step))
                mark("backward start")
                loss.backward()
                opt.step()
                opt.zero_grad()
            bwd = next(i for i, label in ledger.marks if label == "backward start")
            parts = Counter()
            for r in ledger.records:
                parts[f"{r.op} (forward)" if r.index < bwd else r.op] += r.volume_elements
            gathers = Counter(r.tag for r in ledger.records if r.op == "all_gather")  # tag -> n
            out[stage, step] = {"parts": dict(parts), "gathers": gathers}
    return dict(volumes=out, info=run_info())


def step_comm(nprocs: int, stages=(0, 1, 2, 3)) -> dict:
    """Section 7: TinyGPT's first two steps at each stage under a ledger: per (stage, step), the
    volume per op (all-gathers before "backward start" apart, as forward's), and how often each
    all-gather tag (stage 3: one per unit) ran."""
    return minizero.launch(_step_comm, nprocs, stages, verbose=False)[0]


OP_ORDER = ("all_reduce", "reduce_scatter", "all_gather", "all_gather (forward)")
OP_NAMES = {"all_gather": "all_gather (after the step; stage 3: in backward)"}
STEP_TITLES = ("step 0 (stage 3 records the module order)", "step 1 (and every later step)")


def plot_step_comm(comm: dict, paper: dict[int, float], psi: int = PSI) -> None:
    """Per step, each stage's volume / Ψ stacked by op, the paper's figure as a tick."""
    stages = list(paper)
    vol = comm["volumes"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for step, ax in enumerate(axes):
        bottom = [0.0] * len(stages)
        for key in OP_ORDER:
            vals = [vol[s, step]["parts"].get(key, 0) / psi for s in stages]
            ax.bar(stages, vals, bottom=bottom, label=OP_NAMES.get(key, key))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        figures = ", ".join(f"{v:g}Ψ" for v in paper.values())
        ax.plot(stages, list(paper.values()), "k_", ms=30, mew=2, label=f"paper: {figures}")
        ax.set_xticks(stages, ["DDP" if s == 0 else f"stage {s}" for s in stages])
        ax.set_title(f"TinyGPT (Ψ = {psi:,}), {STEP_TITLES[step]}", fontsize=9)
    top = max(sum(v["parts"].values()) for v in vol.values()) / psi
    axes[0].set_ylim(0, 1.1 * max(top, *paper.values()))  # no bar reaches the frame
    axes[0].set_ylabel("volume per step / Ψ (elements)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.02),
        ncol=3,
        markerscale=0.5,
    )
    fig.suptitle(f"Communication volume per training step: {describe(comm['info'])}", fontsize=9)
    fig.tight_layout()
    plt.show()


def show_step_comm(comm: dict, root_tag: str, psi: int = PSI) -> None:
    """Each step's total per stage, and how often stage 3 gathered the root unit and the others."""
    vol = comm["volumes"]
    stages = sorted({s for s, _ in vol})
    for step in (0, 1):
        total = ", ".join(
            f"stage {s} {sum(vol[s, step]['parts'].values()) / psi:.3f}Ψ" for s in stages
        )
        g = vol[3, step]["gathers"]
        others = sorted({n for tag, n in g.items() if tag != root_tag})
        print(
            f"step {step}: {total}; stage 3 all-gathered the root unit {g[root_tag]} times, "
            f"each of the other {len(g) - 1} units {' or '.join(map(str, others))} times"
        )
