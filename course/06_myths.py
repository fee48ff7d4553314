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
import statistics
import time
from unittest import mock

import matplotlib.pyplot as plt
import torch

# torch.optim imports torch's compiler on first use (~10 s per process). The ranks of a CPU launch
# are forked from this kernel: importing it once here saves every launch below that time.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.optim.zero_redundancy_optimizer as zro_module
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import minizero
from minizero import collectives as C
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import MemoryMeter, format_bytes, model_state_bytes
from minizero.course import checks, compare, hint, plots
from minizero.course.checks.lesson06 import check_owned_tensors
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.parallelize import full_state_dict, parallelize
from minizero.units import assign_params, select_units

NPROCS = checks.default_nprocs()
INFO = minizero.launch(checks.run_info, NPROCS)[0]  # where this lesson's measurements are made
print(checks.describe(INFO))
GPT = GPTConfig.tiny()
adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)

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
def who_computes_what():
    rank, world, dev = dist.get_rank(), dist.get_world_size(), checks.rank_device()
    torch.manual_seed(0)
    plain = TinyGPT(GPT).to(dev)  # the whole model, no ZeRO: the reference
    torch.manual_seed(0)
    net, _ = parallelize(TinyGPT(GPT), 3, adamw)
    groups, owners, _ = assign_params(net.module, select_units(net.module))  # ZeRO-3's units
    names = {m: name or "(root)" for name, m in net.module.named_modules()}
    ran = []  # per unit, as its module starts: [name, elements, present while it runs, after]

    def present(params):  # parameter elements whose storage holds data right now
        return sum(p.numel() for p in params if p.untyped_storage().nbytes())

    def before(m, args, name, params):
        ran.append([name, sum(p.numel() for p in params), present(params)])

    def after(m, args, out, name, params):
        next(row for row in ran if row[0] == name).append(present(params))

    for params, m in zip(groups, owners, strict=True):  # these run after ZeRO-3's gather / free
        m.register_forward_pre_hook(lambda m, a, n=names[m], ps=params: before(m, a, n, ps))
        m.register_forward_hook(lambda m, a, out, n=names[m], ps=params: after(m, a, out, n, ps))
    x, y = synthetic_batch("gpt", 4 * world, 0, rank=rank, world=world, device=dev)  # (4, T)
    with CommLedger() as ledger, FlopCounterMode(display=False) as flops:
        net(x, y)
    with FlopCounterMode(display=False) as plain_flops:
        plain(x, y)
    return dict(
        ran=ran,
        rows=x[:, 0].tolist(),
        flops=flops.get_total_flops(),
        plain_flops=plain_flops.get_total_flops(),
        psi=count_params(plain),
        held=sum(s.numel() for s in net.param_shards),
        gathered=sum(r.numel for r in ledger.records if r.op == "all_gather"),
    )


runs = minizero.launch(who_computes_what, NPROCS, verbose=False)
head = "".join(f"rank {r}: while | after".rjust(24) for r in range(NPROCS))
print(f"{'unit (module)':22}{'elements':>10}{head}")
for i, (name, n, *_) in enumerate(runs[0]["ran"]):
    cells = "".join(f"{r['ran'][i][2]:>15,} | {r['ran'][i][3]:>6,}" for r in runs)
    print(f"{name:22}{n:>10,}{cells}")
for rank, r in enumerate(runs):
    print(
        f"rank {rank}: micro-batch starts with tokens {r['rows']}; ran {len(r['ran'])} units; "
        f"holds {r['held']:,} of Ψ = {r['psi']:,} elements at rest; all-gathered "
        f"{r['gathered']:,} in forward; forward FLOPs {r['flops']:,} (plain TinyGPT on the same "
        f"rows: {r['plain_flops']:,})"
    )

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
DELAY, STEPS = 0.3, 3


