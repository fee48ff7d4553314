# %% [markdown]
# # Lesson 03 — ZeRO stage 2: partition the gradients too (P_os+g)
#
# After lesson 02, rank r steps only its chunk r of every bucket, so of the averaged gradient it
# only ever reads chunk r, Ψ/N elements. Yet it holds the whole gradient, 2Ψ bytes in mixed
# precision, from backward to the step. **Stage 2** (ZeRO §5.2, P_os+g) keeps only the chunk:
#
# | | per-rank model states | volume per step |
# |---|---|---|
# | stage 1 (P_os) | 2Ψ + 2Ψ + KΨ/N | 2Ψ |
# | **stage 2 (P_os+g)** | **2Ψ + (2 + K)Ψ/N** | **2Ψ** |
#
# The gradient of a bucket exists in full only for a moment: backward fills the bucket, its
# reduce-scatter starts at once (while backward goes on with earlier layers, as DDP's
# all-reduce did in lesson 01), the averaged chunk is added into a small persistent (shard,)
# buffer, and the full buffer is freed. The paper reduces the gradients bucket by bucket,
# overlapped with backward, each rank receiving the reduced gradients of its partition (§5.2),
# and counts Ψ for this reduce-scatter plus Ψ for the all-gather of the parameters (§7.2.1).
# You will write the hook that does it, and the gradient clipping that sharded gradients need.
#
#     python -m minizero grade my-lessons/03_zero2.ipynb

# %%
from minizero.course.labs.lesson03 import *  # torch, minizero, hint, lab, lesson03, ZeRO2, ...

NPROCS, INFO = setup(**{"TinyGPT Ψ": PSI})  # PSI: Ψ of the model the measurements use

# %% [markdown]
# ## 1. What stage 1 holds and never reads
#
# One bf16 backward of TinyGPT under stage 1, on rank 0: the gradient bytes it holds (the formula:
# 2Ψ), and the bytes the optimizer then reads (its (shard,) chunks: 2Ψ/N). Each measurement is one
# function of `minizero/course/labs/lesson03.py`, with one beside it that shows the result.


# %%
FORMULA = {"held": 2, "read": 2 / NPROCS}  # bf16 gradient bytes / Ψ: the whole, chunk r of it
lab.show_stage1_gradients(lab.stage1_gradients(NPROCS), FORMULA)

# %% [markdown]
# ## 2. Stage 2: reduce-scatter during backward, keep the chunk
#
# `ZeRO2` (`minizero/zero2.py`) is `ZeRO1` with a different life for gradients. The layout is the
# same; what changes is the gradient hook. Per bucket `b`:
#
# 1. the first gradient of `b` to arrive allocates a zero (padded,) buffer, `self.filling[b.index]`
#    (None while `b` is not filling), in `self.precision.reduce_dtype` (which may differ from
#    `p.grad`'s dtype);
# 2. each gradient is copied into its slot `b.view(buffer, p)`, and **`p.grad` is dropped** (`p.grad
#    = None`): the full gradient of `p` now lives only in the bucket;
# 3. `self.pending[b.index]` counts the gradients still to come; at 0 `self.reduce_bucket(b)` starts
#    the bucket's reduce-scatter (asynchronous) **in place**, into `b.chunk(buffer, self.rank)`, and
#    remembers `self.in_flight = (b, work, buffer, output)`;
# 4. `self.finish_in_flight()` waits for it, divides the output by N and **adds** it into
#    `self.grad_shards[b.index]`, the (shard,) gradient this rank keeps (adds, so that several
#    backwards before one step sum up), then forgets the buffer, which frees it.
#
# In fp16 `reduce_bucket` has already divided the buffer by N *before* the sum
# (`minizero.precision.divides_before_sum(out)` is True): do not divide again. `reduce_bucket` first
# calls `finish_in_flight()`, so at most two full buffers are alive: one in flight, one filling. At
# the end of backward `backward_end()` (given) finishes the last; then the rest is stage 1.
#
# ## Exercise 1 — `MyZeRO2`: the gradient hook of stage 2
#
# Write `post_accumulate_grad_hook(p)` (steps 1–3; autograd calls it with the **parameter** once
# `p.grad` holds this backward's gradient) and `finish_in_flight()` (step 4).


