"""Every stage measured side by side: ``python -m minizero compare``. Lessons 05 and 06.

* ``workload(...)``: the seeded model and this rank's batches the measurements train on;
* ``profile_stages(...)`` runs inside every rank: for each stage it trains a few steps of a small
  model with ``minizero.parallelize`` and returns what one step costs there: model-state bytes
  (``model_state_bytes`` at the end of backward), the peak of the step (``MemoryMeter``: the CUDA
  allocator on GPUs, a storage tracker on CPUs), every collective (``CommLedger``) and step times;
* ``stage_table`` and ``compare_stages(nprocs)``: the instructor's one-command demo; prints the
  numbers and saves ``runs/stages.png`` (the figures of :mod:`minizero.course.plots`).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import format_bytes, paper_model_state_bytes
from minizero.course.plots import (
    MODELS,
    STAGE_NAMES,
    bandwidth_axes,
    measured_where,
    memory_axes,
    meter_name,
    time_axes,
    volume_axes,
)

MLP_SIZES = (32, 64, 64, 16)  # every layer's and gain's element count divides by 2, 4 and 8


def workload(name: str, rows: int, dev: torch.device, precision: str = "fp32"):
    """``(model, batch)``: a fresh seeded model (on the CPU) and ``batch(step)``, this rank's
    ``rows`` rows of that step's global batch on ``dev`` (float inputs in the working dtype of
    ``precision``). ``name``: "gpt" (TinyGPT tiny, tied embedding) or "mlp" (``models.MLP`` with
    sizes ``MLP_SIZES``, whose flat buffers need no padding at N = 2, 4, 8)."""
    from minizero.models import MLP, GPTConfig, TinyGPT, synthetic_batch
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
    ``bucket_cap_mb=0.02`` cuts TinyGPT tiny's 108,608 parameters into 7 buckets (sized in fp32, by
    torch DDP's rule), as 25 MiB buckets cut a model of a few hundred MiB: with one bucket for the
    whole model, stage 2
    would hold every gradient at once during backward.
    """
    from minizero.analysis.memory import MemoryMeter, model_state_bytes
    from minizero.launcher import rank_device
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
    cap = None if stage == 3 else bucket_cap_mb  # stage 3's buckets are its units
    net, opt = parallelize(module, stage, adamw, precision=precision, bucket_cap_mb=cap)

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
    with CommLedger() as ledger:
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
    Returns ``{"info": run_info(), "profiles": [...]}``."""
    from minizero.course.checks import run_info

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


# -- the instructor's demo -------------------------------------------------------------------------
def stage_table(by_model: dict[str, list[dict]], info: dict) -> str:
    """The numbers behind :func:`compare_stages`'s figure, one block per model, one row per stage:
    model states against the paper's formula, the step's peak, volume moved, collectives, median
    busbw and message size (marked ~ when latency-bound), and the median step time."""
    from minizero.analysis.ledger import LATENCY_BOUND

    out = [
        f"measured on {measured_where(info)} (memory: {meter_name(info)}), rank 0",
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
                f"{p['stage']}: {STAGE_NAMES[p['stage']]:<10}{states:>12}"
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

    from minizero.launcher import default_nprocs
    from minizero.launcher.progress import launch_with_progress

    nprocs = nprocs or default_nprocs()
    print(f"minizero compare: stages 0-3 on {nprocs} ranks, {precision}, TinyGPT tiny and an MLP, "
          f"{steps} timed steps each ...", flush=True)  # fmt: skip
    res = launch_with_progress(
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
    where = f"{measured_where(info)} (memory: {meter_name(info)})"
    fig.suptitle(f"minizero stages 0-3, measured on {where}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nsaved the figure to {path}")
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m minizero compare [--nprocs N] [--precision bf16] [--out runs/stages.png]``."""
    from minizero.tools.cli import Parser, add_nprocs, positive_int

    p = Parser(
        prog="minizero compare",
        description="Run every stage (0: DDP, 1-3: ZeRO) for a few steps on the same ranks, with "
        "TinyGPT and a small MLP; print per stage the model states against the paper's formula, "
        "the step's peak memory, the volume moved, the collectives' bandwidth and the step time; "
        "save the same as one figure.",
    )
    add_nprocs(p)
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
