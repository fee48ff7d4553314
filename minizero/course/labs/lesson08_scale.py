"""Lesson 08's scenario at scale (``course/08_beyond_one_node.py``, sections 6, 7 and exercise 4):
the tables, figure and calculator of :mod:`minizero.analysis.scenario`'s predictions.

``show_scale`` / ``plot_scale`` (section 6) every configuration's step and memory per rank;
``calculator`` (section 7) the same under sliders, where a widget front end runs;
``show_choice`` / ``show_sensitivity`` (exercise 4) the student's decision and its reason, and what
changes it.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt

from minizero.analysis import budget, scenario
from minizero.analysis.scenario import GB, Question, Scenario, plan_name
from minizero.analysis.simulate import short_psi
from minizero.course import plots
from minizero.models import GPTConfig

OLD_MODEL = ("ZeRO-1", "ZeRO-1 HSDP", "ZeRO-3")  # the rows the one-NIC model is shown for


def gb(b: float) -> str:
    return f"{b / GB:.1f} GB"  # lesson 05's GB: 10^9 bytes


def _table(rows: list[dict], sc: Scenario) -> None:
    print(
        f"{'configuration':<16}{'ckpt':>5}{'step s':>8}{'overlapped':>11}{'comm inter':>11}"
        f"{'comm intra':>11}{'of which α':>11}{'model states':>14}{'no ckpt':>10}"
        f"{'memory/rank':>13}"
    )
    for r in rows:
        flag = "yes" if r["ckpt"] else "no"
        fits = "" if r["memory"] <= sc.room else "  (does not fit)"
        print(
            f"{r['name']:<16}{flag:>5}{r['step_s']:>8.2f}{r['overlapped_s']:>11.2f}"
            f"{r['inter']:>11.3f}{r['intra']:>11.3f}{r['alpha']:>11.3f}{gb(r['states']):>14}"
            f"{gb(r['plain']):>10}{gb(r['memory']):>13}{fits}"
        )


def show_scale(rows: list[dict], sc: Scenario, model: GPTConfig, candidates: dict) -> None:
    """Section 6: the scenario, each configuration's row, the compute per step, and the network
    seconds the one-NIC model gave (``scenario.one_nic_network_s``)."""
    psi = budget.gpt_params(model)
    print(
        f"{short_psi(psi)} parameters, {sc.nodes} nodes × {sc.gpus}, {sc.micro} micro-batches of "
        f"{sc.seqs} × {model.block_size} tokens per GPU, {gb(sc.room)} per rank (assumed scenario)"
    )
    _table(rows, sc)
    plain, ckpt = (scenario.step_compute_s(model, sc, c) for c in (False, True))
    weights_only = 6 * psi * sc.seqs * model.block_size * sc.micro / (sc.tflops * 1e12)
    print(
        f"compute per step: {plain:.2f} s, {ckpt:.2f} s with checkpointing (6Ψ per token alone: "
        f"{weights_only:.2f} s)"
    )
    old = [f"{n} {scenario.one_nic_network_s(model, sc, candidates[n]):.2f}" for n in OLD_MODEL]
    print(
        "the old model, a crossing ring at one NIC's speed: network s per step, " + ", ".join(old)
    )


def plot_scale(rows: list[dict], sc: Scenario) -> None:
    """Memory per rank (without checkpointing, and what the row runs with) against the room a
    GPU has; the step's seconds, compute and communication."""
    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 4.4), sharey=True)
    ys = range(len(rows))[::-1]
    mem.barh(
        ys,
        [r["plain"] / GB for r in rows],
        color="#DDDDDD",
        hatch="//",
        label="without checkpointing",
    )
    mem.barh(
        ys,
        [r["memory"] / GB for r in rows],
        color="tab:blue",
        height=0.5,
        label="as run (checkpointing where needed)",
    )
    mem.axvline(sc.room / GB, color="k", ls="--", lw=1, label=f"room: {gb(sc.room)}")
    mem.set_xlim(0, 1.1 * max(r["plain"] for r in rows) / GB)
    mem.set_yticks(list(ys), [r["name"] + (" (ckpt)" if r["ckpt"] else "") for r in rows])
    mem.set_xlabel("GB per rank")
    mem.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    comm = [r["inter"] + r["intra"] for r in rows]
    compute = [r["step_s"] - c for r, c in zip(rows, comm, strict=True)]
    step.barh(ys, compute, color="tab:gray", label="compute")
    step.barh(ys, comm, left=compute, color="tab:red", label="communication (no overlap)")
    step.set_xlim(0, 1.1 * max(r["step_s"] for r in rows))
    step.set_xlabel("seconds per step")
    step.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(f"{sc.nodes} nodes × {sc.gpus} GPUs of {sc.gpu_GB:g} GB (a scenario)", fontsize=9)
    fig.tight_layout()
    plt.show()


def calculator(model: GPTConfig, candidates: dict, sc: Scenario) -> None:
    """Section 7: the table under sliders over every input, where a widget front end runs; else
    (a graded run, no front end) the table of ``sc``."""

    def table(every_microbatch: bool = True, **inputs) -> None:
        changed = Scenario(**inputs)
        _table(scenario.predict_rows(model, changed, candidates, every_microbatch), changed)

    if not plots.widgets_available():
        return table(**dataclasses.asdict(sc))
    import ipywidgets as widgets
    from IPython.display import display

    sliders = {k: _slider(widgets, k, getattr(sc, k), r) for k, r in RANGES.items()}
    display(widgets.interactive(table, every_microbatch=True, **sliders))


RANGES = dict(  # the calculator's sliders: (min, max), or the choices
    nodes=(1, 256),
    gpus=[1, 2, 4, 8],
    nvlink_GBps=(10.0, 900.0),
    nic_GBps=(1.0, 100.0),
    nics=(1, 8),
    alpha_us=(1.0, 100.0),
    seqs=(1, 16),
    micro=(1, 32),
    tflops=(50.0, 1000.0),
    gpu_GB=(16.0, 192.0),
    headroom_GB=(0.0, 20.0),
)


def _slider(widgets, name: str, value, bounds):
    if isinstance(bounds, list):
        return widgets.Dropdown(options=bounds, value=value, description=name)
    kind = widgets.IntSlider if isinstance(value, int) else widgets.FloatSlider
    return kind(value=value, min=bounds[0], max=bounds[1], description=name)


def show_choice(choose, q: Question) -> tuple | None:
    """Exercise 4's decision on ``q``: the plan and its reason; None (and a note) until
    ``choose`` is written."""
    try:
        plan, reason = choose(q)
    except NotImplementedError:
        print("(write choose() in exercise 4 first)")
        return None
    print(f"with {gb(q.memory)} per rank ({gb(q.activations)} of activations): run "
          f"{plan_name(plan)}, decided by {reason}")  # fmt: skip
    return plan, reason


def show_sensitivity(sens: dict) -> None:
    """``scenario.sensitivity``'s picks, "=" where an input's change leaves the answer."""
    pick = sens["pick"]
    mark = lambda p: "=" if p == pick else str(p)
    w = max(18, *(len(str(p)) + 2 for _, picks in sens["inputs"].values() for p in picks))
    heads = "".join(f"{'× ' + format(f, 'g'):>{w}}" for f in sens["factors"])
    print(f"{'input':14}{'value':>8}{heads}")
    for key, (value, picks) in sens["inputs"].items():
        print(f"{key:14}{value:>8g}" + "".join(f"{mark(p):>{w}}" for p in picks))
    once = sens["replicate_once"]
    print(f"HSDP's replicate all-reduce once per step (MiCS; FSDP2's switch): {once}")
