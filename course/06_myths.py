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

# %%
from minizero.course.labs.lesson06 import *  # torch, nn, minizero, hint, lab, the check

NPROCS, INFO = setup()


# @save
adamw = partial(torch.optim.AdamW, lr=1e-2)  # the optimizer of myths 1 to 4: adamw(params)


# %% [markdown]
# ## Myth 1: "ZeRO splits the model into parts that run on separate GPUs"
#
# That describes **model parallelism**: pipeline parallelism gives each GPU some of the layers,
# tensor parallelism a slice of each matrix, and each GPU computes only its part. ZeRO-3 does
# *store* 1/N of every parameter tensor on each rank, which is where the idea comes from. But
# storage is all it splits. The measurement: ZeRO-3 on TinyGPT, a hook on every module that owns
# parameters records, at the moment the module runs, how many of its parameter elements are
# present; a `FlopCounterMode` counts the forward's floating-point operations on each rank, next
# to a plain, unwrapped TinyGPT on the same micro-batch. The prediction, if ZeRO-3 split the
# model: each rank runs some units, with its 1/N of their elements, and about 1/N of the FLOPs.


# %%
# @save
def watch_units(net) -> dict:
    """Hooks on ZeRO-3's units: per unit, its elements, those present while it runs and after."""
    present = lambda ps: sum(p.numel() for p in ps if p.untyped_storage().nbytes())  # with data
    names = {m: n or "(root)" for n, m in net.module.named_modules()}
    ran = {}  # unit's name -> [elements, present while its module runs, present after]

    def before(name, ps):  # runs as the module starts: after ZeRO-3's gather
        return lambda m, args: ran.update({name: [sum(p.numel() for p in ps), present(ps)]})

    def after(name, ps):  # runs as the module ends: after ZeRO-3's free
        return lambda m, args, out: ran[name].append(present(ps))

    for ps, m in zip(*assign_params(net.module, select_units(net.module))[:2]):
        m.register_forward_pre_hook(before(names[m], ps))
        m.register_forward_hook(after(names[m], ps))
    return ran


