"""Figures of the stages' measurements and of the paper's formulas. Lessons 05 (05_all_stages), 06.

* ``memory_axes``, ``volume_axes``, ``bandwidth_axes``, ``time_axes``, ``memory_figure``,
  ``comm_figure``: matplotlib figures of what :func:`minizero.course.compare.profile_stages`
  measured, each titled with where it was measured;
* ``table1_figure``: ``minizero.simulate.table1()`` against the paper's Table 1;
* ``state_bars``: the paper's model-state formula at every stage.

The memory budget of a step and its calculator: :mod:`minizero.course.plots_budget`.
"""

from __future__ import annotations

import os
import statistics

from minizero.analysis.ledger import PAPER_VOLUME
from minizero.analysis.memory import format_bytes, paper_model_state_bytes

CATS = ("params", "grads", "optimizer")
# bar segment -> (legend label, colour, hatch), bottom to top
STYLE = {
    "params": ("parameters", "#4C72B0", None),
    "grads": ("gradients", "#DD8452", None),
    "optimizer": ("optimizer states", "#55A868", None),
    "comm": ("communication buffers at the peak", "#AAAAAA", "xx"),
    "other": ("activations and temporaries at the peak", "#DDDDDD", "//"),
    "all_reduce": ("all_reduce", "#8172B3", None),
    "reduce_scatter": ("reduce_scatter", "#C44E52", None),
    "all_gather": ("all_gather", "#64B5CD", None),
    "activations": ("activations (transformer layers)", "#CCB974", None),
    "logits": ("output layer (logits, loss)", "#DA8BC3", None),
    "stage 3 working set": ("stage 3: gathered units + a full gradient", "#8C8C8C", "..."),
}
OPS = ("all_reduce", "reduce_scatter", "all_gather")
STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
MODELS = {"gpt": "TinyGPT", "mlp": "MLP"}  # workload key -> name in figures
GLOO_NOTE = "gloo: loopback on the cores that compute; minizero's own reduce-scatter, all-gather"
GLOO_RS_BUFFER = "on gloo minizero's reduce_scatter receives others' chunks: (N-1)/N of its input"
GLOO_MEMORY_NOTE = f"{GLOO_RS_BUFFER} more than NCCL (lesson 03)"
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GB": 1e9}


def widgets_available() -> bool:
    """Whether this kernel has a front end that shows widgets: a Jupyter server started it (it
    sets ``JPY_SESSION_NAME``), unless ``MINIZERO_WIDGETS=0``; ``MINIZERO_WIDGETS=1`` forces it
    (other front ends). nbclient, nbval and the grader set neither (``grade`` sets
    ``MINIZERO_WIDGETS=0`` too): graded runs build no widget. That is also what keeps them from
    stalling: with a widget's comm messages in a cell, nbclient sometimes sees the kernel go idle
    before the cell's reply and waits out its whole timeout (jupyter/nbclient#312).
    The lessons' widget cells draw their figure once without one instead. False, too, where
    ipywidgets is not installed."""
    from importlib.util import find_spec

    force = os.environ.get("MINIZERO_WIDGETS")
    if force in ("0", "1"):
        wanted = force == "1"
    else:
        wanted = bool(os.environ.get("JPY_SESSION_NAME"))
    return wanted and find_spec("ipywidgets") is not None


def unit_of(n: float) -> str:
    """The paper's GB (1e9 bytes) at scale; binary units for the small models measured here."""
    if n >= 1e9:
        return "GB"
    return next((u for u in ("MiB", "KiB") if n >= UNITS[u]), "B")


def measured_where(info: dict) -> str:
    """``"gloo · cpu (CPU) · world 2"`` for a title (``checks.describe``, imported when drawn)."""
    from minizero.course.checks import describe

    return describe(info)


