# %% [markdown]
# # Lesson 07 — Checkpoints: save sharded, resume anywhere
#
# A training run that cannot be saved is lost when one machine dies. With DDP saving is easy:
# every rank holds everything, so rank 0 calls `torch.save`. With ZeRO it is not: at stages 1-3
# each rank's optimizer holds the states of *its* elements only, and at stage 3 its parameters
# too. torch's `optimizer.state_dict()` is a different, partial thing on every rank, and nothing
# in it says which rank or which world size it came from. The habit "save on rank 0, load
# everywhere" then resumes with the wrong optimizer states on every rank but 0, silently.
#
# The real systems took years here. DeepSpeed's stages 1 and 2 could reload their optimizer
# states at another data-parallel degree only when saved with `"elastic_checkpoint": true` in
# the `zero_optimization` config (`deepspeed/runtime/zero/stage_1_and_2.py`,
# `_restore_elastic_base_optimizer_state`: every rank reads every partition and cuts out its
# own); otherwise, and at stage 3, a ZeRO checkpoint resumed at another GPU count was refused
# ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
# currently supported", deepspeedai/DeepSpeed issue #2898) until the separate *universal
# checkpoint* reached stages 1-3 (issue #2921); `torch.distributed.optim.ZeroRedundancyOptimizer`
# raises on a partition that does not match (pytorch/pytorch issue #65650). This lesson builds the
# idea that fixes it: **address every saved piece by parameter name and element range, never by
# bucket or rank**. Then resuming on another world size, stage or precision is only a matter of
# reading the right ranges. You will write the two halves: what each rank owns, and how a rank
# reads the ranges it owns *now* from pieces that other ranks saved.
#
#     python -m minizero grade my-lessons/07_checkpoints.ipynb

# %%
from minizero.course.labs.lesson07 import *  # torch, dist, minizero, hint, lab, lesson07, TinyGPT

CKPT = Path(tempfile.mkdtemp(prefix="minizero-07-"))  # this lesson's checkpoints
NPROCS, INFO = setup(**{"TinyGPT Ψ": PSI, "checkpoints in": CKPT})

# %% [markdown]
# ## 1. What each rank's optimizer holds
#
# Lesson 02 gave each rank's optimizer one tensor per **fragment**: the part of one parameter
# that falls in the rank's chunk of its bucket, a view of the rank's fp32 master shard. The cell
# takes one step of TinyGPT at stage 2 and counts, on each rank, the elements behind the Adam
# momentum `exp_avg` in `optimizer.state`:


# %%
lab.show_state_sizes(lab.state_sizes(NPROCS, stage=2))

# %% [markdown]
# Each rank holds 1/N of the states, and torch's `state_dict()` numbers them 0, 1, 2, ... in the
# order of its own fragments: entry 3 on rank 0 and entry 3 on rank 1 are parts of different
# parameters, of different sizes. Rank 0's file loaded on every rank would hand rank 1 the
# states of rank 0's elements. A checkpoint must say *what* each saved number is: which
# parameter, which elements. (minizero's `optimizer.state_dict()` says it, warns that it holds
# one rank's shard, and refuses to load elsewhere; a whole state on rank 0 needs every rank:
# `minizero.consolidate_state_dict(model, opt)`. This lesson builds the checkpoint that needs
# neither.)
#
# ## Exercise 1 — what each rank owns, by name and range
#
# Every stage keeps its layout in `model.buckets`: bucket `b` lays its parameters `b.params` end
# to end, parameter `i` at elements `[b.offsets[i], b.offsets[i] + numel)` of the bucket, which
# has `b.numel` elements. At stages 1-3 the bucket is padded to `b.shard * N` elements and rank r
# owns chunk r, `[r * b.shard, (r + 1) * b.shard)`; at stage 0 (DDP) every rank owns all of every
# bucket. Stage 3's buckets are its units; the code is the same.
#
# Write `owned_ranges(model)`: for every trainable parameter that this rank owns elements of,
# its name and the range `(start, end)` of those elements **counted from the parameter's own
# first element** (flattened), the numbers a checkpoint file can carry without knowing anything
# about buckets. A parameter with no element in this rank's chunk is left out. Tied parameters
# appear once, under their first name (`named_parameters()` gives that one).