# %%
class MyZeRO2(ZeRO2):
    """ZeRO stage 2 (P_os+g): gradients live in full only in a bucket, until its reduce-scatter."""

    def post_accumulate_grad_hook(self, p: torch.nn.Parameter) -> None:
        """Autograd calls this when ``p.grad`` holds this backward's gradient (``p``: the param)."""
        b = self.bucket_of(p)  # the bucket p belongs to
        self.queue_backward_end()  # given: runs self.backward_end() once backward is over
        # BEGIN SOLUTION
        # TODO: p's gradient lives only in its bucket's buffer; a complete bucket is reduced
        # HINT: self.filling[b.index] is the (padded,) buffer b fills in this backward; it is
        #       None until b's first gradient arrives. That one allocates it: zeros (padding must
        #       add nothing), in the reduce dtype self.precision.reduce_dtype (not always p.grad's)
        #       on p.grad's device, stored in self.filling[b.index].
        # HINT: Copy p.grad into p's slot, b.view(buf, p), then drop it: p.grad = None. Stage 2
        #       keeps no full gradient outside its bucket (the check looks for a p.grad after
        #       backward).
        # HINT: self.pending[b.index] counts b's gradients still to come: one fewer. At 0,
        #       self.reduce_bucket(b) starts b's reduce-scatter (it first finishes the one in
        #       flight).
        # HINT: buf = self.filling[b.index]
        #       if buf is None:
        #           buf = torch.zeros(b.padded, dtype=self.precision.reduce_dtype,
        #                             device=p.grad.device)
        #           self.filling[b.index] = buf
        #       b.view(buf, p).copy_(p.grad)
        #       p.grad = None
        #       ...  # one fewer pending; at 0, reduce b
        buf = self.filling[b.index]
        if buf is None:  # (padded,) zero-padded, reduce dtype; b's first gradient of this backward
            buf = torch.zeros(b.padded, dtype=self.precision.reduce_dtype, device=p.grad.device)
            self.filling[b.index] = buf
        b.view(buf, p).copy_(p.grad)
        p.grad = None  # the full gradient of p now lives only in the bucket
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:  # b is complete: reduce-scatter it while backward goes on
            self.reduce_bucket(b)
        # END SOLUTION

    def finish_in_flight(self) -> None:
        """Wait for the reduce-scatter in flight (if any); add its averaged chunk to the shard."""
        # BEGIN SOLUTION
        # TODO: nothing in flight; its chunk, averaged, is added into the bucket's gradient shard
        # HINT: self.in_flight is None or (b, work, buf, out): out, a (shard,) view of buf, holds
        #       this rank's chunk of the sum once work.wait() returns.
        # HINT: Add, do not copy (micro-batches accumulate); forgetting the tuple drops the last
        #       reference to buf, which frees it. In fp16 reduce_bucket divided before the sum:
        #       if self.in_flight is not None:
        #           b, work, _buf, out = self.in_flight
        #           work.wait()
        #           if not divides_before_sum(out):
        #               ...  # the sum -> the average: out divided by self.world, in place
        #           self.grad_shards[b.index].add_(out)
        #           self.in_flight = None
        if self.in_flight is not None:
            b, work, _buf, out = self.in_flight
            work.wait()
            if not divides_before_sum(out):  # fp16: reduce_bucket divided before the sum
                out.div_(self.world)
            self.grad_shards[b.index].add_(out)  # (shard,) += average
            self.in_flight = None  # the last reference to buf (out is a view of it): freed
        # END SOLUTION


# %% check="MyZeRO2"
# 3 Adam steps of the MLP (3 buckets), the second over 2 micro-batches: gradient chunks against
# minizero's ZeRO2, parameters against one process, FSDP2 (reshard_after_forward=False) and
# ZeRO2; then one SGD step over 2 micro-batches in bf16, fp16 and bf16 reduced in fp32 against
# ZeRO2 in the same precision, bit for bit; no p.grad after backward, every
# reduce-scatter started during backward, no more full bucket buffers (two), nor bytes of them,
# alive at once than ZeRO2; one reduce-scatter per bucket per backward and one all-gather.
lesson03.check_zero2(MyZeRO2, NPROCS)

# %% [markdown]
# FSDP2 with `reshard_after_forward=False` is PyTorch's closest relative of stage 2: it
# reduce-scatters gradients during backward and keeps only its shard, per parameter rather than per
# flat bucket. DeepSpeed's stage 2 also reduces during backward, bucket by bucket (by default with a
# whole all-reduce: lesson 02, section 9).
#
# ## 3. Memory per rank: measured against the formula
#
# From here on `minizero.parallelize(model, 2, ...)` is the class you just completed. First the
# model states after one step, on every rank, stage 1 against stage 2, fp32 and bf16:


# %%
RUNS = [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]  # (precision, stage), Adam
print(f"TinyGPT, Ψ = {PSI:,}: bytes per rank / Ψ, beside paper_model_state_bytes")
lab.show_model_states(lab.model_states(NPROCS, RUNS))

