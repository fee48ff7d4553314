# %% [markdown]
# # Lesson 04 — ZeRO stage 3: partition the parameters too (P_os+g+p)
#
# After lesson 03 every rank still holds all 2Ψ bytes of 16-bit parameters, although between
# two uses of a layer nobody needs its weights. **Stage 3** (ZeRO §5.3, P_os+g+p) keeps only
# rank r's chunk of the parameters too, and gathers each module's parameters just before it
# runs:
#
# | | per-rank model states | volume per step |
# |---|---|---|
# | DDP | (2 + 2 + K)Ψ | 2Ψ |
# | stage 2 (P_os+g) | 2Ψ + (2 + K)Ψ/N | 2Ψ |
# | **stage 3 (P_os+g+p)** | **(2 + 2 + K)Ψ/N** | **3Ψ** |
#
# Every model state is divided by N. Memory per rank does not shrink without bound, though:
# what a rank needs *while it computes* (the units it has gathered, the gradient buckets in
# flight, its activations) is not a model state and does not shrink with N; section 6 measures
# that floor. The price is communication (§7.2.2): the parameters are all-gathered once for forward
# (Ψ) and once more for backward (Ψ, they were freed in between), and the gradients are
# reduce-scattered as in stage 2 (Ψ): **3Ψ, 1.5x DDP**. The all-gather after the optimizer step
# of stages 1 and 2 disappears: the next forward gathers what it needs.
#
# You will write the two halves of it: gathering and freeing one module's parameters, and the
# hooks that do it around each module with **prefetch**, the next module's all-gather started
# while the current one computes.
#
#     python -m minizero grade my-lessons/04_zero3.ipynb

# %%
from minizero.course.labs.lesson04 import *  # torch, nn, dist, minizero, hint, lab, lesson04, ZeRO3

NPROCS, INFO = setup(**{"TinyGPT Ψ": PSI})  # PSI: Ψ of the model the measurements use

# %% [markdown]
# ## 1. Units: what is gathered together
#
# Stages 1 and 2 cut buckets. Stage 3 needs the parameters *of the module about to run*, so
# minizero's `ZeRO3` (`minizero/zero3.py`) cuts **units** along the model's modules, as FSDP2's
# `fully_shard(module)` does: a unit is a module whose subtree's parameters (minus those of units
# nested in it) live in one flat buffer laid out like a bucket (padded, rank r owns chunk r). The
# root is always a unit. `minizero/units.py` picks the others: by default the model's **repeated
# blocks** (the children of an `nn.ModuleList`, or of an `nn.Sequential` with repeats), so a nanoGPT
# `Block` is one unit with no configuration; `parallelize(model, 3, opt, units=...)` takes module
# classes or a predicate instead. TinyGPT's units:

# %%
lab.show_units(lab.units(TinyGPT(GPTConfig.tiny())))

# %% [markdown]
# Bigger units mean fewer, larger all-gathers and more memory held while a unit computes. A
# parameter registered in two places (`lm_head.weight` *is* `wte.weight`) belongs to the unit that
# reaches it first: the root's unit holds the embeddings, the final LayerNorm and, through the tie,
# the output layer. The root's forward *is* the whole forward, so its unit stays gathered from the
# first layer to the last (section 4).
#
# ## 2. Freeing parameters that autograd still needs
#
# A freed parameter must keep its shape and identity: the optimizer, the hooks and autograd's saved
# tensors all refer to the same `Parameter`. So `ZeRO3` frees the **storage** under the flat buffer,
# `flat.untyped_storage().resize_(0)`, and leaves every view in place; gathering gives the storage
# its bytes back and all-gathers into it. The cell shows it on one process: the parameter survives
# its storage going to 0 bytes, and autograd's saved copy (`w`) is valid again once refilled.

