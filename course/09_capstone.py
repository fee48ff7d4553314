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
# rank and step time, all from the loop you write: nanoGPT's, at a stage given as an argument.
#
#     python -m minizero grade my-lessons/09_capstone.ipynb

# %%
from minizero.course.labs.lesson09 import *  # torch, dist, all_reduce, hint, lab, lesson09, ...

NPROCS, INFO = setup()
DATA = shakespeare.load()  # the characters, their vocabulary, the train and val splits
lab.show_data(DATA)

# %% [markdown]
# ## 1. What changes in nanoGPT's loop
#
# nanoGPT's `train.py` is written for torch DDP. What distributed training changes in it:
#
# - **The data.** nanoGPT draws each rank's batch with a seed offset by the rank; minizero's
#   `train_batch(data, cfg, step, rank, world, device)` draws the *global* batch number `step`
#   the same on every rank and keeps this rank's rows, so 1, 2 or 3 ranks train on exactly the
#   same rows and their curves can be compared point by point.
# - **The model** goes through `minizero.parallelize(model, stage, optimizer)` (pass
#   `process_group=group`); the learning-rate schedule sets `param_group["lr"]` on the optimizer
#   it returns, as nanoGPT does; clipping is `torch.nn.utils.clip_grad_norm_`, which minizero makes
#   global where each rank holds a shard of the gradients.
# - **Micro-batches.** A step accumulates `cfg.gradient_accumulation_steps` micro-batches. Each
#   loss is divided by their number, so that the step's gradient is their mean. Only the last
#   backward reduces the gradients over the ranks: the others run under `model.no_sync()`, which
#   accumulates them locally (torch DDP's name; nanoGPT sets `require_backward_grad_sync`).
# - **The evaluation.** nanoGPT evaluates on the master process only (`if iter_num %
#   eval_interval == 0 and master_process:`). Under torch DDP that works: its forward
#   communicates nothing. **At ZeRO stage 3 a forward is collective**: each unit's parameters are
#   all-gathered from every rank before it runs, and rank 0 evaluating alone waits for ranks that
#   never come. So every rank evaluates its share of the fixed eval batches (`eval_batches(data,
#   cfg, split, rank, world, device)`, a list of `(x, y)`), and the ranks average their means:
#   `all_reduce` sums, divide by the group's size. Rank 0 alone prints.
# - **The saved model.** At stages 1-3 no rank holds the whole model; `model.state_dict()` on
#   the parallelized model gathers the full fp32 parameters under the plain model's keys, on every
#   rank (collective: every rank calls it).

# %% [markdown]
# ## Exercise — nanoGPT's loop, at any stage
#
# Write `train(cfg, stage, group=None)`, called on every rank of `group` with a `TrainConfig`.
# Seed with `cfg.seed` (the same initial weights on every rank), build `TinyGPT(cfg.gpt(
# data.vocab_size))` on `rank_device()` (`data = shakespeare.load()`), its optimizer
# `make_optimizer(model, cfg)` (nanoGPT's AdamW groups), and parallelize both at `stage`. Then
# for `it` in `0 .. cfg.max_iters`: evaluate at every `cfg.eval_interval` and after the last
# step; then (but not after the last step) set nanoGPT's schedule, `get_lr(it, cfg)`, run the
# micro-batches (micro-batch `m` is global batch `it * cfg.gradient_accumulation_steps + m`),
# clip to `cfg.grad_clip`, step, zero the gradients. Return a dict: `"loss"`, per iteration this
# rank's loss of the step (the mean over its micro-batches) as a float; `"evals"`, `[it, train
# loss, val loss]` per evaluation, the same on every rank; `"state_dict"`, the whole model's
# after the last step.


