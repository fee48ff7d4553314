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
# One bf16 backward of TinyGPT under stage 1, measured on rank 0: the gradient bytes it holds
# (the formula: the whole gradient, 2Ψ), and the bytes the optimizer then reads (the (shard,)
# chunks handed to it: 2Ψ/N). Each measurement of this lesson is one function of its lab,
# `minizero/course/labs/lesson03.py`, and one beside it that shows the result: read them there.


# %%
FORMULA = {"held": 2, "read": 2 / NPROCS}  # bf16 gradient bytes / Ψ: the whole, chunk r of it
lab.show_stage1_gradients(lab.stage1_gradients(NPROCS), FORMULA)

# %% [markdown]
# ## 2. Stage 2: reduce-scatter during backward, keep the chunk
#
# `ZeRO2` (`minizero/zero2.py`) is `ZeRO1` with a different life for gradients. The layout is
# the same (buckets, flat buffers padded to a multiple of N, rank r owns chunk r); what changes
# is what the gradient hook does. Per bucket `b`:
#
# 1. the first gradient of `b` to arrive in backward allocates a zero (padded,) buffer,
#    `self.filling[b.index]` (None while `b` is not filling), in the policy's reduce dtype
#    `self.precision.reduce_dtype` (bf16 gradients may be reduced in fp32: then it is not
#    `p.grad`'s dtype);
# 2. each gradient is copied into its slot `b.view(buffer, p)`, and **`p.grad` is dropped**
#    (`p.grad = None`): the full gradient of `p` now lives only in the bucket;
# 3. `self.pending[b.index]` counts the gradients still to come; when it reaches 0 the bucket
#    is complete and `self.reduce_bucket(b)` starts its reduce-scatter (asynchronous), **in place**:
#    the output is chunk r of the bucket's own buffer, `b.chunk(buffer, self.rank)`, a (shard,)
#    view, so no second buffer is allocated; it remembers
#    `self.in_flight = (b, work, buffer, output)`;
# 4. `self.finish_in_flight()` waits for that reduce-scatter, divides the output by N and
#    **adds** it into `self.grad_shards[b.index]`, the (shard,) gradient this rank keeps; then
#    forgets the buffer, which frees it. It **adds** so that several backwards before one
#    step (gradient accumulation) sum up in the chunk.
#
# One exception to "divides the output by N": in fp16, `reduce_bucket` (given) has already divided
# the buffer by N *before* the sum, so that N loss-scaled fp16 gradients cannot overflow
# (`minizero.precision.divides_before_sum(out)` is True); dividing again would halve a 2-rank
# gradient. Every other dtype is divided after the sum: one rounding fewer.
#
# `reduce_bucket` (given) first calls `finish_in_flight()`, so at most one reduce-scatter is in
# flight and the stage keeps at most two full buffers alive: one in flight, one filling (DeepSpeed's
# stage 2 with `overlap_comm` also alternates two bucket buffers). The backend may add its own:
# section 3 measures a third on gloo. At the end of backward, `backward_end()` (given) finishes
# the last one. After that, `before_step()` hands `grad_shards` to the optimizer, and the rest is
# stage 1: step the chunk, all-gather the parameters.
#
# ## Exercise 1 — `MyZeRO2`: the gradient hook of stage 2
#
# Write `on_grad_ready(p)` (steps 1–3 above; autograd calls it with the **parameter** once
# `p.grad` holds this backward's gradient) and `finish_in_flight()` (step 4).


# %%
class MyZeRO2(ZeRO2):
    """ZeRO stage 2 (P_os+g): gradients live in full only in a bucket, until its reduce-scatter."""

    def on_grad_ready(self, p: torch.nn.Parameter) -> None:
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
# reduce-scatters gradients during backward and keeps only its shard of them, and keeps the
# gathered parameters from forward to backward (it also shards the parameters between steps,
# which stage 3 does; lesson 04). It shards each parameter on its first dimension rather than
# flat buckets, so its reduce-scatter runs per group of parameters. DeepSpeed's stage 2 also
# reduces during backward, bucket by bucket; by default (DeepSpeed 0.16,
# `use_multi_rank_bucket_allreduce=True`) each bucket is all-reduced whole and each rank keeps the
# slice its contiguous 1/N of the parameter group owns, which moves twice the reduce-scatter's
# volume (lesson 02, section 9).
#
# ## 3. Memory per rank: measured against the formula
#
# The cells below use `minizero.parallelize(model, 2, ...)`, whose stage 2 is minizero's
# `ZeRO2`: the class you just completed. First the model states after one step, on every rank,
# stage 1 against stage 2, fp32 and bf16:


