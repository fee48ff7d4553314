# %% [markdown]
# # Lesson 08 — Beyond one node: what crosses the boundary, and what a step will cost
#
# Every lesson so far ran on one machine, where every rank reaches every other over the same
# link. Real runs span **nodes**: inside a node the GPUs talk over NVLink, between nodes over a
# network. Both are per-GPU figures on a DGX H100: each GPU sends about 450 GB/s over NVLink
# (line rate) and has its own 400 Gb/s (50 GB/s) network card, eight NICs a node. The question a
# practitioner meets next is not "which stage?" but "which stage, sharded over what, and how long
# will a step take?". This lesson:
#
# 1. treats blocks of consecutive ranks on this machine as nodes and measures, with the ledger,
#    which of ZeRO's bytes **cross a node boundary**, and that the cost model's collectives are
#    the library's, byte for byte (section 1);
# 2. builds **hybrid sharding** (HSDP, exercise 1) and ZeRO++'s **qwZ** quantiser (exercise 2)
#    and measures them beside flat ZeRO-3, FSDP2's HSDP and hpZ (sections 2 and 3);
# 3. builds a **link model that follows NCCL** (NVLink per GPU, all of a node's NICs), checks it
#    against measured nccl-tests figures, and has you write the prediction of a step's
#    time (section 4, exercise 3), checked against this machine's steps (section 5);
# 4. predicts steps and memory **at scale** (lesson 05's 6.7B model, 64 nodes × 8 GPUs) with a
#    calculator (sections 6 and 7), and asks you **which configuration you would run**
#    (exercise 4), and which input, changed by 2×, would change the answer.
#
#     python -m minizero grade my-lessons/08_beyond_one_node.ipynb
#
# The ranks here are 4 gloo processes on this machine, whatever it has: "nodes" are a labelling,
# so every link measured below is the same loopback. The lesson says so wherever it matters.

# %%
from minizero.course.labs.lesson08 import *  # torch, dist, C, cost, scenario, hint, lab, lesson08

NODE, MICRO = 2, 2  # ranks per "node"; micro-batches per step
NPROCS, INFO = setup(4, node=NODE)  # 4 gloo ranks as 2 "nodes" of 2 (0, 1 | 2, 3)

# %% [markdown]
# ## 1. What crosses a node boundary
#
# The ledger counts what each rank *sends* under the ring model (minizero/analysis/topology.py):
# a group of n ranks is one ring in rank order, and in a ring every rank sends all its bytes to
# its successor. A rank's bytes cross a node boundary when its successor is on another node. For
# the flat group of 4 over 2 nodes the ring is 0 → 1 → 2 → 3 → 0: ranks 1 and 3 send everything
# across, ranks 0 and 2 nothing, so **half the ring's bytes cross**. (How fast they cross is
# section 4's question: NCCL runs several such rings at once, over all of a node's NICs.)
#
# One launch of 4 ranks runs everything this lesson measures (`lab.on_nodes`): each stage, flat,
# for `MICRO` micro-batches per step under a `CommLedger(node_size=NODE)`, then timed; the
# layouts of `MORE` (HSDP at stages 1-3, hpZ and hpZ + qwZ, named by `cost.Config`'s options:
# sections 2 and 3 explain them) the same, untimed; the plain model's forward + backward (the
# compute) and AdamW's step; and two sweeps for the cost model of section 4, one inside each
# node, one over all 4 ranks.

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
# Beside the formula: per rank and step, DDP and ZeRO-1 send 2 · (n−1)/n · Ψ elements (one
# all-reduce, or its two halves), ZeRO-2 reduce-scatters every micro-batch, and ZeRO-3 moves
# 3 · (n−1)/n · Ψ per micro-batch (gather in forward, gather in backward, reduce-scatter). The
# cell prints the formula, the model's bytes (minizero.analysis.cost.step_collectives, from the
# buckets the stages really made, padding included) and the ledger's; then, group by group, the
# same for the layouts of `MORE`. The model lists the collectives the library issues, so the two
# agree to the byte (tests/library/test_cost_ledger.py checks every one of these at 1 and 4
# micro-batches).

# %%
RING = (NPROCS - 1) / NPROCS  # what each rank of a ring sends, per pass over a payload
SENT = {0: 2 * RING, 1: 2 * RING, 2: (MICRO + 1) * RING, 3: 3 * MICRO * RING}  # × Ψ elements
lab.show_against_model(RUN, SENT)


