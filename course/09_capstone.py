# %% [markdown]
# # Lesson 09 — Capstone: a real model learns real text, at every stage
#
# Every lesson so far trained on synthetic batches and proved that each stage computes what one
# process computes. Here a model *learns* something: nanoGPT's character-level Shakespeare model
# (github.com/karpathy/nanoGPT) as its README trains it on a CPU. nanoGPT's "baby GPT" is
# `config/train_shakespeare_char.py` (6 layers, n_embd 384, a context of 256 characters, for a
# GPU); the README's CPU command line shrinks it to 4 layers, 4 heads, n_embd 128, a context of
# 64 characters, a batch of 12, 2,000 iterations, AdamW with a warm-up and a cosine decay,
# dropout 0. Its README reports a validation loss of 1.88 "in about ~3 minutes" and samples that
# look like Shakespeare.
#
# `python -m minizero train` is that training script with `minizero.parallelize` in it, at any
# stage, on gloo CPU ranks or one rank per GPU over NCCL (the full 2,000 iterations take minutes:
# run it from a terminal, section 5). This lesson trains the same model for a short budget on
# each stage, puts the four curves on one axis beside one process's, and measures memory per
# rank and step time. You write the one piece of nanoGPT's loop that distributed training
# changes: the evaluation.
#
#     python -m minizero grade my-lessons/09_capstone.ipynb
#
# A check whose ranks need longer on a slow or busy machine: `python -m minizero grade
# --check-timeout 600 ...`, or `MINIZERO_CHECK_TIMEOUT=600` set where `jupyter lab` starts.

# %%
from minizero.course.labs.lesson09 import *  # torch, dist, all_reduce, hint, lab, lesson09, ...

NPROCS, INFO = setup()
DATA = shakespeare.load()  # the characters, their vocabulary, the train and val splits
lab.show_data(DATA)

# %% [markdown]
# ## 1. What changes in nanoGPT's loop
#
# nanoGPT's `train.py` is written for torch DDP. Its data loader draws each rank's batch with a
# seed offset by the rank; minizero's draws the *global* batch of step `it` the same on every
# rank and keeps this rank's rows (`minizero/tools/shakespeare.py`), so 1, 2 or 3 ranks train on
# exactly the same rows and their curves can be compared point by point. The model and
# optimizer go through `minizero.parallelize(model, stage, optimizer)`; the learning-rate
# schedule sets `param_group["lr"]` on the optimizer it returns, as nanoGPT does; gradient
# clipping is `torch.nn.utils.clip_grad_norm_`, which minizero makes global where each rank holds
# a shard of the gradients.
#
# The evaluation is different. nanoGPT evaluates on the master process only
# (`if iter_num % eval_interval == 0 and master_process:` in its `train.py`), on that process's
# own random batches. Under torch DDP that works: nanoGPT's model has no buffers to broadcast, so
# its forward communicates nothing. **At ZeRO stage 3 a forward is collective**: each unit's
# parameters are all-gathered from every rank before it runs. Rank 0 evaluating alone waits for
# ranks that never come, until the process group's timeout ends the run. So every rank
# evaluates: its share of each eval batch, then the ranks average.
#
# ## Exercise — the eval loss, averaged over the ranks
#
# Write `estimate_loss(model, batches, group=None)`, called on every rank of `group` with
# `batches`, a list of `(x, y)`: this rank's rows of each eval batch. Return, as a Python float,
# the mean loss over **every rank's rows**, the same number on every rank. Every rank holds the
# same number of rows, so that is the mean over the ranks of each rank's mean: compute this
# rank's mean over its batches, `all_reduce` it over `group`
# (`minizero.collectives.all_reduce(t, group=group)`, in place, it **sums**) and divide by the
# group's size. Keep nanoGPT's habits: no graph (`@torch.no_grad()`), `model.eval()` while
# evaluating (dropout off) and `model.train()` before returning.


# %%
@torch.no_grad()
def estimate_loss(model, batches, group=None) -> float:
    """The mean loss over every rank's ``batches``; the same value on every rank of ``group``."""
    # BEGIN SOLUTION
    # TODO: the mean loss over every rank's rows, as a float, the same on every rank of group
    # HINT: Every rank holds the same number of rows, so the mean over every row is the mean over
    #       the ranks of each rank's own mean. Evaluate as nanoGPT does: model.eval() first
    #       (dropout off), model.train() before returning; @torch.no_grad() is given.
    # HINT: This rank's mean: torch.stack([model(x, y) for x, y in batches]).mean(), a 0-d
    #       tensor. all_reduce(t, group=group) sums it over the group's ranks, in place: divide
    #       by the group's size, dist.get_world_size(group), not the world's.
    # HINT: model.eval()
    #       mean = torch.stack([model(x, y) for x, y in batches]).mean()
    #       all_reduce(mean, group=group)
    #       model.train()
    #       return ...  # a float: the sum over the ranks / their number
    model.eval()
    mean = torch.stack([model(x, y) for x, y in batches]).mean()  # 0-d: this rank's mean
    all_reduce(mean, group=group)  # the sum of the ranks' means
    model.train()
    return mean.item() / dist.get_world_size(group)
    # END SOLUTION