# %%
def train(cfg: TrainConfig, stage: int, group=None) -> dict:
    """nanoGPT's loop at ZeRO ``stage`` on this rank of ``group``: its losses, evals, state dict."""
    # BEGIN SOLUTION
    # TODO: the losses, evaluations and whole state dict of cfg.max_iters steps at this stage
    # HINT: The order of nanoGPT's loop: build and wrap once; then per iteration evaluate when
    #       due (every rank), stop after the last evaluation, else set the lr, accumulate the
    #       micro-batches, clip, step, zero the gradients. At the end, the state dict, on every
    #       rank: at stages 1-3 it gathers.
    # HINT: This rank's rows: rank, world = dist.get_rank(group), dist.get_world_size(group).
    #       The wrapper: model, opt = minizero.parallelize(model, stage, make_optimizer(model,
    #       cfg), process_group=group). Evaluate under torch.no_grad() in model.eval(), then
    #       model.train(); each split's value is the all-reduced mean divided by world.
    # HINT: The micro-batches, as torch DDP's users write them:
    #       for m in range(micro):
    #           sync = ...  # True on the last micro-batch only
    #           with contextlib.nullcontext() if sync else model.no_sync():
    #               loss = ...  # this micro-batch's loss, divided by micro
    #               loss.backward()
    #       then clip_grad_norm_(model.parameters(), cfg.grad_clip), opt.step(), opt.zero_grad()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data, dev, micro = shakespeare.load(), rank_device(), cfg.gradient_accumulation_steps
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = TinyGPT(cfg.gpt(data.vocab_size)).to(dev)
    model, opt = minizero.parallelize(model, stage, make_optimizer(model, cfg), process_group=group)
    evals = {s: eval_batches(data, cfg, s, rank, world, dev) for s in ("train", "val")}
    out = {"loss": [], "evals": []}
    for it in range(cfg.max_iters + 1):
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:  # every rank: stage 3 gathers
            model.eval()
            losses = [it]
            with torch.no_grad():
                for split in ("train", "val"):
                    mean = torch.stack([model(x, y) for x, y in evals[split]]).mean()
                    all_reduce(mean, group=group)  # the sum of the ranks' means
                    losses.append(mean.item() / world)
            model.train()
            out["evals"].append(losses)
        if it == cfg.max_iters:
            break
        for g in opt.param_groups:
            g["lr"] = get_lr(it, cfg)  # warm-up, then cosine decay
        total = 0.0
        for m in range(micro):
            x, y = train_batch(data, cfg, it * micro + m, rank, world, dev)
            with contextlib.nullcontext() if m == micro - 1 else model.no_sync():
                loss = model(x, y) / micro  # the step's gradient: the micro-batches' mean
                loss.backward()  # reduces over the ranks on the last micro-batch only
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(total)
    out["state_dict"] = model.state_dict()  # every rank: stages 1-3 gather the full parameters
    return out
    # END SOLUTION


# %% check="train"
# Your loop at stages 0-3 on max(NPROCS, 3) ranks, then at stage 3 on the subgroup [0, 1], on a
# tiny model, 4 steps of 2 micro-batches: every loss against one process's, the micro-batches'
# sync and scaling, the schedule, the clipping, every rank evaluating, the whole state dict
lesson09.check_train(train, NPROCS)

# %% [markdown]
# ## 2. Four stages, one curve
#
# nanoGPT's CPU configuration (one micro-batch a step, as its README runs it; the check above ran
# yours with two), for a short budget: 40 iterations with the warm-up shortened to 5 (so the loss
# moves), an evaluation every 10 iterations on one fixed batch per split. First one process in
# plain PyTorch (minizero's own loop, `python -m minizero train`'s, with no minizero and no
# process group, one thread as each rank has), then **your** `train` at each stage on `NPROCS`
# ranks. The lab watches your loop from outside (torch's global hooks) for the memory and the step
# times of section 3, and samples from the state dict you return in section 4. (The loss over the
# whole validation split, which the full run of section 5 prints at its end, is left out here:
# `val_full=False`.)

# %%
SHORT = TrainConfig(  # nanoGPT's CPU model and schedule, 40 iterations
    max_iters=40, warmup_iters=5, eval_interval=10, eval_iters=1
)
SHORT.sample_tokens, SHORT.val_full = 150, False  # 150 characters sampled; no whole-split loss
RUNS = lab.train_every_stage(train, SHORT, NPROCS, stages=(0, 1, 2, 3))  # one process first

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
# While your loop ran, the lab measured each rank's model states at its second `opt.step()`,
# gradients alive and Adam's moments made (`minizero.analysis.memory.model_state_bytes`:
# parameters, gradients, Adam's two moments; fp32, so (4 + 4 + 8)Ψ for DDP), and timed each step
# from its first forward; the paper's formula is beside the measurement. A step ends when its
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
# Rank 0 loads the state dict your loop returned into a plain `TinyGPT` and samples 150
# characters from it, as nanoGPT's `sample.py` does (temperature 0.8, top-k 200, from a
# newline).

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