# %% [markdown]
# ## 2. Hybrid sharding (HSDP): shard inside a node, replicate across
#
# Flat ZeRO-3 puts every rank in one ring, so half its ring's hops cross nodes (section 1).
# **HSDP** (FSDP2's `fully_shard(model, mesh=mesh)` with a 2-D mesh; DeepSpeed calls the same
# layout MiCS, Zhang et al., arXiv 2205.00119) shards the model states over the ranks of one node
# only and *replicates* them across nodes. Each gradient is then reduced in two steps:
#
# 1. reduce-scatter over the node (the "shard" group, N_s ranks): each rank gets its shard summed
#    over its node;
# 2. all-reduce that shard over the "replicate" group (the R ranks, one per node, that hold the
#    same shard), and divide by R · N_s: the average over every rank.
#
# Only step 2 crosses a node boundary: an all-reduce of Ψ/N_s elements per rank, instead of flat
# ZeRO-3's three collectives of Ψ. But all N_s ranks of a node run their replicate all-reduces at
# once, so the node sends about 2Ψ across per reduction, where a flat ring sends about Ψ per
# collective: section 4 prices both. The price is memory: a rank holds the model states of a
# world of N_s ranks, (2 + 2 + K)Ψ/N_s at stage 3, not (2 + 2 + K)Ψ/N.
#
# How often step 2 runs. With several micro-batches per step, minizero's HSDP all-reduces across
# nodes after **every** backward at stages 2-3 by default (minizero/hsdp.py's
# `finish_in_flight`, around the stage's, hands each shard to `Replicas`), and once per step at
# stage 1 (section 1's table: "replicate" carries MICRO times more at stages 2-3). FSDP2 does the
# same by default and offers the switch, which minizero's HSDP at stages 2-3 takes under the same
# name: `model.set_requires_all_reduce(False)` on all but the last micro-batch keeps the
# reduce-scattered shards and all-reduces them once (pytorch/pytorch,
# `torch/distributed/fsdp/_fully_shard/_fully_shard.py`); DeepSpeed's MiCS all-reduces once, at
# the accumulation boundary (minizero too, if the switch stays False: the step averages what is
# held). The cost model prices either (`cost.Config(..., replicate_every_microbatch=False)`), and
# tests/library/test_cost_ledger.py measures both against the ledger. HSDP at stages 1 and 2 is
# not new: Megatron-LM's distributed optimizer with `--num-distributed-optimizer-instances`
# shards the optimizer states within a group and replicates them across groups (stage 1;
# NVIDIA/Megatron-LM, `megatron/training/arguments.py`), and FSDP1 had
# `ShardingStrategy._HYBRID_SHARD_ZERO2` (stage 2; pytorch/pytorch,
# `torch/distributed/fsdp/api.py`). FSDP2 and MiCS shard the parameters too.
#
# **Exercise 1.** Write that reduction. `grad` is this rank's local gradient, flat, (numel,) with
# numel divisible by N_s; return this rank's (numel / N_s,) shard of the gradient averaged over
# every rank. Use `C.reduce_scatter(out, grad, group=...)` and `C.all_reduce(t, group=...)` and
# take the sizes from the groups (`dist.get_world_size(group)`): the check runs your function on
# 4 ranks as 2 × 2, 1 × 4 and 4 × 1 (nodes × ranks per node).


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
# `minizero.parallelize(model, stage, optimizer, mesh=mesh)` does exactly this at stages 1-3
# (minizero/hsdp.py), with `mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate",
# "shard"))`; stage 3 all-gathers the parameters over "shard" only. Section 3's cell measures it
# beside flat ZeRO-3, FSDP2's own HSDP and the ZeRO++ options.
#
# ## 3. ZeRO++: hpZ and qwZ
#
# ZeRO++ (Wang et al., arXiv 2306.10209) cuts what crosses nodes at a small cost in memory:
#
# * **hpZ** (hierarchical partitioning, §3.2; FSDP2's `reshard_after_forward=k`): after a unit's
#   forward each rank keeps 1/k of it (k = the ranks of a node: its *secondary shard*, Ψ/k more
#   elements per rank from forward to backward, 2Ψ/k bytes in bf16), so backward's all-gather
#   runs inside the node. `reshard_after_forward=False` keeps the whole unit instead (no backward
#   gather, Ψ more elements). With several micro-batches, minizero drops the secondary shard at
#   every forward, as FSDP2's integer `reshard_after_forward` does, so every forward gathers
#   across nodes again; DeepSpeed keeps it until the optimizer step, so only the first
#   micro-batch's forward crosses (`deepspeed/runtime/zero/partition_parameters.py`, the
#   `ds_secondary_tensor`). "hpZ = `reshard_after_forward=k`" holds at one micro-batch per step.
# * **qwZ** (quantised weights, §3.1): the all-gathers carry the weights as int8 in blocks, with
#   one fp32 scale per block: about Ψ(1 + 4/256) bytes instead of 4Ψ (fp32) or 2Ψ (bf16). Blocks of
#   256 are minizero's choice; DeepSpeed's quantiser picks groups of up to 8,000 elements
#   (`CUDAQuantizer.target_group_size` in the same file). Only the gathered copy is quantised;
#   the shards and the optimizer's fp32 masters are not. With hpZ, minizero quantises the
#   forward gather only: backward's gather from the secondary shards goes in the working dtype
#   (minizero/zero3.py's `_all_gather` takes the secondary path first); DeepSpeed quantises that
#   one too.
# * **qgZ** (quantised gradients, §3.3) is built too (`quantize_gradients=True`, one hop); its
#   int4 and hierarchical forms are simulated (`python -m minizero bench zeropp`; README).
#
# **Exercise 2.** Write qwZ's quantiser: `x` (n,) float, `block` elements a block (the last one
# may be shorter). Return `q` (n,) int8 and `scales` (ceil(n / block),) fp32 with
# x ≈ q · scale of its block: symmetric absmax, scale = max |x| over the block / 127, q the
# nearest integer to x / scale (an all-zero block: scale 0 and q 0).


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
# Now every layout on the same 4 ranks as 2 nodes × 2, TinyGPT for a few steps: flat ZeRO-3; HSDP
# at stages 1-3; FSDP2's own HSDP (`fully_shard(..., mesh=mesh)`, the reference); hpZ with k = 2
# and `reshard_after_forward=False`; qwZ. For each: the bytes this rank moves per group in the
# paper's accounting (an all-reduce of S counts 2S) beside the formula, the bytes it sends inside
# its node and across (the ring model of section 1), the bytes it holds from forward to backward
# beyond what it held before forward (`model_state_bytes(model, include_comm=True)`, read at both
# moments: gathered units, hpZ's secondary shards), and the largest gap between its loss and one
# process's on the whole batch. (gloo: the ranks share this machine's loopback, so "across" is a
# label, not a slower link; and gloo's reduce-scatter is an all-reduce that keeps one chunk, see
# lesson 00.)

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
# volume, Ψ/2 per rank all-reduced (counted 2 · Ψ/2), is all that crosses a node: every rank sends a
# little across instead of half the ranks sending everything. FSDP2's HSDP trains the same model
# (its loss matches one process as minizero's does). Its bytes are not in the table or the figure:
# torch's collectives do not go through minizero/collectives.py, so the ledger cannot see them (an
# empty bar would read as "sends nothing"). hpZ moves backward's gather into the node ("hpZ", Ψ) and
# holds Ψ/2 more from forward to backward; no resharding holds Ψ more and gathers nothing in
# backward. qwZ moves about a quarter of the gather bytes; its loss is off one process's by the
# quantisation, not by rounding. hpZ + qwZ gathers int8 in forward ("world": Q + Ψ) and full
# precision in backward ("hpZ": Ψ), as minizero's library does. The cost model prices each of these
# from the collectives the library issues (section 1 compared them byte for byte).
#
# ## 4. A link model that follows NCCL
#
# Lesson 00 fitted t = α · rounds + wire / β to one sweep: β is what one rank sends per second.
# Across nodes there are two links, and both figures are **per GPU**: on a DGX H100 each GPU
# sends about 450 GB/s over NVLink (line rate) and owns one 400 Gb/s NIC, eight a node. NCCL does
# not run a cross-node ring at one NIC's speed: it runs several rings at once (its channels),
# spread over all of the node's NICs, and NVLink carries each GPU's share to the GPU beside the
# NIC it leaves by. So the model (minizero/analysis/cost.py, its docstring lists the assumptions)
# keeps one (α, β) per link class, β per GPU for NVLink and per NIC for the network, the number
# of NICs a node has, and prices a collective by its bottleneck:
#
#     time = α · rounds + max( gpu_bytes / β_NVLink,  node_bytes / (NICs · β_NIC) )
#
# with `gpu_bytes` what one GPU sends over NVLink (its ring bytes, less the hops that leave the
# node) and `node_bytes` what one node sends to the others: once its ring bytes for a flat ring
# (each ring leaves each node once), N_s times them for HSDP's replicate groups (N_s all-reduces,
# one per GPU, at once). Rings only: NCCL's trees, NVLS and CollNet are left out.
#
# Against measured nccl-tests figures on H100s with 8 NDR 400 Gb/s NICs a node, at sizes large
# enough that α does not matter. The inputs come from two of them: β_NVLink = 370 GB/s, the
# ring busbw over NVLink on one node (an NVIDIA engineer in
# https://github.com/NVIDIA/nccl-tests/issues/212: "about 370 GB/s"; 368.76 GB/s measured with
# NVLS disabled in https://github.com/NVIDIA/nccl-tests/issues/309), and β_NIC = 47 GB/s, the
# 46-48 GB/s per NIC of https://github.com/NVIDIA/nccl-tests/issues/290. So the one-node rows
# restate an input, and every row the table marks "arithmetic" is the inputs multiplied out, with
# no measurement to hold it. The one prediction a measurement holds is the 4-node ring: issue 309
# reports 365.84 GB/s of all-reduce busbw on 4 nodes × 8 GPUs, where the model's 8 NICs × 47 GB/s
# give 376. (On 2 nodes the same issue reports 470 GB/s: NCCL then runs a tree or NVLS-tree, not a
# ring, which can exceed the NICs' rate; nccl-tests#196, where NCCL's author says so. The model
# prices rings only.)

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
# Where its assumptions hold (rings, all NICs used, one collective at a time) the model lands
# within 3% of the one multi-node measurement it can be held to: a ring over 4 nodes runs at
# about 8 × 47 GB/s a node, not at the 47 GB/s of one NIC (the "old model" row, 8× too slow).
# HSDP's replicate all-reduces share the NICs, one each. Two rows it does not price:
#
# - **Trees.** On 2 nodes NCCL picks a tree, measured at 470 GB/s, 25% above the ring the model
#   prices. The model is pessimistic there.
# - **NVLS** (NVLink SHARP: the NVSwitch reduces). NVIDIA gives NVLS's algbw as the NVLink
#   bandwidth times n/(n+1) (sjeaugey in nccl-tests#212 and in nccl-tests#239: "algobw = busbw *
#   n / (n+1)", busbw there being the links' rate): a GPU moves S(n+1)/n over its NVLink per
#   all-reduce, so 370 GB/s of NVLink bounds algbw at 370 · 8/9 ≈ 329 GB/s, which nccl-tests
#   reports as a busbw of 2(n−1)/n · 329 ≈ 575 GB/s (`cost.nvls_busbw`). NCCL's own tuner
#   scales its NVLS bandwidth on Hopper by an efficiency of 0.85 (`nvlsEfficiency`,
#   src/graph/tuning.cc), which gives about 490; measured: 476-480. That 0.85 is NCCL's factor,
#   not a mechanism: nothing from NVIDIA says what sets it. The scale model below prices rings
#   only: a little pessimistic for one-node all-reduces and for trees.
#
# ZeRO++'s own claims (arXiv 2306.10209, §3) are volume claims: per micro-batch, ZeRO-3 sends
# three fp16 collectives of Ψ across nodes; hpZ removes backward's all-gather, qwZ halves the
# gathers (int8), qgZ's int4 quarters the gradients, 3 → 0.75 in all. The model, in bytes a node
# sends across per micro-batch, relative to one fp16 ring collective of Ψ:

# %%
ZERO_PP = {  # ZeRO++'s claims (§3): bytes across per micro-batch, × one fp16 ring collective of Ψ
    "ZeRO-3, fwd + bwd gathers + grads": 3.0,
    "hpZ: backward's gather": 0.0,
    "qwZ: forward's gather (int8)": 0.5,
    "qgZ, ZeRO++'s (hierarchical, int4)": 0.25,
}
lab.show_zeropp(lab.zeropp_across(psi=2**30, nodes=64, gpus=8), ZERO_PP)

# %% [markdown]
# hpZ and qwZ come out as the paper says, qwZ a little over half for minizero's fp32 scale per 256
# elements. ZeRO++'s qgZ quarters the gradients because it reduces inside the node first, so
# each GPU sends only its node-summed Ψ/8, in int4. minizero's qgZ (`quantize_gradients=True`)
# is the one-hop form: every rank sends its whole int8 gradient to its owners, nearly all of it
# to other nodes, so a node's 8 GPUs send about 4× what the node sends in the fp16 ring, which
# sums as it goes: cheaper per byte, dearer in bytes. It is for one node; across nodes, the
# hierarchical form is the one to use.
#
# This machine, for section 5: the two fits of section 1 as the two link classes, one "NIC" (one
# loopback). Here both are the same loopback: the fits differ by the ring size and by noise,
# not by hardware.

