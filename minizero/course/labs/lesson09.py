"""Lesson 09's experiments (``course/09_capstone.py``): nanoGPT's Shakespeare model at every stage.

``show_data`` (opening) the text the model learns;
``train_every_stage`` (section 2) one process in plain PyTorch, then the student's ``train`` at
each stage on real ranks, watched from outside (``lesson09.LoopWatch``) for memory and step time;
``differences`` / ``plot_curves`` (section 2) each stage's loss curve against one process's;
``show_states`` / ``plot_states`` (section 3) model states per rank beside the paper's formula,
and the step time;
``show_samples`` (section 4) what the trained model writes.
The loop the student's is compared with is ``minizero/tools/train.py`` (``python -m minizero
train``); the paper's formula is the lesson's own.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass, replace

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import format_bytes
from minizero.collectives import all_reduce
from minizero.course import hint
from minizero.course.checks import lesson09
from minizero.course.labs import describe, setup
from minizero.launcher import rank_device
from minizero.launcher.progress import launch_with_progress
from minizero.models import TinyGPT, count_params
from minizero.tools import shakespeare
from minizero.tools.train import (
    TrainConfig,
    eval_batches,
    generate,
    get_lr,
    make_optimizer,
    single_process,
    train_batch,
)
from minizero.tools.train_cli import STAGE_NAMES, curve

lab = sys.modules[__name__]
__all__ = ["hint", "lab", "minizero", "setup", "torch", "dist", "all_reduce", "lesson09"]
__all__ += ["shakespeare", "TrainConfig", "TinyGPT", "make_optimizer", "get_lr", "train_batch"]
__all__ += ["eval_batches", "rank_device", "contextlib"]

COLORS = ("tab:gray", "tab:blue", "tab:orange", "tab:green")  # stages 0-3, as lessons 02-07


def show_data(data: shakespeare.CharText, head: int = 120) -> None:
    """The opening: the split's sizes, the vocabulary, and the first ``head`` characters."""
    print(
        f"Tiny Shakespeare: {len(data.train):,} training and {len(data.val):,} validation "
        f"characters, a vocabulary of {data.vocab_size}: {data.chars!r}"
    )
    print(data.decode(data.train[:head]))


@dataclass
class StageRuns:
    """Section 2's runs of one ``cfg``: ``one``, one process's history (``single_process``, plain
    PyTorch); ``stages``, every rank's history per stage (:func:`run_rank`: "loss" and "evals" as
    the student's ``train`` returned them, "states", "step_s", "sample", "where")."""

    cfg: TrainConfig
    psi: int  # the model's parameters
    one: dict
    stages: dict[int, list[dict]]

    @property
    def where(self) -> dict:
        """Where the ranks ran: backend, device, world (``describe`` names it)."""
        return next(iter(self.stages.values()))[0]["where"]


def run_rank(train, cfg: TrainConfig, stage: int, progress=None) -> dict:
    """Inside a rank: the student's ``train(cfg, stage)`` under a ``LoopWatch`` (the model states
    at the second step, each step's time); rank 0 samples from the state dict it returned. Until
    ``train`` is written (its stub raises NotImplementedError), minizero's own loop runs."""
    from minizero.tools.report import measured_on
    from minizero.tools.train import train_rank

    try:
        with lesson09.LoopWatch(measure=True, progress=progress) as watch:
            out = train(cfg, stage)
    except NotImplementedError:  # in lessons/, until it is written: minizero's own loop
        return train_rank(replace(cfg, stage=stage)) | {"yours": False}
    h = {"loss": [float(v) for v in out["loss"]], "evals": out["evals"], "stage": stage}
    h |= {"states": watch.states, "step_s": watch.step_s, "where": measured_on()}
    if dist.get_rank() == 0 and cfg.sample_tokens:
        data = shakespeare.load()
        plain = TinyGPT(cfg.gpt(data.vocab_size))
        plain.load_state_dict({k: v.cpu() for k, v in out["state_dict"].items()})
        idx = torch.tensor([data.encode("\n")])  # nanoGPT's sample.py starts from a newline
        h["sample"] = data.decode(generate(plain, idx, cfg.sample_tokens, seed=cfg.seed)[0, 1:])
    return h


def train_every_stage(
    train, cfg: TrainConfig, nprocs: int, stages=(0, 1, 2, 3), timeout: float = 600.0
) -> StageRuns:
    """Section 2: ``cfg`` in one process (minizero's loop, one thread, as each rank has), then the
    student's ``train(cfg, stage)`` at each of ``stages`` on ``nprocs`` ranks, with a bar."""
    data = shakespeare.load()
    psi = count_params(TinyGPT(cfg.gpt(data.vocab_size)))
    one = single_process(cfg)
    runs = {
        s: launch_with_progress(run_rank, nprocs, train, cfg, s, total=cfg.max_iters,
                                desc=f"stage {s}", timeout=timeout, verbose=False)
        for s in stages
    }  # fmt: skip
    if not all(r[0].get("yours", True) for r in runs.values()):
        print(f"{getattr(train, '__name__', 'train')}() is not written yet (the exercise above): "
              "these runs are minizero's own loop, minizero/tools/train.py")  # fmt: skip
    return StageRuns(cfg=cfg, psi=psi, one=one, stages=runs)


