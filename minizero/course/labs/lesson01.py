"""Lesson 01's experiments (``course/01_ddp.py``): what DDP sends, when, and at what cost.

``gradient_mean`` (section 1) the lesson's own: the ranks' local gradients against one process;
``naive_volume`` (section 2) naive DDP's all-reduces and volume per step;
``overlap_timelines`` (section 4) one step per bucket size seen by the profiler;
``ddp_variants`` (section 5) naive, bucketed and torch DDP: messages, volume, time;
``bucket_sweep`` (section 7) step time over ``bucket_cap_mb`` and what the α-β model needs.
Section 6 uses :func:`minizero.course.labs.common.model_states`.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero import collectives as C
from minizero.analysis import cost, timeline
from minizero.analysis.ledger import CommLedger
from minizero.bucket import make_buckets
from minizero.collectives import all_reduce, mark
from minizero.course import hint
from minizero.course.checks import lesson01
from minizero.course.labs import describe, rank_device, run_info, setup
from minizero.course.labs.common import GPT, PSI, gpt_batch, gpt_step
from minizero.course.labs.common import model_states as model_states  # section 6
from minizero.course.labs.common import show_model_states as show_model_states
from minizero.course.labs.saved import gradient_mean as gradient_mean  # section 1
from minizero.course.plots import widgets_available
from minizero.launcher.progress import launch_with_progress
from minizero.models import MLP, TinyGPT, synthetic_batch

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "C", "PSI", "all_reduce", "cost", "dist"]
__all__ += ["MLP", "lesson01", "make_buckets", "mark", "synthetic_batch"]


def show_gradient_mean(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{r['name']:18} ranks differ by up to {r['spread']:.2e};  "
            f"|mean over ranks - one process| = {r['error']:.1e}"
        )


def _naive_volume() -> dict:
    from minizero.naive_ddp import NaiveDDP

    torch.manual_seed(0)
    model = NaiveDDP(TinyGPT(GPT).to(rank_device()))
    with CommLedger() as ledger:
        gpt_step(model, 0)
    end = next(i for i, label in ledger.marks if label == "backward end")
    after = sum(r.index > end for r in ledger.records)
    return dict(calls=len(ledger.records), after_backward=after, volume=ledger.volume_elements)


def naive_volume(nprocs: int) -> dict:
    """Section 2: one step of TinyGPT under minizero's NaiveDDP, on rank 0: ``calls``
    (all-reduces), ``after_backward`` (how many were issued after backward ended), ``volume``."""
    return minizero.launch(_naive_volume, nprocs, verbose=False)[0]


def show_naive_volume(v: dict, psi: int = PSI) -> None:
    print(
        f"TinyGPT: Ψ = {psi:,}; naive DDP issued {v['calls']} all-reduces per step, "
        f"{v['after_backward']} of them after backward ended; volume {v['volume']:,} elements = "
        f"{v['volume'] / psi:.2f} Ψ"
    )


def _overlap(tl: dict) -> float:
    hidden, total, _ = timeline.hidden_fraction(tl)
    return hidden / max(total, 1e-9)


def _timelines(caps: list[float], steps: int, progress) -> dict:
    out = {}
    for cap in caps:
        torch.manual_seed(0)
        sgd = lambda p: torch.optim.SGD(p, lr=0.1)
        model, opt = minizero.parallelize(TinyGPT(GPT).to(rank_device()), 0, sgd, bucket_cap_mb=cap)
        seen = []
        for step in range(steps):
            seen.append(timeline.profile_step(lambda m=model, s=step: gpt_step(m, s)))
            opt.step()
            opt.zero_grad()
        seen = sorted(seen[1:], key=_overlap)  # step 0 warms up
        out[cap] = seen[len(seen) // 2]  # the step with the median overlap
        progress.tick()
    return dict(timelines=out, info=run_info())


def overlap_timelines(nprocs: int, caps: list[float], steps: int = 6) -> dict:
    """Section 4: minizero's DDP trains TinyGPT ``steps`` steps at each ``bucket_cap_mb`` of
    ``caps``, every step under the profiler; after the first, the step of median overlap is kept.
    Rank 0's ``{"timelines": {cap: timeline}, "info": ...}`` (:mod:`minizero.analysis.timeline`)."""
    return launch_with_progress(
        _timelines, nprocs, caps, steps, total=len(caps), desc="timelines", verbose=False
    )[0]


