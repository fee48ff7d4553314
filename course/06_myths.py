# %% [markdown]
# # Lesson 06 — Myths and facts
#
# Some claims about ZeRO are easy to believe and wrong, or true only with a qualifier that gets
# lost. This lesson takes nine of them and tests each one with a measurement on real ranks, then
# shows what really happens and why.
#
# The facts, from the paper (Rajbhandari, Rasley, Ruwase, He, Microsoft's DeepSpeed team,
# *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, arXiv 1910.02054,
# SC20): ZeRO-DP is **plain synchronous data parallelism with the redundancy removed**. Every rank
# runs the whole model on its own micro-batch; the model states (parameters, gradients, optimizer
# states) are partitioned so that each rank *stores* only 1/N of them, and collectives among peers
# bring the missing pieces back when they are needed. There is no parameter server, nothing is
# asynchronous, and nothing in it is specific to Transformers.
#
#     python -m minizero grade my-lessons/06_myths.ipynb
#
# A check whose ranks need longer on a slow or busy machine: `python -m minizero grade
# --check-timeout 600 ...`, or `MINIZERO_CHECK_TIMEOUT=600` set where `jupyter lab` starts.

# %%
from minizero.course.labs.lesson06 import *  # torch, nn, minizero, hint, lab, the check

NPROCS, INFO = setup()

# %% [markdown]
# ## Myth 1: "ZeRO splits the model into parts that run on separate GPUs"
#
# That describes **model parallelism**: pipeline parallelism gives each GPU some of the layers,
# tensor parallelism a slice of each matrix, and each GPU computes only its part. ZeRO-3 does
# *store* 1/N of every parameter tensor on each rank, which is where the idea comes from. But
# storage is all it splits. The measurement: ZeRO-3 on TinyGPT, a hook on every module that owns
# parameters records, at the moment the module runs, how many of its parameter elements are
# present; a `FlopCounterMode` counts the forward's floating-point operations on each rank, next
# to a plain, unwrapped TinyGPT on the same micro-batch.


# %%
lab.show_who_computes_what(lab.who_computes_what(NPROCS))

# %% [markdown]
# What the measurement shows:
#
# * every rank ran **every** module, on **different rows** (its own micro-batch);
# * each unit had **all** of its parameter elements present while its module ran, and none right
#   after: ZeRO-3 all-gathers a unit (a block; the root holds the embeddings and `ln_f`) just
#   before its module runs and frees it when the module is done (lesson 04); between uses a rank
#   holds only its 1/N shard;
# * each rank did exactly the FLOPs of the whole, unsplit model on its micro-batch.
#
# So ZeRO-3 partitions *storage*, never *computation*: it is data parallelism. (The forward
# all-gathered exactly Ψ: every unit once, the root's, with the embeddings and the tied `lm_head`,
# included; lesson 04.) Model parallelism and ZeRO are complementary: the paper's largest runs
# combine ZeRO-DP with Megatron-LM's tensor parallelism (§10).
#
# ## Myth 2: "ZeRO is asynchronous"
#
# Partitioned updates sound like ranks updating their shards on their own schedules, with stale
# gradients. They do not. Two measurements, at every stage:
#
# 1. **Ranks wait for each other.** The last rank sleeps 0.3 s before the forward of its third
#    step (`step == 2`, counting from 0); rank 0 times its steps. In a synchronous step rank 0
#    cannot finish until the last rank's gradients have arrived, so its third step takes about
#    0.3 s longer.
# 2. **Same result as one process.** After every step each rank collects the full parameters
#    (`minizero.full_state_dict`, an all-gather for ZeRO); they must be bit-identical on every rank
#    and equal, up to float rounding, to one process trained on the whole global batch. A stale
#    gradient would show as a difference from the first step on.


# %%
DELAY, STEPS = 0.3, 3  # in step 2 the last rank is DELAY seconds late
lab.show_synchronous(lab.synchronous(NPROCS, stages=(0, 1, 2, 3), steps=STEPS, delay=DELAY))

