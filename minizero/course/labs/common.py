"""What several lessons' experiments share: the batch and step of TinyGPT on a rank, the model
states after one step beside the paper's formula, and the memory held through one step.

``model_states`` lessons 01-03 (bytes per rank after one step, beside the paper's formula);
``states_over_world`` lessons 02 and 04 (model states per rank for N = 1..world);
``plot_memory_per_step`` lessons 02-03 (what a rank holds at each point of one step, as lesson
02's lab's ``memory_per_step`` measures it).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import model_state_bytes, print_states_per_rank
from minizero.collectives import mark
from minizero.course.checks.common import describe, run_info
from minizero.course.plots import GLOO_MEMORY_NOTE
from minizero.launcher import rank_device
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch

GPT = GPTConfig.tiny()  # the model the lessons measure
PSI = count_params(TinyGPT(GPT))  # its Ψ
COLORS = ("tab:gray", "tab:blue", "tab:orange", "tab:green")  # stages 0-3 in figures
MEMORY_CATS = ("params", "grads", "optimizer", "activations")  # what lesson 02 stacks


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def gpt_batch(step: int = 0, group=None, rows_per_rank: int = 8):
    """Inside a rank: this rank's slice of step ``step``'s global batch of token ids, 8 rows a
    rank: ``(x, y)``, each (8, block_size)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return synthetic_batch(
        "gpt", rows_per_rank * world, step, rank=rank, world=world, device=rank_device()
    )


def gpt_step(model, step: int) -> None:
    """Inside a rank: one forward + backward of ``model`` on this rank's slice, with the ledger's
    marks "forward start" and "backward start"."""
    x, y = gpt_batch(step)
    mark("forward start")
    loss = model(x, y)
    mark("backward start")
    loss.backward()


def _model_states(runs: list[tuple[str, int]], optimizer) -> list[tuple]:
    out = []
    for precision, stage in runs:
        torch.manual_seed(0)
        model, opt = minizero.parallelize(
            TinyGPT(GPT).to(rank_device()), stage, optimizer, precision=precision
        )
        gpt_step(model, 0)
        opt.step()
        out.append((precision, stage, model_state_bytes(model, opt)))
    return out


def model_states(nprocs: int, runs: list[tuple[str, int]], optimizer=adam) -> list[list[tuple]]:
    """Lessons 01-03: for each ``(precision, stage)`` of ``runs``, TinyGPT after one step with
    ``optimizer``: every rank's ``[(precision, stage, {"params", "grads", "optimizer"}), ...]``."""
    return minizero.launch(_model_states, nprocs, runs, optimizer, verbose=False)


def show_model_states(per_rank: list[list[tuple]], psi: int = PSI, label: str = "") -> None:
    """Bytes per rank / Ψ, each run beside the paper's formula for it (a named precision: "fp32",
    "bf16", ...), or rank 0's alone, named ``label`` (a ``minizero.Precision``, which the
    formula does not name)."""
    if all(isinstance(precision, str) for precision, _, _ in per_rank[0]):
        return print_states_per_rank(per_rank, psi, len(per_rank))
    for _, stage, got in per_rank[0]:
        parts = ", ".join(f"{k} {v / psi:.3f}Ψ" for k, v in got.items())
        print(f"{label}, stage {stage}, rank 0: {parts} = {sum(got.values()) / psi:.3f}Ψ")


def show_after_step(runs: dict[int, dict], psi: int = PSI) -> None:
    """Each stage's model states once its step is done, in Ψ."""
    for stage, run in runs.items():
        end = run["marks"][-1]
        parts = ", ".join(f"{c} {end[c] / psi:.2f}Ψ" for c in ("params", "grads", "optimizer"))
        print(f"stage {stage}, after the step: {parts}")