# %%
LINKS = lab.fit_links(RUN)  # each node's ring as "intra", the ring over all 4 ranks as "inter"
lab.show_links(LINKS, RUN)

# %% [markdown]
# `cost.step_collectives(cfg, [psi])` lists the collectives one rank issues in one optimizer step
# of a configuration `cfg` (a `cost.Config`: stage, N, node size, HSDP, hpZ, qwZ, micro-batches),
# as minizero's library issues them (section 1 checked it against the ledger). Each is a `Comm`
# with `op`, `nbytes` (the payload S), `n` (ranks in its group), `nodes` (nodes the group spans),
# `group` and `times` (how often it runs per step: stages 2 and 3 pay per micro-batch). Per call,
# `c.rounds()` is its ring's rounds, `c.gpu_bytes()` what one GPU sends over NVLink and
# `c.node_bytes()` what one node sends to the others.
#
# ## Exercise 3 — `predict_step_time`
#
# Write `predict_step_time(cfg, links, compute_s, psi)`: the seconds of one optimizer step of
# `cfg` for a model of `psi` parameters, with `compute_s` the forward + backward of one
# micro-batch, `links` a `cost.Links` (`links.intra`, `links.inter`: each a `Link` with `alpha`
# and `beta`; `links.nics`), and **no overlap** (compute, then communication). Each collective
# costs its latency plus the slower of its NVLink bytes over β_intra and its node's bytes over all
# the node's NICs, nics · β_inter. The latency is α per round, charged as NCCL's tuner charges a
# ring (src/graph/tuning.cc: `nInterSteps`): the inter link's α on the rounds whose step crosses
# nodes, `c.inter_rounds()` (2(k−1) of an all-reduce's 2(n−1) over k nodes, k−1 for the others,
# none inside a node), the intra link's α on the other `c.rounds() - c.inter_rounds()`. Use
# `cost.step_collectives`, not `cost.predict` (the check compares with it).

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
# The same model, fed with this machine's fits, its measured compute and the buckets the stages
# made, against the step times section 1 measured (the slowest rank's; every time in this section
# is the fastest of 10, each after a barrier: on a shared machine noise only adds). gloo's
# reduce-scatter is costed as the all-reduce it runs (lesson 00). "no overlap" is exercise 3's
# prediction: `MICRO` forward + backward passes of the plain model, then the collectives. It
# leaves out four things a step does, which section 1 measured on every rank at once (4 ranks
# share this machine's 2 cores, as they do in a step; minizero/analysis/step_parts.py):
#
# - the **optimizer step**: AdamW's `step()` and `zero_grad()` on the rank's share (all of Ψ at
#   stage 0, Ψ/4 at stages 1-3);
# - the **wrappers' own work**: copies into and out of flat buffers, hooks, stage 3's per-unit
#   order check. Measured as the whole step run with every collective replaced by a local
#   stand-in ("local"), less the plain compute and optimizer;
# - the **synchronisation**: at every collective each rank waits for the slowest, and with 4
#   ranks on 2 cores the slowest is the one the scheduler left waiting. Measured as the local
#   step with a barrier in place of each collective ("sync": that step less the local one, less
#   the barriers' own latency, which α already prices);
# - the **contention** itself: compute_s is timed with the other ranks computing too.
#
# "predicted" = local + sync + comm: the model's collectives on top of the measured rest, so its
# error is what is left: how the bytes and the compute slow each other.