def synchronous(stage):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), checks.rank_device()
    model, batch = compare.workload("mlp", 4, dev)  # this rank's 4 rows of each step
    ref, _ = compare.workload("mlp", 4 * world, dev)  # one process, the whole global batch
    ref.to(dev)
    ref_opt = adamw(ref.parameters())
    net, opt = parallelize(model, stage, adamw)
    times, params, ref_params = [], [], []
    for step in range(STEPS):
        dist.barrier()  # everyone starts the step together
        t0 = time.perf_counter()
        if rank == world - 1 and step == 2:
            time.sleep(DELAY)  # a slow rank
        net(*batch(step)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        params.append({k: v.cpu() for k, v in full_state_dict(net).items()})
        whole = synthetic_batch("mlp", 4 * world, step, device=dev, in_features=32, out_features=16)
        ref(*whole).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_params.append({k: v.detach().cpu().clone() for k, v in ref.state_dict().items()})
    return dict(times=times, params=params, ref=ref_params)


def run_synchronous(progress):
    out = {}
    for stage in range(4):
        out[stage] = synchronous(stage)
        progress.tick()
    return out


sync = checks.launch_with_progress(run_synchronous, NPROCS, total=4, desc="stages", verbose=False)
for stage in range(4):
    t = [f"{s * 1e3:.0f}" for s in sync[0][stage]["times"]]
    same = all(
        torch.equal(r[stage]["params"][s][k], sync[0][stage]["params"][s][k])
        for r in sync
        for s in range(STEPS)
        for k in r[stage]["params"][s]
    )
    diff = max(
        (p[k] - ref[k]).abs().max().item()
        for p, ref in zip(sync[0][stage]["params"], sync[0][stage]["ref"])
        for k in p
    )
    print(
        f"stage {stage}: rank 0's step times (ms) {t}; parameters bit-identical on all ranks "
        f"after every step: {same}; max |rank 0 - one process| = {diff:.1e}"
    )
print(checks.describe(INFO))

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
def step_ledgers():
    dev = checks.rank_device()
    out = {}
    for stage in range(4):
        model, batch = compare.workload("mlp", 4, dev)
        psi = count_params(model)
        with CommLedger() as setup:
            net, opt = parallelize(model, stage, adamw)
        for step in range(2):  # step 0 warms up; step 1 is recorded
            with CommLedger() as ledger:
                net(*batch(step)).backward()
                opt.step()
                opt.zero_grad()
        out[stage] = dict(psi=psi, setup=setup, step=ledger)
    return out


res = minizero.launch(step_ledgers, NPROCS, verbose=False)
LEDGERS = {stage: [r[stage]["step"] for r in res] for stage in range(4)}  # [rank] per stage
PSI = res[0][0]["psi"]
for stage, ledgers in LEDGERS.items():
    calls = [[(r.op, r.numel, r.dtype) for r in L.records] for L in ledgers]
    per_rank = ", ".join(
        f"rank {i}: {len(c)} calls, {L.volume_elements / PSI:.2f}Ψ"
        for i, (c, L) in enumerate(zip(calls, ledgers))
    )
    ops = sorted({r.op for L in ledgers for r in L.records})
    print(
        f"stage {stage}: {per_rank}; ops {ops}; same calls on every rank: "
        f"{all(c == calls[0] for c in calls)}"
    )
setup = [(r.op, r.tag) for r in res[1][0]["setup"].records]
print(f"construction (stage 0, rank 1): {len(setup)} x {sorted(set(setup))}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
width = 0.8 / NPROCS
for rank in range(NPROCS):
    xs = [s - 0.4 + width * (rank + 0.5) for s in LEDGERS]
    ax.bar(
        xs,
        [LEDGERS[s][rank].volume_elements / PSI for s in LEDGERS],
        width * 0.9,
        label=f"rank {rank}",
    )
ax.set_xticks(list(LEDGERS), [f"{s}: {plots.STAGE_NAMES[s]}" for s in LEDGERS])
ax.set_ylabel("elements moved per step / Ψ")
ax.set_title(f"every rank moves the same: MLP, one step, {checks.describe(INFO)}", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

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
class ConvNet(nn.Module):
    """Two convolutions and a linear head on 3 x 16 x 16 images, 10 classes. No BatchNorm: its
    statistics are per rank under any data parallelism, so it would not match one process."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x, y=None):
        h = F.relu(self.conv1(x))  # (B, 8, 16, 16)
        h = F.relu(self.conv2(h))  # (B, 16, 8, 8)
        logits = self.head(h.mean(dim=(2, 3)))  # (B, 10)
        return logits if y is None else F.cross_entropy(logits, y)


def images(global_batch, step, rank=0, world=1, device="cpu"):
    g = torch.Generator().manual_seed(step)  # the same global batch on every rank
    x = torch.randn(global_batch, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (global_batch,), generator=g)
    rows = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
    return x[rows].to(device), y[rows].to(device)


def mlp_batch(global_batch, step, rank=0, world=1, device="cpu"):
    return synthetic_batch("mlp", global_batch, step, rank=rank, world=world, device=device)


def train(make, data, stage):
    """3 AdamW steps; ``stage=None``: one process on the whole batch. Full fp32 params after."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), checks.rank_device()
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


def not_a_transformer():
    return {
        name: {stage: train(make, data, stage) for stage in (None, 0, 3)}
        for name, make, data in (("MLP", MLP, mlp_batch), ("ConvNet", ConvNet, images))
    }


res4 = minizero.launch(not_a_transformer, NPROCS, verbose=False)
for (name, by_stage), make in zip(res4[0].items(), (MLP, ConvNet)):
    torch.manual_seed(0)
    start = make().state_dict()  # the initial weights, to see how far training moved them
    one = by_stage[None]  # one process, whole batch
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    diff = {s: max((by_stage[s][k] - one[k]).abs().max().item() for k in one) for s in (0, 3)}
    d03 = max((by_stage[3][k] - by_stage[0][k]).abs().max().item() for k in one)
    print(
        f"{name}: 3 steps moved the parameters by up to {moved:.1e}; max |params - one process| "
        f"= {diff[0]:.1e} for DDP, {diff[3]:.1e} for stage 3 on {NPROCS} ranks; "
        f"max |stage 3 - DDP| = {d03:.1e}"
    )

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
for stage, ledgers in LEDGERS.items():
    by_op = {op: v / PSI for op, v in ledgers[0].by_op().items()}
    print(
        f"stage {stage} {plots.STAGE_NAMES[stage]:9}: {ledgers[0].volume_elements / PSI:.3f}Ψ = {by_op}"
    )

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
LONG = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)
fused = lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)


def activations_by_stage():
    dev, out = checks.rank_device(), {}
    for stage in range(4):
        torch.manual_seed(0)
        cap = None if stage == 3 else 0.05  # stage 3 cuts by units, not buckets
        net, opt = parallelize(TinyGPT(LONG), stage, fused, precision="bf16", bucket_cap_mb=cap)
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randint(0, LONG.vocab_size, (2, LONG.block_size), generator=g).to(dev)  # (b, s)
        net(x, x).backward()  # a warm-up step creates the optimizer states
        opt.step()
        opt.zero_grad()
        with MemoryMeter(net, opt, device=dev) as meter:
            meter.reset_peak()
            loss = net(x, x)
            fwd = meter.mark("end of forward")
            loss.backward()
            states = sum(model_state_bytes(net, opt).values())
            opt.step()
            opt.zero_grad()
            end = meter.mark("end of step")
        out[stage] = dict(states=states, fwd=fwd, peak=end["peak"])
    return out


acts = minizero.launch(activations_by_stage, NPROCS, verbose=False)[0]  # rank 0
print(f"TinyGPT, L=2 h=64 s=128 b=2, bf16, rank 0 of {checks.describe(INFO)}")
print(f"{'stage':12}{'model states':>14}{'activations, end of forward':>30}{'peak - states':>16}")
for stage, m in acts.items():
    fwd = m["fwd"]  # CPU: the split; CUDA: total - model states (the allocator gives no split)
    alive = fwd["activations"] if fwd["at_peak"] is not None else fwd["total"] - m["states"]
    print(
        f"{stage}: {plots.STAGE_NAMES[stage]:9}{format_bytes(m['states']):>14}{format_bytes(alive):>30}"
        f"{format_bytes(m['peak'] - m['states']):>16}"
    )

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
class LedgeredDist:
    """torch.distributed, except that broadcast goes through minizero's ledger."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def broadcast(tensor, src, group=None, async_op=False):
        group_src = dist.get_group_rank(group or dist.group.WORLD, src)  # src: a global rank
        return C.broadcast(tensor, src=group_src, group=group, async_op=async_op, tag="zro")


def torch_zero_vs_stage1():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, world, dev = dist.get_rank(), dist.get_world_size(), checks.rank_device()
    out = {}
    for opt_name, opt_class in (("AdamW", torch.optim.AdamW), ("Adafactor", torch.optim.Adafactor)):
        torch.manual_seed(0)
        model = TinyGPT(GPT).to(dev)
        torch.manual_seed(0)
        ref = TinyGPT(GPT).to(dev)  # one process, the whole batch
        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_class, lr=1e-2)
        ref_opt = opt_class(ref.parameters(), lr=1e-2)
        for step in range(3):
            x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, device=dev)
            model(x, y).backward()
            with CommLedger() as ledger, mock.patch.object(zro_module, "dist", LedgeredDist()):
                for p in model.parameters():  # DDP: the average gradient on every rank
                    C.all_reduce(p.grad, tag="ddp")
                    p.grad /= world
                zro.step()
            zro.zero_grad()
            ref(*synthetic_batch("gpt", 4 * world, step, device=dev)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        out[f"torch {opt_name}"] = dict(
            by_op=ledger.by_op(),
            opt=model_state_bytes(None, zro.optim)["optimizer"],  # zro.optim: this rank's
            diff=diff,
        )
        try:
            net, opt = parallelize(TinyGPT(GPT), 1, lambda p, cls=opt_class: cls(p, lr=1e-2))
        except TypeError as e:
            out[f"stage 1 {opt_name}"] = dict(refused=str(e))
            continue
        for step in range(2):
            x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, device=dev)
            with CommLedger() as ledger:
                net(x, y).backward()
                opt.step()
                opt.zero_grad()
        out[f"stage 1 {opt_name}"] = dict(
            by_op=ledger.by_op(), opt=model_state_bytes(net, opt)["optimizer"]
        )
    return out


zro = minizero.launch(torch_zero_vs_stage1, NPROCS, verbose=False)
psi = count_params(TinyGPT(GPT))
print(f"TinyGPT tiny, Ψ = {psi:,}, fp32, one step, {checks.describe(INFO)}")
for key in zro[0]:
    if "refused" in zro[0][key]:
        print(f"{key}: refused: {zro[0][key]['refused'][:130]}...")
        continue
    moved = {op: f"{v / psi:.2f}Ψ" for op, v in zro[0][key]["by_op"].items()}
    total = sum(zro[0][key]["by_op"].values()) / psi
    per_rank = ", ".join(format_bytes(r[key]["opt"]) for r in zro)
    d = zro[0][key].get("diff")  # torch's: against one process after 3 steps
    diff = "" if d is None else f"; max |params - one process| after 3 steps {d:.1e}"
    print(f"{key}: moved {total:.2f}Ψ {moved}; optimizer states per rank: {per_rank}{diff}")

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
check_owned_tensors(assign_owners, owned_step, NPROCS)

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


def stage2_vs_stage3():
    dev, out = checks.rank_device(), []
    for V in VOCABS:
        cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=6, n_head=4, n_embd=64)
        for stage in (2, 3):
            torch.manual_seed(0)
            cap = None if stage == 3 else 0.05  # stage 3 cuts by units, not buckets
            net, opt = parallelize(TinyGPT(cfg), stage, fused, precision="bf16", bucket_cap_mb=cap)
            x = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
            net(x, x).backward()  # a warm-up step creates the optimizer states
            opt.step()
            opt.zero_grad()
            with MemoryMeter(net, opt, device=dev) as meter:
                meter.reset_peak()
                net(x, x).backward()
                opt.step()
                opt.zero_grad()
                end = meter.mark("step")
            out.append(dict(V=V, stage=stage, peak=end["peak"], psi=count_params(TinyGPT(cfg))))
    return out


sweep = minizero.launch(stage2_vs_stage3, NPROCS, verbose=False)[0]
print(f"peak per rank, rank 0 of {checks.describe(INFO)}")
share = {}
for V in VOCABS:
    p2, p3 = (next(r for r in sweep if r["V"] == V and r["stage"] == s) for s in (2, 3))
    share[V] = V * 64 / p2["psi"]  # the embedding's share of Ψ
    print(
        f"V = {V:6}: embedding {share[V]:4.0%} of Ψ = {p2['psi']:>9,}; stage 2 "
        f"{format_bytes(p2['peak']):>10}, stage 3 {format_bytes(p3['peak']):>10} "
        f"({p3['peak'] / p2['peak'] - 1:+.1%})"
    )

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
xs = [share[V] for V in VOCABS]
for stage in (2, 3):
    ys = [r["peak"] / r["psi"] for V in VOCABS for r in sweep if (r["V"], r["stage"]) == (V, stage)]
    ax.plot(xs, ys, "o-", label=f"stage {stage}: {plots.STAGE_NAMES[stage]}")
ax.set_xlabel("the embedding's share of Ψ (V × h, in the root's unit)")
ax.set_ylabel("peak bytes per rank / Ψ")
note = f"\n{plots.GLOO_MEMORY_NOTE}" if INFO["backend"] == "gloo" else ""
where = f"{checks.describe(INFO)}{note}"
ax.set_title(f"TinyGPT L=6 h=64, bf16, 16 tokens per rank; {where}", fontsize=9)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# Where the embedding is a small share of Ψ, stage 3's peak is the lower one. As it grows, the
# curves cross: stage 3 holds the root's unit, the embedding with it, gathered through forward
# and backward, and at the end of backward both its 16-bit copy and its full gradient until the
# reduce-scatter, while stage 2 never gathers anything. (With L = 2 they never cross: the root
# and both blocks, all of Ψ, are gathered at once at stage 3's peak. Units must be small
# against the model for stage 3 to pay.) These peaks were measured on gloo, whose reduce-scatter
# clones its input (lesson 03): a bucket more for stage 2, a unit's gradient more for stage 3;
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
def stage3_by_n(worlds):
    rank, dev, out = dist.get_rank(), checks.rank_device(), []
    for n in worlds:
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank < n:
            torch.manual_seed(0)
            net, opt = parallelize(TinyGPT(LONG), 3, fused, precision="bf16", process_group=group)
            x = torch.randint(0, LONG.vocab_size, (2, LONG.block_size)).to(dev)  # (b, s)
            net(x, x).backward()  # a warm-up step creates the optimizer states
            opt.step()
            opt.zero_grad()
            with MemoryMeter(net, opt, device=dev) as meter:
                meter.reset_peak()
                net(x, x).backward()
                states = sum(model_state_bytes(net, opt).values())
                opt.step()
                opt.zero_grad()
                end = meter.mark("step")
            out.append(dict(n=n, states=states, peak=end["peak"], psi=count_params(TinyGPT(LONG))))
        dist.barrier()
    return dict(info=checks.run_info(), rows=out)


floor = minizero.launch(stage3_by_n, 4, [1, 2, 4], backend="gloo", verbose=False)[0]
for r in floor["rows"]:
    rest = r["peak"] - r["states"]
    print(
        f"N = {r['n']}: peak {format_bytes(r['peak'])} = model states {format_bytes(r['states'])} "
        f"+ the rest {format_bytes(rest)}"
    )

# %%
rows = floor["rows"]
psi, rest = rows[0]["psi"], statistics.fmean(r["peak"] - r["states"] for r in rows)
fig, ax = plt.subplots(figsize=(7, 3.5))
ns = [r["n"] for r in rows]
ax.bar([str(n) for n in ns], [r["states"] / 2**20 for r in rows], label="model states (16Ψ/N)")
ax.bar([str(n) for n in ns], [(r["peak"] - r["states"]) / 2**20 for r in rows],
       bottom=[r["states"] / 2**20 for r in rows], label="the rest of the peak", hatch="//",
       color="#DDDDDD")  # fmt: skip
for n in (64, 1024):  # the formula's model states, the measured rest
    label = "16Ψ/N by formula + the measured rest" if n == 64 else None
    ax.bar(f"{n}\n(formula)", (16 * psi / n + rest) / 2**20, color="#BBBBBB", label=label)
ax.set_ylabel("peak per rank (MiB)")
ax.set_xlabel("N: ranks in the process group")
info = floor["info"]
ax.set_title(f"stage 3, TinyGPT L=2 h=64 s=128 b=2, bf16; {info['backend']} · {info['device']}, "
             f"groups of the first N of {info['world']} ranks\n{plots.GLOO_MEMORY_NOTE}",
             fontsize=9)  # fmt: skip
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

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