# %% [markdown]
# Rank 0's third step took about 0.3 s longer at every stage: it waited inside a collective
# (DDP's all-reduce, stage 1's reduce-scatter in `optimizer.step()`, stage 2's at the end of
# backward, stage 3's gathers and reduce-scatters) for the slow rank. (Only that difference
# matters here: the step times themselves are this machine's, and on gloo each reduce-scatter
# runs as an all-reduce of its whole input; lesson 00.) After every step the parameters are the
# same bits on every rank and match one process on the whole batch to float rounding (the sums
# are added in a different order). ZeRO's step is exactly DDP's step:
# synchronous, one optimizer update per global batch, no stale gradients. What ZeRO *does*
# overlap is communication with computation *inside* a step (buckets, prefetch), which is a
# different thing from asynchronous training.
#
# ## Myth 3: "Gradients are sent to a parameter server"
#
# A parameter server is a process that receives every worker's gradients, updates the parameters
# and sends them back: it receives N − 1 times what a worker sends. ZeRO has no such process. Each
# rank's `CommLedger` over one training step at every stage (MLP, fp32), and over the
# construction of the wrapper:


# %%
LEDGERS = lab.step_ledgers(NPROCS, stages=(0, 1, 2, 3))
lab.show_step_ledgers(LEDGERS)

# %%
lab.plot_step_ledgers(LEDGERS)

# %% [markdown]
# Every rank issued the same collectives, of the same sizes, in the same order, and moved the same
# volume: all-reduce, reduce-scatter and all-gather are **collectives among peers**, in which every
# rank sends and receives the same amount (in a ring, each sends (N−1)/N of the payload per pass
# to its neighbour). No rank collects the others' gradients. Each rank *owns* the optimizer
# states of its shard and updates that shard itself: the "server" role is spread evenly over all
# ranks, which is the point of partitioning.
#
# The one asymmetry is at construction: the wrapper **broadcasts** rank 0's initial parameters
# so that every rank starts from the same weights, as PyTorch's DDP does. It happens once, before
# training.
#
# ## Myth 4: "ZeRO only works for Transformers"
#
# ZeRO's papers and libraries train language models, so it is easy to think it depends on them.
# Nothing in it does: a stage needs only a module's parameters, its gradients and an elementwise
# optimizer (Adam, SGD, …), whatever the layers compute. The measurement: stage 3 trains the
# course's awkwardly sized `MLP` (its flat buffers need padding) and a small convolutional
# network, next to DDP (stage 0) and one process on the whole batch, for 3 AdamW steps.


# %%
RES = lab.not_a_transformer(NPROCS, models=("MLP", "ConvNet"), stages=(None, 0, 3))
lab.show_not_a_transformer(RES, NPROCS)  # None: one process on the whole batch

# %% [markdown]
# Both match DDP and one process to float rounding after three steps. ZeRO is a way of doing
# data parallelism, and it applies wherever data parallelism does: CNNs, MLPs, mixtures of
# experts, diffusion models. The conditions are those of any data parallelism: no per-rank state
# such as BatchNorm statistics, or the result depends on the split.
#
# minizero adds a condition of its own: each rank updates a flat slice of a bucket, which cuts
# across tensors, so the optimizer must act elementwise (`minizero.parallelize` refuses others
# with an explanation). That is minizero's layout, not ZeRO's: PyTorch's ZeroRedundancyOptimizer
# gives each rank whole tensors and runs an optimizer that is not elementwise (myth 7 measures it).
#
# ## Myth 5: "ZeRO reduces communication"
#
# Compared with DDP, it does not. From the ledgers of myth 3 (MLP, one step, rank 0):

# %%
lab.show_volumes_by_op(LEDGERS)  # the paper: 2Ψ at stages 0-2, 3Ψ at stage 3