# %%
RUNS = [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]  # (precision, stage), Adam
print(f"TinyGPT, Ψ = {PSI:,}: bytes per rank / Ψ, beside paper_model_state_bytes")
lab.show_model_states(lab.model_states(NPROCS, RUNS))

# %% [markdown]
# The gradients that persist between steps, `grad_shards`, are 2Ψ/N (bf16) or 4Ψ/N (fp32), as
# the formula says. But the formula counts what a rank *keeps*. During backward the bucket
# buffers hold full gradients for a while; how much depends on the bucket size. The next cell
# runs one backward per `bucket_cap_mb` and, after every gradient hook, measures the bytes of
# the full-size buffers alive (`model_state_bytes(..., include_comm=True)["comm"]`: the buckets
# being filled and in flight), keeping the maximum.

# %%
CAPS = [0.01, 0.03, 0.1, 0.3, 25]  # MiB; 25 holds all of TinyGPT in one bucket
PEAKS = lab.bucket_peaks(NPROCS, CAPS)  # stage 2, bf16, one backward, rank 0
lab.plot_bucket_peaks(PEAKS, kept=2 / NPROCS, stage1=2)  # the formula: 2Ψ/N kept; stage 1: 2Ψ

# %% [markdown]
# With one bucket (25 MiB) the whole gradient is alive at the end of backward, as in stage 1,
# and then some: the kept chunks (`grad_shards`, 2Ψ/N) come on top, so at its peak stage 2
# holds *more* than stage 1. With small buckets the temporaries stay small (about two buckets:
# one filling, one in flight) and the peak approaches the 2Ψ/N of the formula. Smaller buckets
# mean more, smaller reduce-scatters, each paying a latency (lesson 00): `bucket_cap_mb` trades
# peak memory for message count, which is why DeepSpeed exposes `reduce_bucket_size`.
#
# **What the backend adds.** The figure counts the buffers the stage holds. Does the
# reduce-scatter itself need memory? minizero's is in place: the output is chunk r of the
# bucket, so the stage allocates nothing for it. The backend may still copy. The cell measures
# one in-place reduce-scatter of a 4 MiB buffer with `MemoryMeter` (on CPUs it sees every
# storage an operation touches; on GPUs it reads the caching allocator): the memory held
# before it, at its peak, and after `wait()`.


# %%
lab.show_reduce_scatter_memory(lab.reduce_scatter_memory(NPROCS, mib=4))  # fp32, rank 0

# %% [markdown]
# On **gloo** the extra is a whole copy of the input: PyTorch's gloo backend does not call gloo's
# own reduce-scatter but all-reduces a clone of the input (lesson 00) and keeps it until the
# collective completes. So on gloo stage 2 holds **three** full bucket buffers at its worst: the
# one filling, the one in flight, and the backend's copy of it. **NCCL** reduce-scatters in place
# in its own kernels; run this notebook on GPUs and the same cell measures the caching
# allocator there. Either way the extra is per bucket in flight, so small buckets keep it small.
#
# ## 4. One step, mark by mark
#
# `MemoryMeter` over one bf16 step of stage 1 and stage 2 (small buckets, 0.03 MiB), on rank 0:
# `lab.memory_per_step` runs lesson 02's `one_step_memory` (section 6 there) at each stage.

# %%
STEPS = lab.memory_per_step(NPROCS, stages=(1, 2), precision="bf16", bucket_cap_mb=0.03)
lab.plot_memory_per_step(STEPS, "TinyGPT, one bf16 Adam step", cats=lab.MEMORY_CATS)
lab.show_grads_after_backward(STEPS, formula={1: 2, 2: 2 / NPROCS})  # bf16 gradients / Ψ

# %% [markdown]
# Parameters, optimizer states and activations are the same under both stages; the gradient
# bar shrinks from 2Ψ to 2Ψ/N. What every rank still holds in full is the 2Ψ of parameters.
# The ticks are the peak so far, backend copies included (on gloo, section 3's copy of the
# bucket in flight).
#
# ## 5. Communication: the same 2Ψ, started earlier
#
# A `CommLedger` over one step of each stage: the volume per op, and how many reduce-scatters
# were issued before `optimizer.step()` was called, i.e. during backward (a mark on the ledger's
# timeline, `minizero.collectives.mark("step")`, separates the two).


# %%
PAPER = {1: 2, 2: 2}  # volume per step / Ψ: reduce-scatter Ψ + all-gather Ψ
COMM = lab.reduce_scatters_in_backward(NPROCS, stages=(1, 2), bucket_cap_mb=0.03)
lab.show_reduce_scatters_in_backward(COMM, PAPER)

