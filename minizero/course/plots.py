"""Measurements and figures that compare the stages. Lessons 05 (05_all_stages) and 06 (06_myths).

* ``profile_stages(...)`` runs inside every rank: for each stage it trains a few steps of a small
  model with ``minizero.parallelize`` and returns what one step costs there: model-state bytes
  (``model_state_bytes`` at the end of backward), the peak of the step (``MemoryMeter``: the CUDA
  allocator on GPUs, a storage tracker on CPUs), every collective (``CommLedger``) and step times.
* ``memory_axes``, ``volume_axes``, ``bandwidth_axes``, ``time_axes``, ``table1_figure``,
  ``state_bars``: matplotlib figures of those numbers, each titled with where it was measured.
* ``budget_figure``: the memory budget of a step (``minizero.budget.step_budget``) at every stage,
  without and with activation checkpointing, against the GPU's memory.
* ``calculator()``: ipywidgets sliders (the model's shape, s, b, N, GPU memory, checkpointing,
  attention kernel) that redraw ``budget_figure``; built only where a widget front end can show
  it (``widgets_available()``).
* ``compare_stages(nprocs)``: the instructor's one-command demo; saves ``runs/stages.png``.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.memory import format_bytes, paper_model_state_bytes

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
STAGES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
MLP_SIZES = (32, 64, 64, 16)  # every layer's and gain's element count divides by 2, 4 and 8
MODELS = {"gpt": "TinyGPT", "mlp": "MLP"}  # workload key -> name in figures
GLOO_NOTE = "gloo: reduce_scatter runs as an all-reduce of the whole input"
GLOO_MEMORY_NOTE = "gloo: a reduce_scatter clones its input, one buffer more than NCCL (lesson 03)"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GB": 1e9}


# -- measuring, inside a rank ----------------------------------------------------------------------
def workload(name: str, rows: int, dev: torch.device, precision: str = "fp32"):
    """``(model, batch)``: a fresh seeded model (on the CPU) and ``batch(step)``, this rank's
    ``rows`` rows of that step's global batch on ``dev`` (float inputs in the working dtype of
    ``precision``). ``name``: "gpt" (TinyGPT tiny, tied embedding) or "mlp" (``models.MLP`` with
    sizes ``MLP_SIZES``, whose flat buffers need no padding at N = 2, 4, 8)."""
    from minizero.data import synthetic_batch
    from minizero.models import MLP, GPTConfig, TinyGPT
    from minizero.precision import resolve

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    if name not in MODELS:
        raise ValueError(f"workload is one of {list(MODELS)}, got {name!r}")
    if name == "gpt":
        model, kw = TinyGPT(GPTConfig.tiny()), {}
    else:
        model, kw = MLP(MLP_SIZES), dict(in_features=MLP_SIZES[0], out_features=MLP_SIZES[-1])
    dtype = resolve(precision).param_dtype

    def batch(step: int) -> tuple[torch.Tensor, ...]:
        xy = synthetic_batch(name, rows * world, step, rank=rank, world=world, device=dev, **kw)
        return tuple(t.to(dtype) if t.is_floating_point() else t for t in xy)

    return model, batch


def profile_stage(
    stage: int,
    model: str = "gpt",
    precision: str = "bf16",
    steps: int = 5,
    rows: int = 4,
    bucket_cap_mb: float = 0.02,
) -> dict:
    """Inside a rank: one stage's memory, communication and step time (see the module docstring).

    Step 0 is a warm-up (it creates the optimizer states; stage 3 records its module order, so
    from step 1 on it gathers a tied unit once per pass: the ledger shows the steady state).
    Step 1 runs under a ``MemoryMeter``; step 2 under a ``CommLedger``; ``steps`` more are timed.
    ``bucket_cap_mb=0.02`` cuts TinyGPT tiny's 212 KiB of bf16 gradients into about ten buckets,
    as 25 MB buckets cut a model of a few hundred MB: with one bucket for the whole model, stage 2
    would hold every gradient at once during backward.
    """
    from minizero.checks import rank_device
    from minizero.memory import MemoryMeter, model_state_bytes
    from minizero.models import count_params
    from minizero.parallelize import parallelize

    dev = rank_device()
    gc.collect()  # the previous stage's tensors (profile_stages froze what the rank inherited)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    module, batch = workload(model, rows, dev, precision)
    psi = count_params(module)
    # fused: one kernel per step, no full-size temporaries (the default, foreach, allocates some)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)
    net, opt = parallelize(module, stage, adamw, precision=precision, bucket_cap_mb=bucket_cap_mb)

    def step(s: int) -> None:
        net(*batch(s)).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    with MemoryMeter(net, opt, device=dev) as meter:
        meter.reset_peak()
        net(*batch(1)).backward()
        states = model_state_bytes(net, opt)  # every model state is alive here
        opt.step()
        opt.zero_grad()
        mem = meter.mark("step")
    with C.CommLedger() as ledger:
        step(2)
    times = []
    for s in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step(3 + s)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    keep = ("op", "numel", "nbytes", "seconds", "busbw", "async_op", "tag")
    records = [{k: getattr(r, k) for k in keep} for r in ledger.records]  # picklable, small
    return dict(
        stage=stage,
        model=model,
        precision=precision,
        psi=psi,
        world=net.world,
        states=states,
        peak=mem["peak"],
        at_peak=mem["at_peak"],
        records=records,
        volume=ledger.volume_elements,
        step_s=times,
    )


def profile_stages(
    models=("gpt",), stages=(0, 1, 2, 3), precision: str = "bf16", steps: int = 5, progress=None
) -> dict:
    """Inside a rank: ``profile_stage`` for every model and stage; ``progress.tick()`` after each.
    Returns ``{"info": checks.run_info(), "profiles": [...]}``."""
    from minizero.checks import run_info

    # A rank forked from a notebook kernel inherits the kernel's objects; collecting them here could
    # run their finalisers (sockets, threads' locks) in this process. Freeze them out of reach.
    gc.freeze()
    out = []
    for m in models:
        for s in stages:
            out.append(profile_stage(s, m, precision, steps))
            if progress is not None:
                progress.tick()
    return dict(info=run_info(), profiles=out)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- drawing ---------------------------------------------------------------------------------------
def _unit(n: float) -> str:
    """The paper's GB (1e9 bytes) at scale; binary units for the small models measured here."""
    if n >= 1e9:
        return "GB"
    return next((u for u in ("MiB", "KiB") if n >= _UNITS[u]), "B")