# %% check="estimate_loss"
# A small GPT wrapped at stage 0 and at stage 3 (a forward gathers) on max(NPROCS, 3) ranks: your
# value on every rank against minizero's estimate_loss and one process on the whole batches;
# no_grad, eval mode, left training; then on the subgroup [0, 1] of the 3 with group=...
lesson09.check_estimate_loss(estimate_loss, NPROCS)

# %% [markdown]
# ## 2. Four stages, one curve
#
# nanoGPT's CPU configuration, for a short budget: 40 iterations with the warm-up
# shortened to 5 (so the loss moves), an evaluation every 10 iterations on one fixed batch per
# split. First one process in plain PyTorch (no minizero, no process group, one thread as each
# rank has), then each stage on `NPROCS` ranks; the runs use minizero's own `estimate_loss`, the
# function you just wrote. (The loss over the whole validation split, which the full run of
# section 5 prints at its end, is left out here: `val_full=False`.)

# %%
SHORT = TrainConfig(  # nanoGPT's CPU model and schedule, for 40 iterations
    max_iters=40, warmup_iters=5, eval_interval=10, eval_iters=1, sample_tokens=150, val_full=False
)
RUNS = lab.train_every_stage(SHORT, NPROCS, stages=(0, 1, 2, 3))  # and one process first

# %%
TOLERANCE = 0.02  # the largest relative difference from one process's curve this lesson allows
lab.plot_curves(RUNS, TOLERANCE)  # each stage's curve on one process's; val loss beside its own
assert max(lab.differences(RUNS).values()) <= TOLERANCE, lab.differences(RUNS)

# %% [markdown]
# The four curves lie on one process's: a stage changes where the model states live and which
# collectives move them, not the arithmetic of training. What is left is float32 rounding, from
# sums taken in another order (a mean over the ranks' rows, an all-reduce), which Adam's
# division by the gradients' running magnitude carries into the weights. The 2% tolerance is this
# cell's, for these 40 iterations, and the printed differences are the measurement. The
# 2,000-iteration runs are measured, not held to a tolerance: `python -m minizero bench nanogpt`
# prints each stage's largest relative difference from one process over its evaluations.
#
# ## 3. Memory per rank and step time, on this run
#
# Each rank measured its model states at the end of a backward (`minizero.analysis.memory.
# model_state_bytes`: parameters, gradients, Adam's two moments; fp32, so (4 + 4 + 8)Ψ for DDP)
# and timed each step; the paper's formula is beside the measurement. A step ends when its
# slowest rank's does, so the step time is the median over iterations of the slowest rank's.

# %%
PSI, N = RUNS.psi, NPROCS
PAPER = {  # fp32 AdamW, per rank: 4Ψ of parameters, 4Ψ of gradients, 8Ψ of Adam's two moments
    0: (4 + 4 + 8) * PSI,  # DDP: everything on every rank
    1: (4 + 4) * PSI + 8 * PSI / N,  # P_os
    2: 4 * PSI + (4 + 8) * PSI / N,  # P_os+g
    3: (4 + 4 + 8) * PSI / N,  # P_os+g+p
}
lab.show_states(RUNS, PAPER)  # the largest rank's, beside PAPER; / DDP; the median step time
lab.plot_states(RUNS, PAPER)

# %% [markdown]
# The states shrink as the paper says: stage 1 divides the optimizer's 8Ψ by the ranks, stage 2
# the gradients' 4Ψ too, stage 3 everything. The step times are this run's, on this machine: on a
# few shared CPU cores they move from one run to the next (rerun the cell), and with a model this
# small a step is mostly per-call overhead. Stage 3 moves 3Ψ per step where the others move 2Ψ
# (lesson 04); on GPUs with a model that fills them, the trade is the one lesson 05 predicts.
#
# ## 4. What the model writes
#
# After training, every rank calls `minizero.full_state_dict(model)` (collective: at stage 3 the
# parameters are gathered) and rank 0 samples 150 characters from a plain `TinyGPT` with those
# weights, as nanoGPT's `sample.py` does (temperature 0.8, top-k 200, from a newline).

# %%
lab.show_samples(RUNS)

# %% [markdown]
# After 40 iterations the model has the texture of the text, characters in words of a few
# letters between spaces and line breaks, and few real words. The full run below trains 50 times
# longer.
#
# ## 5. The full run, and nanoGPT beside it
#
# From a terminal (each takes minutes on a laptop CPU; a progress bar shows the live loss):
#
#     python -m minizero train                      # stage 0 on 2 CPU ranks, nanoGPT's defaults
#     python -m minizero train --stage 3            # the same at ZeRO-3
#     python -m minizero train --stage 2 --nprocs 3 --resume runs/train/ckpt --max-iters 2500
#
# Each prints the train and val loss every 250 iterations, the memory per rank, the step time
# and 500 generated characters, writes `runs/train/loss.png`, and saves a checkpoint
# (`minizero.save_checkpoint`) at every evaluation that resumes at any stage and world size.
# Under torchrun, one rank per GPU and across nodes: `python -m minizero run -m minizero train
# --stage 3`. `python -m minizero bench nanogpt` runs nanoGPT's own `train.py` with the same
# configuration on this machine beside `minizero train` at stages 0 and 3, and prints the
# validation loss at 2,000 iterations (the 20-batch estimate both print, and the final model over
# the whole validation split, every character predicted once), each run's difference from one
# process, the wall time as a ratio to nanoGPT's and the peak memory per rank; `--seeds 1,2,3,4,5`
# repeats every run over seeds and prints their spread.
