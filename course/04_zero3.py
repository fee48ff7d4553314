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
#
# A check whose ranks need longer on a slow or busy machine: `python -m minizero grade
# --check-timeout 600 ...`, or `MINIZERO_CHECK_TIMEOUT=600` set where `jupyter lab` starts.

# %%
from collections import Counter

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

import minizero
from minizero.analysis.memory import MemoryMeter, model_state_bytes, paper_model_state_bytes
from minizero.collectives import all_gather, mark
from minizero.course import checks, hint
from minizero.course.checks import lesson04
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.units import assign_params, select_units
from minizero.zero3 import ZeRO3

NPROCS = checks.default_nprocs()
INFO = minizero.launch(checks.run_info, NPROCS)[0]  # where this lesson's measurements are made
GPT = GPTConfig.tiny()
PSI = count_params(TinyGPT(GPT))  # Ψ of the model the measurements use
print(checks.describe(INFO), f"| TinyGPT Ψ = {PSI:,}")


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def gpt_batch(step=0, group=None):
    """This rank's slice of step ``step``'s global batch of 8 N rows of token ids."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return synthetic_batch("gpt", 8 * world, step, rank=rank, world=world,
                           device=checks.rank_device())  # fmt: skip


# %% [markdown]
# ## 1. Units: what is gathered together
#
# Stage 1 and 2 cut buckets of `bucket_cap_mb`. Stage 3 needs the parameters *of the module
# about to run*, so minizero's `ZeRO3` (`minizero/zero3.py`) cuts **units** along the model's
# modules, the way PyTorch's FSDP2 does with `fully_shard(module)`: a unit is a module whose whole
# subtree's parameters (minus those of units nested inside it) live in one flat buffer with the
# same layout as a bucket (padded to a multiple of N, rank r owns chunk r). The root module is
# always a unit and holds what no other unit holds. `minizero/units.py` picks the others; the
# default is the model's **repeated blocks** (the children of an `nn.ModuleList`, or of an
# `nn.Sequential` with repeats), so a nanoGPT `Block`, an `nn.TransformerEncoderLayer` or a
# torchvision `BasicBlock` is one unit with no configuration; `parallelize(model, 3, opt,
# units=...)` takes module classes or a predicate instead. TinyGPT's units:

# %%
model = TinyGPT(GPT)
names = {m: name or "(root)" for name, m in model.named_modules()}
groups, owners, needs = assign_params(model, select_units(model))  # one group per unit
for unit, (params, module) in enumerate(zip(groups, owners, strict=True)):
    held = [n for n, p in model.named_parameters() if any(p is q for q in params)]
    print(f"unit {unit}: {names[module]:9} {sum(p.numel() for p in params):6,} elements: "
          f"{', '.join(held[:4])}{', ...' if len(held) > 4 else ''}")  # fmt: skip

# %% [markdown]
# Bigger units mean fewer, larger all-gathers (better bandwidth) and more memory held while a
# unit computes; smaller units the opposite. `lm_head.weight` *is* `wte.weight` (tied): a
# parameter registered in two places belongs to the unit that reaches it first, and the root's
# unit holds the embeddings, the final LayerNorm and, through the tie, the output layer. The root's
# forward *is* the whole forward, so its unit stays gathered from the first layer to the last
# (section 4 shows it in memory).
#
# ## 2. Freeing parameters that autograd still needs
#
# A freed parameter must keep its shape and identity: the optimizer, the hooks and autograd's
# saved tensors all refer to the same `Parameter`. So `ZeRO3` frees the **storage** under the
# flat buffer, `flat.untyped_storage().resize_(0)`, and leaves every view in place. Gathering
# gives the storage its bytes back and all-gathers into it. The cell shows the trick on one
# process, with a parameter set up as minizero's stages do it (`p.data = view of the flat
# buffer`: the `Parameter` object stays, its data lives in the buffer): the parameter survives
# its storage going to 0 bytes, and autograd's saved copy of it (here `w`, saved by the
# multiplication) is valid again once the storage is refilled.

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
# * `self.param_shards[i]`: this rank's chunk of the unit's parameters, (shard,): the only copy
#   kept between uses;
# * `self.flat_params[i]`: the unit's flat buffer, (padded,); every parameter of the unit is a
#   view into it; its storage has 0 bytes while freed;
# * `self.buckets[i].padded`: the buffer's length; `self.gathered[i]`: whether the storage is
#   full (or being filled); `self.gather_works[i]`: the asynchronous all-gather in flight, or
#   None.
#
# Write `gather(i, wait=True)`: if the unit is not gathered, give the storage back its bytes
# and start `all_gather(flat, shard, group=self.group, async_op=True)`; then, if `wait`, wait
# for the all-gather in flight (prefetch calls it with `wait=False`, and the module that needs
# the unit calls it again with `wait=True`: then the unit is already marked gathered, and the
# gather a prefetch started must still be waited for). And `free(i)`: wait for an all-gather
# still in flight (never free memory a collective is writing into), then resize the storage
# to 0. The check also hands each method an all-gather that has not completed, unit by unit.


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
            self.gather_works[i] = all_gather(flat, self.param_shards[i], group=self.group,
                                          async_op=True, tag=f"zero3 params {i}")  # fmt: skip
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
        #           self.gather_works[i].wait()
        #           self.gather_works[i] = None
        #       self.flat_params[i].untyped_storage().resize_(0)
        #       self.gathered[i] = False
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
# asynchronous; then again on a subgroup (ranks 0 and 1 of the 3).
lesson04.check_zero3_gather(MyZeRO3, NPROCS)

# %% [markdown]
# FSDP2's `fully_shard` is PyTorch's implementation of the same idea (with its default
# `reshard_after_forward=True`, parameters are freed after forward and gathered again for
# backward, as here); the check trained it next to your class.
#
# ## 3. When to gather: hooks, and prefetch
#
# `ZeRO3` calls `gather` and `free` from hooks:
#
# * a **forward pre-hook** on each module that uses a unit (`pre_forward`): gather its units;
# * a **forward hook** (`_post_forward`, given): free them again (unless a module still running
#   uses them: the root's unit stays while the root's forward runs), and register a
#   hook on the module's output tensor that fires when backward reaches it, i.e. just before the
#   module's own backward (`pre_backward`): gather the units again;
# * when all gradients of a unit are in, the stage-2 machinery reduce-scatters them and frees
#   the unit (`reduce_bucket`, given).
#
# Gathering on demand makes every module wait for its all-gather. **Prefetch** hides it: the
# first forward records the order in which the modules ran (`self.order`); from then on,
# once a module's own units are gathered, the hook *starts* the all-gather of the next
# module's units (`wait=False`) so that it runs while this module computes; in backward the
# order is reversed. `self.neighbour(m, k)` gives the units of the module k places after `m`
# in the recorded order (`k < 0`: before), or `[]` while recording; `self.prefetch` is 1.
#
# Backward runs the modules in the reverse of the order in which they *finished* forward
# (`self.ends`), not the order they started: the root starts first and finishes last, so in
# backward its hook fires first. One rule remains: a unit whose gradients are all in has been
# reduce-scattered and freed (`self.started[i]`); nothing in this backward
# needs it again, so backward never prefetches such a unit (it would gather Ψ/N for nothing; a
# model that calls one module twice can reach that case).
#
# ## Exercise 2 — prefetch
#
# Write `pre_forward(m, args)` and `pre_backward(m)`: gather (and wait for) every unit of
# `m`, `self.units_of[m]`; then start, without waiting, the gathers of the units of the module
# `self.prefetch` places ahead in the direction of travel (forward: after `m`; backward:
# before it, skipping units already reduce-scattered). The class is built on minizero's `ZeRO3`,
# so it does not depend on exercise 1.


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
        #       for i in self.neighbour(m, -self.prefetch):
        #           if not self.started[i]:
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
# The cells below use `minizero.parallelize(model, 3, ...)`, whose stage 3 is minizero's
# `ZeRO3`: your two exercises together. The cell trains a 6-block TinyGPT in bf16 for two steps
# (the first records the module order) and, in the second, measures the parameter bytes rank 0
# holds as each unit's module starts its forward and its backward (after the stage's own hooks
# have gathered), for stage 2 and stage 3.

# %%
DEEP = GPTConfig.tiny(n_layer=6)  # 6 blocks: more units than prefetch keeps gathered at once
PSI_DEEP = count_params(TinyGPT(DEEP))
deep = TinyGPT(DEEP)
picked = select_units(deep)
UNIT_MODULES = [name or "(root)" for name, m in deep.named_modules() if m in picked]


def params_timeline(stage):
    torch.manual_seed(0)
    model, opt = minizero.parallelize(TinyGPT(DEEP), stage, adam, precision="bf16")
    trace = []

    def sample(label):
        kept = model_state_bytes(model, opt)["params"]  # stage 3: the shards only
        # stage 3: the unit buffers gathered right now (0 bytes while freed)
        gathered = sum(f.untyped_storage().nbytes() for f in model.flat_params) if stage == 3 else 0
        trace.append((label, kept, gathered))

    def pre(m, args, name):
        sample(f"fwd {name}")

    def post(m, args, out, name):
        if out.requires_grad:
            out.register_hook(lambda grad: sample(f"bwd {name}"))

    for step in range(2):
        if step == 1:  # registered after the stage's hooks: they run after its gathers
            for name in UNIT_MODULES:
                m = model.module if name == "(root)" else model.module.get_submodule(name)
                m.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name))
                m.register_forward_hook(lambda m, a, out, name=name: post(m, a, out, name))
        sample("start")
        model(*gpt_batch(step)).backward()
        sample("end of backward")
        opt.step()
        opt.zero_grad()
    return trace[2:]  # the second step (the first sampled only "start" and "end of backward")


TIMELINES = {s: minizero.launch(params_timeline, NPROCS, s, verbose=False)[0] for s in (2, 3)}
fig, ax = plt.subplots(figsize=(11, 4.5))
xs = range(len(TIMELINES[3]))
ax.step(xs, [kept / PSI_DEEP for _, kept, _ in TIMELINES[2]], where="mid", marker=".",
        label="stage 2: all parameters")  # fmt: skip
ax.step(xs, [(kept + g) / PSI_DEEP for _, kept, g in TIMELINES[3]], where="mid", marker=".",
        label="stage 3: shards + gathered units")  # fmt: skip
ax.step(xs, [kept / PSI_DEEP for _, kept, _ in TIMELINES[3]], where="mid", color="k", ls="--",
        lw=1,
        label="stage 3: shards (2Ψ/N)")  # fmt: skip
ax.set_xticks(list(xs), [label for label, _, _ in TIMELINES[3]], rotation=90, fontsize=7)
ax.set_ylim(0, 2.2)
ax.set_ylabel(f"parameter bytes on rank 0 / Ψ (Ψ = {PSI_DEEP:,})")
ax.legend(fontsize=8)
ax.set_title(f"TinyGPT, 6 blocks, bf16, one step after the first: {checks.describe(INFO)}",
             fontsize=9)  # fmt: skip
fig.tight_layout()
plt.show()
peak = max(kept + g for _, kept, g in TIMELINES[3])
print(f"stage 3: at most {peak / PSI_DEEP:.2f}Ψ of parameters held at once; stage 2: 2.00Ψ "
      "throughout")  # fmt: skip

# %% [markdown]
# Stage 2 holds all parameters all the time. Stage 3 holds the shards (2Ψ/N) plus whatever is
# gathered at that moment: the running block's unit and, with prefetch, the next one's. The
# root's unit lingers: it is gathered for the root's forward, which is the whole forward (the
# embeddings run first, `ln_f` and the tied `lm_head` last), and again for the whole backward
# (its gradients are complete only after the embedding's backward, the very last). So between
# "start" and "end of backward" the orange line never drops back to the shards: it stays at
# least the root's unit above them. With two blocks instead of six, the root and both blocks are
# gathered at once and stage 3 would hold more than stage 2 at its peak: units must be small
# against the model for stage 3 to pay.
#
# ## 5. Memory per rank, every stage, against the formula
#
# As in lesson 02, one launch measures every N from 1 to `SWEEP` (the first n ranks form a
# process group), now for all four stages, in bf16 with Adam (K = 12):

# %%
SWEEP = NPROCS if INFO["backend"] == "nccl" else 4
STAGES = (0, 1, 2, 3)


def sweep():
    rank, rows = dist.get_rank(), []
    for n in range(1, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))  # every rank calls new_group; ranks < n use it
        if rank < n:
            for stage in STAGES:
                torch.manual_seed(0)
                model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam, precision="bf16",
                                                  process_group=group)  # fmt: skip
                model(*gpt_batch(group=group)).backward()
                opt.step()  # measured before zero_grad(), which frees the gradient shards
                rows.append((n, stage, sum(model_state_bytes(model, opt).values())))
                opt.zero_grad()
    return {"info": checks.run_info(), "rows": rows}


SWEPT = minizero.launch(sweep, SWEEP, verbose=False)
sweep_info = SWEPT[0]["info"]
fig, ax = plt.subplots(figsize=(7, 4))
ns = range(1, 65)
for stage, color in zip(STAGES, ("tab:gray", "tab:blue", "tab:orange", "tab:green"), strict=True):
    paper = [sum(paper_model_state_bytes(PSI, n, stage, "bf16").values()) / PSI for n in ns]
    ax.plot(ns, paper, color=color, lw=1, label=f"paper, stage {stage}")
    got = [(n, b / PSI) for res in SWEPT for n, s, b in res["rows"] if s == stage]
    ax.plot(*zip(*got, strict=True), "o", color=color, label=f"measured, stage {stage}")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("N: data-parallel ranks")
ax.set_ylabel("model-state bytes per rank / Ψ")
ax.grid(alpha=0.3)
ax.legend(fontsize=7, ncol=2)
ax.set_title(
    f"TinyGPT, bf16 + Adam (K = 12): measured on {sweep_info['backend']} · "
    f"{sweep_info['device']} · N = 1..{sweep_info['world']}",
    fontsize=9,
)
plt.show()
for n, stage, b in SWEPT[0]["rows"]:
    if n == sweep_info["world"]:
        paper = sum(paper_model_state_bytes(PSI, n, stage, "bf16").values())
        print(f"N = {n}, stage {stage}: measured {b / PSI:.3f}Ψ, paper {paper / PSI:.3f}Ψ")

# %% [markdown]
# Stages 1 and 2 flatten out at 4Ψ and 2Ψ (what they do not partition); stage 3's model states
# keep falling as 16Ψ/N.
#
# ## 6. The floor: what stage 3 does not divide
#
# Model states are what a rank *keeps*. While it computes, a rank also holds the units it has
# gathered (the running module's, the next one's if prefetched, and the tied `wte` unit through
# forward), the gradient buckets being reduce-scattered (and, on gloo, the backend's copy of the
# one in flight: lesson 03), and the activations of its own micro-batch, which ZeRO-DP does not
# partition at all (the paper's ZeRO-R, P_a, partitions them across tensor-parallel ranks only,
# §6.1: nothing with pure data parallelism). None of these shrinks with N. The cell
# measures the peak of one bf16 training step (the second: the first records the module order)
# with `MemoryMeter`, for N = 1 to `SWEEP`, each rank on its own micro-batch of 8 rows, and
# splits it into the model states held at that moment and the rest.


# %%
def floor():
    rank, rows = dist.get_rank(), []
    for n in range(1, dist.get_world_size() + 1):
        group = dist.new_group(list(range(n)))  # every rank calls new_group; ranks < n use it
        if rank < n:
            torch.manual_seed(0)
            model, opt = minizero.parallelize(TinyGPT(GPT), 3, adam, precision="bf16",
                                              process_group=group)  # fmt: skip
            for step in range(2):  # step 0 records the module order; step 1 is measured
                x, y = gpt_batch(step, group)
                with MemoryMeter(model, opt) as meter:
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad()
                    end = meter.mark("end of step")
            at = end["at_peak"]  # CPU: the split at the peak; CUDA: None (the allocator's peak)
            states = sum(model_state_bytes(model, opt).values()) if at is None else sum(
                at[c] for c in ("params", "grads", "optimizer"))  # fmt: skip
            units = sorted((b.padded * 2 for b in model.buckets), reverse=True)  # bf16 bytes
            rows.append((n, end["peak"], states, at and at["comm"], units))
    return {"info": checks.run_info(), "rows": rows}


FLOOR = minizero.launch(floor, SWEEP, verbose=False)[0]  # rank 0: every N from 1 to SWEEP
ns = [n for n, *_ in FLOOR["rows"]]
fig, ax = plt.subplots(figsize=(7, 4))
states = [st / PSI for _, _, st, _, _ in FLOOR["rows"]]
comm = [(c or 0) / PSI for *_, c, _ in FLOOR["rows"]]
rest = [(pk - st) / PSI - c for (_, pk, st, _, _), c in zip(FLOOR["rows"], comm, strict=True)]
ax.bar(ns, states, label="model states held (16Ψ/N)")
if FLOOR["rows"][0][3] is not None:
    ax.bar(ns, comm, bottom=states, label="gathered units and gradient buckets")
ax.bar(ns, rest, bottom=[a + b for a, b in zip(states, comm, strict=True)],
       label="activations and other temporaries")  # fmt: skip
ax.set_xticks(ns)
ax.set_xlabel("N: data-parallel ranks")
ax.set_ylabel("peak bytes on rank 0 / Ψ")
ax.legend(fontsize=8)
where = FLOOR["info"]
ax.set_title(f"TinyGPT, stage 3, bf16 Adam, peak of one step: measured on {where['backend']} · "
             f"{where['device']} · N = 1..{where['world']}", fontsize=9)  # fmt: skip
plt.show()
units = FLOOR["rows"][0][4]
for n, peak, st, c, _ in FLOOR["rows"]:
    split = f" (units and buckets {c / PSI:.2f}Ψ)" if c is not None else ""
    print(f"N = {n}: peak {peak / PSI:.2f}Ψ = model states {st / PSI:.2f}Ψ + the rest "
          f"{(peak - st) / PSI:.2f}Ψ{split}")  # fmt: skip
print(f"largest units: {units[0]:,} and {units[1]:,} bytes (bf16), together "
      f"{(units[0] + units[1]) / PSI:.2f}Ψ")  # fmt: skip

# %% [markdown]
# The model states fall as 16Ψ/N; the rest does not fall at all. That rest is the floor: at
# large N the peak per rank tends to it, not to 0. Its parts scale with different things:
#
# * **gathered units**: the largest unit, plus the one prefetched beside it, plus the root's unit
#   (the embeddings and the tied head, gathered through the whole forward and backward): set by
#   how the model is cut into units, not by N. A model whose embedding is a large share of Ψ
#   keeps that share gathered all the time.
# * **gradient buckets**: one filling and one in flight (three on gloo), set by the unit sizes;
# * **activations**: set by the micro-batch and the sequence length, untouched by ZeRO-DP
#   (activation checkpointing reduces them; the paper's P_a needs tensor parallelism, §6.1).
#
# So "stage 3 divides memory by N" holds for the model states only; for a large model at large
# N the floor decides what fits, and lesson 05 budgets it.
#
# **How the systems you will read next shard parameters.** minizero's unit is a flat buffer,
# cut into N chunks like a bucket, and in mixed precision it keeps a 16-bit shard for the
# all-gather and a separate fp32 master shard for the optimizer (2 + 12 bytes per parameter, /N).
# **FSDP2** (`torch.distributed.fsdp.fully_shard`) shards *each parameter* on its first dimension,
# as a `DTensor`, and all-gathers a unit's parameters into one buffer; with a
# `MixedPrecisionPolicy` its fp32 shards *are* the masters, cast to 16 bits only on the way to
# the all-gather, and its sharded gradients are fp32 too. The cell measures its per-rank states
# on TinyGPT after one Adam step (bf16 compute, fp32 gradient reduction), one unit per block.


# %%
def fsdp2_states():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = checks.rank_device()
    torch.manual_seed(0)
    model = TinyGPT(GPT).to(dev)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adam(model.parameters())
    model(*gpt_batch()).backward()
    opt.step()
    local = lambda t: t.to_local()  # this rank's (dim-0) shard of a DTensor
    nbytes = lambda ts: sum(local(t).numel() * t.element_size() for t in ts)
    states = [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    params = list(model.parameters())
    return {
        "params": (nbytes(params), params[0].dtype),
        "grads": (nbytes(p.grad for p in params), params[0].grad.dtype),
        "optimizer": (nbytes(states), states[0].dtype),
    }


FSDP2 = minizero.launch(fsdp2_states, NPROCS, verbose=False)[0]
ours = paper_model_state_bytes(PSI, NPROCS, 3, "bf16")
print(f"TinyGPT, N = {NPROCS}, bf16, after one Adam step, rank 0 ({checks.describe(INFO)}):")
for cat, (b, dtype) in FSDP2.items():
    print(f"  FSDP2 {cat:9} {b * NPROCS / PSI:5.2f}Ψ/N ({str(dtype).replace('torch.', '')});"
          f"  minizero stage 3: {ours[cat] * NPROCS / PSI:5.2f}Ψ/N")  # fmt: skip
print(
    f"  total: FSDP2 {sum(b for b, _ in FSDP2.values()) * NPROCS / PSI:.2f}Ψ/N, "
    f"minizero {sum(ours.values()) * NPROCS / PSI:.2f}Ψ/N"
)

# %% [markdown]
# The same 16 bytes per parameter, divided by N, split differently: FSDP2 keeps 4-byte fp32
# parameter shards (no separate master) and 4-byte gradient shards, minizero 2-byte shards of
# each plus a 12-byte master and moments. FSDP2's layout pads each parameter's first dimension
# to a multiple of N, and its optimizer sees one tensor per parameter (a `DTensor`), which is how
# it supports param groups per parameter. DeepSpeed's stage 3
# (`deepspeed/runtime/zero/partition_parameters.py`) partitions each parameter's flattened
# elements into N contiguous pieces, padded, and gathers them per module, with prefetch
# driven by a recorded trace, as here.
#
# ## 7. Communication: 1.5x
#
# A `CommLedger` over each of the first two training steps of TinyGPT, at each stage. The
# forward's collectives are those issued before the `"backward start"` mark. At stage 3 the cell
# also counts how often each unit was all-gathered (the tag of a stage-3 all-gather names its
# unit; the root's unit, with the embeddings and the tied `lm_head`, is unit 0).

# %%
ROOT = "zero3 params 0"  # the tag of the root unit's all-gathers (section 1)


def comm():
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model, opt = minizero.parallelize(TinyGPT(GPT), stage, adam)
        for step in range(2):  # step 0: stage 3 records the module order; step 1: it uses it
            with minizero.CommLedger() as ledger:
                mark("forward start")
                loss = model(*gpt_batch(step))
                mark("backward start")
                loss.backward()
                opt.step()
                opt.zero_grad()
            bwd = next(i for i, label in ledger.marks if label == "backward start")
            parts = {}
            for r in ledger.records:
                key = f"{r.op} (forward)" if r.index < bwd else r.op
                parts[key] = parts.get(key, 0) + r.volume_elements
            gathers = Counter(r.tag for r in ledger.records if r.op == "all_gather")  # tag -> n
            out[stage, step] = {"parts": parts, "gathers": gathers}
    return out


COMM = minizero.launch(comm, NPROCS, verbose=False)[0]
KEYS = ("all_reduce", "reduce_scatter", "all_gather", "all_gather (forward)")
NAMES = {"all_gather": "all_gather (after the step; stage 3: in backward)"}
TITLES = ("step 0 (stage 3 records the module order)", "step 1 (and every later step)")
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for step, ax in enumerate(axes):
    bottom = [0.0] * len(STAGES)
    for key in KEYS:
        vals = [COMM[s, step]["parts"].get(key, 0) / PSI for s in STAGES]
        ax.bar(STAGES, vals, bottom=bottom, label=NAMES.get(key, key))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(STAGES, [2, 2, 2, 3], "k_", ms=30, mew=2, label="paper: 2Ψ, 2Ψ, 2Ψ, 3Ψ")
    ax.set_xticks(STAGES, ["DDP", "stage 1", "stage 2", "stage 3"])
    ax.set_title(f"TinyGPT (Ψ = {PSI:,}), {TITLES[step]}", fontsize=9)
axes[0].set_ylabel("volume per step / Ψ (elements)")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=3,
           markerscale=0.5)  # fmt: skip
fig.suptitle(f"Communication volume per training step: {checks.describe(INFO)}", fontsize=9)
fig.tight_layout()
plt.show()
for step in (0, 1):
    total = ", ".join(f"stage {s} {sum(COMM[s, step]['parts'].values()) / PSI:.3f}Ψ"
                      for s in STAGES)  # fmt: skip
    g = COMM[3, step]["gathers"]
    others = sorted({n for tag, n in g.items() if tag != ROOT})
    print(
        f"step {step}: {total}; stage 3 all-gathered the root unit {g[ROOT]} times, "
        f"each of the other {len(g) - 1} units {' or '.join(map(str, others))} times"
    )

# %% [markdown]
# Every stage moves what the paper counts, from the first step on: 2Ψ for DDP and stages 1
# and 2; 3Ψ for stage 3, Ψ all-gathered in forward, Ψ in backward and Ψ reduce-scattered, every
# unit gathered once for each pass, the root's included. (TinyGPT's units split evenly over 2,
# 4 or 8 ranks. A unit that does not is padded, and the ledger counts the padding: the checks'
# `MLP` moves 3Ψ plus a few elements per step, as exercise 1's check printed.) The first forward
# records the order in which the modules run, the order prefetch follows from the second step
# on (PyTorch's FSDP records its first iteration's order the same way for `forward_prefetch`);
# it changes when an all-gather starts, not how much is moved.
#
# The root's unit is freed at the end of forward and gathered again for backward, as FSDP2 does
# for every unit but its root: that is what makes stage 3's volume exactly 3Ψ. FSDP2 keeps its
# root's parameters through to backward (it would be gathered again at once), which saves the
# root's share of Ψ in volume and costs it in memory between forward and backward;
# `parallelize(..., reshard_root=False)` does the same here.
#
# That is volume, the quantity the paper counts; on gloo, where a reduce-scatter runs as an
# all-reduce, time would not follow it (lesson 00).
#
# **Summary.** Stage 3 keeps only a 1/N chunk of every model state and gathers each module's
# parameters around its forward and its backward: measured memory per rank follows
# (2 + 2 + K)Ψ/N, for 1.5x the communication of DDP, and prefetch lets the all-gathers run
# while the previous module computes. That completes ZeRO-DP: the same training, with model
# states per rank divided by N, above a floor (gathered units, buckets, activations) that does
# not shrink with N.