def _where(info: dict) -> str:
    from minizero.checks import describe

    return describe(info)


def _peak_parts(p: dict) -> dict[str, float]:
    """What the step's peak held beyond the model states: communication buffers (stage 2's
    buckets, stage 3's gathered layers; CPU only: the split at the peak) and the rest."""
    rest = max(p["peak"] - sum(p["states"].values()), 0)
    comm = min((p["at_peak"] or {}).get("comm", 0), rest)
    return {"comm": comm, "other": rest - comm}


def _stack(ax, x: float, parts: dict[str, float], width: float, labelled: bool, alpha=1.0) -> float:
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
    ax.set_xticks(range(len(stages)), [f"{s}: {STAGES[s]}{suffix}" for s in stages])


def memory_axes(ax, profiles: list[dict], info: dict) -> None:
    """Per stage, two stacked bars: measured (model states at the end of backward, then the rest
    of the step's peak, hatched) and the paper's formula for the same Ψ, N and precision."""
    psi, world, prec = profiles[0]["psi"], profiles[0]["world"], profiles[0]["precision"]
    unit = _unit(max(p["peak"] for p in profiles))
    for i, p in enumerate(profiles):
        mine = {k: v / _UNITS[unit] for k, v in {**p["states"], **_peak_parts(p)}.items()}
        states = sum(mine[c] for c in CATS)
        top = _stack(ax, i - 0.2, mine, 0.38, labelled=i == 0)
        ax.text(i - 0.2, top, f"{states:.2f}\npeak {top:.2f}", ha="center", va="bottom", fontsize=7)
        paper = paper_model_state_bytes(psi, world, p["stage"], prec)
        top = _stack(ax, i + 0.2, {k: v / _UNITS[unit] for k, v in paper.items()}, 0.38, False)
        ax.text(i + 0.2, top, f"{top:.2f}", ha="center", va="bottom", fontsize=7)
    _stage_ticks(ax, [p["stage"] for p in profiles], "\nmeasured | paper")
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_ylim(0, max(p["peak"] for p in profiles) / _UNITS[unit] * 1.15)
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
                moved[r["op"]] += C.PAPER_VOLUME[r["op"]] * r["numel"] / p["psi"]
            x = i - 0.4 + width * (j + 0.5)
            top = _stack(ax, x, moved, width * 0.9, labelled=i == 0 and j == 0)
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
    from minizero.bench import LATENCY_BOUND

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
    gloo (``info``) the title says that a reduce-scatter costs an all-reduce there."""
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
    fig.suptitle(f"measured on {_where(info)} (memory: {_meter(info)}){note}", fontsize=10)
    fig.tight_layout()
    return fig


def comm_figure(by_model: dict[str, list[dict]], info: dict):
    """Volume (every model), bandwidth (TinyGPT if there) and step time, one step per stage."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    volume_axes(axes[0], by_model)
    bandwidth_axes(axes[1], by_model.get("gpt") or next(iter(by_model.values())), info)
    time_axes(axes[2], by_model, info)
    fig.suptitle(f"one training step per stage, measured on {_where(info)}")
    fig.tight_layout()
    return fig