def draw_timeline(tl: dict, cap: float, ax) -> None:
    """One step on one axis: forward and backward, then each bucket's all-reduce (dotted: issued
    and waiting; bar: running), the dashed line at backward's last gradient."""
    m = tl["marks"]  # ms since forward start
    ax.barh(0, m["backward start"], color="tab:gray", label="forward")
    backward = m["backward end"] - m["backward start"]
    ax.barh(0, backward, left=m["backward start"], color="tab:blue", label="backward")
    for k, c in enumerate(tl["comm"], start=1):
        ax.plot([c["issued"], c["start"]], [k, k], color="tab:orange", lw=1, ls=":")
        ax.barh(k, c["end"] - c["start"], left=c["start"], color="tab:orange")
        ax.text(c["end"], k, f" {c['numel']:,} elements", va="center", fontsize=7)
    ax.axvline(m["backward end"], color="k", ls="--", lw=1)
    labels = ["compute"] + [f"bucket {k}" for k in range(len(tl["comm"]))]
    ax.set_yticks(range(len(tl["comm"]) + 1), labels)
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    ax.set_title(f"bucket_cap_mb={cap}: {len(tl['comm'])} buckets", fontsize=9)


def plot_timelines(run: dict) -> None:
    """Every bucket size's step, one panel each, on one time axis."""
    tls = run["timelines"]
    rows = [len(tl["comm"]) + 1 for tl in tls.values()]
    fig, axes = plt.subplots(
        len(tls),
        1,
        figsize=(10, 1.5 + 0.3 * sum(rows)),
        sharex=True,
        gridspec_kw={"height_ratios": rows},
        squeeze=False,
    )
    for (cap, tl), ax in zip(tls.items(), axes[:, 0], strict=True):
        draw_timeline(tl, cap, ax)
    axes[-1, 0].set_xlabel(
        "ms since forward start (dotted: issued, waiting to run; bar: running; "
        "dashed line: backward's last gradient)"
    )
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper right", fontsize=7)
    fig.suptitle(
        f"minizero DDP on TinyGPT, one step seen by the profiler on rank 0: {describe(run['info'])}"
    )
    fig.tight_layout()
    plt.show()


def show_overlap(run: dict) -> None:
    for cap, tl in run["timelines"].items():
        hidden, total, exposed = timeline.hidden_fraction(tl)
        print(
            f"bucket_cap_mb={cap:>5}: {len(tl['comm']):2d} all-reduces ran for "
            f"{total:6.1f} ms, {hidden / total:4.0%} of it while backward computed; the step then "
            f"waited {exposed:5.1f} ms for the rest"
        )