def plot_memory_per_step(
    runs: dict[int, dict], title: str, cats=MEMORY_CATS, peak: bool = True
) -> None:
    """One panel per stage: ``cats`` stacked at each mark, the peak so far as a tick."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 4), sharey=True, squeeze=False)
    for ax, (stage, run) in zip(axes[0], runs.items(), strict=True):
        marks = run["marks"]
        bottom = [0.0] * len(marks)
        for cat in cats:
            vals = [m[cat] / 2**10 for m in marks]
            ax.bar(range(len(marks)), vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        if peak:
            peaks = [m["peak"] / 2**10 for m in marks]
            ax.plot(range(len(marks)), peaks, "k_", ms=20, label="peak so far")
        ax.set_xticks(range(len(marks)), [m["label"] for m in marks], rotation=20, fontsize=8)
        ax.set_title(f"stage {stage}", fontsize=9)
    axes[0][0].set_ylabel("KiB held by rank 0")
    axes[0][-1].legend(fontsize=7)
    info = next(iter(runs.values()))["info"]
    gloo = info["backend"] == "gloo" and any(stage > 0 for stage in runs)  # a reduce-scatter ran
    fig.suptitle(f"{title}: {describe(info)}" + f"\n{GLOO_MEMORY_NOTE}" * gloo, fontsize=9)
    fig.tight_layout()
    plt.show()


def _states_over_world(stages, precision: str) -> dict:
    rank, rows = dist.get_rank(), []
    for n in range(1, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))  # every rank calls new_group; ranks < n use it
        if rank < n:
            for stage in stages:
                torch.manual_seed(0)
                model, opt = minizero.parallelize(
                    TinyGPT(GPT), stage, adam, precision=precision, process_group=group
                )
                model(*gpt_batch(0, group)).backward()
                opt.step()  # measured before zero_grad(), which frees stage 2-3's gradient shards
                rows.append((n, stage, sum(model_state_bytes(model, opt).values())))
                opt.zero_grad()
    return {"info": run_info(), "rows": rows}


def states_over_world(world: int, stages=(0, 1), precision: str = "bf16") -> dict:
    """Lessons 02 and 04 (section 5 of each): for every n from 1 to ``world``, the first n ranks
    train TinyGPT one step on a group of their own, at each stage: rows ``(n, stage, model-state
    bytes)`` of every rank (``rank0``: rank 0's alone)."""
    per_rank = minizero.launch(_states_over_world, world, stages, precision, verbose=False)
    rows = [row for r in per_rank for row in r["rows"]]
    return dict(info=per_rank[0]["info"], rows=rows, rank0=per_rank[0]["rows"])


def plot_states_over_world(
    swept: dict, formula: dict, psi: int = PSI, up_to: int = 64, log: bool = False
) -> None:
    """The measured bytes per rank / Ψ (dots) on the formula's lines, N = 1..``up_to``;
    ``formula``: ``{stage: f(N) -> bytes per rank / Ψ}``; ``log``: a log y axis."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ns = range(1, up_to + 1)
    for (stage, f), color in zip(formula.items(), COLORS):
        ax.plot(ns, [f(n) for n in ns], color=color, lw=1, label=f"paper, stage {stage}")
        got = [(n, b / psi) for n, s, b in swept["rows"] if s == stage]
        ax.plot(*zip(*got, strict=True), "o", color=color, label=f"measured, stage {stage}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N: data-parallel ranks")
    ax.set_ylabel("model-state bytes per rank / Ψ")
    if log:
        ax.set_yscale("log", base=2)
    else:
        ax.set_ylim(0, 1.05 * max(f(1) for f in formula.values()))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=1 + (len(formula) > 2))
    i = swept["info"]
    where = f"{i['backend']} · {i['device']} · N = 1..{i['world']}"
    ax.set_title(f"TinyGPT, bf16 + Adam (K = 12): measured on {where}", fontsize=9)
    plt.show()


def show_states_at_world(swept: dict, formula: dict, psi: int = PSI) -> None:
    """Rank 0's measured bytes per rank / Ψ at the largest N, beside the formula's."""
    world = swept["info"]["world"]
    for n, stage, b in swept["rank0"]:
        if n == world:
            print(
                f"N = {n}, stage {stage}: measured {b / psi:.3f}Ψ, paper {formula[stage](n):.3f}Ψ"
            )