# %% [markdown]
# The gradients kept between steps, `grad_shards`, are 2Ψ/N (bf16) or 4Ψ/N (fp32), as the formula
# says. But during backward the buckets hold full gradients for a while. The next cell runs one
# backward per `bucket_cap_mb` and measures, after every hook, the full-size buffers alive
# (`model_state_bytes(..., include_comm=True)["comm"]`), keeping the maximum.

# %%
CAPS = [0.01, 0.03, 0.1, 0.3, 25]  # MiB; 25 holds all of TinyGPT in one bucket
PEAKS = lab.bucket_peaks(NPROCS, CAPS)  # stage 2, bf16, one backward, rank 0
lab.plot_bucket_peaks(PEAKS, kept=2 / NPROCS, stage1=2)  # the formula: 2Ψ/N kept; stage 1: 2Ψ

# %% [markdown]
# With one bucket (25 MiB) the whole gradient is alive at the end of backward, plus the kept chunks:
# at its peak stage 2 holds *more* than stage 1. With small buckets the peak approaches the
# formula's 2Ψ/N, for more reduce-scatters, each paying a latency: `bucket_cap_mb` trades peak
# memory for message count (DeepSpeed's `reduce_bucket_size`).
#
# **What the backend adds.** minizero's reduce-scatter is in place, but the backend may still copy.
# The cell measures one in-place reduce-scatter of a 4 MiB buffer with `MemoryMeter`: before, at its
# peak, and after `wait()`.


# %%
lab.show_reduce_scatter_memory(lab.reduce_scatter_memory(NPROCS, mib=4))  # fp32, rank 0

# %% [markdown]
# On **gloo** the extra is a buffer of (N−1)/N of the input, kept until the collective completes:
# minizero's reduce-scatter receives the other ranks' chunks r into it, then adds them to its own
# (lesson 00; PyTorch's own, an all-reduce of a clone, holds the whole input). Stage 2 holds two
# full bucket buffers and (N−1)/N of a third at its worst. **NCCL** reduce-scatters in place.
# Either way the extra is per bucket in flight, so small buckets keep it small.
#
# ## 4. One step, mark by mark
#
# `MemoryMeter` over one bf16 step of stages 1 and 2 (0.03 MiB buckets), on rank 0:
# `lab.memory_per_step` runs lesson 02's `one_step_memory` at each stage.

# %%
STEPS = lab.memory_per_step(NPROCS, stages=(1, 2), precision="bf16", bucket_cap_mb=0.03)
lab.plot_memory_per_step(STEPS, "TinyGPT, one bf16 Adam step", cats=lab.MEMORY_CATS)
lab.show_grads_after_backward(STEPS, formula={1: 2, 2: 2 / NPROCS})  # bf16 gradients / Ψ

# %% [markdown]
# Parameters, optimizer states and activations are the same under both stages; the gradient bar
# shrinks from 2Ψ to 2Ψ/N. Every rank still holds the 2Ψ of parameters in full.
#
# ## 5. Communication: the same 2Ψ, started earlier
#
# A `CommLedger` over one step of each stage: volume per op, and how many reduce-scatters were
# issued during backward, before the mark `minizero.collectives.mark("step")`.


# %%
PAPER = {1: 2, 2: 2}  # volume per step / Ψ: reduce-scatter Ψ + all-gather Ψ
COMM = lab.reduce_scatters_in_backward(NPROCS, stages=(1, 2), bucket_cap_mb=0.03)
lab.show_reduce_scatters_in_backward(COMM, PAPER)

# %% [markdown]
# Same volume, Ψ + Ψ. Stage 1's reduce-scatters wait for `optimizer.step()`; stage 2's run during
# backward, where on GPUs they overlap with computation.
#
# ## 6. The price: gradient accumulation communicates every backward
#
# With several backwards per step, DDP and stage 1 accumulate full local gradients and communicate
# once (DDP inside `no_sync()`). Stage 2 keeps no full gradient, so each backward reduce-scatters
# into the chunk. FSDP2's `set_requires_gradient_sync(False)` keeps the full gradients across
# micro-batches instead, paying their memory for 1/k of the communication; minizero's stage 2 does
# the same inside `no_sync()` (or with nanoGPT's `require_backward_grad_sync = False`). Measured
# over 4 micro-batches per step, stage 2 both ways:


# %%
MICRO = 4  # micro-batches (backwards) per optimizer step
FORMULA = {  # (stage, all but the last backward in no_sync()) -> volume per step / Ψ
    (1, False): 2,  # one reduce-scatter + one all-gather
    (2, False): MICRO + 1,  # a reduce-scatter per backward + one all-gather
    (2, True): 2,  # only the last backward reduce-scatters
}
lab.show_accumulation_volume(lab.accumulation_volume(NPROCS, list(FORMULA), MICRO), FORMULA)