# %%
PARTS = lab.step_parts(RUN, LINKS)  # per stage: measured, predicted, and the parts measured
lab.show_step_parts(PARTS)
lab.plot_step_parts(PARTS)

# %% [markdown]
# Read the columns as what exercise 3's model leaves out. The optimizer step, the wrappers' work
# and the synchronisation are not in `compute_s`, and with a model this small they are not small
# beside it: the "no overlap" line sits far below the measurement (a third to a half, in most of
# our runs). With them, measured, "predicted" lands within about ±25% of the measurement (on this
# 2-core machine, with nothing else running, 16 of 16 stage runs were within ±20%). Without
# "sync" (local + comm) it fell 13-43% short at stages 0-2: a model of a step on shared cores
# must price the waiting at each collective, which here costs about as much as the bytes. ZeRO-3
# comes out above its measurement when it misses: it prefetches the next unit's all-gather under
# the current unit's compute, the overlap this no-overlap model leaves out. Every figure here
# moves with what else the machine runs: the line under the table gives the load average, and
# above the core count (other work on the machine) rerun section 1's measuring cell before
# reading the errors. On a GPU the balance differs: the optimizer and the copies are fast
# kernels, each rank has its own device (no waiting for a core), and the overlap is real but
# partial: NCCL's collectives run on their own stream, yet they are kernels on the same SMs and
# take SMs and memory bandwidth from the compute beside them (lesson 01 measured it), so a real
# step sits between no overlap and full overlap.
#
# ## 6. At scale: lesson 05's 6.7B model on 64 nodes × 8 GPUs
#
# A scenario, not a measurement. The model is lesson 05's (GPT-3 6.7B's shape: L = 32, h = 4096,
# s = 4096, flash attention); the machines are 64 DGX H100-like nodes: 8 GPUs of 80 GB, NVLink at
# section 4's 370 GB/s per GPU, 8 NICs of 47 GB/s, an assumed α of 10 µs per ring round on both
# links (measure yours with `python -m minizero bench collectives`). Each GPU runs 4 sequences of
# 4096 tokens per micro-batch, 4 micro-batches per step, bf16 weights and gradients, Adam in
# mixed precision. α is paid on every round of every ring: stages 0-2 reduce in torch DDP's 25
# MiB buckets (130 here: each of a block's four weight matrices is over 25 MiB and closes a bucket
# of its own), stage 3 gathers and reduce-scatters per unit (33: a block each and the root's),
# every micro-batch. A ring of 512 ranks takes 511 rounds for a reduce-scatter or an all-gather and
# 1,022 for an all-reduce: 5-10 ms of latency per call before its bytes. At this scale NCCL would
# run its all-reduces as trees, whose rounds grow with log n, which this ring model does not
# price.
#
# Memory per rank is lesson 05's budget: model states (`simulate`: the real stage code on meta
# tensors, plus hpZ's secondary shard), activations (lesson 05 measured about 17 GB per sequence
# of 4096 tokens at this size, so 4 sequences are about 69 GB), the output layer's logits and
# stage 3's gathered units (`budget.step_budget`). We keep an assumed 5 GB of the 80 for the CUDA
# context, NCCL's buffers and the allocator's slack. A configuration that does not fit runs with
# activation checkpointing (lesson 05 §4: each block keeps only its input and runs its forward
# again in backward), which costs one more forward. FLOPs per token, as PaLM counts them
# (arXiv 2204.02311, appendix B): 6Ψ for the weights' matrix products plus 12 · L · s · h for
# attention's two products with the s × s scores (forward and backward; the full matrix, though
# a causal kernel skips about half of it), 8Ψ + 16 · L · s · h with checkpointing, at an assumed
# 300 TFLOP/s achieved.

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
# What the table says. Compute is about 10.2 s a step without checkpointing and 13.5 s with it
# (6Ψ per token alone would give 8.74 s: attention adds 16% at s = h = 4096). Memory decides
# first: 4 sequences of activations (about 69 GB) leave room only for ZeRO-3's few GB of model
# states, and even flat ZeRO-3 needs about 76 GB ("no ckpt"), over the 75 GB budget, so every
# configuration runs with checkpointing and pays its 33% more compute. DDP does not fit even so
# (107 GB of model states). Among the rest the network decides, and at 512 ranks its cost is
# latency ("of which α"). Flat ZeRO-1 moves the fewest bytes, about 0.07 s through a node's 8
# NICs, but each of its 130 buckets pays a reduce-scatter and an all-gather of 511 rounds: 130 ×
# 1,022 × 10 µs = 1.33 s. ZeRO-1 HSDP sends as many bytes across (N_s replicate all-reduces at
# once, each with one NIC) and adds the node's two collectives, but its rings are short: 7 rounds
# in the node twice and 2 × 63 across, 140 a bucket, 0.18 s. That latency is the term HSDP
# removes, and it wins by about 1.1 s a step. ZeRO-2 reduce-scatters every micro-batch (3.3 s of
# α), ZeRO-3 issues 3 collectives per unit and micro-batch (2.0 s); HSDP cuts them to 0.70 s and
# 0.19 s. hpZ moves backward's gather inside the node; qwZ halves the forward's bytes (int8 plus a
# scale per 256 elements) but sends the scales as collectives of their own, which doubles the
# forward's α; in minizero backward's hpZ gather stays in bf16. The old model (the last line), a
# flat ring crossing at one NIC's speed, favoured HSDP too (1.9 s against 0.31), for the wrong
# reason: with all of a node's NICs the bytes favour the flat ring, which wins only below about
# 0.5 µs a round.
#
# ## 7. A calculator
#
# Change the scenario and read the prediction (a widget in JupyterLab; where no widget frontend
# runs, the cell prints the default scenario).