# %%
# @save
def forward_on_rank(rows: int = 4) -> dict:
    """On every rank: one stage-3 forward of TinyGPT on its rows, beside a plain TinyGPT's."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    torch.manual_seed(0)
    plain = TinyGPT(GPT).to(dev)  # the whole model, no ZeRO: the reference
    torch.manual_seed(0)
    net, _ = parallelize(TinyGPT(GPT), 3, adamw)  # each rank stores 1/N of every unit
    ran = watch_units(net)
    x, y = synthetic_batch("gpt", rows * world, 0, rank=rank, world=world, device=dev)  # my rows
    with CommLedger() as ledger, FlopCounterMode(display=False) as flops:
        net(x, y)
    with FlopCounterMode(display=False) as plain_flops:
        plain(x, y)
    return dict(
        ran=[[name, *seen] for name, seen in ran.items()],
        rows=x[:, 0].tolist(),  # each row's first token: which rows this rank saw
        flops=flops.get_total_flops(),
        plain_flops=plain_flops.get_total_flops(),
        psi=count_params(plain),
        held=sum(s.numel() for s in net.param_shards),  # elements stored here at rest
        gathered=sum(r.numel for r in ledger.records if r.op == "all_gather"),
    )


lab.show_who_computes_what(lab.who_computes_what(NPROCS, forward_on_rank))

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
#    0.3 s longer. (Asynchronous, it would take as long as the others.)
# 2. **Same result as one process.** After every step each rank collects the full parameters
#    (`minizero.full_state_dict`, an all-gather for ZeRO); they must be bit-identical on every rank
#    and equal, up to float rounding, to one process trained on the whole global batch. A stale
#    gradient would show as a difference from the first step on.


# %%
# @save
def steps_with_a_slow_rank(stage: int, steps: int, delay: float) -> dict:
    """Every rank: the MLP at ``stage``, the last rank ``delay`` s late in step 2; one process."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    model, batch = compare.workload("mlp", 4, dev)  # this rank's 4 rows of each step
    ref, _ = compare.workload("mlp", 4 * world, dev)  # one process, the whole global batch
    ref_opt, (net, opt) = adamw(ref.to(dev).parameters()), parallelize(model, stage, adamw)
    out = dict(times=[], params=[], ref=[])
    for step in range(steps):
        dist.barrier()  # everyone starts the step together
        t0 = time.perf_counter()
        if rank == world - 1 and step == 2:
            time.sleep(delay)  # a slow rank
        net(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
        out["times"].append(time.perf_counter() - t0)
        out["params"].append({k: v.cpu() for k, v in full_state_dict(net).items()})
        whole = synthetic_batch("mlp", 4 * world, step, device=dev, in_features=32, out_features=16)
        ref(*whole).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref"].append({k: v.detach().cpu().clone() for k, v in ref.state_dict().items()})
    return out


# %%
DELAY, STEPS = 0.3, 3  # in step 2 the last rank is DELAY seconds late; stages 0 to 3
lab.show_synchronous(lab.synchronous(NPROCS, (0, 1, 2, 3), STEPS, DELAY, steps_with_a_slow_rank))

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
# construction of the wrapper. With a server, one rank's ledger would hold N − 1 times the others'.


# %%
# @save
def one_step_ledgers(stage: int) -> dict:
    """On every rank: the MLP at ``stage``; ledgers of the wrapper's construction and of step 1."""
    model, batch = compare.workload("mlp", 4, rank_device())
    with CommLedger() as built:
        net, opt = parallelize(model, stage, adamw)
    for step in range(2):  # step 0 warms up; step 1 is recorded
        with CommLedger() as ledger:
            net(*batch(step)).backward()
            opt.step()
            opt.zero_grad()
    return dict(psi=count_params(model), setup=built, step=ledger)


# %%
LEDGERS = lab.step_ledgers(NPROCS, (0, 1, 2, 3), one_step_ledgers)
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
# network, next to DDP (stage 0) and one process on the whole batch, for 3 AdamW steps. The
# prediction: all three equal, to float rounding.


# %%
# @save
def train_three_steps(make, data, stage) -> dict:
    """3 AdamW steps of ``make()`` on ``data``; ``stage=None``: one process, the whole batch."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    torch.manual_seed(0)
    model = make()
    if stage is None:
        model, opt, rank, world = model.to(dev), adamw(model.parameters()), 0, 1
    else:
        model, opt = parallelize(model, stage, adamw)
    for step in range(3):
        model(*data(8, step, rank=rank, world=world, device=dev)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.cpu() for k, v in full_state_dict(model).items()}


# %%
RES = lab.not_a_transformer(NPROCS, ("MLP", "ConvNet"), (None, 0, 3), train_three_steps)
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
# model states). If ZeRO shrank activations, the bytes alive at the end of forward would fall
# with the stage, as the model states do.


# %%
# @save
LONG = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)  # s = 128


# @save
fused = partial(torch.optim.AdamW, lr=1e-3, fused=True)  # the memory experiments' optimizer


# @save
def step_memory(stage: int, cfg=LONG, rows: int = 2, group=None) -> dict:
    """On every rank of ``group``: TinyGPT (``cfg``, b = ``rows``), bf16, ``stage``; one step."""
    dev = rank_device()
    torch.manual_seed(0)
    cap = None if stage == 3 else 0.05  # stage 3 cuts by units, not buckets
    how = dict(precision="bf16", bucket_cap_mb=cap, process_group=group)
    net, opt = parallelize(TinyGPT(cfg), stage, fused, **how)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g).to(dev)  # (b, s)
    for _ in range(2):  # step 0 creates the optimizer states; step 1 is measured
        with MemoryMeter(net, opt, device=dev) as meter:
            meter.reset_peak()
            loss = net(x, x)
            fwd = meter.mark("end of forward")  # what forward left alive, by kind
            loss.backward()
            states = sum(model_state_bytes(net, opt).values())
            opt.step()
            opt.zero_grad()
            end = meter.mark("end of step")
    return dict(states=states, fwd=fwd, peak=end["peak"], psi=count_params(TinyGPT(cfg)))


# %%
lab.show_activations_by_stage(lab.activations_by_stage(NPROCS, (0, 1, 2, 3), step_memory))

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
# 2. it assigns **whole tensors** to ranks, balancing the elements each rank owns (the exercise
#    below writes it), so the ranks' shares are unequal, but each rank's optimizer sees complete
#    tensors and can be any optimizer. minizero's stages, like DeepSpeed's stage 1 and 2
#    (`deepspeed/runtime/zero/stage_1_and_2.py`: each rank gets one contiguous 1/N of the
#    flattened parameter group), cut tensors; FSDP2 shards each parameter on its first dimension.
#
# The measurement: 3 steps of TinyGPT tiny in fp32, three ways: DDP (stage 0) with the optimizer
# over every tensor, DDP with torch's `ZeroRedundancyOptimizer` of it, and minizero's stage 1; a
# `CommLedger` records the last step. ZeroRedundancyOptimizer calls `torch.distributed.broadcast`
# itself, which the ledger cannot see: inside the lab's `torch_broadcasts_on_ledger()` it calls
# `minizero.broadcast`. Each with AdamW, then Adafactor (`torch.optim.Adafactor`, row and column
# statistics per matrix: not elementwise). The prediction: 3Ψ against 2Ψ, unequal states per
# rank, and DDP's parameters exactly: each tensor gets the whole optimizer's update from the same
# average gradient.


# %%
# @save
def zero_vs_stage1(stage: int, opt_class, torch_zero: bool = False) -> dict:
    """On every rank: 3 steps of TinyGPT tiny; the last one's ledger, optimizer bytes, params."""
    make = partial(ZeroRedundancyOptimizer, optimizer_class=opt_class) if torch_zero else opt_class
    model, batch = compare.workload("gpt", 4, rank_device())  # batch(step): this rank's 4 rows
    net, opt = parallelize(model, stage, partial(make, lr=1e-2))  # stage 0 is DDP
    for step in range(3):
        with CommLedger() as ledger, torch_broadcasts_on_ledger():  # torch's broadcasts too
            net(*batch(step)).backward()  # stage 0: DDP's all-reduce, in backward
            opt.step()  # torch's: each rank steps the tensors it owns, then broadcasts them
            opt.zero_grad()
    states = model_state_bytes(net, opt.optim if torch_zero else opt)["optimizer"]  # this rank's
    return dict(moved=ledger.by_op(), states=states, params=full_state_dict(net))


# %%
OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adafactor": torch.optim.Adafactor}
lab.show_torch_zero_vs_stage1(lab.torch_zero_vs_stage1(NPROCS, OPTIMIZERS, zero_vs_stage1))

# %% [markdown]
# ZeroRedundancyOptimizer moves 3Ψ per step where stage 1 moves 2Ψ. Its ranks' optimizer states
# differ by what whole tensors leave over (a little for TinyGPT's many small tensors; a lot when
# one tensor, such as a large embedding, is more than Ψ/N), where stage 1's are Ψ/N each, up to
# padding. In exchange it runs Adafactor, and with either optimizer its parameters are DDP's bit
# for bit, while minizero's stage 1 refuses Adafactor. Both are "stage 1" in what they store; they
# differ in what they move and how they cut.
#
# ## Exercise — ZeroRedundancyOptimizer's step
#
# Write the mechanism of `torch.distributed.optim.ZeroRedundancyOptimizer`, `MyZeroRedundancy`:
#
# * in `__init__`, the owners: `self.owners`, one rank of `group` per parameter. Whole tensors,
#   balanced by elements: the check allows no rank more than torch's own partition gives its
#   busiest rank (the sizes it tries are chosen to unbalance a careless rule). Then
#   `self.optimizer`: `optimizer_class(..., **defaults)` on this rank's tensors only, so that
#   the optimizer states live on their owner alone;
# * `step()`, called after DDP's all-reduce (every rank holds the average gradient of every
#   parameter): the local update, and then every rank must hold every parameter as its owner
#   updated it. Send with `minizero.broadcast(tensor, src=..., group=...)`, so that the ledger
#   sees it; `src` is a rank of `group`.
#
# The check trains TinyGPT tiny for 3 steps with AdamW and with Adafactor on max(NPROCS, 3)
# ranks and on a subgroup of 2, and compares every parameter after every step with torch's
# ZeroRedundancyOptimizer and with one optimizer over every tensor, given the same gradients;
# it also reads the ledger of each step.


# %%
class MyZeroRedundancy:
    """Each rank owns whole tensors, keeps the optimizer states of those, updates them alone."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.params, self.group = list(params), group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        # BEGIN SOLUTION
        # TODO: self.owners (a rank per parameter) and self.optimizer (on this rank's only)
        # HINT: Keep a list of world counts, the elements each rank owns so far; each parameter
        #       goes to the rank that owns the fewest so far. The order you visit them in matters:
        #       a big tensor handed out last lands on a rank that is already full.
        # HINT: Visit the indices i of the parameters sorted by decreasing numel(), but store
        #       owners[i] in the parameters' own order: every rank computes the same list.
        # HINT: The optimizer is optimizer_class([...], **defaults) on the parameters p whose
        #       owner is this rank: zip(self.params, self.owners).
        load, self.owners = [0] * world, [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            r = min(range(world), key=load.__getitem__)  # the least loaded so far
            self.owners[i], load[r] = r, load[r] + self.params[i].numel()
        mine = [p for p, owner in zip(self.params, self.owners) if owner == rank]
        self.optimizer = optimizer_class(mine, **defaults)
        # END SOLUTION

    def step(self) -> None:
        """After DDP's all-reduce: update this rank's tensors; then every rank holds them all."""
        # BEGIN SOLUTION
        # TODO: the local step, then every parameter from its owner
        # HINT: self.optimizer holds this rank's tensors only: its step() updates those. Every
        #       other parameter is stale here, and fresh on its owner.
        # HINT: A broadcast is a collective: every rank calls it for every parameter, in the same
        #       order, with the same src (its owner), after the update, on self.group.
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            minizero.broadcast(p.data, src=owner, group=self.group)
        # END SOLUTION


# %% check="owned_tensors"
# Your class with AdamW and Adafactor on max(NPROCS, 3) ranks, and with AdamW on a subgroup of 2.
lesson06.check_owned_tensors(MyZeroRedundancy, NPROCS)

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
# is a large share of Ψ, that outweighs the saving. The measurement: TinyGPT (V = 64, h = 64) of
# 1, 2, 4 and 6 blocks, one unit each (lesson 04), so that a unit is about 1/L of Ψ; the peak of
# one step at stages 2 and 3, bf16, fused AdamW, 16 tokens per rank.


# %%
DEPTHS = (1, 2, 4, 6)  # TinyGPT V = 64, h = 64, 16 tokens on each rank
CFGS = [GPTConfig(vocab_size=64, block_size=16, n_layer=L, n_head=4, n_embd=64) for L in DEPTHS]
# step_memory(stage, cfg, rows=1) at stages 2 and 3 for each config
lab.show_stage2_vs_stage3(lab.stage2_vs_stage3(NPROCS, CFGS, step_memory))  # and its figure

# %% [markdown]
# With one or two blocks, stage 3's peak is the **higher** one; with four or six, the lower. At
# its peak stage 3 holds a gathered unit, at the end of backward both its 16-bit copy and its full
# gradient until the reduce-scatter, while stage 2 never gathers anything; when a unit is half
# of Ψ or more, that costs more than the 2Ψ(1 − 1/N) it saves. Units must be small against the
# model for stage 3 to pay. These peaks were measured on gloo, where a reduce-scatter
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
# @save
def on_first(n: int, fn, *args) -> dict | None:
    """On every rank: a group of the first ``n`` ranks; its members run ``fn(*args, group=it)``."""
    group = dist.new_group(list(range(n)))  # every rank creates every group
    return fn(*args, group=group) if dist.get_rank() < n else None


# 4 gloo ranks, groups of the first 1, 2 and 4 (the formula at N = 64 and 1024 too): a table
# and its figure
lab.show_stage3_by_n(lab.stage3_by_n((1, 2, 4), on_first, step_memory), formula_ns=(64, 1024))

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