# %% [markdown]
# Stage 1: 2Ψ per step, however many micro-batches. Stage 2: one reduce-scatter per backward,
# (micro-batches + 1)Ψ; inside `no_sync()` back to 2Ψ, holding the full gradient, the memory it was
# built to save.
#
# ## 7. Clipping: a norm no rank can compute alone
#
# Clipping by the global norm (`torch.nn.utils.clip_grad_norm_(params, max_norm)`) scales the whole
# gradient by min(1, max_norm / ‖g‖), ‖g‖ the L2 norm of *every* element. After stage 2's backward
# each rank holds only its chunks. The cell measures each rank's norm of its chunks beside one
# process's norm on the whole batch.


# %%
lab.show_shard_norms(lab.shard_norms(NPROCS))  # fp32, stage 2, one backward

# %% [markdown]
# No rank's own norm is the norm; the squares add up across ranks. So each rank sums the squares of
# its chunks, **one** all-reduce adds the sums, and every rank scales its chunks by the same
# coefficient. Only elements of parameters count: minizero's padding is zeros, but a buffer from
# `torch.empty` or a reused one may hold anything there.
#
# ## Exercise 2 — `clip_grad_norm_` on shards
#
# Write `clip_grad_norm_(shards, valid, max_norm, group=None)`: `shards[i]` is this rank's (shard,)
# chunk of bucket i's averaged gradient; its first `valid[i]` elements are gradient, the rest
# padding (any value). Sum the squares of the real elements (in fp32) into one tensor; `all_reduce`
# it over `group` (`minizero.collectives`), once; the norm is its square root. Multiply every shard
# in place by `min(1, max_norm / (norm + 1e-6))` (as torch does), and return the norm.


# %%
def clip_grad_norm_(
    shards: list[torch.Tensor], valid: list[int], max_norm: float, group=None
) -> torch.Tensor:
    """Scale this rank's gradient shards so the global L2 norm is at most ``max_norm``."""
    # BEGIN SOLUTION
    # TODO: shards scaled in place to a global norm of at most max_norm; returns that global norm
    # HINT: ‖g‖² is a sum of squares, and sums add across ranks: each rank sums the squares of its
    #       own elements, one all-reduce adds the ranks' sums, and the square root is the norm, the
    #       same on every rank.
    # HINT: Only the first n = valid[i] elements of shard i are gradient (s[:n]); the rest is
    #       padding of any value. Sum their squares in fp32 into one 0-d fp32 tensor on the shards'
    #       device, then all_reduce it over group, once.
    # HINT: The coefficient is min(1, max_norm / (norm + 1e-6)): torch.clamp(max_norm / (norm +
    #       1e-6), max=1.0), a tensor. Multiply every shard by it in place (mul_, in the shard's
    #       dtype) and return norm.
    # HINT: sq = torch.zeros((), dtype=torch.float32, device=shards[0].device)
    #       for s, n in zip(shards, valid):
    #           sq += s[:n].float().pow(2).sum()
    #       all_reduce(sq, group=group, tag="grad norm")
    #       norm = sq.sqrt()
    #       coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    #       ...  # every shard times coef, in place, in its dtype
    #       return norm
    sq = torch.zeros((), dtype=torch.float32, device=shards[0].device)  # () this rank's part
    for s, n in zip(shards, valid, strict=True):
        sq += s[:n].float().pow(2).sum()  # the padding s[n:] is no parameter's: left out
    all_reduce(sq, group=group, tag="grad norm")  # every rank's squares: the global sum
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for s in shards:
        s.mul_(coef.to(s.dtype))
    return norm
    # END SOLUTION


# %% check="clip_grad_norm_"
# On max(NPROCS, 3) ranks, then on a subgroup of 2, the MLP's 1,837-element gradient in 2 KiB
# buckets, each rank's chunks with their padding filled with 3.0: your norm and clipped shards
# against torch.nn.utils .clip_grad_norm_ on the whole gradient, for a max_norm that clips and one
# that does not; one all-reduce per call.
lesson03.check_clip_grad_norm(clip_grad_norm_, NPROCS)

# %% [markdown]
# minizero's stages clip the same way in `optimizer.clip_grad_norm_(max_norm)`
# (`minizero/habits/sharded_grad.py`). Stage 1 needs the same one all-reduce: after its
# reduce-scatter a rank has only its own chunk averaged. In fp16, unscale first (lesson 02).
#
# **Summary.** Stage 2 keeps a bucket's full gradient only until its reduce-scatter, started from
# the hook during backward, and keeps rank r's averaged chunk: gradients go from 2Ψ to 2Ψ/N per
# rank, the volume stays 2Ψ. Next, **lesson 04 — stage 3**: the parameters themselves.
