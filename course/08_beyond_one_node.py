# %% [markdown]
# # Lesson 08 — Beyond one node: what crosses the boundary, and what a step will cost
#
# Every lesson so far ran on one machine. Real runs span **nodes**: inside a node the GPUs talk over
# NVLink, between nodes over a network. On a DGX H100 each GPU sends about 450 GB/s over NVLink
# (line rate) and has its own 400 Gb/s (50 GB/s) network card, eight NICs a node. The question
# becomes "which stage, sharded over what, and how long will a step take?". This lesson:
#
# 1. treats blocks of consecutive ranks as nodes and measures which of ZeRO's bytes **cross a node
#    boundary**, and that the cost model's collectives are the library's, byte for byte (section 1);
# 2. builds **hybrid sharding** (HSDP, exercise 1) and ZeRO++'s **qwZ** quantiser (exercise 2)
#    beside flat ZeRO-3, FSDP2's HSDP and hpZ (sections 2 and 3);
# 3. builds a **link model that follows NCCL**, checks it against published nccl-tests figures, and
#    has you predict a step's time (section 4, exercise 3), checked on this machine (section 5);
# 4. predicts steps and memory **at scale** (lesson 05's 6.7B model, 64 nodes × 8 GPUs; sections 6
#    and 7) and asks **which configuration you would run** (exercise 4).
#
#     python -m minizero grade my-lessons/08_beyond_one_node.ipynb
#
# The ranks here are 4 gloo processes on this machine: "nodes" are a labelling, and every link
# measured below is the same loopback.

# %%
from minizero.course.labs.lesson08 import *  # torch, dist, C, cost, scenario, hint, lab, lesson08

NODE, MICRO = 2, 2  # ranks per "node"; micro-batches per step
NPROCS, INFO = setup(4, node=NODE)  # 4 gloo ranks as 2 "nodes" of 2 (0, 1 | 2, 3)

# %% [markdown]
# ## 1. What crosses a node boundary
#
# The ledger counts what each rank *sends* under the ring model (minizero/analysis/topology.py): a
# group of n ranks is one ring in rank order, each rank sending to its successor. A rank's bytes
# cross a node boundary when its successor is on another node. For 4 ranks over 2 nodes the ring is
# 0 → 1 → 2 → 3 → 0: ranks 1 and 3 send everything across, 0 and 2 nothing, so **half the ring's
# bytes cross**.
#
# One launch of 4 ranks runs everything this lesson measures (`lab.on_nodes`): each stage for
# `MICRO` micro-batches per step under a `CommLedger(node_size=NODE)`, then timed; the layouts of
# `MORE` (sections 2 and 3) untimed; the plain model's compute and AdamW's step; and two sweeps for
# section 4's cost model, inside each node and over all 4 ranks.

# %%
MORE = {  # untimed; cost.Config's options
    "ZeRO-1 HSDP": dict(stage=1, hsdp=True),
    "ZeRO-2 HSDP": dict(stage=2, hsdp=True),
    "ZeRO-3 HSDP": dict(stage=3, hsdp=True),
    "ZeRO-3 hpZ": dict(stage=3, hpz=True),
    "ZeRO-3 hpZ+qwZ": dict(stage=3, hpz=True, qwz=True),
}
RUN = lab.on_nodes(NPROCS, NODE, MICRO, MORE)  # sections 1, 4 and 5's measurements
lab.show_node_bytes(RUN)

# %% [markdown]
# One panel per stage, one bar per rank (the two ranks of a node side by side): blue what a rank
# sends to the rank beside it in its node, red what it sends to the other node.

# %%
lab.plot_node_bytes(RUN)

# %% [markdown]
# Per rank and step, DDP and ZeRO-1 send 2 · (n−1)/n · Ψ elements, ZeRO-2 reduce-scatters every
# micro-batch, and ZeRO-3 moves 3 · (n−1)/n · Ψ per micro-batch. The cell prints the formula, the
# cost model's bytes (minizero.analysis.cost.step_collectives, from the stages' real buckets,
# padding included) and the ledger's, then the same for `MORE`. The model lists the collectives the
# library issues, so the two agree to the byte (tests/library/test_cost_ledger.py).

# %%
RING = (NPROCS - 1) / NPROCS  # what each rank of a ring sends, per pass over a payload
SENT = {0: 2 * RING, 1: 2 * RING, 2: (MICRO + 1) * RING, 3: 3 * MICRO * RING}  # × Ψ elements
lab.show_against_model(RUN, SENT)


