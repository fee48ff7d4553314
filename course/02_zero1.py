# %% [markdown]
# # Lesson 02 — ZeRO stage 1: partition the optimizer states (P_os)
#
# **ZeRO** (Zero Redundancy Optimizer; Rajbhandari, Rasley, Ruwase and He, Microsoft's DeepSpeed
# team, *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, arXiv 1910.02054,
# SC20) is the data parallelism of lesson 01 with its **redundancy removed**. Training is the same
# plain synchronous algorithm: every rank runs the whole model on its own slice of each batch and
# every rank ends each step with the same parameters. What changes is who *keeps* what. Under DDP
# every rank keeps a full copy of the three **model states** (paper §3.1):
#
# | model state | mixed-precision Adam | bytes per rank under DDP |
# |---|---|---|
# | parameters (fp16/bf16) | 2 bytes each | 2Ψ |
# | gradients (fp16/bf16) | 2 bytes each | 2Ψ |
# | optimizer states: fp32 master copy, momentum, variance | 4 + 4 + 4 | KΨ, K = 12 |
#
# so (2 + 2 + K)Ψ = 16Ψ bytes on *every* rank, for a model of Ψ parameters. The three ZeRO-DP
# stages partition these states over the N ranks, one more state per stage (§5):
#
# | stage | partitioned | per-rank model states | volume per step |
# |---|---|---|---|
# | DDP | nothing | (2 + 2 + K)Ψ | 2Ψ |
# | 1 (P_os) | optimizer states | 2Ψ + 2Ψ + KΨ/N | 2Ψ |
# | 2 (P_os+g) | + gradients | 2Ψ + (2 + K)Ψ/N | 2Ψ |
# | 3 (P_os+g+p) | + parameters | (2 + 2 + K)Ψ/N | 3Ψ |
#
# This lesson builds **stage 1** and measures it: memory per rank against DDP and against the
# formula, and communication against 2Ψ. You will write the flat layout stage 1 runs on; the two
# methods that *are* stage 1: the reduce-scatter of the gradients before the optimizer steps, and
# the all-gather of the updated parameters after it; and the fp16 step that every rank skips
# together when one of them sees an overflow.
#
#     python -m minizero grade my-lessons/02_zero1.ipynb

# %%
from minizero.course.labs.lesson02 import *  # torch, dist, minizero, hint, lab, lesson02, ZeRO1

NPROCS, INFO = setup(**{"TinyGPT Ψ": PSI})  # PSI: Ψ of the model the measurements use

# %% [markdown]
# ## 1. Why the optimizer can be split: it is elementwise
#
# Adam updates element i of a parameter from element i of its gradient and of its two moments,
# nothing else. So the update of a tensor is the same as the updates of its pieces, done
# separately, by different optimizers, possibly on different ranks. The cell checks it: Adam on
# a whole tensor against two Adams, each on one half, fed the same gradients for 5 steps. The
# prediction: the halves, put end to end, are the whole, to the last bit (`diff` 0).


# %%
# @save
def adam_in_pieces(steps: int = 5, numel: int = 10, lr: float = 0.1) -> dict:
    """Adam on a (numel,) tensor against two Adams, one per half, fed the same gradients."""
    torch.manual_seed(0)
    whole = torch.randn(numel, requires_grad=True)
    halves = [h.clone().requires_grad_() for h in whole.detach().chunk(2)]
    opt_whole = torch.optim.Adam([whole], lr=lr)
    opt_halves = [torch.optim.Adam([h], lr=lr) for h in halves]  # two optimizers, two states
    for _ in range(steps):
        g = torch.randn(numel)  # the same gradient for both
        whole.grad = g.clone()
        for h, part in zip(halves, g.chunk(2), strict=True):
            h.grad = part.clone()
        for opt in [opt_whole, *opt_halves]:
            opt.step()
    diff = (torch.cat([h.detach() for h in halves]) - whole.detach()).abs().max().item()
    shapes = lambda opt, p: [tuple(v.shape) for v in opt.state[p].values()]  # each state's shape
    half = shapes(opt_halves[0], halves[0])
    return dict(steps=steps, diff=diff, whole=shapes(opt_whole, whole), half=half)