# %% [markdown]
# Same volume, Ψ + Ψ. In stage 1 the reduce-scatters wait for `optimizer.step()`; in stage 2
# they run during backward, where (on GPUs with NCCL) they overlap with computation. On gloo a
# reduce-scatter is carried out as a full all-reduce, so it costs all-reduce time here.
#
# ## 6. The price: gradient accumulation communicates every backward
#
# With gradient accumulation (several backwards per step), stage 1 and DDP can accumulate full
# local gradients and communicate once per step (DDP inside `no_sync()`). Stage 2, as built
# here, keeps no full gradient to accumulate into, so each backward reduce-scatters its gradients
# into the chunk. That is a choice, not a law: FSDP2's `set_requires_gradient_sync(False)` keeps
# the full unsharded gradients across micro-batches and reduce-scatters once, paying the full
# gradient's memory per rank (Ψ elements: 4Ψ bytes in fp32) for 1/k of the communication.
# minizero's stage 2 offers both: each backward reduce-scatters, unless it runs inside
# `no_sync()` (or with nanoGPT's `require_backward_grad_sync = False`), which accumulates the full
# gradient locally, as FSDP2 does. Measured over 4 micro-batches per step, stage 2 both ways:


# %%
MICRO = 4  # micro-batches (backwards) per optimizer step
FORMULA = {  # (stage, all but the last backward in no_sync()) -> volume per step / Ψ
    (1, False): 2,  # one reduce-scatter + one all-gather
    (2, False): MICRO + 1,  # a reduce-scatter per backward + one all-gather
    (2, True): 2,  # only the last backward reduce-scatters
}
lab.show_accumulation_volume(lab.accumulation_volume(NPROCS, list(FORMULA), MICRO), FORMULA)

# %% [markdown]
# Stage 1: one reduce-scatter and one all-gather per step, 2Ψ, however many micro-batches.
# Stage 2: one reduce-scatter per backward, (micro-batches + 1)Ψ. Stage 2 saves memory and pays
# for it in communication when gradients are accumulated; with one backward per step the two
# stages move the same 2Ψ. Inside `no_sync()` stage 2 is back to 2Ψ, holding the full gradient
# from the first backward to the last, the memory it was built to save.
#
# ## 7. Clipping: a norm no rank can compute alone
#
# Clipping by the global norm (`torch.nn.utils.clip_grad_norm_(params, max_norm)`) scales the
# whole gradient by min(1, max_norm / ‖g‖), where ‖g‖ is the L2 norm of *every* gradient element.
# After stage 2's backward each rank holds only its chunks. The cell measures, on every rank, the
# norm of the chunks it holds, and beside it the norm one process computes on the whole batch.


# %%
lab.show_shard_norms(lab.shard_norms(NPROCS))  # fp32, stage 2, one backward

# %% [markdown]
# No rank's own norm is the norm; the squares add up across ranks. So each rank sums the squares
# of its chunks, **one** all-reduce adds the ranks' sums, and every rank takes the square root
# and scales its own chunks by the same coefficient. One subtlety: only the elements that belong
# to parameters count. minizero's padding is zeros, which add nothing, but nothing guarantees
# that in general: a buffer allocated with `torch.empty` for speed holds whatever was there
# before, and a scheme that reuses buffers may leave old values in the padding.
#
# ## Exercise 2 — `clip_grad_norm_` on shards
#
# Write `clip_grad_norm_(shards, valid, max_norm, group=None)`: `shards[i]` is this rank's
# (shard,) chunk of bucket i's averaged gradient; its first `valid[i]` elements are gradient, the
# rest padding (any value). Sum the squares of the real elements of every shard (in fp32) into
# one tensor; `all_reduce` it over `group` (`minizero.collectives`), once; the norm is its square
# root. Multiply every shard in place by `min(1, max_norm / (norm + 1e-6))` (what
# `torch.nn.utils.clip_grad_norm_` uses), and return the norm, the same on every rank.


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
# (`minizero/habits/sharded_grad.py`, `GradNorms`). Only DDP holds the whole averaged gradient
# and needs no collective for the norm; stage 1 holds the whole *local* gradient, but after its
# reduce-scatter a rank has only its own chunk averaged, so it needs the same one all-reduce of
# partial sums as stage 2 (`GradNorms.grad_norm`). In fp16 the gradients must be unscaled
# first (lesson 02's exercise), or the norm is the scale times too large.
#
# **Summary.** Stage 2 keeps each bucket's full gradient only from its first gradient to the
# end of its reduce-scatter, started from the gradient hook during backward, and keeps just
# rank r's averaged chunk: gradients go from 2Ψ to 2Ψ/N per rank (measured), the volume stays
# 2Ψ per step. Next, **lesson 04 — stage 3**: the parameters themselves.