def timeline_widget(run: dict) -> None:
    """A dropdown over the bucket sizes, one step at a time (JupyterLab with ipywidgets only)."""
    if not widgets_available():  # never in a graded run: the figure above shows the same data
        return
    import ipywidgets

    def show(cap):
        fig, ax = plt.subplots(figsize=(10, 3))
        draw_timeline(run["timelines"][cap], cap, ax)
        ax.set_xlabel("ms since forward start")
        fig.suptitle(describe(run["info"]), fontsize=9)
        plt.show()

    caps = list(run["timelines"])
    ipywidgets.interact(show, cap=ipywidgets.Dropdown(options=caps, value=caps[0]))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _variants(cap: float, steps: int, progress) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from minizero.ddp import DDP
    from minizero.naive_ddp import NaiveDDP

    dev = rank_device()
    ids = [dev.index] if dev.type == "cuda" else None
    makers = {
        "naive (NaiveDDP)": lambda m: NaiveDDP(m),
        f"bucketed (DDP, {cap} MiB)": lambda m: DDP(m, bucket_cap_mb=cap),
        f"torch DDP ({cap} MiB)": lambda m: DistributedDataParallel(
            m, device_ids=ids, bucket_cap_mb=cap
        ),
    }
    rows = []
    for name, make in makers.items():
        torch.manual_seed(0)
        model = make(TinyGPT(GPT).to(dev))
        times = []
        for step in range(steps):
            _sync(dev)
            t = time.perf_counter()
            with CommLedger() as ledger:
                gpt_step(model, step)
            _sync(dev)
            times.append(time.perf_counter() - t)
            model.zero_grad()
        kept = sorted(times[2:])  # two warm-up steps
        rows.append(
            dict(
                name=name,
                step_s=kept[len(kept) // 2],
                calls=len(ledger.records),
                volume=ledger.volume_elements,
            )
        )
        progress.tick()
    return dict(rows=rows, info=run_info())


def ddp_variants(nprocs: int, bucket_cap_mb: float = 0.1, steps: int = 7) -> dict:
    """Section 5: naive DDP, minizero's DDP and torch DDP (both at ``bucket_cap_mb``) on TinyGPT:
    per step, the median time after 2 warm-up steps, the all-reduces the ledger saw and their
    volume (torch DDP does not go through minizero.collectives: 0, not counted)."""
    return launch_with_progress(
        _variants, nprocs, bucket_cap_mb, steps, total=3, desc="DDP variants", verbose=False
    )[0]


def show_variants(run: dict, psi: int = PSI) -> None:
    print(f"TinyGPT, Ψ = {psi:,}, {describe(run['info'])}")
    for r in run["rows"]:
        count, volume = r["calls"], r["volume"]
        msgs = f"{count:3d} all-reduces, {volume / psi:.2f} Ψ" if count else "(not counted)"
        print(f"  {r['name']:26} {r['step_s'] * 1e3:7.2f} ms/step   {msgs}")


@dataclass
class BucketSweep:
    """Section 7's measurements: per cap, the step (the slowest rank's), and rank 0's no_sync
    forward and backward and its buckets' bytes; the collectives sweep for the α-β fit."""

    caps: list[float]
    step_s: dict[float, float]  # forward + backward + the wait for the last bucket
    forward_s: dict[float, float]
    backward_s: dict[float, float]
    buckets: dict[float, list[int]]  # bytes of each bucket DDP made
    sweep: list[dict]  # {"op", "nbytes", "seconds"}: cost.fit's input
    info: dict


def _time_caps(caps: list[float], steps: int, progress) -> dict:
    from minizero.ddp import DDP

    dev = rank_device()
    out = {"sweep": cost.sweep(repeats=3), "caps": {}}
    out["info"] = run_info()
    progress.tick()
    median = lambda v: sorted(v[1:])[len(v[1:]) // 2]  # the first step warms up
    for cap in caps:
        torch.manual_seed(0)
        model = DDP(TinyGPT(GPT).to(dev), bucket_cap_mb=cap)
        fwd, bwd, times = [], [], []
        for step in range(steps):
            x, y = gpt_batch(step)
            with model.no_sync():  # the same model and hooks, no communication: the compute
                _sync(dev)
                t0 = time.perf_counter()
                loss = model(x, y)
                _sync(dev)
                t1 = time.perf_counter()
                loss.backward()
                _sync(dev)
                fwd.append(t1 - t0)
                bwd.append(time.perf_counter() - t1)
            model.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            gpt_step(model, step)  # forward + backward; backward ends when every bucket is summed
            _sync(dev)
            times.append(time.perf_counter() - t0)
            model.zero_grad()
        sizes = [sum(p.numel() * p.element_size() for p in b.params) for b in model.buckets]
        out["caps"][cap] = dict(
            step_s=median(times), forward_s=median(fwd), backward_s=median(bwd), buckets=sizes
        )
        progress.tick()
    return out


def bucket_sweep(nprocs: int, caps: list[float], steps: int = 5) -> BucketSweep:
    """Section 7: a collectives sweep (``cost.SIZES``: 4 KiB to 64 MiB) for the α-β fit, then
    minizero's DDP on TinyGPT at each ``bucket_cap_mb`` of ``caps``, alternating a step under
    ``no_sync()`` (forward and backward timed apart: T) and a normal step; medians after the first
    step."""
    per_rank = launch_with_progress(
        _time_caps, nprocs, caps, steps, total=1 + len(caps), desc="bucket sizes", verbose=False
    )
    r0 = per_rank[0]["caps"]
    return BucketSweep(
        caps=list(caps),
        step_s={c: max(r["caps"][c]["step_s"] for r in per_rank) for c in caps},
        forward_s={c: r0[c]["forward_s"] for c in caps},
        backward_s={c: r0[c]["backward_s"] for c in caps},
        buckets={c: r0[c]["buckets"] for c in caps},
        sweep=per_rank[0]["sweep"],
        info=per_rank[0]["info"],
    )


def show_bucket_sweep(s: BucketSweep, link: cost.Link, predicted: dict[float, float]) -> None:
    """The measured steps beside the model's, and where each finds its minimum."""
    fwd_ms = statistics.median(s.forward_s.values()) * 1e3
    bwd_ms = statistics.median(s.backward_s.values()) * 1e3
    print(
        f"{describe(s.info)}: α = {link.alpha * 1e6:.0f} µs, β = {link.beta / 1e9:.2f} GB/s; "
        f"no_sync forward {fwd_ms:.1f} ms, backward {bwd_ms:.1f} ms (medians)"
    )
    print(f"{'bucket_cap_mb':>14}{'buckets':>9}{'measured ms':>13}{'model ms':>10}")
    for c in s.caps:
        print(f"{c:>14}{len(s.buckets[c]):>9}{s.step_s[c] * 1e3:>13.2f}{predicted[c] * 1e3:>10.2f}")
    best, model_best = min(s.step_s, key=s.step_s.get), min(predicted, key=predicted.get)
    print(f"best bucket_cap_mb measured here: {best} MiB; the model's: {model_best} MiB")


def plot_bucket_sweep(s: BucketSweep, predicted: dict[float, float]) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.plot(s.caps, [s.step_s[c] * 1e3 for c in s.caps], "o-", label="measured")
    model = [predicted[c] * 1e3 for c in s.caps]
    ax.plot(s.caps, model, "s--", label="model: fwd + bwd + exposed")
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("forward + backward + wait (ms)")
    ax.set_title(f"DDP on TinyGPT, {describe(s.info)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    plt.show()