lab.show_adam_in_pieces(adam_in_pieces(steps=5, numel=10))

# %% [markdown]
# Identical, and each half's optimizer holds states for its half only. That is all stage 1 needs:
# rank r keeps the optimizer states of **its** 1/N of the elements, steps those, and the ranks
# exchange the results. (An optimizer that mixes elements, such as LAMB's per-tensor trust ratio,
# does not split this way; `minizero.parallelize` refuses those for ZeRO: section 9.)
#
# ## 2. The layout: flatten, pad, shard
#
# 1/N of a (37, 13) matrix is not a tensor. So ZeRO lays the parameters end to end in a flat buffer
# and cuts the buffer, not the tensors. minizero does it per **bucket** (lesson 01's buckets): each
# bucket's flat buffer is zero-padded to a multiple of N and cut into N equal chunks, and **rank r
# owns chunk r of every bucket** (`minizero/bucket.py`). A parameter may straddle two chunks.
#
# ## Exercise 1 — `MyBucket`: the flat layout
#
# Write the layout of one bucket, as minizero's `Bucket` has it. `MyBucket(params, index, world)`
# lays `params` end to end:
#
# * `offsets[i]`: where `params[i]` starts in the flat buffer; `numel`: the total of elements;
# * `shard`: the chunk every rank owns, `numel / world` **rounded up** (equal chunks, or the
#   collectives cannot cut the buffer); `padded = shard * world`, the last `padded - numel` elements
#   zeros;
# * `view(flat, p)`: the elements of `flat` (padded,) that belong to `p`, **as a view** shaped like
#   `p` (so `p.data` and `p.grad` can live inside the flat buffer);
# * `chunk(flat, rank)`: rank `rank`'s (shard,) chunk of `flat`, also a view;
# * `flatten(tensors, dtype=None)`: a new zero-padded (padded,) buffer holding `tensors[i]` in
#   `params[i]`'s place (dtype: the tensors' unless given).