# %%
flat = torch.arange(6.0)  # a flat buffer of 6 float32 elements
w = nn.Parameter(torch.empty(2, 2))
w.data = flat[:4].view(2, 2)  # the parameter's data: a view into the flat buffer
x = torch.ones(2, 2, requires_grad=True)
y = (x * w).sum()  # autograd saves w to compute x's gradient
kept = flat.clone()
flat.untyped_storage().resize_(0)  # free: w keeps its shape, the storage has 0 bytes
print(f"freed:    w.shape={tuple(w.shape)}, storage {flat.untyped_storage().nbytes()} bytes")
flat.untyped_storage().resize_(6 * flat.element_size())  # gather: bytes back, then fill them
flat.copy_(kept)  # (ZeRO3: all_gather(flat, my_shard, ...) instead)
y.backward()
print(f"refilled: storage {flat.untyped_storage().nbytes()} bytes, x.grad = {x.grad.tolist()}")

# %% [markdown]
# ## Exercise 1 — gather and free one unit
#
# `ZeRO3` keeps, for unit i:
#
# * `self.param_shards[i]`: this rank's chunk of the unit's parameters, (shard,), the only copy kept
#   between uses;
# * `self.flat_params[i]`: the unit's flat buffer, (padded,); every parameter of the unit is a view
#   into it; its storage has 0 bytes while freed;
# * `self.buckets[i].padded`: the buffer's length; `self.gathered[i]`: whether the storage is full
#   (or being filled); `self.gather_works[i]`: the all-gather in flight, or None.
#
# Write `gather(i, wait=True)`: if the unit is not gathered, give the storage back its bytes and
# start `all_gather(flat, shard, group=self.group, async_op=True)`; then, if `wait`, wait for the
# all-gather in flight (prefetch calls it with `wait=False`; the module that needs the unit calls it
# again with `wait=True`, and must wait for the gather a prefetch started). And `free(i)`: wait for
# an all-gather still in flight (never free memory a collective is writing into), then resize the
# storage to 0.


# %%
class MyZeRO3(ZeRO3):
    """ZeRO stage 3 (P_os+g+p): your gather and free of one unit's parameters."""

    def gather(self, i: int, wait: bool = True) -> None:
        """Make unit i's full parameters available (asynchronously unless ``wait``)."""
        # BEGIN SOLUTION
        # TODO: unit i is gathered or on its way; with wait, its full parameters are in place
        # HINT: A freed unit keeps its views, but the storage under its flat buffer,
        #       self.flat_params[i], has 0 bytes. Give the storage back its bytes first
        #       (untyped_storage().resize_(...) of self.buckets[i].padded * element_size()), then
        #       all-gather into it.
        # HINT: Start the all-gather (async_op=True) only if the unit is not gathered yet, keep
        #       its work in self.gather_works[i] and mark the unit gathered. Wait, when asked,
        #       whether this call or an earlier prefetch started the gather in flight.
        # HINT: if not self.gathered[i]:
        #           flat = self.flat_params[i]
        #           flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
        #           work = all_gather(flat, self.param_shards[i], ..., async_op=True)
        #           self.gather_works[i] = work
        #           self.gathered[i] = True
        #       if wait and self.gather_works[i] is not None:
        #           ...  # wait for it, then forget it
        if not self.gathered[i]:
            flat = self.flat_params[i]  # (padded,) 0 bytes until now
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            tag = f"zero3 params {i}"
            work = all_gather(flat, self.param_shards[i], group=self.group, async_op=True, tag=tag)
            self.gather_works[i] = work
            self.gathered[i] = True
        if wait and self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None
        # END SOLUTION
        self.max_gathered = max(self.max_gathered, sum(self.gathered))  # given: for the check

    def free(self, i: int) -> None:
        """Drop unit i's full parameters; only this rank's shard stays."""
        # BEGIN SOLUTION
        # TODO: unit i holds 0 bytes and is not gathered; no collective writes into it
        # HINT: Never free memory a collective is writing into: an all-gather still in flight
        #       (self.gather_works[i]) must finish first. Then the storage goes to 0 bytes; the
        #       views stay.
        # HINT: if self.gather_works[i] is not None:
        #           ...  # wait for it, then forget it
        #       self.flat_params[i].untyped_storage()...  # 0 bytes
        #       self.gathered[i] = ...
        if self.gather_works[i] is not None:  # never free memory a collective is writing into
            self.gather_works[i].wait()
            self.gather_works[i] = None
        self.flat_params[i].untyped_storage().resize_(0)  # the views stay, with 0 bytes
        self.gathered[i] = False
        # END SOLUTION