def _meter(info: dict) -> str:
    return "CUDA allocator" if info["device"].startswith("cuda") else "CPU storage tracker"


# -- the paper's Table 1 and the calculator ------------------------------------------------------
def _psi(psi: float) -> str:
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
            ax.plot(*xy, "o-", color=f"C{s}", label=f"{s}: {STAGES[s]}", ms=4)
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
    parts = [paper_model_state_bytes(int(psi), world, s, precision) for s in STAGES]
    unit = _unit(max(sum(p.values()) for p in parts))
    for s, p in zip(STAGES, parts):
        alpha = 1.0 if stage in (None, s) else 0.3
        labelled = s == (0 if stage is None else stage)  # a legend in full colour
        top = _stack(ax, s, {c: p[c] / _UNITS[unit] for c in CATS}, 0.6, labelled, alpha=alpha)
        text = format_bytes(sum(p.values()), unit)
        ax.text(s, top, text, ha="center", va="bottom", fontweight="bold" if s == stage else None)
    ax.set_xticks(list(STAGES), [f"{s}: {STAGES[s]}" for s in STAGES])
    if stage is not None:
        ax.get_xticklabels()[list(STAGES).index(stage)].set_fontweight("bold")
    ax.set_ylabel(f"model states per rank ({unit})")
    ax.set_ylim(0, max(sum(p.values()) for p in parts) / _UNITS[unit] * 1.15)
    k = 8 if precision == "fp32" else 12
    ax.set_title(
        f"the paper's formula: Ψ = {_psi(psi)}, N_d = {world}, {precision} (K = {k})", fontsize=10
    )
    ax.legend(fontsize=8)
    return fig or ax.figure


def widgets_available() -> bool:
    """Whether this kernel has a front end that shows widgets: a Jupyter server started it (it
    sets ``JPY_SESSION_NAME``), unless ``MINIZERO_WIDGETS=0``; ``MINIZERO_WIDGETS=1`` forces it
    (other front ends). nbclient, nbval and the grader set neither: graded runs build no widget."""
    force = os.environ.get("MINIZERO_WIDGETS")
    if force in ("0", "1"):
        return force == "1"
    return bool(os.environ.get("JPY_SESSION_NAME"))