# %% [markdown]
# ## 2. Hybrid sharding (HSDP): shard inside a node, replicate across
#
# Flat ZeRO-3 puts every rank in one ring, half of whose hops cross nodes. **HSDP** (FSDP2's
# `fully_shard(model, mesh=mesh)` with a 2-D mesh; DeepSpeed's MiCS, Zhang et al., arXiv 2205.00119)
# shards the model states over the ranks of one node and *replicates* them across nodes. Each
# gradient is reduced in two steps:
#
# 1. reduce-scatter over the node (the "shard" group, N_s ranks): each rank gets its shard summed
#    over its node;
# 2. all-reduce that shard over the "replicate" group (the R ranks, one per node, holding the same
#    shard), and divide by R · N_s: the average over every rank.
#
# Only step 2 crosses nodes: an all-reduce of Ψ/N_s per rank. But all N_s ranks of a node run it at
# once, so the node sends about 2Ψ across per reduction (section 4 prices it). The price is memory:
# (2 + 2 + K)Ψ/N_s per rank at stage 3, not (2 + 2 + K)Ψ/N.
#
# With several micro-batches, minizero's HSDP all-reduces across nodes after **every** backward at
# stages 2-3, once per step at stage 1. FSDP2 does the same by default;
# `model.set_requires_all_reduce(False)` on all but the last micro-batch (the same name in minizero)
# all-reduces once per step, as MiCS does. The cost model prices both (`cost.Config(...,
# replicate_every_microbatch=False)`). HSDP is not new at stages 1-2 either: Megatron-LM's
# `--num-distributed-optimizer-instances` (NVIDIA/Megatron-LM, `megatron/training/arguments.py`) and
# FSDP1's `ShardingStrategy._HYBRID_SHARD_ZERO2` (pytorch/pytorch, `torch/distributed/fsdp/api.py`).
#
# **Exercise 1.** Write that reduction. `grad` is this rank's local gradient, flat, (numel,) with
# numel divisible by N_s; return this rank's (numel / N_s,) shard of the gradient averaged over
# every rank. Use `C.reduce_scatter(out, grad, group=...)` and `C.all_reduce(t, group=...)` and take
# the sizes from the groups (`dist.get_world_size(group)`): the check runs it on 4 ranks as 2 × 2, 1
# × 4 and 4 × 1 (nodes × ranks per node).