# %% [markdown]
# Stages 1 and 2 move **2Ψ**, exactly what DDP's all-reduce moves (the paper, §7.2.1: a
# reduce-scatter of the gradients plus an all-gather of the updated parameters *is* an all-reduce,
# taken apart). Stage 3 moves **3Ψ**, 1.5× DDP (§7.2.2): the parameters are gathered twice per
# step, once for forward and once for backward.
#
# The paper's claim about communication is made against **model parallelism**, not DDP. Before
# ZeRO, a model too large for one GPU's memory had to be split inside its layers (Megatron-LM's
# tensor parallelism; Shoeybi et al. 2019, arXiv 1909.08053), which all-reduces activations twice
# in every layer's forward and twice in its backward, on the critical path. Inside a node that is
# fast; across nodes it is not: the paper (§1) reports a 40B-parameter model split over two DGX-2
# nodes running at about 5 Tflops per V100, under 5% of the hardware's peak. ZeRO-DP fits such a
# model with data parallelism's communication instead: 2Ψ per step (3Ψ at stage 3), which
# overlaps with backward. So ZeRO avoids the communication of cross-node model parallelism; it does
# not reduce DDP's.
#
# ## Myth 6: "ZeRO shrinks activations"
#
# ZeRO partitions the model states. Activations are not model states: each rank computes them for
# its own micro-batch, through the whole model. The measurement: TinyGPT with a longer sequence
# (s = 128, b = 2), bf16 and fused AdamW, one step at each stage under `MemoryMeter`, which splits
# what is alive into model states, communication buffers and everything else (the activations,
# on CPU; on a GPU the allocator gives the total only, so the cell prints the total beyond the
# model states).


# %%
lab.show_activations_by_stage(lab.activations_by_stage(NPROCS, stages=(0, 1, 2, 3)))

# %% [markdown]
# The model states shrink from stage to stage; the activations at the end of forward are the
# same bytes at every stage, and so is (up to stage 2's bucket and stage 3's gathered units) the
# rest of the peak. The paper's own remedies for activations are outside ZeRO-DP: ZeRO-R's
# partitioned activation checkpointing (P_a, §6.1) applies to **model** parallelism, where each
# GPU of a tensor-parallel group holds a replica of the activations. With data parallelism alone,
# activations shrink with activation checkpointing, a smaller micro-batch, or a flash-attention
# kernel (lesson 05 measures all three).
#
# ## Myth 7: "PyTorch's ZeroRedundancyOptimizer is the paper's stage 1"
#
# `torch.distributed.optim.ZeroRedundancyOptimizer` shards the optimizer states "as described by
# ZeRO" (its docstring), so it is easy to take for stage 1. It differs in two ways:
#
# 1. it is an optimizer placed after DDP: DDP has already **all-reduced** every gradient (2Ψ);
#    each rank then updates the parameters it owns and **broadcasts** them to the others (Ψ):
#    about **3Ψ** per step. The paper's stage 1 reduce-scatters the gradients instead (each rank
#    needs only its own part's) and all-gathers the updated parameters: **2Ψ** (§7.2.1);
# 2. it assigns **whole tensors** to ranks (sorted-greedy: largest first, each to the rank that
#    owns the fewest elements so far), so the ranks' shares are unequal, but each rank's optimizer
#    sees complete tensors and can be any optimizer. minizero's stages, like DeepSpeed's stage 1
#    and 2 (`deepspeed/runtime/zero/stage_1_and_2.py`: each rank gets one contiguous 1/N of the
#    flattened parameter group), cut tensors; FSDP2 shards each parameter on its first dimension.
#
# The measurement: TinyGPT tiny in fp32, gradients averaged by one `minizero.all_reduce` per
# tensor (DDP's 2Ψ, as lesson 01's naive DDP), then `ZeroRedundancyOptimizer(AdamW)`; beside it,
# `minizero.parallelize(..., stage=1)`. ZeroRedundancyOptimizer calls `torch.distributed.broadcast`
# itself, which the ledger cannot see: for this measurement it gets a `torch.distributed` whose
# `broadcast` goes through `minizero.broadcast`. Last, Adafactor (`torch.optim.Adafactor`, row and
# column statistics per matrix: not elementwise) under both.


# %%
OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adafactor": torch.optim.Adafactor}
lab.show_torch_zero_vs_stage1(lab.torch_zero_vs_stage1(NPROCS, OPTIMIZERS))