def relative_differences(runs: StageRuns) -> dict[int, list[float]]:
    """Per stage, each iteration's |stage - one process| / one process, on the global batch's
    loss (the mean of the ranks' means: ``curve``)."""
    ref = runs.one["loss"]
    return {
        s: [abs(a - b) / b for a, b in zip(curve(results), ref, strict=True)]
        for s, results in runs.stages.items()
    }


def differences(runs: StageRuns) -> dict[int, float]:
    """Per stage, the largest relative difference from one process's curve."""
    return {s: max(rel) for s, rel in relative_differences(runs).items()}


def plot_curves(runs: StageRuns, tolerance: float) -> None:
    """Every stage's curve on one process's, and their relative difference (log scale); then
    each stage's largest difference and last val loss beside one process's."""
    rel = relative_differences(runs)
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax.plot(runs.one["loss"], color="k", lw=3, alpha=0.3, label="one process")
    for s, results in runs.stages.items():
        ax.plot(curve(results), lw=1, color=COLORS[s], label=f"stage {s}: {STAGE_NAMES[s]}")
        dx.semilogy([max(r, 1e-12) for r in rel[s]], lw=1, color=COLORS[s], label=f"stage {s}")
    dx.axhline(tolerance, color="r", ls=":", lw=1, label=f"tolerance {tolerance:.0%}")
    ax.set(xlabel="iteration", ylabel="training loss (nats per character)")
    ax.set_title("the loss of each global batch", fontsize=9)
    dx.set(xlabel="iteration", ylabel="|stage - one process| / one process")
    dx.set_title("relative difference from one process (equal: drawn at 1e-12)", fontsize=9)
    what = f"nanoGPT's CPU model on Tiny Shakespeare, Ψ = {runs.psi:,}, {runs.cfg.max_iters} iters"
    fig.suptitle(f"{what}: {describe(runs.where)}", fontsize=9)
    ax.legend(fontsize=8)
    dx.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # clear of the lines
    fig.tight_layout()
    plt.show()
    one_it, _, one_val = runs.one["evals"][-1]
    for s, results in runs.stages.items():
        it, _, val = results[0]["evals"][-1]
        print(
            f"stage {s}: largest relative difference from one process {max(rel[s]):.1e} "
            f"(tolerance {tolerance:.0%}); val loss at iteration {it}: {val:.4f} (one process: "
            f"{one_val:.4f})"
        )


def states_and_steps(runs: StageRuns) -> dict[int, tuple[int, float]]:
    """Section 3, per stage: the largest rank's model-state bytes at the end of a backward, and
    the median over iterations (the first left out) of the slowest rank's step time, in s."""
    out = {}
    for s, results in runs.stages.items():
        got = max(sum(r["states"].values()) for r in results)
        steps = [max(per) for per in zip(*(r["step_s"] for r in results), strict=True)]
        out[s] = (got, statistics.median(steps[1:] or steps))
    return out


def show_states(runs: StageRuns, paper: dict[int, float]) -> None:
    """Model states per rank, measured beside ``paper`` (``{stage: bytes per rank}``), as a
    ratio to stage 0's, and the median step time."""
    measured = states_and_steps(runs)
    ddp = measured[min(measured)][0]
    print(f"nanoGPT's CPU Shakespeare model, Ψ = {runs.psi:,}, fp32 AdamW, {describe(runs.where)}")
    print(f"{'stage':<22}{'states per rank':>16}{'paper':>12}{'/ DDP':>8}{'step (median)':>15}")
    for s, (got, step_s) in measured.items():
        row = f"{format_bytes(got):>16}{format_bytes(paper[s]):>12}{got / ddp:>8.2f}"
        print(f"{STAGE_NAMES[s]:<22}{row}{1e3 * step_s:>12.1f} ms")
    if runs.where["backend"] == "gloo":
        print(
            "(on gloo minizero's reduce-scatter receives into a buffer the size of its input: "
            "the stages' communication buffers, not counted here, are larger on gloo than on NCCL)"
        )


def plot_states(runs: StageRuns, paper: dict[int, float]) -> None:
    """Bars per stage: model states per rank (the paper's formula as a black tick), and the
    median step time."""
    measured = states_and_steps(runs)
    stages = list(measured)
    fig, (ax, tx) = plt.subplots(1, 2, figsize=(10, 3.4))
    colors = [COLORS[s] for s in stages]
    ax.bar(stages, [measured[s][0] / 2**20 for s in stages], color=colors, label="measured")
    ax.plot(stages, [paper[s] / 2**20 for s in stages], "k_", ms=28, mew=2, label="paper")
    ax.set(xlabel="stage", ylabel="model states per rank (MiB)")
    ax.set_title(f"Ψ = {runs.psi:,}, fp32 AdamW: (4 + 4 + 8)Ψ split by stage", fontsize=9)
    ax.legend(fontsize=8)
    tx.bar(stages, [1e3 * measured[s][1] for s in stages], color=colors)
    tx.set(xlabel="stage", ylabel="median step, slowest rank (ms)")
    tx.set_title(describe(runs.where), fontsize=9)
    for a in (ax, tx):
        a.set_xticks(stages)
    fig.tight_layout()
    plt.show()


def show_samples(runs: StageRuns) -> None:
    """The last stage's generated text, and which stages wrote the same."""
    texts = {s: results[0]["sample"] for s, results in runs.stages.items()}
    last = max(texts)
    print(f"after {runs.cfg.max_iters} iterations, stage {last}:\n{texts[last]}")
    same = [s for s in texts if texts[s] == texts[last]]
    print(f"\nthe same text from stages {same} (one seed, the same weights up to rounding)")