# %%
def owned_ranges(model) -> dict[str, tuple[int, int]]:
    """{name: (start, end)}: the elements of each trainable parameter this rank owns."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    owned = {}
    # BEGIN SOLUTION
    # TODO: each parameter this rank owns part of, by name: that part's range within the parameter
    # HINT: Work in the bucket's coordinates first: this rank owns [lo, hi) of each bucket b in
    #       model.buckets; at stage 0 all of it, [0, b.numel); at stages 1-3 chunk model.rank, [rank
    #       * b.shard, (rank + 1) * b.shard).
    # HINT: Parameter p sits at [o, o + p.numel()) of its bucket (zip b.params with b.offsets). Its
    #       overlap with [lo, hi) is [max(o, lo), min(o + p.numel(), hi)), empty when its start is
    #       not below its end.
    # HINT: for b in model.buckets:
    #           if model.stage == 0:
    #               lo, hi = 0, b.numel
    #           else:
    #               lo, hi = ...  # chunk model.rank
    #           for p, o in zip(b.params, b.offsets):
    #               s, e = max(o, lo), min(o + p.numel(), hi)
    #               if s < e:
    #                   owned[names[id(p)]] = ...  # counted from o
    for b in model.buckets:
        if model.stage == 0:
            lo, hi = 0, b.numel
        else:
            lo, hi = model.rank * b.shard, (model.rank + 1) * b.shard
        for p, o in zip(b.params, b.offsets, strict=True):
            s, e = max(o, lo), min(o + p.numel(), hi)
            if s < e:
                owned[names[id(p)]] = (s - o, e - o)
    # END SOLUTION
    return owned


# %% check="owned_ranges"
# On max(NPROCS, 3) ranks, stages 0-3, tiny and default buckets, an MLP (with a frozen weight and a
# tied one) and TinyGPT: your ranges against minizero's fragments (model.fragments), rank by rank.
lesson07.check_owned_ranges(owned_ranges, NPROCS)

# %% [markdown]
# `minizero.checkpoint.layout.owned_ranges(model)` is the same function, read off the fragments.
#
# ## 2. A checkpoint on disk
#
# `minizero.save_checkpoint(path, model, optimizer, extra)` is collective: each rank writes its
# ranges of every parameter's fp32 master, of its 16-bit working copy (in mixed precision) and of
# each optimizer state, under the parameter's name. The format is PyTorch's own,
# `torch.distributed.checkpoint` (DCP), whose metadata describes every saved piece as a *chunk*
# (offsets, sizes) of a named tensor, the same description it uses for FSDP2's shards. A range of
# a flattened parameter is a chunk of a 1-D tensor; two small DCP planners in
# `minizero/checkpoint/layout.py` say so. Rank 0 adds what every rank has (frozen parameters,
# buffers, the param groups' settings, `extra`); every rank adds its RNG states.
#
# The save goes into `path.incomplete/`; each rank leaves a marker when its file is on disk;
# rank 0 writes the commit record `minizero.json` (what was saved, every file's size and CRC32)
# and renames the directory to `path` last. Here is one, saved at stage 2 (with 100 KiB buckets,
# so that several parameters straddle the boundary between two ranks' chunks):


# %%
lab.show_files(lab.save_one(NPROCS, stage=2, path=CKPT / "stage2", bucket_cap_mb=0.1))

# %% [markdown]
# DCP's metadata says which chunks of which tensor were saved, and in which rank's file:

# %%
lab.show_chunks(CKPT / "stage2")

# %% [markdown]
# ## Exercise 2 — reading the ranges a rank owns now
#
# Load at another world size or stage and every rank owns new ranges. For each parameter, the
# checkpoint offers the saved pieces, `saved = [(start, end), ...]` (any number, in any places,
# together covering the parameter), and the rank wants `want = (start, end)`. Write
# `read_plan(saved, want)`: one entry `(k, src, dst, n)` for every saved piece `k` that overlaps
# `want`: its elements `[src, src + n)`, counted from the piece's own start, go to
# `[dst, dst + n)` of the wanted range, counted from `want[0]`. Pieces that do not overlap get no
# entry. This is what DCP does at load time (`create_read_items_for_chunk_list`, in any number
# of dimensions), and what minizero uses to refuse, before loading anything, a checkpoint that
# lacks some range a rank needs.


# %%
def read_plan(saved, want):
    """[(k, src, dst, n)]: the elements of saved piece k that fill the range ``want``."""
    plan = []
    # BEGIN SOLUTION
    # TODO: for every saved piece that overlaps want: which of its elements fill which of want's
    # HINT: The overlap of [s, e) and [lo, hi) is [max(s, lo), min(e, hi)); it is empty when its
    #       start is not below its end.
    # HINT: An overlap [a, b) of piece k starts a - s elements into the piece and a - want[0]
    #       elements into the wanted range, and is b - a elements long.
    # HINT: lo, hi = want
    #       for k, (s, e) in enumerate(saved):
    #           a, b = max(s, lo), min(e, hi)
    #           if a < b:
    #               plan.append(...)  # (k, src, dst, n)
    lo, hi = want
    for k, (s, e) in enumerate(saved):
        a, b = max(s, lo), min(e, hi)
        if a < b:
            plan.append((k, a - s, a - lo, b - a))
    # END SOLUTION
    return plan


# %% check="read_plan"
# 300 random layouts against the elements they must fill and against DCP's own read plan; then a
# TinyGPT checkpoint saved at stage 2 on 2 ranks is loaded at stage 3 on 3 ranks (gloo), and each
# rank rebuilds the ranges it now owns from the saved pieces with your plan.
lesson07.check_read_plan(read_plan)

# %% [markdown]
# ## 3. A run killed, and resumed on another world size
#
# A real run: TinyGPT, nanoGPT's param groups, a cosine LR schedule, 16 steps at stage 2 on 2
# ranks, a checkpoint every 4 steps with the step and the scheduler in `extra` (the data position
# is the step here: batch `step` is the same global batch whatever the world size). Rank 0 logs
# the loss of the global batch. At the save after step 12, rank 1 dies halfway through writing
# (`lesson07.crash_during_next_save` makes it raise there, inside `minizero.launch`, once the
# other rank has written its part). Then the run is resumed from the last complete checkpoint on
# **3** ranks at **stage 3**, and a reference run does all 16 steps without interruption.
#
# (Every launch of this section runs on gloo, so that 3 ranks fit on any machine; under NCCL it
# would be one rank per GPU, with the same files.)

# %%
STEPS, EVERY = 16, 4


def train(stage, log, resume_from=None, crash_at=None):
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    opt = lab.nanogpt_adamw(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    model, opt = minizero.parallelize(model, stage, opt)
    start = 0
    if resume_from is not None:
        extra = minizero.load_checkpoint(resume_from, model, opt)
        sched.load_state_dict(extra["sched"])
        start = extra["step"]
    for step in range(start, STEPS):
        loss = model(*lab.gpt_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lab.log_loss(Path(f"{log}.jsonl"), step, loss)  # rank 0: the global batch's loss
        if (step + 1) % EVERY == 0:
            if step + 1 == crash_at and dist.get_rank() == 1:
                lesson07.crash_during_next_save("rank 1 lost power")
            extra = {"step": step + 1, "sched": sched.state_dict()}
            minizero.save_checkpoint(Path(log) / f"step_{step + 1}", model, opt, extra)


lab.run_that_dies(train, 2, 2, CKPT / "crashed", crash_at=12)

# %% [markdown]
# The save of step 12 never committed: `step_12.incomplete/` holds rank 0's part and no record,
# and is refused by name. `step_8` is intact. Resume from it on 3 ranks at stage 3, and run the
# reference:

# %%
latest = lab.latest_checkpoint(CKPT / "crashed")
print("resuming from", latest.name)
minizero.launch(train, 3, 3, CKPT / "resumed", resume_from=latest, backend="gloo")
minizero.launch(train, 2, 2, CKPT / "reference", backend="gloo")
LABELS = {
    "reference": "reference: 16 steps, stage 2, 2 ranks",
    "crashed": "stage 2 on 2 ranks, dies at step 12's save",
    "resumed": f"from {latest.name}: stage 3, 3 ranks",
}
LOGS = lab.read_logs(CKPT, list(LABELS))
lab.plot_resume(LOGS, LABELS, resumed_from=int(latest.name.split("_")[1]))

# %% [markdown]
# The resumed curve lies on the reference: the fp32 masters, Adam's moments and step counts, the
# groups' learning rates and the scheduler came back exactly, only redistributed. What remains
# (below 1e-6) is float rounding: 3 ranks sum the gradients in another order than 2. At the
# same world size and stage a resume is bit for bit the run that never stopped (the tests check
# it for every stage, in fp32, bf16 and fp16).
#
# `minizero.consolidate(path)` needs no ranks at all: it reads the model's part into one
# ordinary state dict (fp32, tied names sharing a tensor), which a plain model loads with
# `strict=True`; `python -m minizero consolidate CKPT model.pt [--safetensors]` writes it to a
# file that `torch.load(..., weights_only=True)` reads without minizero installed.

# %%
x, y = synthetic_batch("gpt", 12, STEPS, seq_len=GPT.block_size)  # the batch after the last
for run in ("resumed", "reference"):
    plain = TinyGPT(GPT)
    plain.load_state_dict(minizero.consolidate(CKPT / run / f"step_{STEPS}"), strict=True)
    with torch.no_grad():
        loss = plain(x, y).item()
    print(f"plain TinyGPT from {run}/step_{STEPS}: loss {loss:.7f} on the next batch")

# %% [markdown]
# ## 4. Bytes written per rank
#
# Each rank writes what it owns and nothing else. In bf16 with AdamW that is, per element,
# P = 2 bytes of 16-bit working copy and K = 12 bytes of fp32 master, momentum and variance: at
# stages 1-3 rank r writes (2 + 12) times the elements it owns, its share of (2 + K)Ψ, although
# at stages 1 and 2 it *holds* all 2Ψ of working parameters in memory. Nobody writes the full
# working copy. At stage 0 every rank owns everything: DCP writes each tensor once, from the rank
# that has written least so far, so the shares are whole tensors. The files add a little to the
# shards: DCP's per-tensor headers, the RNG states, the record.


# %%
GOT = lab.bytes_per_stage(NPROCS, CKPT / "bytes", stages=(0, 1, 2, 3))  # bf16, AdamW: K = 12
lab.plot_bytes_per_stage(GOT, per_rank=(2 + 12) * PSI / NPROCS, one_rank=(2 + 12) * PSI)
lab.show_bytes_per_stage(GOT)
print(f"(2 + 12)Ψ/N = {(2 + 12) * PSI / NPROCS:,.0f} B; the full working copy 2Ψ = {2 * PSI:,} B")

# %% [markdown]
# Save and load times depend on the file system more than on anything else here, so the lesson
# does not show them; `python -m minizero bench checkpoints` measures them for the benchmark model,
# stage by stage, and prints the file system it wrote to. Under NCCL each rank first copies its
# shards from its GPU; the collectives of a save (DCP's plan, the commit) carry a few kilobytes
# under either backend.
#
# What to take away: a checkpoint of a sharded run is a set of *named ranges*; each rank writes
# the ranges it owns and reads the ranges it owns now, whatever wrote them; and it is committed
# only when every rank has finished.

# %%
shutil.rmtree(CKPT)  # this lesson's checkpoints