# %%
def hsdp_reduce(grad, shard_group, replicate_group):
    # BEGIN SOLUTION
    # TODO: this rank's (numel / N_s,) shard of the gradient averaged over every rank
    # HINT: Two collectives: a reduce-scatter over shard_group sums the node's gradients and leaves
    #       this rank its shard; an all-reduce over replicate_group sums that shard over the nodes
    #       that hold the same shard.
    # HINT: Take the sizes from the groups: N_s = dist.get_world_size(shard_group), R =
    #       dist.get_world_size(replicate_group). The shard has grad.numel() // N_s elements, of
    #       grad's dtype; the average is the sum divided by N_s · R.
    # HINT: n_s = dist.get_world_size(shard_group)
    #       out = torch.empty(grad.numel() // n_s, dtype=grad.dtype)
    #       C.reduce_scatter(out, grad, group=shard_group)
    #       C.all_reduce(out, group=replicate_group)
    #       return out / ...  # N_s * R
    n_s = dist.get_world_size(shard_group)
    out = torch.empty(grad.numel() // n_s, dtype=grad.dtype)  # (numel / N_s,) this rank's shard
    C.reduce_scatter(out, grad, group=shard_group)  # summed over the node
    C.all_reduce(out, group=replicate_group)  # summed over the nodes that hold this shard
    return out / (n_s * dist.get_world_size(replicate_group))
    # END SOLUTION


# %% check="hsdp_reduce"
# 4 ranks as 2 × 2, 1 × 4 and 4 × 1: this rank's shard of the world's average, on every rank.
lesson08.check_hsdp_reduce(hsdp_reduce)

# %% [markdown]
# `minizero.parallelize(model, stage, optimizer, mesh=mesh)` does exactly this at stages 1-3, with
# `mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`: minizero/hsdp.py
# makes the two groups, and the stage, given the "replicate" one, all-reduces over it where it
# reduces (as FSDP2 does, HSDP is data, not another class); stage 3 gathers over "shard" only.
#
# ## 3. ZeRO++: hpZ and qwZ
#
# ZeRO++ (Wang et al., arXiv 2306.10209) cuts what crosses nodes at a small cost in memory:
#
# * **hpZ** (hierarchical partitioning, §3.2; FSDP2's `reshard_after_forward=k`): after a unit's
#   forward each rank keeps 1/k of it (k = the ranks of a node: a *secondary shard*, Ψ/k more
#   elements per rank until backward), so backward's all-gather stays inside the node.
#   `reshard_after_forward=False` keeps the whole unit (Ψ more, no backward gather). minizero, like
#   FSDP2, drops the secondary shard at every forward; DeepSpeed keeps it until the optimizer step.
# * **qwZ** (quantised weights, §3.1): the all-gathers carry int8 weights in blocks, one fp32 scale
#   per block: about Ψ(1 + 4/256) bytes instead of 2Ψ in bf16 (blocks of 256 are minizero's choice).
#   Only the gathered copy is quantised, and with hpZ minizero quantises forward's gather only.
# * **qgZ** (quantised gradients, §3.3) is built too (`quantize_gradients=True`, one hop); its int4
#   and hierarchical forms are simulated (`python -m minizero bench zeropp`).
#
# **Exercise 2.** Write qwZ's quantiser: `x` (n,) float, `block` elements a block (the last may be
# shorter). Return `q` (n,) int8 and `scales` (ceil(n / block),) fp32 with x ≈ q · scale of its
# block: symmetric absmax, scale = max |x| over the block / 127, q the nearest integer to x / scale
# (an all-zero block: scale 0 and q 0).


# %%
def quantize(x, block):
    # BEGIN SOLUTION
    # TODO: q, (n,) int8, and one fp32 scale per block, with x ≈ q · the scale of its block
    # HINT: Work block by block: pad x with zeros to a whole number of blocks and view it as
    #       (blocks, block). Zeros change no block's largest |x|.
    # HINT: scales = the largest |x| of each row / 127, rows.abs().amax(dim=1) / 127; then q =
    #       round(x / scale) lies in [-127, 127].
    # HINT: An all-zero block has scale 0: divide by 1 there instead, so its q is 0 and no NaN
    #       appears:
    #       rows = ...  # x padded with zeros to whole blocks, viewed (blocks, block)
    #       scales = rows.abs().amax(dim=1) / 127  # (blocks,)
    #       safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    #       q = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)
    #       return q.view(-1)[:n], scales
    n = x.numel()
    rows = torch.zeros(-(-n // block) * block)
    rows[:n] = x
    rows = rows.view(-1, block)  # (blocks, block)
    scales = rows.abs().amax(dim=1) / 127  # (blocks,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: q = 0
    q = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scales
    # END SOLUTION


# %% check="quantize"
# Three inputs (a short last block, an outlier, an all-zero block) against minizero.precision's.
lesson08.check_quantize(quantize)

# %% [markdown]
# Now every layout on 4 ranks as 2 nodes × 2, TinyGPT for a few steps: flat ZeRO-3, HSDP at stages
# 1-3, FSDP2's HSDP (the reference), hpZ with k = 2, `reshard_after_forward=False`, qwZ. For each:
# the bytes this rank moves per group beside the formula, what it sends inside its node and across,
# what it holds from forward to backward beyond what it held before (`model_state_bytes(model,
# include_comm=True)`), and the largest gap between its loss and one process's.

# %%
STEPS = 4
MESH = (NPROCS // NODE, NODE)  # (replicate, shard): a node shards, the nodes replicate
LAYOUTS = {  # name: parallelize's options; stage "fully_shard": torch's FSDP2
    "ZeRO-3 flat": dict(stage=3),
    "ZeRO-1 HSDP": dict(stage=1, mesh=MESH),
    "ZeRO-2 HSDP": dict(stage=2, mesh=MESH),
    "ZeRO-3 HSDP": dict(stage=3, mesh=MESH),
    "FSDP2 HSDP (torch)": dict(stage="fully_shard", mesh=MESH),
    "ZeRO-3 hpZ k=2": dict(stage=3, reshard_after_forward=NODE),
    "ZeRO-3 no reshard": dict(stage=3, reshard_after_forward=False),
    "ZeRO-3 qwZ": dict(stage=3, quantize_weights=True),
    "ZeRO-3 hpZ+qwZ": dict(stage=3, reshard_after_forward=NODE, quantize_weights=True),
}
LAY = lab.layouts(GPT, LAYOUTS, world=NPROCS, node=NODE, steps=STEPS)

# %%
B = 4 * PSI  # Ψ in fp32 bytes
Q = PSI * (1 + 4 / 256)  # Ψ as int8 blocks of 256 with an fp32 scale each
FORMULA = {  # per rank and step, the paper's accounting (an all-reduce of S counts 2S)
    "ZeRO-3 flat": {"world": 3 * B},
    "ZeRO-1 HSDP": {"shard": 2 * B, "replicate": 2 * B / NODE},
    "ZeRO-2 HSDP": {"shard": 2 * B, "replicate": 2 * B / NODE},
    "ZeRO-3 HSDP": {"shard": 3 * B, "replicate": 2 * B / NODE},
    "ZeRO-3 hpZ k=2": {"world": 2 * B, "hpZ": B},
    "ZeRO-3 no reshard": {"world": 2 * B},
    "ZeRO-3 qwZ": {"world": 2 * Q + B},
    "ZeRO-3 hpZ+qwZ": {"world": Q + B, "hpZ": B},  # backward's gather: full precision
}
# what each holds from forward to backward; the others hold 0
HELD = {"ZeRO-3 hpZ k=2": B / NODE, "ZeRO-3 no reshard": B, "ZeRO-3 hpZ+qwZ": B / NODE}
lab.show_layouts(LAY, FORMULA, HELD, psi_bytes=B)

# %% [markdown]
# What each rank sends in the last step, one panel per layout on minizero's ledger (FSDP2's is
# not: see below).

# %%
lab.plot_layouts(LAY)

# %% [markdown]
# What to read in it. HSDP's "shard" volume is flat ZeRO's over a world of 2, and its "replicate"
# volume is all that crosses a node: every rank sends a little across instead of half the ranks
# sending everything. FSDP2's HSDP matches one process's loss as minizero's does; its bytes are not
# shown, since torch's collectives bypass minizero/collectives.py and the ledger cannot see them.
# hpZ moves backward's gather into the node and holds Ψ/2 more; no resharding holds Ψ more. qwZ
# moves about a quarter of the gather bytes, and its loss is off by the quantisation.
#
# ## 4. A link model that follows NCCL
#
# Lesson 00 fitted t = α · rounds + wire / β to one sweep. Across nodes there are two links, both
# figures **per GPU**: NVLink, and one NIC per GPU, eight a node. NCCL does not run a cross-node
# ring at one NIC's speed: it runs several rings at once (its channels) over all of a node's NICs.
# So the model (minizero/analysis/cost.py lists its assumptions) keeps one (α, β) per link class and
# the node's NIC count, and prices a collective by its bottleneck:
#
#     time = α · rounds + max( gpu_bytes / β_NVLink,  node_bytes / (NICs · β_NIC) )
#
# `gpu_bytes` is what one GPU sends over NVLink, `node_bytes` what one node sends to the others: its
# ring bytes once for a flat ring, N_s times them for HSDP's replicate groups. Rings only (no trees,
# NVLS or CollNet, lesson 00).
#
# The inputs come from published nccl-tests figures on H100s with 8 NDR NICs a node: β_NVLink = 370
# GB/s, the ring busbw on one node (nccl-tests issues 212 and 309:
# https://github.com/NVIDIA/nccl-tests/issues/309), and β_NIC = 47 GB/s
# (https://github.com/NVIDIA/nccl-tests/issues/290). Rows marked "arithmetic" are these multiplied
# out. The one prediction a measurement holds is the 4-node ring: issue 309 reports 365.84 GB/s of
# all-reduce busbw on 4 × 8 GPUs, the model 8 × 47 = 376.

# %%
PEAK = cost.Links(intra=cost.Link(0.0, 370e9), inter=cost.Link(0.0, 47e9), nics=8)  # α: none
ONE_NIC = cost.Links(intra=PEAK.intra, inter=PEAK.inter, nics=1)  # the old model
bw = lambda op, n, nodes, links=PEAK: lab.busbw(op, n, nodes, links)  # the model's busbw, GB/s
NVLS_BOUND, NVLS = cost.nvls_busbw(8, 370.0)  # NVLS: the links' bound; × 0.85 (NCCL's tuner)
VALIDATION = [  # what, model GB/s, measured GB/s (None: none), source (#: nccl-tests' issues)
    ("1 node × 8, ring all-reduce", bw("all_reduce", 8, 1), 368.76, "#309 (input)"),
    ("1 node × 8, ring all-gather", bw("all_gather", 8, 1), None, "arithmetic (β_NVLink)"),
    ("4 nodes × 8, all-reduce, 8 NICs", bw("all_reduce", 32, 4), 365.84, "#309"),
    ("2 nodes × 8, all-reduce (a tree)", bw("all_reduce", 16, 2), 470.0, "#309; a tree (#196)"),
    ("64 nodes × 8, ring, 8 NICs", bw("all_reduce", 512, 64), None, "arithmetic: 8 × β_NIC"),
    ("HSDP replicate, 1 rank/node", bw("all_reduce", 64, 64), None, "arithmetic: β_NIC"),
    ("4 nodes, one NIC (the old model)", bw("all_reduce", 32, 4, ONE_NIC), 365.84, "#309"),
    ("1 node × 8, NVLS links' bound", NVLS_BOUND, None, "arithmetic (#212's formula)"),
    ("1 node × 8, NVLS × 0.85 (NCCL)", NVLS, 480.0, "#309: 480; #290: 476"),
]
lab.show_validation(VALIDATION)

# %% [markdown]
# Where its assumptions hold (rings, all NICs, one collective at a time) the model lands within 3%
# of that measurement; the "old model" row, one NIC per ring, is 8× too slow. Two rows it does not
# price:
#
# - **Trees.** On 2 nodes NCCL picks a tree, measured at 470 GB/s, 25% above the ring (nccl-tests
#   #196). The model is pessimistic there.
# - **NVLS.** NVIDIA gives its algbw as the NVLink rate times n/(n+1) (nccl-tests #212, #239): 370 ·
#   8/9 ≈ 329 GB/s, a busbw of about 575 (`cost.nvls_busbw`). NCCL's tuner scales it by 0.85 on
#   Hopper (`nvlsEfficiency`, src/graph/tuning.cc), about 490; measured 476-480.
#
# ZeRO++'s claims (§3) are volume claims: per micro-batch ZeRO-3 sends three fp16 collectives of Ψ
# across nodes; hpZ removes backward's gather, qwZ halves the gathers, qgZ's int4 quarters the
# gradients: 3 → 0.75. The model, in bytes a node sends across per micro-batch, relative to one fp16
# ring collective of Ψ:

# %%
ZERO_PP = {  # ZeRO++'s claims (§3): bytes across per micro-batch, × one fp16 ring collective of Ψ
    "ZeRO-3, fwd + bwd gathers + grads": 3.0,
    "hpZ: backward's gather": 0.0,
    "qwZ: forward's gather (int8)": 0.5,
    "qgZ, ZeRO++'s (hierarchical, int4)": 0.25,
}
lab.show_zeropp(lab.zeropp_across(psi=2**30, nodes=64, gpus=8), ZERO_PP)

# %% [markdown]
# hpZ and qwZ come out as the paper says. ZeRO++'s qgZ reduces inside the node first, so each GPU
# sends only its node-summed Ψ/8, in int4. minizero's qgZ is the one-hop form: every rank sends its
# whole int8 gradient to its owners, mostly across nodes, about 4× the fp16 ring's bytes. It is for
# one node; across nodes, the hierarchical form is the one to use.
#
# For section 5, this machine's two fits of section 1 stand for the two link classes, with one
# "NIC": both are the same loopback.

# %%
LINKS = lab.fit_links(RUN)  # each node's ring as "intra", the ring over all 4 ranks as "inter"
lab.show_links(LINKS, RUN)

# %% [markdown]
# `cost.step_collectives(cfg, [psi])` lists the collectives one rank issues in one optimizer step of
# `cfg` (a `cost.Config`: stage, N, node size, HSDP, hpZ, qwZ, micro-batches). Each is a `Comm` with
# `op`, `nbytes` (the payload S), `n` (ranks in its group), `nodes`, `group` and `times` (how often
# per step). Per call, `c.rounds()` is its ring's rounds, `c.gpu_bytes()` what one GPU sends over
# NVLink and `c.node_bytes()` what one node sends to the others.
#
# ## Exercise 3 — `predict_step_time`
#
# Write `predict_step_time(cfg, links, compute_s, psi)`: the seconds of one optimizer step, with
# `compute_s` the forward + backward of one micro-batch, `links` a `cost.Links` (`links.intra`,
# `links.inter`: each with `alpha` and `beta`; `links.nics`), and **no overlap**. Each collective
# costs its latency plus the slower of its NVLink bytes over β_intra and its node's bytes over nics
# · β_inter. Latency is α per round, as NCCL's tuner charges a ring (src/graph/tuning.cc): the inter
# link's α on `c.inter_rounds()`, the rounds that cross nodes, the intra link's on the other
# `c.rounds() - c.inter_rounds()`. Use `cost.step_collectives`, not `cost.predict` (the check
# compares with it).

# %%
CFG = cost.Config(stage=3, world=16, node_size=8, micro_batches=2)
for c in cost.step_collectives(CFG, [PSI]):
    rounds = f"rounds {c.rounds()} ({c.inter_rounds()} across)"
    print(c, f"{rounds}, NVLink {c.gpu_bytes():,.0f} B, node {c.node_bytes():,.0f} B")


# %%
def predict_step_time(cfg: cost.Config, links: cost.Links, compute_s: float, psi: int) -> float:
    """Seconds of one optimizer step of ``cfg``: compute + communication, no overlap."""
    # BEGIN SOLUTION
    # TODO: the seconds of one step: every micro-batch's compute, then every collective, no overlap
    # HINT: Compute: cfg.micro_batches forward + backward passes of compute_s each. Communication:
    #       each collective of the step costs its latency plus the slower of two pipes, as many
    #       times as it runs: NCCL drives all of a node's NICs in one collective.
    # HINT: cost.step_collectives(cfg, [psi]) lists the collectives (each a Comm with .times,
    #       .rounds(), .inter_rounds(), .gpu_bytes() over NVLink, .node_bytes() across); links
    #       has .intra, .inter (each .alpha, .beta) and .nics, the NICs per node.
    # HINT: latency: links.inter.alpha on c.inter_rounds() rounds, links.intra.alpha on the other
    #       c.rounds() - c.inter_rounds(). The two pipes: c.gpu_bytes() / links.intra.beta, and
    #       c.node_bytes() divided by links.nics * links.inter.beta.
    # HINT: total = cfg.micro_batches * compute_s
    #       for c in cost.step_collectives(cfg, [psi]):
    #           latency = ...
    #           total += c.times * (latency + max(...))
    #       return total
    total = cfg.micro_batches * compute_s
    for c in cost.step_collectives(cfg, [psi]):
        across = c.inter_rounds()
        latency = links.inter.alpha * across + links.intra.alpha * (c.rounds() - across)
        nvlink = c.gpu_bytes() / links.intra.beta
        network = c.node_bytes() / (links.nics * links.inter.beta)
        total += c.times * (latency + max(nvlink, network))
    return total
    # END SOLUTION


# %% check="predict_step_time"
# Five configurations (stages 0-3, one node, HSDP, hpZ + qwZ, 1-4 micro-batches, 4 NICs a node)
# against minizero.analysis.cost.predict with no overlap.
lesson08.check_predict_step_time(predict_step_time)

# %% [markdown]
# ## 5. Predicted against measured, on this machine
#
# The same model, fed with this machine's fits, its measured compute and the stages' buckets,
# against section 1's step times (the slowest rank's, fastest of 10). "no overlap" is exercise 3's
# prediction. It leaves out what section 1 also measured on every rank at once
# (minizero/analysis/step_parts.py):
#
# - the **optimizer step** on the rank's share;
# - the **wrappers' own work** (copies, hooks): the step with every collective replaced by a local
#   stand-in ("local"), less compute and optimizer;
# - the **synchronisation**: each rank waits for the slowest at every collective ("sync": the local
#   step with a barrier per collective, less the local step and the barriers' latency).
#
# "predicted" = local + sync + comm, so its error is how bytes and compute slow each other.

# %%
PARTS = lab.step_parts(RUN, LINKS)  # per stage: measured, predicted, and the parts measured
lab.show_step_parts(PARTS)
lab.plot_step_parts(PARTS)

# %% [markdown]
# With a model this small, the optimizer, the wrappers and the waiting are not small beside
# `compute_s`: "no overlap" sits at a third to a half of the measurement. With them, "predicted"
# lands within about ±25% (on a quiet 2-core machine, 16 of 16 stage runs within ±20%); without
# "sync" it fell 13-43% short at stages 0-2. ZeRO-3 comes out above its measurement when it misses:
# it prefetches, the overlap this model leaves out. A loaded machine moves every figure: if the load
# average under the table is above the core count, rerun section 1. On a GPU the optimizer and the
# copies are fast kernels, and NCCL overlaps only partly (its kernels share the SMs, lesson 01), so
# a real step sits between no overlap and full overlap.

# %% [markdown]
# ## 6. At scale: lesson 05's 6.7B model on 64 nodes × 8 GPUs
#
# A scenario, not a measurement. The model is lesson 05's (L = 32, h = 4096, s = 4096, flash
# attention); 64 DGX H100-like nodes: 8 GPUs of 80 GB, NVLink at 370 GB/s, 8 NICs of 47 GB/s, an
# assumed α of 10 µs a ring round (measure yours with `python -m minizero bench collectives`). Each
# GPU runs 4 sequences per micro-batch, 4 micro-batches a step, bf16 with mixed-precision Adam. α is
# paid per round of every ring: stages 0-2 reduce in DDP's 25 MiB buckets (130 here), stage 3 per
# unit (33), every micro-batch. A ring of 512 ranks takes 511 rounds for a reduce-scatter or
# all-gather: 5-10 ms of latency per call. (NCCL would use trees here, whose rounds grow with log n;
# the model does not price them.)
#
# Memory is lesson 05's budget: model states (`simulate`, plus hpZ's secondary shard), activations
# (about 17 GB a sequence, so 69 GB for 4), logits and stage 3's gathered units
# (`budget.step_budget`), with an assumed 5 GB kept for the CUDA context, NCCL and the allocator.
# What does not fit runs with activation checkpointing (lesson 05 §4), one more forward. FLOPs per
# token as PaLM counts them (arXiv 2204.02311, appendix B): 6Ψ + 12 · L · s · h, or 8Ψ + 16 · L · s
# · h with checkpointing, at an assumed 300 TFLOP/s.

# %%
BIG = GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
MACHINES = dict(nodes=64, gpus=8, gpu_GB=80.0, nvlink_GBps=370.0, nic_GBps=47.0, nics=8)
WORK = dict(seqs=4, micro=4)  # per GPU: sequences per micro-batch, micro-batches per step
ASSUMED = dict(alpha_us=10.0, tflops=300.0, headroom_GB=5.0)
SCENARIO = scenario.Scenario(**MACHINES, **WORK, **ASSUMED)
CANDIDATES = {  # cost.Config's options
    "DDP": dict(stage=0),
    "ZeRO-1": dict(stage=1),
    "ZeRO-1 HSDP": dict(stage=1, hsdp=True),
    "ZeRO-2": dict(stage=2),
    "ZeRO-2 HSDP": dict(stage=2, hsdp=True),
    "ZeRO-3": dict(stage=3),
    "ZeRO-3 HSDP": dict(stage=3, hsdp=True),
    "ZeRO-3 hpZ": dict(stage=3, hpz=True),
    "ZeRO-3 hpZ+qwZ": dict(stage=3, hpz=True, qwz=True),
}
SCALE = scenario.predict_rows(BIG, SCENARIO, CANDIDATES)  # one row per candidate
lab.show_scale(SCALE, SCENARIO, BIG, CANDIDATES)
lab.plot_scale(SCALE, SCENARIO)

# %% [markdown]
# What the table says. Compute is about 10.2 s a step, 13.5 s with checkpointing. Memory decides
# first: 69 GB of activations leave room only for ZeRO-3's few GB, and even flat ZeRO-3 needs about
# 76 GB, over the 75 GB budget, so every configuration runs with checkpointing; DDP does not fit
# even so. Then the network decides, and at 512 ranks its cost is latency ("of which α"). Flat
# ZeRO-1 moves the fewest bytes (about 0.07 s), but its 130 buckets each pay 1,022 rounds: 130 ×
# 1,022 × 10 µs = 1.33 s. ZeRO-1 HSDP's rings are short (7 rounds in the node twice, 2 × 63 across):
# 0.18 s. That latency is the term HSDP removes, and it wins by about 1.1 s a step. ZeRO-2 pays 3.3
# s of α flat, ZeRO-3 2.0 s; HSDP cuts them to 0.70 s and 0.19 s. qwZ halves forward's bytes but
# sends its scales as collectives of their own, which doubles forward's α. The old model (last line)
# favoured HSDP too, for the wrong reason: with all of a node's NICs the bytes favour the flat ring.
#
# ## 7. A calculator
#
# Change the scenario and read the prediction (a widget in JupyterLab; where no widget frontend
# runs, the cell prints the default scenario).


# %%
lab.calculator(BIG, CANDIDATES, SCENARIO)  # sliders where a widget front end runs; else the table

# %% [markdown]
# ## Exercise 4 — which configuration would you run, and why?
#
# Write the decision itself. `choose(q)` gets a `scenario.Question`: `q.psi` parameters on
# `q.world` ranks in nodes of `q.node`, `q.micro` micro-batches of `q.compute_s` seconds each,
# `q.links`, `q.memory` the bytes a rank has and `q.activations` the bytes it needs beyond its model
# states; `q.buckets` and `q.units` the elements of each collective at stages 0-2 and at stage 3
# (and `q.replicate_every_microbatch`, for `cost.Config`). It returns `(plan, reason)`:
#
# 1. **The plans**: stages 0-3, each flat or HSDP, as `(stage, hsdp)`. HSDP needs a stage that
#    shards and more than one node.
# 2. **Memory first.** A plan fits when its model states by the paper's formula, (2 + 2 + 12)Ψ with
#    each part divided by the ranks that shard it, plus the activations, are at most `q.memory`.
# 3. **Then time**: `cost.predict(...).step_s` of each plan that fits, per bucket or unit (α is paid
#    per call). The fastest wins; of equally fast plans (`math.isclose`, rel_tol=1e-9), the one
#    that needs less memory. None fits: `None`.
# 4. **The reason**, the first of these that holds: `"memory"` if ignoring memory would pick
#    another plan (or none fits); `"latency"` if ranking by step time less its α
#    (`c.latency(q.links)` of each collective, `c.times` a step) would; `"tie"` if only the
#    tie-break decided; else `"bandwidth"`.
#
# The check runs it on eight scenarios where the answer flips, against its own decision.


# %%
def choose(q: scenario.Question) -> tuple[tuple[int, bool] | None, str]:
    """(plan, reason): the fastest plan (stage, hsdp) that fits in ``q.memory``, and why."""
    # BEGIN SOLUTION
    # TODO: (plan, reason): (stage, hsdp) or None, and "memory", "latency", "tie" or "bandwidth"
    # HINT: Write one helper that picks a plan, with switches to ignore memory, ignore α and break
    #       ties the other way; the reason is which switch changes its answer, tried in order.
    # HINT: A plan's shard group is the node with HSDP, the world without: stage 1 divides the 12
    #       bytes of optimizer state by it, stage 2 the grads' 2 too, stage 3 the params' 2 too.
    # HINT: Price a plan with cost.Config(stage=..., world=q.world, node_size=q.node, hsdp=...,
    #       micro_batches=q.micro, replicate_every_microbatch=...) and
    #       cost.predict(cfg, q.links, compute_s=q.compute_s, sizes=q.units if stage == 3 else
    #       q.buckets); its α: the sum over cost.step_collectives(cfg, sizes) of c.times *
    #       c.latency(q.links).
    # HINT: def pick(memory=True, alpha=True, ties=min):
    #           rows = []  # (seconds, bytes needed, (stage, hsdp)) of each plan allowed
    #           ...
    #           best = min(r[0] for r in rows)
    #           return ties([r for r in rows if math.isclose(r[0], best, rel_tol=1e-9)],
    #                       key=...)[2]
    import math

    def pick(memory=True, alpha=True, ties=min):
        rows = []
        for stage, hsdp in [(s, h) for s in range(4) for h in (False, True)]:
            if hsdp and (stage == 0 or q.world == q.node):
                continue  # DDP shards nothing; on one node HSDP is the flat plan
            n = q.node if hsdp else q.world  # the ranks that shard the states
            per = (
                2 / (n if stage == 3 else 1)
                + 2 / (n if stage >= 2 else 1)
                + 12 / (n if stage else 1)
            )
            need = per * q.psi + q.activations
            if memory and need > q.memory:
                continue
            cfg = cost.Config(
                stage=stage,
                world=q.world,
                node_size=q.node,
                hsdp=hsdp,
                micro_batches=q.micro,
                replicate_every_microbatch=q.replicate_every_microbatch,
            )
            sizes = q.units if stage == 3 else q.buckets
            step = cost.predict(cfg, q.links, compute_s=q.compute_s, sizes=sizes).step_s
            if not alpha:
                step -= sum(c.times * c.latency(q.links) for c in cost.step_collectives(cfg, sizes))
            rows.append((step, need, (stage, hsdp)))
        if not rows:
            return None
        best = min(r[0] for r in rows)
        return ties(
            [r for r in rows if math.isclose(r[0], best, rel_tol=1e-9)], key=lambda r: r[1]
        )[2]

    plan = pick()
    if plan is None or pick(memory=False) != plan:
        return plan, "memory"
    if pick(alpha=False) != plan:
        return plan, "latency"
    return plan, "tie" if pick(ties=max) != plan else "bandwidth"
    # END SOLUTION


# %% check="choose"
# Eight scenarios: α decides (twice), memory (three times), a tie, bytes, nothing fits.
lesson08.check_choose(choose)

# %% [markdown]
# Now section 6's scenario as a question (`scenario.question`: 80 GB less the 5 GB of headroom,
# checkpointed activations), then each of its inputs halved and doubled: which one, changed by 2×,
# changes the answer or its reason?

# %%
PICK = lab.show_choice(choose, scenario.question(BIG, SCENARIO))  # None until exercise 4 runs
if PICK is not None:  # each input halved and doubled: which one changes the answer?
    lab.show_sensitivity(scenario.question_sensitivity(BIG, SCENARIO, choose))

# %% [markdown]
# The decision is **ZeRO-1 HSDP, with activation checkpointing**, and **latency** decided it: it
# fits (about 48 GB of the 75), and ranked by bytes alone flat ZeRO-1 would win (13.60 s against
# 13.66), but flat ZeRO-1 pays 1.33 s of α a step and HSDP's short rings 0.18 s: 14.93 s against
# 13.84. ("=": the same plan and reason.) Doubled or halved, the network's figures, the nodes, the
# compute rate, the micro-batches, the sequences and the headroom leave it there. Memory moves it:
# with half the GPU memory (35 GB) neither ZeRO-1 HSDP (48 GB) nor ZeRO-2 HSDP (36 GB) fits, and
# ZeRO-3 HSDP (25 GB) wins, decided by memory. Latency picks the sharding, memory the stage. The
# decision leaves out hpZ, qwZ and running without checkpointing, which section 6's table prices;
# the calculator (section 7) prices them for any scenario.
#
# The method does not change: measure the links, count each configuration's collectives as the
# library issues them, and let memory decide what is allowed before time decides what is best.