# %% check="MyZeRO3"
# 3 Adam steps of the MLP (one unit per Linear, one for the output gain) on max(NPROCS, 3) ranks,
# step by step: losses against minizero's ZeRO3 and FSDP2's fully_shard, gradient chunks against
# ZeRO3, parameters against one process, FSDP2 and ZeRO3; no full parameters held after backward;
# the same all-gathers as ZeRO3 and one reduce-scatter per unit; then, unit by unit, free and
# gather(wait=True) handed an all-gather still in flight must wait for it; every all-gather
# asynchronous; one SGD step in bf16 and in fp16 against ZeRO3 in the same precision, bit for bit;
# then again on a subgroup (ranks 0 and 1 of the 3).
lesson04.check_zero3_gather(MyZeRO3, NPROCS)

# %% [markdown]
# FSDP2's `fully_shard` is PyTorch's implementation of the same idea (by default it frees after
# forward and gathers again for backward, as here); the check trained it next to your class.
#
# ## 3. When to gather: hooks, and prefetch
#
# `ZeRO3` calls `gather` and `free` from hooks:
#
# * a **forward pre-hook** on each module that uses a unit (`pre_forward`): gather its units;
# * a **forward hook** (`_post_forward`, given): free them (unless a module still running uses them,
#   as the root does), and hook the module's output tensor, which fires just before the module's own
#   backward (`pre_backward`): gather the units again;
# * when all gradients of a unit are in, stage 2's machinery reduce-scatters them and frees the unit
#   (`reduce_bucket`, given).
#
# **Prefetch** hides the all-gather: the first forward records the order of the modules
# (`self.order`); from then on, once a module's own units are gathered, the hook *starts* the gather
# of the next module's units (`wait=False`), so it runs while this module computes. Backward runs
# the modules in the reverse of the order they *finished* forward (`self.ends`). `self.neighbour(m,
# k)` gives the units of the module k places after `m` (`k < 0`: before), or `[]` while recording;
# `self.prefetch` is 1. A unit already reduce-scattered in this backward (`self.started[i]`) is
# never prefetched: it would be gathered for nothing.
#
# ## Exercise 2 — prefetch
#
# Write `pre_forward(m, args)` and `pre_backward(m)`: gather (and wait for) every unit of `m`,
# `self.units_of[m]`; then start, without waiting, the gathers of the units of the module
# `self.prefetch` places ahead in the direction of travel (forward: after `m`; backward: before it,
# skipping units already reduce-scattered). The class builds on minizero's `ZeRO3`, not on exercise
# 1.


# %%
class PrefetchZeRO3(ZeRO3):
    """ZeRO stage 3 whose hooks gather each module's units and prefetch the next module's."""

    def pre_forward(self, m: nn.Module, args) -> None:
        """Forward pre-hook of every module that uses a unit."""
        if self.recording and m not in self.order:  # given: the first forward records
            self.order.append(m)
        # BEGIN SOLUTION
        # TODO: m's units are gathered; those of the module self.prefetch places on, on their way
        # HINT: Two kinds of gather: the units m needs now, self.units_of[m], gathered and waited
        #       for; the units of the next module, only started (wait=False), so that their
        #       all-gather runs while m computes.
        # HINT: self.neighbour(m, k) gives the units of the module k places after m in the recorded
        #       order (k < 0: before; [] while recording). In forward the next module is
        #       self.prefetch places after m.
        # HINT: for i in self.units_of[m]:
        #           self.gather(i)  # needed now
        #       for i in self.neighbour(m, +self.prefetch):
        #           ...  # needed next: start it, do not wait
        for i in self.units_of[m]:
            self.gather(i)  # needed now: wait for it
        for i in self.neighbour(m, +self.prefetch):
            self.gather(i, wait=False)  # needed next: runs while m computes
        # END SOLUTION

    def pre_backward(self, m: nn.Module) -> None:
        """Runs when the gradient of m's output arrives: just before m's backward."""
        self.queue_backward_end()  # given: frees everything and finishes up after backward
        # BEGIN SOLUTION
        # TODO: as in pre_forward, backward's way; no unit already reduce-scattered is prefetched
        # HINT: Backward runs the modules in reverse: the module to prefetch is self.prefetch places
        #       BEFORE m. A unit whose gradients are all in was reduce-scattered and freed
        #       (self.started[i]): gathering it again would move Ψ/N for nothing.
        # HINT: for i in self.units_of[m]:
        #           self.gather(i)
        #       for i in self.neighbour(m, ...):  # backward's direction of travel
        #           if ...:  # not reduce-scattered yet
        #               self.gather(i, wait=False)
        for i in self.units_of[m]:
            self.gather(i)
        for i in self.neighbour(m, -self.prefetch):  # backward runs the modules in reverse order
            if not self.started[i]:  # its backward is over: gathering it is wasted
                self.gather(i, wait=False)
        # END SOLUTION