# %% [markdown]
# ZeroRedundancyOptimizer moves 3Ψ per step where stage 1 moves 2Ψ. Its ranks' optimizer states
# differ by what whole tensors leave over (a little for TinyGPT's many small tensors; a lot when
# one tensor, such as a large embedding, is more than Ψ/N), where stage 1's are Ψ/N each, up to
# padding. In exchange it runs Adafactor and matches one process, while minizero's stage 1 refuses
# it. Both are "stage 1" in what they store; they differ in what they move and how they cut.
#
# ## Exercise — whole tensors, owned
#
# Write the two halves of ZeroRedundancyOptimizer's mechanism:
#
# * `assign_owners(numels, world)`: the rank that owns each tensor (a list, one rank per tensor).
#   Balance the elements: no rank may own more than total / world + the largest tensor, which
#   giving each tensor, largest first, to the rank that owns the fewest elements so far achieves.
# * `owned_step(params, owners, optimizer)`: called after DDP's all-reduce, when every rank holds
#   the average gradient of every parameter, with `optimizer` built on the parameters this rank
#   owns. Update them, then give every rank every updated parameter, from its owner, with
#   `minizero.broadcast(tensor, src=rank)` (so that the ledger sees it).
#
# The check builds the optimizer on each rank's tensors, trains TinyGPT tiny for 3 steps with
# AdamW and with Adafactor on NPROCS ranks, and compares every parameter with one process on the
# whole batch; it also runs `assign_owners` on lists of sizes that a careless assignment
# balances badly, and reads the ledger of each step.


# %%
def assign_owners(numels: list[int], world: int) -> list[int]:
    """The rank that owns each tensor: whole tensors, the elements balanced over the ranks."""
    # BEGIN SOLUTION
    # TODO: each tensor's owner, whole tensors, no rank above total / world + the largest tensor
    # HINT: Greedy is enough: give each tensor, largest first, to the rank that owns the fewest
    #       elements so far. Keep what each rank owns in a list of world counts.
    # HINT: Visit the tensors' indices sorted by decreasing size, but return one owner per tensor in
    #       the tensors' own order (owners[i] for numels[i]).
    # HINT: load, owners = [0] * world, [0] * len(numels)
    #       for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
    #           rank = min(range(world), key=load.__getitem__)  # the least loaded so far
    #           ...  # rank owns tensor i; its load grows by numels[i]
    #       return owners
    load, owners = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = min(range(world), key=load.__getitem__)
        owners[i], load[rank] = rank, load[rank] + numels[i]
    return owners
    # END SOLUTION


def owned_step(params: list[nn.Parameter], owners: list[int], optimizer, group=None) -> None:
    """After DDP's all-reduce: update this rank's tensors, then every rank gets every tensor."""
    # BEGIN SOLUTION
    # TODO: every rank holds every parameter as its owner updated it
    # HINT: The optimizer holds this rank's tensors only: optimizer.step() updates those. Every
    #       other parameter is stale here, and fresh on its owner.
    # HINT: Then, for every parameter, in the same order on every rank (a collective: every rank
    #       calls it for every parameter):
    #       optimizer.step()
    #       for p, owner in zip(params, owners):
    #           minizero.broadcast(p.data, src=owner, group=group)
    optimizer.step()
    for p, owner in zip(params, owners):
        minizero.broadcast(p.data, src=owner, group=group)
    # END SOLUTION


# %% check="owned_tensors"
# Your assignment on awkward size lists, then your step with AdamW and Adafactor on max(NPROCS, 3)
# ranks, and with AdamW on a subgroup of 2 of them.
lesson06.check_owned_tensors(assign_owners, owned_step, NPROCS)

# %% [markdown]
# The broadcast is the price of the layout: an owner that updates a whole tensor must send all of
# it, to everyone, after the gradients were already everywhere. The paper's stage 1 sends each
# rank only its part of the gradients (reduce-scatter), and gathers the parameters back: the same
# memory saving for 2Ψ instead of 3Ψ.
#
# ## Myth 8: "a higher stage always uses less memory"
#
# Each stage partitions one more model state, so this sounds like arithmetic; Hugging Face's
# DeepSpeed guide says "Every additional stage and offload level reduces peak memory"
# (huggingface.co/docs/transformers/deepspeed). For the model states it is true. For the **peak**
# it is not: stage 3 saves 2Ψ(1 − 1/N) bytes of 16-bit parameters but, at its peak, holds the
# units it has gathered and the full gradient of a unit before its reduce-scatter. When one unit
# is a large share of Ψ, that outweighs the saving. The measurement: TinyGPT (L = 6, h = 64) with
# a growing vocabulary, so that the tied embedding (V × h, in the root's unit, which stays
# gathered through the whole forward and the whole backward) becomes most of Ψ; the peak of one
# step at stages 2 and 3, bf16, fused AdamW, 16 tokens per rank.