# %%
lab.calculator(BIG, CANDIDATES, SCENARIO)  # sliders where a widget front end runs; else the table

# %% [markdown]
# ## Exercise 4 — which configuration would you run?
#
# Write `choose(rows, memory)`: `rows` are the table's rows (dicts with `name`, `step_s`, the
# predicted seconds per step, and `memory`, the bytes one rank needs, model states and
# activations); `memory` the bytes a rank has. Return the **name** of the configuration you
# would run: the fastest that fits; of two equally fast, the one that leaves more memory free;
# `None` if none fits.


# %%
def choose(rows: list[dict], memory: float) -> str | None:
    """The name of the fastest row that fits in ``memory`` (ties: less memory), or None."""
    # BEGIN SOLUTION
    # TODO: the name of the fastest row that fits in memory (a tie: less memory), or None
    # HINT: Two steps: keep the rows that fit, then pick one. A row fits when its memory is at most
    #       the memory given (an exact fit fits).
    # HINT: Among those that fit, compare step_s first and memory second: the tuple (step_s, memory)
    #       as min's key does both. No row fits: None.
    # HINT: fits = [r for r in rows if r["memory"] <= memory]
    #       if not fits:
    #           return None
    #       return min(fits, key=lambda r: ...)["name"]  # step_s first, then memory
    fits = [r for r in rows if r["memory"] <= memory]
    if not fits:
        return None
    return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"]
    # END SOLUTION