def _peak_parts(p: dict) -> dict[str, float]:
    """What the step's peak held beyond the model states: communication buffers (stage 2's
    buckets, stage 3's gathered layers; CPU only: the split at the peak) and the rest."""
    rest = max(p["peak"] - sum(p["states"].values()), 0)
    comm = min((p["at_peak"] or {}).get("comm", 0), rest)
    return {"comm": comm, "other": rest - comm}


def stack(ax, x: float, parts: dict[str, float], width: float, labelled: bool, alpha=1.0) -> float:
    """One stacked bar of ``parts`` (keys from STYLE, in STYLE's order); returns its top."""
    top = 0.0
    for key, (label, color, hatch) in STYLE.items():
        if key in parts:
            ax.bar(
                x,
                parts[key],
                width,
                bottom=top,
                color=color,
                hatch=hatch,
                linewidth=0,
                edgecolor="grey",
                alpha=alpha,
                label=label if labelled else None,
            )
            top += parts[key]
    return top


def _log_y(ax) -> None:
    """Log scale with plain tick labels (0.002, 30) rather than powers of ten, at 1, 2 and 5
    times each power of ten, so that a range narrower than a decade still gets labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _stage_ticks(ax, stages: list[int], suffix: str = "") -> None:
    ax.set_xticks(range(len(stages)), [f"{s}: {STAGE_NAMES[s]}{suffix}" for s in stages])


def memory_axes(ax, profiles: list[dict], info: dict) -> None:
    """Per stage, two stacked bars: measured (model states at the end of backward, then the rest
    of the step's peak, hatched) and the paper's formula for the same Ψ, N and precision."""
    psi, world, prec = profiles[0]["psi"], profiles[0]["world"], profiles[0]["precision"]
    unit = unit_of(max(p["peak"] for p in profiles))
    for i, p in enumerate(profiles):
        mine = {k: v / UNITS[unit] for k, v in {**p["states"], **_peak_parts(p)}.items()}
        states = sum(mine[c] for c in CATS)
        top = stack(ax, i - 0.2, mine, 0.38, labelled=i == 0)
        ax.text(i - 0.2, top, f"{states:.2f}\npeak {top:.2f}", ha="center", va="bottom", fontsize=7)
        paper = paper_model_state_bytes(psi, world, p["stage"], prec)
        top = stack(ax, i + 0.2, {k: v / UNITS[unit] for k, v in paper.items()}, 0.38, False)
        ax.text(i + 0.2, top, f"{top:.2f}", ha="center", va="bottom", fontsize=7)
    _stage_ticks(ax, [p["stage"] for p in profiles], "\nmeasured | paper")
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_ylim(0, max(p["peak"] for p in profiles) / UNITS[unit] * 1.15)
    name = MODELS.get(profiles[0]["model"], profiles[0]["model"])
    ax.set_title(f"memory per rank: {name}, Ψ = {psi:,}, {prec}, AdamW", fontsize=10)
    ax.legend(fontsize=8)


def volume_axes(ax, by_model: dict[str, list[dict]]) -> None:
    """Elements moved per step (CommLedger, the paper's accounting) in units of Ψ, by op."""
    width = 0.8 / len(by_model)
    for j, (name, profiles) in enumerate(by_model.items()):
        for i, p in enumerate(profiles):
            moved = {op: 0.0 for op in OPS}
            for r in p["records"]:
                moved[r["op"]] += PAPER_VOLUME[r["op"]] * r["numel"] / p["psi"]
            x = i - 0.4 + width * (j + 0.5)
            top = stack(ax, x, moved, width * 0.9, labelled=i == 0 and j == 0)
            label = f"{top:.3f}\n{MODELS.get(name, name)}"
            ax.text(x, top, label, ha="center", va="bottom", fontsize=7)
    for y in (2, 3):
        ax.axhline(y, color="k", lw=0.6, ls="--")
    _stage_ticks(ax, [p["stage"] for p in next(iter(by_model.values()))])
    ax.set_ylim(0, 3.9)
    ax.set_ylabel("elements moved per step / Ψ")
    ax.set_title("communication volume, rank 0 (paper: 2Ψ, 2Ψ, 2Ψ, 3Ψ)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def _median_bytes(p: dict, op: str) -> float | None:
    sizes = [r["nbytes"] for r in p["records"] if r["op"] == op and r["seconds"]]
    return statistics.median(sizes) if sizes else None


def bandwidth_axes(ax, profiles: list[dict], info: dict) -> None:
    """Median busbw of each op in one step, per stage (asynchronous ops: issue to wait), with the
    median message size on each bar. Bars of messages under ``LATENCY_BOUND`` are hatched and the
    title says that they measure per-call latency, not the link's bandwidth."""
    from minizero.analysis.ledger import LATENCY_BOUND

    width = 0.8 / len(OPS)
    small, top = [], 0.0  # median message sizes under LATENCY_BOUND; the highest bar
    for k, op in enumerate(OPS):
        xs, ys, sizes = [], [], []
        for i, p in enumerate(profiles):
            bw = [r["busbw"] for r in p["records"] if r["op"] == op and r["seconds"]]
            if bw:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(statistics.median(bw) / 1e9)
                sizes.append(_median_bytes(p, op))
        hatch = ["//" if n < LATENCY_BOUND else None for n in sizes]
        ax.bar(xs, ys, width * 0.9, color=STYLE[op][1], label=op, hatch=hatch, edgecolor="white")
        for x, y, n in zip(xs, ys, sizes):
            ax.text(x, y, format_bytes(n).replace(".00", ""), ha="center", va="bottom",
                    fontsize=6, rotation=90)  # fmt: skip
        small += [n for n in sizes if n < LATENCY_BOUND]
        top = max([top, *ys])
    _stage_ticks(ax, [p["stage"] for p in profiles])
    _log_y(ax)
    if top:
        ax.set_ylim(top=top * 3)  # room for the size labels above the bars
    ax.set_ylabel("median busbw per collective (GB/s)")
    name = MODELS.get(profiles[0]["model"], profiles[0]["model"])
    lines = [f"bus bandwidth, {name}, one step, rank 0 (label: median message size)"]
    if small:
        lines.append(f"hatched: messages of {format_bytes(min(small))} to "
                     f"{format_bytes(max(small))}, LATENCY-BOUND: per-call cost, not the link's "
                     "bandwidth")  # fmt: skip
    if info["backend"] == "gloo":
        lines.append(GLOO_NOTE)
    ax.set_title("\n".join(lines), fontsize=9)
    ax.legend(fontsize=8)


def time_axes(ax, by_model: dict[str, list[dict]], info: dict | None = None) -> None:
    """Median step time per stage (error bars: fastest and slowest timed step), per model; on
    gloo (``info``) the title says what gloo is here (loopback on the cores that compute)."""
    width = 0.8 / len(by_model)
    for j, (name, ps) in enumerate(by_model.items()):
        med = [statistics.median(p["step_s"]) * 1e3 for p in ps]
        err = [
            [m - min(p["step_s"]) * 1e3 for m, p in zip(med, ps)],
            [max(p["step_s"]) * 1e3 - m for m, p in zip(med, ps)],
        ]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(ps))]
        ax.bar(xs, med, width * 0.9, yerr=err, capsize=3, label=MODELS.get(name, name))
    _stage_ticks(ax, [p["stage"] for p in next(iter(by_model.values()))])
    _log_y(ax)
    ax.set_ylabel("step time, rank 0 (ms)")
    n = len(next(iter(by_model.values()))[0]["step_s"])
    note = f"\n{GLOO_NOTE}" if info is not None and info["backend"] == "gloo" else ""
    ax.set_title(f"step time: median of {n} steps (bars: min..max){note}", fontsize=10)
    ax.legend(fontsize=8)


def memory_figure(profiles: list[dict], info: dict):
    """:func:`memory_axes` on its own, titled with where it was measured."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    memory_axes(ax, profiles, info)
    note = f"\n{GLOO_MEMORY_NOTE}" if info["backend"] == "gloo" else ""
    where = f"{measured_where(info)} (memory: {meter_name(info)})"
    fig.suptitle(f"measured on {where}{note}", fontsize=10)
    fig.tight_layout()
    return fig


def comm_figure(by_model: dict[str, list[dict]], info: dict):
    """Volume (every model), bandwidth (TinyGPT if there) and step time, one step per stage."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    volume_axes(axes[0], by_model)
    bandwidth_axes(axes[1], by_model.get("gpt") or next(iter(by_model.values())), info)
    time_axes(axes[2], by_model, info)
    fig.suptitle(f"one training step per stage, measured on {measured_where(info)}")
    fig.tight_layout()
    return fig


def meter_name(info: dict) -> str:
    """What measured the memory of ``info``'s ranks, for a title."""
    return "CUDA allocator" if info["device"].startswith("cuda") else "CPU storage tracker"


# -- the paper's Table 1 and formula ---------------------------------------------------------------
def short_count(psi: float) -> str:
    """7.5e9 -> '7.5B', 1e12 -> '1T', 108608 -> '109K'."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if psi >= div:
            return f"{psi / div:.3g}{suffix}"
    return f"{psi:.0f}"


def table1_figure(rows: list[dict]):
    """``minizero.simulate.table1()`` rows: GB per rank against N_d, one panel per model size;
    lines: measured by simulate; crosses: the paper's printed Table 1."""
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for s in sorted({r["stage"] for r in rows}):
            mine = [r for r in rows if r["model"] == model and r["stage"] == s]
            xy = [r["world"] for r in mine], [r["gb"] for r in mine]
            ax.plot(*xy, "o-", color=f"C{s}", label=f"{s}: {STAGE_NAMES[s]}", ms=4)
        paper = [
            (r["world"], r["paper_gb"])
            for r in rows
            if r["model"] == model and r["paper_gb"] is not None and r["stage"] > 0
        ]
        if paper:
            ax.plot(*zip(*paper), "x", color="k", ms=7, label="paper's Table 1")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N_d (data-parallel ranks)")
        ax.set_ylabel("model states per rank (GB)")
        ax.set_title(f"Ψ = {model}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(
        "ZeRO Table 1 (mixed-precision Adam, K = 12), measured: minizero's stage code on the meta "
        "device under a fake process group of N_d ranks"
    )
    fig.tight_layout()
    return fig


def state_bars(psi: float, world: int, precision: str = "bf16", stage: int | None = None, ax=None):
    """The paper's formula for every stage at Ψ, N_d and precision; ``stage`` stands out."""
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4))
    parts = [paper_model_state_bytes(int(psi), world, s, precision) for s in STAGE_NAMES]
    unit = unit_of(max(sum(p.values()) for p in parts))
    for s, p in zip(STAGE_NAMES, parts):
        alpha = 1.0 if stage in (None, s) else 0.3
        labelled = s == (0 if stage is None else stage)  # a legend in full colour
        top = stack(ax, s, {c: p[c] / UNITS[unit] for c in CATS}, 0.6, labelled, alpha=alpha)
        text = format_bytes(sum(p.values()), unit)
        ax.text(s, top, text, ha="center", va="bottom", fontweight="bold" if s == stage else None)
    ax.set_xticks(list(STAGE_NAMES), [f"{s}: {STAGE_NAMES[s]}" for s in STAGE_NAMES])
    if stage is not None:
        ax.get_xticklabels()[list(STAGE_NAMES).index(stage)].set_fontweight("bold")
    ax.set_ylabel(f"model states per rank ({unit})")
    ax.set_ylim(0, max(sum(p.values()) for p in parts) / UNITS[unit] * 1.15)
    k = 8 if precision == "fp32" else 12
    title = f"the paper's formula: Ψ = {short_count(psi)}, N_d = {world}, {precision} (K = {k})"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig or ax.figure