# %%
VOCABS = (64, 512, 2048, 8192)
lab.show_stage2_vs_stage3(lab.stage2_vs_stage3(NPROCS, VOCABS))  # and its figure

# %% [markdown]
# Where the embedding is a small share of Ψ, stage 3's peak is the lower one. As it grows, the
# curves cross: stage 3 holds the root's unit, the embedding with it, gathered through forward
# and backward, and at the end of backward both its 16-bit copy and its full gradient until the
# reduce-scatter, while stage 2 never gathers anything. (With L = 2 they never cross: the root
# and both blocks, all of Ψ, are gathered at once at stage 3's peak. Units must be small
# against the model for stage 3 to pay.) These peaks were measured on gloo, where a reduce-scatter
# receives into a buffer the size of its input (lesson 03): a bucket more for stage 2, a unit's
# gradient more for stage 3;
# NCCL's does not. At N = 1,
# stage 3 has nothing to partition: its shards are whole copies, and every gathered unit is a
# second one. Real systems bound this working set: FSDP2 gathers one `fully_shard` unit at a time
# (and keeps the root's parameters after forward); DeepSpeed caps it with
# `stage3_max_live_parameters`. And stage 3 also moves 1.5× the data. Pick the stage from a
# measured budget (lesson 05), not from its number.
#
# ## Myth 9: "ZeRO-3's memory per rank goes to zero as N grows"
#
# The model states do: 16Ψ/N. The rest of the peak does not: the activations of the rank's
# micro-batch, the units gathered at once, and the buffers. The measurement: stage 3 on TinyGPT
# (s = 128, b = 2) with 1, 2 and 4 ranks: four ranks on gloo, with process groups of the first 1,
# 2 and 4 of them (`parallelize(..., process_group=...)`).


# %%
lab.show_stage3_by_n(lab.stage3_by_n(worlds=(1, 2, 4)), formula_ns=(64, 1024))  # and its figure

# %% [markdown]
# The model states halve with each doubling of N; the rest of the peak stays where it is. At
# N = 1024 a rank would still hold it all: stage 3 goes to a floor, not to zero. For the 6.7B
# model of lesson 05 that floor is about 20 GB at s = 4096 (its §5), almost all activations.
#
# ## Summary
#
# * **"ZeRO splits the model into parts on separate GPUs."** Measured: every rank ran every module,
#   with all of its parameters present, and the whole model's FLOPs on its own rows. Fact: ZeRO
#   partitions storage; the computation is data parallel.
# * **"ZeRO is asynchronous."** Measured: a slow rank delays every rank's step; the parameters are
#   bit-identical on all ranks and equal one process's. Fact: one synchronous update per global
#   batch.
# * **"Gradients go to a parameter server."** Measured: every rank issues the same collectives
#   among peers and moves the same volume. Fact: no server; each rank owns and updates its shard.
# * **"ZeRO is for Transformers."** Measured: stage 3 on an MLP and a CNN equals DDP and one
#   process. Fact: any model; minizero's flat slices need an elementwise optimizer, ZeRO does not.
# * **"ZeRO reduces communication."** Measured: 2Ψ at stages 0–2, 3Ψ at stage 3. Fact: against
#   DDP it moves as much or more; what it avoids is cross-node model parallelism.
# * **"ZeRO shrinks activations."** Measured: the same activation bytes at every stage. Fact: it
#   partitions model states only.
# * **"ZeroRedundancyOptimizer is the paper's stage 1."** Measured: 3Ψ per step against 2Ψ,
#   unequal shares, Adafactor accepted. Fact: same partitioned states, a different layout and
#   traffic.
# * **"A higher stage always uses less memory."** Measured: stage 3's peak above stage 2's when
#   one unit is a large share of Ψ. Fact: stage 3 holds gathered units at its peak.
# * **"ZeRO-3's memory goes to zero with N."** Measured: the rest of the peak does not move with
#   N. Fact: it goes to a floor: activations, gathered units, buffers.