# %% check="choose"
# Five small tables: the fastest fits; the fastest does not; a tie; nothing fits; an exact fit.
lesson08.check_choose(choose)

# %% [markdown]
# Now the scenario of section 6: 80 GB GPUs less the assumed 5 GB of headroom. Then the same
# choice with each input of the scenario halved and doubled: which one, changed by 2×, changes
# the answer?

# %%
PICK = lab.show_choice(choose, SCALE, SCENARIO)  # None until exercise 4 is written
if PICK is not None:  # each input halved and doubled: which one changes the answer?
    lab.show_sensitivity(scenario.sensitivity(BIG, SCENARIO, CANDIDATES, choose))

# %% [markdown]
# The model's answer is **ZeRO-1 HSDP, with activation checkpointing**: it fits (about 48 GB per
# rank), every configuration needs checkpointing anyway, and its short rings pay a seventh of flat
# ZeRO-1's latency. ("=" in the table: the same answer.) Doubled or halved, the network's figures
# (NVLink, NIC, NICs, α), the nodes, the compute rate, the micro-batches and the sequences per GPU
# leave it there: at 5 µs a round flat ZeRO-1 still pays 0.66 s of α against HSDP's 0.09. Memory
# moves it: half the GPU memory and ZeRO-1 HSDP's 48 GB no longer fits, so ZeRO-3 HSDP (26 GB);
# half the headroom (2.5 GB) and ZeRO-3 with hpZ (about 77 GB) fits **without** checkpointing,
# about 11.9 s a step against 13.8 (the calculator shows it). Latency picks the sharding, memory
# the stage, and the stage sits on a knife edge: measure the headroom your runs really need
# (lesson 05) before you trust a 77 GB plan on an 80 GB GPU.
#
# What does not change is the method: measure the links once, count the collectives of each
# configuration as the library issues them, and let the memory decide what is allowed before the
# time decides what is best.