# %% check="PrefetchZeRO3"
# As the previous check, and: in steps 1 and 2 (step 0 records the order), every module whose
# units minizero's ZeRO3 all-gathers before the module starts (prefetched) is prefetched by
# yours too, in forward and in backward; no more units gathered at once than ZeRO3, and no more
# elements all-gathered (no unit gathered after its reduce-scatter), here and on a model whose
# first layer runs twice, the first time without gradient (checks.lesson04.ReusedLayer: there
# backward reaches a finished unit); in each hook, the module's own units gathered before its
# neighbour's prefetch.
lesson04.check_zero3_prefetch(PrefetchZeRO3, NPROCS)

# %% [markdown]
# ## 4. Parameters held during one step
#
# From here on `minizero.parallelize(model, 3, ...)` is minizero's `ZeRO3`: your two exercises
# together. The cell trains a 6-block TinyGPT in bf16 for two steps and, in the second, measures the
# parameter bytes rank 0 holds as each unit's module starts its forward and its backward, for stages
# 2 and 3.

# %%
DEEP = GPTConfig.tiny(n_layer=6)  # 6 blocks: more units than prefetch keeps gathered at once
HELD = lab.params_held(NPROCS, DEEP, stages=(2, 3))
lab.plot_params_held(HELD, psi=count_params(TinyGPT(DEEP)))

# %% [markdown]
# Stage 2 holds all parameters all the time. Stage 3 holds the shards (2Ψ/N) plus what is gathered
# at that moment: the running block's unit and, with prefetch, the next one's. The root's unit
# lingers through the whole forward and the whole backward (its gradients are complete only after
# the embedding's backward, the very last), so the orange line never drops back to the shards. With
# two blocks instead of six, stage 3 would hold more than stage 2 at its peak: units must be small
# against the model for stage 3 to pay.
#
# ## 5. Memory per rank, every stage, against the formula
#
# As in lesson 02, one launch measures every N from 1 to `SWEEP`, now for all four stages, in bf16
# with Adam (K = 12):

# %%
SWEEP = NPROCS if INFO["backend"] == "nccl" else 4
FORMULA = {  # bf16 + Adam (K = 12): model-state bytes per rank / Ψ on N ranks
    0: lambda n: 2 + 2 + 12,
    1: lambda n: 2 + 2 + 12 / n,
    2: lambda n: 2 + (2 + 12) / n,
    3: lambda n: (2 + 2 + 12) / n,
}
SWEPT = lab.states_over_world(SWEEP, stages=(0, 1, 2, 3))
lab.plot_states_over_world(SWEPT, FORMULA, log=True)
lab.show_states_at_world(SWEPT, FORMULA)

# %% [markdown]
# Stages 1 and 2 flatten out at 4Ψ and 2Ψ (what they do not partition); stage 3's model states
# keep falling as 16Ψ/N.
#
# ## 6. The floor: what stage 3 does not divide
#
# Model states are what a rank *keeps*. While it computes, a rank also holds the units it has
# gathered, the gradient buckets being reduce-scattered, and the activations of its own micro-batch,
# which ZeRO-DP does not partition (the paper's P_a, §6.1, needs tensor parallelism). None of these
# shrinks with N. The cell measures the peak of one bf16 step with `MemoryMeter`, for N = 1 to
# `SWEEP`, and splits it into the model states held at that moment and the rest.