def budget_axes(ax, rows: list[tuple[str, dict[str, float]]], capacity_gb: float, title: str):
    """Stacked bars of :func:`minizero.budget.step_budget` parts (GB), one per ``(label, parts)``,
    and a line at the GPU's memory; each bar says its total, red where it does not fit."""
    for i, (_, parts) in enumerate(rows):
        top = _stack(ax, i, {k: v / 1e9 for k, v in parts.items()}, 0.7, labelled=i == 0)
        fits = top <= capacity_gb
        ax.text(i, top, f"{top:.1f}", ha="center", va="bottom", fontsize=7,
                color="k" if fits else "C3", fontweight=None if fits else "bold")  # fmt: skip
    ax.axhline(capacity_gb, color="C3", lw=1, ls="--")
    ax.text(len(rows) - 0.5, capacity_gb, f" {capacity_gb:g} GB", color="C3", va="bottom",
            ha="right", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylabel("bytes per rank at the peak (GB)")
    top = max(sum(p.values()) for _, p in rows) / 1e9
    ax.set_ylim(0, max(top, capacity_gb) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def budget_figure(
    cfg,
    world: int,
    *,
    micro_batch: int = 1,
    capacity_gb: float = 80,
    flash: bool = True,
    dropout: bool = False,
    logit_bytes: float = 6.0,
    stage: int | None = None,
    checkpointing: bool | None = None,
    where: str = "",
    ax=None,
):
    """:func:`budget_axes` for ``TinyGPT(cfg)`` at every stage, without and with activation
    checkpointing (``stage`` / ``checkpointing`` narrow it). ``where``: where the constants were
    measured, for the title."""
    import matplotlib.pyplot as plt

    from minizero.budget import gpt_params, step_budget

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4.5))
    rows = []
    for ck in (False, True) if checkpointing is None else (checkpointing,):
        for s in STAGES if stage is None else (stage,):
            parts = step_budget(cfg, world=world, stage=s, micro_batch=micro_batch,
                                checkpointing=ck, flash=flash, dropout=dropout,
                                logit_bytes=logit_bytes)  # fmt: skip
            rows.append((f"{s}: {STAGES[s]}" + ("\nckpt" if ck else ""), parts))
    attn = "flash attention" if flash else "scores stored" + (", dropout" if dropout else "")
    title = (
        f"Ψ = {_psi(gpt_params(cfg))} (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, "
        f"V={cfg.vocab_size}), s={cfg.block_size}, b={micro_batch}, N={world}, bf16 AdamW, {attn}"
    )
    if where:
        title += f"\nconstants measured on {where}"
    budget_axes(ax, rows, capacity_gb, title)
    return fig or ax.figure