# %%
class MyBucket:
    """``params`` end to end in a flat buffer of ``padded`` elements, ``world`` chunks."""

    def __init__(self, params: list[torch.nn.Parameter], index: int, world: int = 1):
        self.params, self.index, self.world = params, index, world
        self._slot = {id(p): i for i, p in enumerate(params)}  # id(param) -> its position
        # BEGIN SOLUTION
        # TODO: offsets, numel, shard and padded describe params end to end in world equal chunks
        # HINT: offsets[i] is the number of elements of the parameters before params[i]: a running
        #       sum from 0. numel is the total of every p.numel().
        # HINT: shard is numel / world rounded UP (-(-numel // world) in integers), so that world
        #       equal chunks cover every element; padded = shard * world, the buffer's length.
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard = -(-n // world)  # ceil: rank r owns [r * shard, (r + 1) * shard)
        self.padded = self.shard * world  # numel rounded up to a multiple of world
        # END SOLUTION

    def view(self, flat: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        """The view of ``flat`` (padded,) that belongs to ``p``, shaped like ``p``."""
        # BEGIN SOLUTION
        # TODO: the elements of flat that are p's, shaped like p, sharing flat's memory
        # HINT: self._slot[id(p)] is p's position i. A slice, flat[offsets[i] : offsets[i] +
        #       p.numel()], is a view of flat, and .view(p.shape) of it is still one.
        i = self._slot[id(p)]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)
        # END SOLUTION

    def chunk(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Chunk ``rank`` of ``flat`` (padded,): a (shard,) view."""
        # BEGIN SOLUTION
        # TODO: rank's chunk of flat, shard elements, sharing flat's memory
        # HINT: Rank r owns [r * shard, (r + 1) * shard) of flat; return that slice (a view).
        return flat[rank * self.shard : (rank + 1) * self.shard]
        # END SOLUTION

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None):
        """Copy one tensor per parameter into a new zero-padded flat buffer (padded,)."""
        # BEGIN SOLUTION
        # TODO: a new zero-padded (padded,) buffer with each tensor in its parameter's place
        # HINT: view() already finds each parameter's place in a flat buffer:
        #       flat = torch.zeros(self.padded, dtype=dtype or tensors[0].dtype, device=...)
        #       for p, t in zip(self.params, tensors):
        #           ...  # t into p's view of flat
        #       return flat
        flat = torch.zeros(self.padded, dtype=dtype or tensors[0].dtype, device=tensors[0].device)
        for p, t in zip(self.params, tensors, strict=True):
            self.view(flat, p).copy_(t)
        return flat
        # END SOLUTION


# %% check="MyBucket"
# Your layout against minizero's Bucket on five sets of shapes and world sizes 1, 2, 3, 4, 8 (the
# MLP's 1,837 elements over 3 ranks; 5 elements over 8 ranks): offsets, shard, padded, the
# views and chunks (values, shapes, and that they share the flat buffer's memory), and flatten.
lesson02.check_bucket(MyBucket)

# %% [markdown]
# minizero's `Bucket` is the same code. The cell lays out the MLP (Ψ = 1,837, an odd number on
# purpose) in 2 KiB buckets for N ranks, with it:

# %%
lab.show_bucket_ownership(lab.bucket_ownership(MLP(), bucket_cap_mb=0.002, world=NPROCS))

# %% [markdown]
# Every rank owns the same number of elements, so optimizer memory divides exactly by N, for at most
# N − 1 zeros of padding per bucket.
#
# ## 3. The step: reduce-scatter, step, all-gather
#
# DDP all-reduces the gradients, then every rank steps *every* element. Stage 1 puts the optimizer
# step **between the two halves** of that all-reduce (lesson 00):
#
# 1. backward fills each bucket's flat gradient buffer (the full local gradient);
# 2. **reduce-scatter** each bucket: rank r receives the sum of chunk r only; divide by N (volume
#    Ψ);
# 3. the optimizer steps chunk r: its states are (shard,) tensors, 1/N of the model;
# 4. **all-gather** the updated chunks: every rank has every parameter again (volume Ψ).
#
# Total 2Ψ, DDP's volume (§7.2.1): stage 1 saves memory for free. What minizero's `ZeRO1`
# (`minizero/zero1.py`) gives you:
#
# * `self.buckets`; `b.chunk(flat, r)` is the (shard,) view of chunk r, `b.index` its position;
# * `self.grad_buffers[i]`: bucket i's flat gradient (padded,); every `p.grad` is a view into it;
# * `self.flat_params[i]`: bucket i's flat parameters (padded,); every `p.data` is a view into it;
# * `self.optim_params[i]`: what the optimizer steps for bucket i, (shard,): in fp32 it *is*
#   `b.chunk(self.flat_params[i], self.rank)`, in mixed precision a separate fp32 copy (part of K);
# * `self.rank`, `self.world`, `self.group` (pass `group=self.group` to every collective),
#   `self.precision.master` (True in mixed precision).
#
# The optimizer's `step()` runs `before_step()` (given: it calls `finish_grad_sync()` and hands the
# optimizer its chunk's gradients), the optimizer's step on this rank's elements, and
# `after_step()`. How your optimizer's param groups are kept:
# [fragments](../docs/machinery.md#stage-1s-fragments).

# %% [markdown]
# ## Exercise 2 — `MyZeRO1`: the two collectives of stage 1
#
# * `finish_grad_sync()`: leave in each of this rank's chunks the gradient **averaged** over the
#   ranks of `self.group`, for that chunk only, moving Ψ in all. Which collective of lesson 00 does
#   that, and what must follow it? (Its output may be the chunk of its own input, in place.) Divide
#   by N after the sum, except in fp16, a 16-bit format whose largest value is 65504 (section 7):
#   there the gradients are scaled up and a sum of N of them can overflow, so divide each rank's
#   buffer before the sum. `minizero.precision.divides_before_sum(flat)` says which.
# * `after_step()`: the optimizer has updated this rank's chunk of each bucket only. Make every rank
#   hold every updated chunk, moving Ψ. In mixed precision the optimizer stepped a separate fp32
#   master, not the bf16 parameters: what must happen first?
#
# The check runs your class on 3 ranks and on a subgroup of 2, in fp32, bf16 and fp16, against
# minizero's `ZeRO1` bit for bit: use `self.world` and `self.group`, never a constant.


# %%
class MyZeRO1(ZeRO1):
    """ZeRO stage 1 (P_os): your reduce-scatter and all-gather around the optimizer's step."""

    def finish_grad_sync(self) -> list[torch.Tensor]:
        """Average every bucket's gradient over the ranks into this rank's chunk of it."""
        # (shard,) per bucket: chunk `self.rank` of the (padded,) flat gradient buffer
        chunks = [b.chunk(g, self.rank) for b, g in zip(self.buckets, self.grad_buffers)]
        # (called once a step: clip_grad_norm_() and step() share its result)
        # BEGIN SOLUTION
        # TODO: each chunk holds its elements' gradient, averaged over the group's ranks
        # HINT: Lesson 00: a reduce-scatter leaves on rank r chunk r of the sum over the ranks,
        #       and moves Ψ where an all-reduce moves 2Ψ. One per bucket.
        # HINT: Its input is the bucket's whole (padded,) gradient buffer (self.grad_buffers),
        #       its output this rank's (shard,) chunk of it, already in chunks: a view of the
        #       same buffer, which NCCL allows. Pass group=self.group. The collective sums:
        #       divide by self.world, once: before the sum where divides_before_sum(flat) (fp16,
        #       which could overflow), after it otherwise.
        # HINT: for b, flat, chunk in zip(self.buckets, self.grad_buffers, chunks):
        #           if divides_before_sum(flat):
        #               flat.div_(self.world)
        #           reduce_scatter(chunk, flat, group=self.group, tag=f"grads {b.index}")
        #           ...  # sum -> average, where not divided before
        for b, flat, chunk in zip(self.buckets, self.grad_buffers, chunks, strict=True):
            before = divides_before_sum(flat)  # fp16: N scaled gradients could overflow the sum
            if before:
                flat.div_(self.world)
            reduce_scatter(chunk, flat, group=self.group, tag=f"grads {b.index}")
            if not before:
                chunk.div_(self.world)  # sum over ranks -> average
        # END SOLUTION
        return chunks

    def after_step(self) -> None:
        """The optimizer has stepped this rank's optim_params: every rank gets every new chunk."""
        with torch.no_grad():
            for b, stepped, flat in zip(self.buckets, self.optim_params, self.flat_params):
                own = b.chunk(flat, self.rank)  # (shard,) view: this rank's chunk of the params
                # BEGIN SOLUTION
                # TODO: every rank's flat holds every rank's updated chunk
                # HINT: The optimizer stepped self.optim_params. In fp32 each IS this rank's chunk
                #       own; in mixed precision (self.precision.master) it is a separate fp32 copy,
                #       so copy it into own (16-bit) first.
                # HINT: An all-gather of own (shard,) into flat (padded,) over self.group gives
                #       every rank every chunk, Ψ in all:
                #       if self.precision.master:
                #           own.copy_(...)  # the 16-bit chunk takes the stepped fp32 master
                #       all_gather(...)  # flat from own over self.group, tag f"params {b.index}"
                if self.precision.master:
                    own.copy_(stepped)  # fp32 master -> bf16/fp16 working copy
                all_gather(flat, own, group=self.group, tag=f"params {b.index}")
                # END SOLUTION


# %% check="MyZeRO1"
# 3 Adam steps of the MLP (3 buckets, padded) on max(NPROCS, 3) ranks, step by step: the gradient
# chunks your optimizer steps with against minizero's ZeRO1, the parameters against one process on
# the whole batch, torch's ZeroRedundancyOptimizer and ZeRO1; then one SGD step in bf16 and in
# fp16 against ZeRO1 in the same precision, gradient chunks and parameters equal bit for bit; one
# reduce-scatter + one all-gather per bucket (2Ψ).
lesson02.check_zero1(MyZeRO1, NPROCS)

# %% [markdown]
# ## 4. Memory per rank: measured against the formula
#
# From here on the cells use `minizero.parallelize(model, stage, ...)`, whose stage 1 is the class
# you just completed. Each rank trains TinyGPT for one step with Adam under DDP and stage 1, in fp32
# and bf16, and measures the bytes of each model state it holds (`model_state_bytes`: every live
# tensor's storage, once), beside the paper's formula (`paper_model_state_bytes`). In fp32 the
# parameters are their own master, so K = 8 and gradients take 4 bytes.


# %%
RUNS = [("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1)]  # (precision, stage), Adam
print(f"TinyGPT, Ψ = {PSI:,}: bytes per rank / Ψ, beside paper_model_state_bytes")
lab.show_model_states(lab.model_states(NPROCS, RUNS))

# %% [markdown]
# Every rank measures the formula: the optimizer states (fp32 masters included) drop from KΨ to
# KΨ/N; parameters and gradients stay whole. When Ψ does not divide by N the figure is a few bytes
# above the formula: the padding.
#
# The formula's 2 + 2 + K counts 16-bit gradients, as minizero and DeepSpeed keep them. Some systems
# keep fp32 gradients on purpose, because bf16's 8-bit mantissa loses small contributions when
# gradients are accumulated (Megatron-LM's distributed optimizer, 2 + 4 + 12 bytes; FSDP2 with fp32
# parameters: [details](../docs/machinery.md#fp32-gradients-in-fsdp2-and-megatron-lm)). The fp32
# rows above measure that case. minizero's precision policy uses the names of FSDP2's
# `MixedPrecisionPolicy`: `precision="bf16"` is `minizero.Precision(param_dtype=torch.bfloat16)`,
# and `reduce_dtype=torch.float32` asks for fp32 gradient buckets, reduction and accumulation.
# Measured:

# %%
FP32_GRADS = minizero.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STATES = lab.model_states(NPROCS, [(FP32_GRADS, 0), (FP32_GRADS, 1)])
lab.show_model_states(STATES, label="bf16 + fp32 gradients")
print(f"formula: DDP 2 + 4 + 12 = 18Ψ; stage 1 2 + 4 + 12/{NPROCS} = {6 + 12 / NPROCS:.3f}Ψ")

# %% [markdown]
# ## 5. How it scales with N
#
# The formula says stage 1 tends to 4Ψ per rank in mixed precision (the 16-bit parameters and
# gradients), 4x less than DDP's 16Ψ, and gets most of the way at small N. The cell measures every N
# from 1 to `SWEEP` in one launch: the first n ranks form their own group (`dist.new_group`), as
# `parallelize(..., process_group=...)` allows.

# %%
SWEEP = NPROCS if INFO["backend"] == "nccl" else 4
FORMULA = {0: lambda n: 2 + 2 + 12, 1: lambda n: 2 + 2 + 12 / n}  # bf16 + Adam: bytes / Ψ
lab.plot_states_over_world(lab.states_over_world(SWEEP, stages=(0, 1)), FORMULA)

# %% [markdown]
# The dots (every rank of every group; they coincide) sit on the lines. The lines beyond the
# dots are the formula alone; for large models the paper's Table 1 lists it, and
# `minizero.analysis.memory.table1_gb` recomputes it, e.g. 7.5B parameters on 64 ranks:

# %%
lab.show_table1("7.5B", world=64, stages=(1, 2, 3))

# %% [markdown]
# ## 6. Inside one step
#
# `model_state_bytes` is a snapshot. `MemoryMeter` follows a whole step: at each mark it splits the
# memory this rank holds into parameters, gradients, optimizer states, communication buffers and the
# rest (activations), and keeps the peak (the caching allocator on GPUs, every tensor storage on
# CPUs). A meter is a `with` block around the step; `meter.mark(label)` takes a reading. Each rank
# runs `one_step_memory`, in bf16, DDP against stage 1; the prediction after the step: optimizer
# states 12Ψ at stage 0, 12Ψ/N at stage 1.


# %%
# @save
def one_step_memory(stage: int, precision: str, bucket_cap_mb: float | None = None) -> dict:
    """On every rank: TinyGPT through one Adam step at ``stage``, read by a ``MemoryMeter``."""
    torch.manual_seed(0)
    kw = {} if bucket_cap_mb is None or stage == 3 else dict(bucket_cap_mb=bucket_cap_mb)
    model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam, precision=precision, **kw)
    x, y = gpt_batch(0)  # this rank's rows of step 0
    with MemoryMeter(model, opt) as meter:  # what this rank holds, by category, and the peak
        meter.mark("start")
        loss = model(x, y)
        meter.mark("after forward")
        loss.backward()
        meter.mark("after backward")
        opt.step()
        opt.zero_grad()
        meter.mark("after step")
    return dict(marks=meter.marks, info=run_info())


# %%
STEPS = {s: minizero.launch(one_step_memory, NPROCS, s, "bf16", verbose=False)[0] for s in (0, 1)}
lab.plot_memory_per_step(STEPS, "TinyGPT, one bf16 Adam step")
lab.show_after_step(STEPS)

# %% [markdown]
# Before the first step the optimizer holds only the fp32 masters (Adam creates its moments in its
# first step); after it, stage 1 holds 12Ψ/N of optimizer states where DDP holds 12Ψ. Every rank
# still holds the full 2Ψ of bf16 gradients, though after the reduce-scatter it reads only its
# chunk: stage 2 (lesson 03) stops keeping the rest. Activations are not model states, and ZeRO-DP
# leaves them alone (lesson 06).
#
# ## 7. fp16: loss scaling, and a step that every rank skips
#
# bf16 has fp32's exponent range; **fp16** does not: its largest value is 65504, its smallest normal
# 2^-14 ≈ 6.1e-5 (subnormals down to 2^-24 keep fewer bits), and smaller is 0. Gradients are small,
# so in fp16 many lose bits or vanish. **Loss scaling** (Micikevicius et al., *Mixed Precision
# Training*, ICLR 2018) multiplies the loss by s before backward and divides s out of the gradients,
# in fp32, before the step. Too large a scale overflows to inf. The cell computes TinyGPT's
# gradients in fp16 for several scales, against fp32.

# %%
lab.show_fp16_gradients(lab.fp16_gradients(log2_scales=(0, 8, 12, 15, 16)))

# %% [markdown]
# At scale 1 some gradient elements flush to 0 and many more are subnormal; a larger scale lifts
# them into fp16's normal range. At 2^16 everything is inf *in this cell*, because it computes the
# loss itself in fp16 (the loss's gradient with respect to itself is the scale); under autocast the
# loss is fp32. The useful scale changes during training, so it is **dynamic**: start high (torch's
# `GradScaler` and minizero's `LossScaler`, `minizero/precision.py`, start at 2^16); when a step's
# gradients hold an inf or a NaN, **skip the step** and halve the scale; after a long run of good
# steps, double it. A skipped step costs one batch; a step taken with an inf destroys the
# parameters.
#
# With sharded gradients the skip is a collective decision. If rank 1 finds an inf and rank 0 does
# not, and rank 0 steps while rank 1 skips, the ranks all-gather chunks from different steps and
# diverge. So every rank unscales and checks its shards, and one all-reduce of a found-inf flag
# tells every rank whether any rank found one.
#
# ## Exercise 3 — `fp16_step`: skip on every rank, or on none
#
# Write `fp16_step(optimizer, masters, scale, group=None)`. `masters` are this rank's (shard,) fp32
# tensors the optimizer steps; each `m.grad` is its gradient shard, still multiplied by `scale`.
# Divide every gradient by `scale` (in place); count the elements that are not finite
# (`torch.isfinite`) over all shards into one small tensor; sum it over the ranks with **one**
# `all_reduce(flag, group=group)` (`minizero.collectives`); if the sum is 0, `optimizer.step()` and
# return `scale`; else skip the step and return `scale / 2`.


# %%
def fp16_step(
    optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], scale: float, group=None
) -> float:
    """Unscale this rank's gradient shards; step unless some rank saw an inf or a NaN."""
    # BEGIN SOLUTION
    # TODO: gradients unscaled; every rank stepped and returns scale, or none did and all halve it
    # HINT: The decision must be the same on every rank, and a rank sees only its own shards: each
    #       rank counts what it finds, and one collective adds the counts.
    # HINT: Unscale first, in place and in fp32: m.grad.div_(scale) for every master m. Then count
    #       the elements that are not finite, (~torch.isfinite(m.grad)).sum(), into one (1,) tensor
    #       on the masters' device.
    # HINT: One all_reduce(found, group=group) sums the counts over the ranks. 0: no rank saw an inf
    #       or a NaN, so optimizer.step() and return scale. Otherwise do not step; return scale / 2.
    # HINT: found = torch.zeros(1, device=masters[0].device)
    #       for m in masters:
    #           m.grad.div_(scale)
    #           found += ...  # how many elements of m.grad are not finite
    #       all_reduce(found, group=group, tag="fp16 inf check")
    #       if found.item():
    #           return scale / 2
    #       optimizer.step()
    #       return scale
    found = torch.zeros(1, device=masters[0].device)  # (1,) non-finite elements on this rank
    for m in masters:
        m.grad.div_(scale)  # unscale in fp32, before anything reads the gradient
        found += (~torch.isfinite(m.grad)).sum()
    all_reduce(found, group=group, tag="fp16 inf check")  # one collective for every shard
    if found.item():  # some rank saw an inf or a NaN: every rank skips
        return scale / 2
    optimizer.step()
    return scale
    # END SOLUTION


# %% check="fp16_step"
# On max(NPROCS, 3) ranks, then on a subgroup of 2, three calls with SGD on three master shards per
# rank, scale 1024: every gradient finite (the step must use the unscaled gradient); an inf in the
# last rank's shard only; a NaN in rank 0's shard only (no rank may step, every rank must halve the
# scale); one all-reduce per call.
lesson02.check_fp16_step(fp16_step, NPROCS)

# %% [markdown]
# minizero's stages do the same in `before_step()` when `precision="fp16"`, before the
# optimizer's step. Clipping by the global gradient norm also needs every rank: lesson 03.
#
# ## 8. Communication: still 2Ψ
#
# Same TinyGPT step, with a `CommLedger` open: what each stage sent, in the paper's volume
# (an all-reduce of S elements counts 2S, a reduce-scatter or an all-gather of S counts S).


# %%
lab.show_step_volume(lab.step_volume(NPROCS, stages=(0, 1)))  # the formula: 2Ψ at both

# %% [markdown]
# The same volume, split differently: DDP's all-reduce 2Ψ, stage 1's reduce-scatter Ψ and all-gather
# Ψ. The time depends on the backend: NCCL has a native reduce-scatter; on gloo, whose own (in
# PyTorch) is an all-reduce of a clone, minizero sends each chunk straight to its owner (lesson 00).
#
# ## 9. PyTorch's stage 1, and the layouts of real systems
#
# `torch.distributed.optim.ZeroRedundancyOptimizer` (the check compared your class with it) gives
# **whole parameter tensors** to ranks, greedily by size, keeps DDP's all-reduce for the gradients,
# and after each step **broadcasts** every parameter from its owner. No padding, but the split is
# only as even as the tensor sizes allow:

# %%
lab.show_optimizer_share(lab.optimizer_share(NPROCS))

# %% [markdown]
# Flat chunks split every bucket evenly; whole tensors cannot: the MLP's `layers.1.weight` alone is
# 1,073 of its 1,837 parameters.
#
# **How the systems you will read next lay it out.** minizero cuts *every bucket* into N chunks, one
# reduce-scatter a bucket. **DeepSpeed** stages 1 and 2 (`deepspeed/runtime/zero/stage_1_and_2.py`)
# give rank r one contiguous 1/N of each whole parameter group; with its default
# `use_multi_rank_bucket_allreduce=True` a gradient bucket ends in a **full all-reduce**, each rank
# keeping its slice, so a step moves about 3Ψ, not 2Ψ. **`ZeroRedundancyOptimizer`** gives whole
# tensors and broadcasts (lesson 06 measures that volume). **FSDP2** (`fully_shard`, lesson 04)
# shards each parameter on its first dimension, as a `DTensor`. The elementwise restriction of
# section 1 comes from minizero's flat 1-D shards, not from ZeRO: a layout of whole tensors can run
# any optimizer that updates one tensor at a time.
#
# **Summary.** Stage 1 keeps DDP's algorithm and its 2Ψ of communication, and moves the optimizer
# step between the two halves of the all-reduce, so each rank steps, and keeps states for, its 1/N
# of every bucket: KΨ becomes KΨ/N. Next, **lesson 03**: the gradients, still held in full.