# %%
FLOOR = lab.stage3_floor(SWEEP)  # rank 0, every N from 1 to SWEEP
lab.plot_stage3_floor(FLOOR)
lab.show_stage3_floor(FLOOR)

# %% [markdown]
# The model states fall as 16Ψ/N; the rest does not fall at all. That rest is the floor, and its
# parts scale with different things:
#
# * **gathered units**: the largest unit, the one prefetched, and the root's (embeddings and tied
#   head): set by how the model is cut into units, not by N;
# * **gradient buckets**: one filling and one in flight (three on gloo), set by the unit sizes;
# * **activations**: set by the micro-batch and the sequence length (activation checkpointing
#   reduces them).
#
# So "stage 3 divides memory by N" holds for the model states only; at large N the floor decides
# what fits, and lesson 05 budgets it.
#
# **How FSDP2 shards parameters.** minizero keeps a 16-bit shard for the all-gather and a separate
# fp32 master for the optimizer (2 + 12 bytes per parameter, /N). **FSDP2** (`fully_shard`) shards
# *each parameter* on its first dimension, as a `DTensor`; with a `MixedPrecisionPolicy` its fp32
# shards *are* the masters, cast to 16 bits on the way to the all-gather, and its sharded gradients
# are fp32. The cell measures it on TinyGPT after one Adam step, one unit per block.


# %%
OURS = {"params": 2, "grads": 2, "optimizer": 12}  # minizero stage 3, bf16: bytes × N / Ψ
lab.show_fsdp2_states(lab.fsdp2_states(NPROCS), OURS)

# %% [markdown]
# The same 16 bytes per parameter, divided by N, split differently: FSDP2 keeps 4-byte fp32
# parameter and gradient shards, minizero 2-byte shards of each plus a 12-byte master and moments.
# FSDP2's optimizer sees one tensor per parameter, which is how it supports param groups per
# parameter. DeepSpeed's stage 3 (`deepspeed/runtime/zero/partition_parameters.py`) cuts each
# parameter's elements into N padded pieces and gathers per module, with prefetch from a recorded
# trace, as here.
#
# ## 7. Communication: 1.5x
#
# A `CommLedger` over each of the first two training steps of TinyGPT, at each stage; forward's
# collectives are those before the `"backward start"` mark. At stage 3 the cell also counts how
# often each unit was all-gathered (the root's unit is unit 0).

# %%
PAPER = {0: 2, 1: 2, 2: 2, 3: 3}  # volume per step / Ψ
COMM = lab.step_comm(NPROCS, stages=(0, 1, 2, 3))
lab.plot_step_comm(COMM, PAPER)
lab.show_step_comm(COMM, root_tag="zero3 params 0")  # the root unit's all-gathers (section 1)

# %% [markdown]
# Every stage moves what the paper counts: 2Ψ for DDP and stages 1 and 2; 3Ψ for stage 3, Ψ gathered
# in forward, Ψ in backward and Ψ reduce-scattered, every unit gathered once per pass. Stage 3 does
# so from the first step on; stages 1 and 2 move more once, in their first step
# ([why](../docs/machinery.md#stages-1-and-2-rebuild-their-buckets-after-the-first-step)). The
# recorded order changes when an all-gather starts, not how much is moved.
#
# The root's unit is freed at the end of forward and gathered again for backward, which makes the
# volume exactly 3Ψ. FSDP2 keeps its root through to backward, saving the root's share of volume for
# memory; `parallelize(..., reshard_root=False)` does the same here. On gloo, where a reduce-scatter
# runs as an all-reduce, time would not follow volume (lesson 00).
#
# **Summary.** Stage 3 keeps a 1/N chunk of every model state and gathers each module's parameters
# around its forward and backward: memory per rank follows (2 + 2 + K)Ψ/N, above a floor that does
# not shrink with N, for 1.5x DDP's communication, with prefetch overlapping the gathers.