def calculator(cfg=None, world: int = 8, micro_batch: int = 1, capacity_gb: float = 80):
    """Sliders that redraw :func:`budget_figure`: the model's shape, sequence length, micro-batch,
    ranks, the GPU's memory, activation checkpointing and the attention kernel (ipywidgets)."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from minizero.models import GPTConfig

    cfg = cfg or GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    log2 = lambda v, lo, hi, d: W.SelectionSlider(
        options=[2**k for k in range(lo, hi + 1)], value=v, description=d
    )
    controls = dict(
        n_layer=W.IntSlider(value=cfg.n_layer, min=1, max=128, description="layers L"),
        n_embd=log2(cfg.n_embd, 6, 15, "width h"),
        n_head=log2(cfg.n_head, 0, 8, "heads a"),
        vocab_size=W.IntSlider(cfg.vocab_size, min=256, max=262144, step=256, description="V"),
        block_size=log2(cfg.block_size, 6, 17, "sequence s"),
        micro_batch=log2(micro_batch, 0, 6, "micro-batch b"),
        world=log2(world, 0, 12, "ranks N"),
        capacity_gb=W.FloatSlider(value=capacity_gb, min=8, max=192, step=8, description="GPU GB"),
        checkpointing=W.ToggleButtons(
            options=[("both", None), ("off", False), ("on", True)], description="checkpoint"
        ),
        flash=W.Checkbox(value=True, description="flash attention (no s² scores)"),
    )
    out = W.Output()

    def redraw(_=None) -> None:
        v = {k: w.value for k, w in controls.items()}
        with out:
            out.clear_output(wait=True)
            if v["n_embd"] % v["n_head"]:
                print(f"width h = {v['n_embd']} must be a multiple of heads a = {v['n_head']}")
                return
            keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
            shape = GPTConfig(**{k: v[k] for k in keys})
            budget_figure(shape, v["world"], micro_batch=v["micro_batch"],
                          capacity_gb=v["capacity_gb"], flash=v["flash"],
                          checkpointing=v["checkpointing"])  # fmt: skip
            plt.show()

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    return W.VBox([*controls.values(), out])


# -- the instructor's demo -------------------------------------------------------------------------
def stage_table(by_model: dict[str, list[dict]], info: dict) -> str:
    """The numbers behind :func:`compare_stages`'s figure, one block per model, one row per stage:
    model states against the paper's formula, the step's peak, volume moved, collectives, median
    busbw and message size (marked ~ when latency-bound), and the median step time."""
    from minizero.bench import LATENCY_BOUND

    out = [
        f"measured on {_where(info)} (memory: {_meter(info)}), rank 0",
        "states: params + grads + optimizer at the end of backward; paper: its formula for the "
        "same Ψ, N, precision",
        f"~: median message under {format_bytes(LATENCY_BOUND)}: its busbw is latency-bound, "
        "per-call cost, not the link's bandwidth",
        "   (python -m minizero bench collectives measures bandwidth up to 64 MiB)",
    ]
    for model, profiles in by_model.items():
        p0 = profiles[0]
        out.append(f"\n{MODELS.get(model, model)}, Ψ = {p0['psi']:,}, {p0['precision']}, AdamW, "
                   f"{p0['world']} ranks")  # fmt: skip
        out.append(f"{'stage':<13}{'states':>12}{'paper':>12}{'peak':>12}{'moved':>9}"
                   f"{'calls':>6}{'busbw GB/s':>12}{'message':>11}{'step ms':>9}")  # fmt: skip
        for p in profiles:
            paper = sum(paper_model_state_bytes(p["psi"], p["world"], p["stage"],
                                                p["precision"]).values())  # fmt: skip
            timed = [r for r in p["records"] if r["seconds"]]
            bw = statistics.median(r["busbw"] for r in timed) / 1e9 if timed else float("nan")
            size = statistics.median(r["nbytes"] for r in timed) if timed else 0
            mark = "~" if size < LATENCY_BOUND else " "
            states = format_bytes(sum(p["states"].values()))
            out.append(
                f"{p['stage']}: {STAGES[p['stage']]:<10}{states:>12}"
                f"{format_bytes(paper):>12}{format_bytes(p['peak']):>12}"
                f"{p['volume'] / p['psi']:>8.3f}Ψ{len(p['records']):>6}{mark:>3}{bw:>9.4f}"
                f"{format_bytes(size):>11}{statistics.median(p['step_s']) * 1e3:>9.1f}"
            )
    return "\n".join(out)


def compare_stages(
    nprocs: int | None = None,
    *,
    precision: str = "bf16",
    steps: int = 10,
    path: str | Path = "runs/stages.png",
):
    """Run every stage on ``nprocs`` ranks (TinyGPT and an MLP), print the numbers
    (:func:`stage_table`) and save one figure: memory per rank against the paper, volume per step,
    bandwidth, step time. Returns the figure."""
    import matplotlib.pyplot as plt
    import torch._dynamo  # noqa: F401  (torch.optim imports it; once here, not once per rank)

    from minizero import checks

    nprocs = nprocs or checks.default_nprocs()
    print(f"minizero compare: stages 0-3 on {nprocs} ranks, {precision}, TinyGPT tiny and an MLP, "
          f"{steps} timed steps each ...", flush=True)  # fmt: skip
    res = checks.launch_with_progress(
        profile_stages, nprocs, models=("gpt", "mlp"), precision=precision, steps=steps,
        total=8, desc="stages", verbose=False,
    )[0]  # fmt: skip
    info, profiles = res["info"], res["profiles"]
    by_model = {m: [p for p in profiles if p["model"] == m] for m in ("mlp", "gpt")}
    print(stage_table({"gpt": by_model["gpt"], "mlp": by_model["mlp"]}, info))
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    memory_axes(axes[0, 0], by_model["gpt"], info)
    volume_axes(axes[0, 1], by_model)
    bandwidth_axes(axes[1, 0], by_model["gpt"], info)
    time_axes(axes[1, 1], by_model, info)
    fig.suptitle(f"minizero stages 0-3, measured on {_where(info)} (memory: {_meter(info)})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nsaved the figure to {path}")
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero compare [--nprocs N] [--precision bf16] [--out runs/stages.png]``."""
    from minizero.cli import Parser, positive_int

    p = Parser(
        prog="minizero compare",
        description="Run every stage (0: DDP, 1-3: ZeRO) for a few steps on the same ranks, with "
        "TinyGPT and a small MLP; print per stage the model states against the paper's formula, "
        "the step's peak memory, the volume moved, the collectives' bandwidth and the step time; "
        "save the same as one figure.",
    )
    p.add_argument(
        "--nprocs",
        type=positive_int,
        default=None,
        help="ranks (default: one per GPU with 2 or more GPUs, else 2 on the CPU)",
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp16", "fp32"],
        help="precision policy of every stage (default bf16)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=10, help="timed steps per stage (default 10)"
    )
    p.add_argument("--out", default="runs/stages.png", help="where to save the figure (PNG)")
    a = p.parse_args(argv)  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    compare_stages(a.nprocs, precision=a.precision, steps=a.steps, path=a.out)
    return 0
