# %% [markdown]
# # Lesson 08 — Beyond one node: what crosses the boundary, and what a step will cost
#
# Every lesson so far ran on one machine, where every rank reaches every other over the same
# link. Real runs span **nodes**: inside a node the GPUs talk over NVLink or PCIe, between nodes
# over a network several times slower (issue 17 of this kit takes 400 GB/s inside and 50 GB/s
# across as its example). The question a practitioner meets next is not "which stage?" but
# "which stage, sharded over what, and how long will a step take?". This lesson:
#
# 1. treats blocks of consecutive ranks on this machine as nodes and measures, with the ledger,
#    which of ZeRO's bytes **cross a node boundary** (section 1);
# 2. builds **hybrid sharding** (HSDP, exercise 1) and ZeRO++'s **qwZ** quantiser (exercise 2)
#    and measures them beside flat ZeRO-3, FSDP2's HSDP and hpZ (sections 2 and 3);
# 3. fits the **α-β cost model** of lesson 00 once per link class and has you write the
#    prediction of a step's time (section 4, exercise 3), checked against this machine's steps
#    (section 5);
# 4. predicts steps and memory **at scale** (7.5B parameters, 64 nodes × 8 GPUs) with a
#    calculator (sections 6 and 7), and asks you **which configuration you would run**
#    (exercise 4).
#
#     python -m minizero grade my-lessons/08_beyond_one_node.ipynb
#
# The ranks here are 4 gloo processes on this machine, whatever it has: "nodes" are a labelling,
# so every link measured below is the same loopback. The lesson says so wherever it matters.

# %%
import functools
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import minizero
from minizero import collectives as C
from minizero.analysis import cost
from minizero.analysis.memory import format_bytes
from minizero.analysis.simulate import short_psi
from minizero.course import checks
from minizero.course.checks import lesson08
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch

WORLD, NODE = 4, 2  # 4 ranks as 2 "nodes" of 2: ranks 0, 1 on node 0; ranks 2, 3 on node 1
MICRO = 2  # micro-batches per optimizer step
GPT = GPTConfig.tiny()
PSI = count_params(TinyGPT(GPT))
print(f"{WORLD} gloo ranks as {WORLD // NODE} nodes × {NODE} | TinyGPT Ψ = {PSI:,}")

# %% [markdown]
# ## 1. What crosses a node boundary
#
# The ledger counts what each rank *sends* under the ring model (minizero/topology.py): a group
# of n ranks is one ring in rank order, and in a ring every rank sends all its bytes to its
# successor. A rank's bytes cross a node boundary when its successor is on another node. For the
# flat group of 4 over 2 nodes the ring is 0 → 1 → 2 → 3 → 0: ranks 1 and 3 send everything
# across, ranks 0 and 2 nothing, so **half the ring's bytes cross**, and the step goes at the
# speed of the slow hops.
#
# The cell runs everything this lesson measures in one launch of 4 ranks: each stage, flat,
# for `MICRO` micro-batches per step under a `CommLedger(node_size=NODE)`, timed; the plain
# model's forward + backward (the compute); and two sweeps for the cost model of section 4, one
# inside each node, one over all 4 ranks.


# %%
def one_step(model, opt, stage, x, y):
    """One optimizer step of MICRO micro-batches; stages 0-1 accumulate without communicating."""
    for m in range(MICRO):
        if m < MICRO - 1 and stage < 2:
            with model.no_sync():
                model(x, y).backward()
        else:
            model(x, y).backward()
    opt.step()
    opt.zero_grad()


def on_nodes(progress):
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = [
        C.name_group(dist.new_group(list(range(k, k + NODE))), "node")
        for k in range(0, world, NODE)
    ]  # fmt: skip  (made on every rank, in order)
    x, y = synthetic_batch("gpt", 4 * world, 0, rank=rank, world=world)  # (4, T) this rank's
    out = {"stages": {}, "info": checks.run_info()}
    for stage in range(4):
        torch.manual_seed(0)
        model, opt = minizero.parallelize(
            TinyGPT(GPT), stage, lambda p: torch.optim.AdamW(p, lr=1e-3),
            bucket_cap_mb=None if stage == 3 else 25,
        )  # fmt: skip

        step = functools.partial(one_step, model, opt, stage, x, y)
        step()  # warm-up (stage 3 records the order of its units)
        with C.CommLedger(node_size=NODE) as ledger:
            step()
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out["stages"][stage] = dict(
            node_bytes=ledger.node_bytes()["total"],
            sizes=[b.padded for b in model.buckets],  # elements per bucket (stage 3: per unit)
            step_s=statistics.median(times),
        )
        progress.tick()
    plain, compute = TinyGPT(GPT), []
    for _ in range(3):
        t0 = time.perf_counter()
        plain(x, y).backward()
        compute.append(time.perf_counter() - t0)
    out["compute_s"] = statistics.median(compute)
    sizes = [2**12, 2**16, 2**20, 2**22]  # bytes: latency-bound to bandwidth-bound
    out["intra"] = cost.sweep(sizes, repeats=3, group=nodes[rank // NODE])  # each node's ring
    progress.tick()
    out["inter"] = cost.sweep(sizes, repeats=3)  # the ring over both nodes
    progress.tick()
    return out


RUN = checks.launch_with_progress(on_nodes, WORLD, total=6, desc="ranks", backend="gloo",
                                  verbose=False)  # fmt: skip
INFO = RUN[0]["info"]  # where this lesson's measurements are made
NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
print(f"bytes each rank sends in one step ({MICRO} micro-batches, fp32), flat groups over 2 nodes")
print(f"{'':8}" + "".join(f"{'rank ' + str(r) + ' in/across':>22}" for r in range(WORLD)))
for s in range(4):
    cells = [RUN[r]["stages"][s]["node_bytes"] for r in range(WORLD)]
    row = "".join(f"{format_bytes(c['inside']):>11}{format_bytes(c['across']):>11}" for c in cells)
    print(f"{NAMES[s]:8}{row}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
width = 0.2
for r in range(WORLD):
    xs = [s + (r - 1.5) * width for s in range(4)]
    nb = [RUN[r]["stages"][s]["node_bytes"] for s in range(4)]
    ax.bar(xs, [b["inside"] / 1e6 for b in nb], width, color="tab:blue",
           label="inside a node" if r == 0 else None)  # fmt: skip
    ax.bar(xs, [b["across"] / 1e6 for b in nb], width, bottom=[b["inside"] / 1e6 for b in nb],
           color="tab:red", label="across nodes" if r == 0 else None)  # fmt: skip
ax.set_xticks(range(4), [f"{NAMES[s]}\n(ranks 0-3)" for s in range(4)])
ax.set_ylabel("MB sent per rank per step")
ax.set_title(f"Flat groups on {WORLD} ranks as 2 nodes × {NODE}: ring model, measured ledger",
             fontsize=9)  # fmt: skip
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# Beside the formula: per rank and step, DDP and ZeRO-1 send 2 · (n−1)/n · Ψ elements (one
# all-reduce, or its two halves), ZeRO-2 reduce-scatters every micro-batch, and ZeRO-3 moves
# 3 · (n−1)/n · Ψ per micro-batch (gather in forward, gather in backward, reduce-scatter). The
# cell prints the formula, the model's bytes (minizero.analysis.cost.step_collectives, from the
# buckets the stages really made, padding included) and the ledger's; the last two agree to the
# byte.

# %%
for s in range(4):
    res = RUN[0]["stages"][s]
    cfg = cost.Config(stage=s, world=WORLD, node_size=NODE, micro_batches=MICRO,
                      param_bytes=4, grad_bytes=4)  # fmt: skip
    model_bytes = sum(c.wire() for c in cost.step_collectives(cfg, res["sizes"]))
    ledger_bytes = sum(res["node_bytes"].values())
    per_psi = {0: 2, 1: 2, 2: MICRO + 1, 3: 3 * MICRO}[s] * (WORLD - 1) / WORLD
    print(f"{NAMES[s]:8} formula {per_psi:.2f} Ψ × 4 B = {per_psi * 4 * PSI:>12,.0f} B   "
          f"model {model_bytes:>12,.0f} B   ledger {ledger_bytes:>12,.0f} B")  # fmt: skip


# %% [markdown]
# ## 2. Hybrid sharding (HSDP): shard inside a node, replicate across
#
# Flat ZeRO-3 puts every rank in one ring, so half its bytes cross the slow link (section 1).
# **HSDP** (FSDP2's `fully_shard(model, mesh=mesh)` with a 2-D mesh; DeepSpeed calls the same
# layout MiCS, Zhang et al., arXiv 2205.00119) shards the model states over the ranks of one node
# only and *replicates* them across nodes. Each gradient is then reduced in two steps:
#
# 1. reduce-scatter over the node (the "shard" group, N_s ranks): each rank gets its shard summed
#    over its node;
# 2. all-reduce that shard over the "replicate" group (the R ranks, one per node, that hold the
#    same shard), and divide by R · N_s: the average over every rank.
#
# Only step 2 crosses a node boundary: 2 · Ψ/N_s elements per rank (an all-reduce of the shard)
# instead of flat ZeRO-3's 3Ψ. The price is memory: a rank holds the model states of a world of
# N_s ranks, (2 + 2 + K)Ψ/N_s at stage 3, not (2 + 2 + K)Ψ/N.
#
# **Exercise 1.** Write that reduction. `grad` is this rank's local gradient, flat, (numel,) with
# numel divisible by N_s; return this rank's (numel / N_s,) shard of the gradient averaged over
# every rank. Use `C.reduce_scatter(out, grad, group=...)` and `C.all_reduce(t, group=...)` and
# take the sizes from the groups (`dist.get_world_size(group)`): the check runs your function on
# 4 ranks as 2 × 2, 1 × 4 and 4 × 1 (nodes × ranks per node).


# %%
def hsdp_reduce(grad, shard_group, replicate_group):
    # BEGIN SOLUTION
    # TODO: this rank's shard of the node's sum (one collective over the node), then the sum of
    # TODO: that shard over the nodes (one collective over the others holding it); the average
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
# ZeRO++ (Wang et al., arXiv 2306.10209) keeps ZeRO-3's memory and cuts what crosses nodes:
#
# * **hpZ** (hierarchical partitioning, §3.2; FSDP2's `reshard_after_forward=k`): after a unit's
#   forward each rank keeps 1/k of it (k = the ranks of a node: its *secondary shard*, Ψ/k more
#   bytes from forward to backward), so backward's all-gather runs inside the node.
#   `reshard_after_forward=False` keeps the whole unit instead (no backward gather, Ψ more).
# * **qwZ** (quantised weights, §3.1): the all-gathers carry the weights as int8 in blocks, with
#   one fp32 scale per block: about Ψ(1 + 4/256) bytes instead of 4Ψ (fp32) or 2Ψ (bf16). Only the
#   gathered copy is quantised; the shards and the optimizer's fp32 masters are not.
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
    # TODO: pad x to whole blocks and view it (blocks, block); per block scale = max|x| / 127;
    # TODO: q = the nearest integer to x / scale as int8 (a zero scale: q = 0); cut the padding
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
# its node and across (the ring model of section 1), the parameter bytes it holds from forward to
# backward beyond its shards, and the largest gap between its loss and one process's on the whole
# batch. (gloo: the ranks share this machine's loopback, so "across" is a label, not a slower
# link; and gloo's reduce-scatter is an all-reduce that keeps one chunk, see lesson 00.)

# %%
STEPS = 4
LAYOUTS = {  # name: (stage, parallelize options; "mesh": the 2 x 2 mesh)
    "ZeRO-3 flat": (3, {}),
    "ZeRO-1 HSDP": (1, {"mesh": True}),
    "ZeRO-2 HSDP": (2, {"mesh": True}),
    "ZeRO-3 HSDP": (3, {"mesh": True}),
    "FSDP2 HSDP (torch)": (None, {}),
    "ZeRO-3 hpZ k=2": (3, {"reshard_after_forward": NODE}),
    "ZeRO-3 no reshard": (3, {"reshard_after_forward": False}),
    "ZeRO-3 qwZ": (3, {"quantize_weights": True}),
}


def held_bytes(model):
    """Parameter bytes held beyond this rank's shards (stage 3: gathered units, hpZ's shards)."""
    if getattr(model, "stage", None) != 3:
        return 0
    full = sum(f.untyped_storage().nbytes() for f in model.flat_params)
    secondary = getattr(model, "secondary", None)  # ZeRO++'s hpZ (minizero.zeropp.ZeROPlusPlus)
    shards = secondary.shards if secondary is not None else []
    return full + sum(t.numel() * t.element_size() for t in shards if t is not None)


def paper_bytes(ledger):
    """Bytes per group in the paper's accounting (volume elements x element size)."""
    out = {}
    for r in ledger.records:
        out[r.group] = out.get(r.group, 0) + r.volume_elements * r.nbytes // max(r.numel, 1)
    return out


def layouts(progress):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // NODE, NODE), mesh_dim_names=("replicate", "shard"))
    out = {}
    for name, (stage, opts) in LAYOUTS.items():
        torch.manual_seed(0)
        net = TinyGPT(GPT)
        adamw = lambda p: torch.optim.AdamW(p, lr=1e-3)
        if stage is None:  # FSDP2's HSDP: each block, then the root, on the same mesh
            for block in net.blocks:
                fully_shard(block, mesh=mesh)
            model = fully_shard(net, mesh=mesh)
            opt = adamw(model.parameters())
        else:
            opts = {**opts, "mesh": mesh} if opts.get("mesh") else opts
            model, opt = minizero.parallelize(net, stage, adamw, **opts)
        losses, held = [], 0
        for step in range(STEPS):
            x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world)
            with C.CommLedger(node_size=NODE) as ledger:
                loss = model(x, y)
                held = max(held, held_bytes(model))  # between forward and backward
                loss.backward()
                opt.step()
                opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # equal local batches: the mean of the means is the global mean
            losses.append(mean.item() / world)
        nb = ledger.node_bytes()["total"]
        out[name] = dict(groups=paper_bytes(ledger), inside=nb["inside"], across=nb["across"],
                         held=held, losses=losses)  # fmt: skip
        progress.tick()
    return out


LAY = checks.launch_with_progress(layouts, WORLD, total=len(LAYOUTS), desc="ranks",
                                  backend="gloo", verbose=False)  # fmt: skip
torch.manual_seed(0)
one = TinyGPT(GPT)
one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3)
ONE = []
for step in range(STEPS):  # one process on each step's whole global batch
    x, y = synthetic_batch("gpt", 4 * WORLD, step)
    loss = one(x, y)
    loss.backward()
    one_opt.step()
    one_opt.zero_grad()
    ONE.append(loss.item())

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
}
HELD = {"ZeRO-3 hpZ k=2": B / NODE, "ZeRO-3 no reshard": B}  # formula; the others hold 0
print(f"rank 0, per step ({STEPS} steps, TinyGPT Ψ = {PSI:,}, fp32; Ψ = {B:,} B)")
print(f"{'layout':20}{'group: measured (formula) in Ψ':46}{'inside':>12}{'across':>12}"
      f"{'held (formula)':>26}{'|loss - one':>13}")  # fmt: skip
for name, r in LAY[0].items():
    want = FORMULA.get(name, {})
    groups = ", ".join(
        f"{g} {v / B:.3f}" + (f" ({want[g] / B:.3f})" if g in want else "")
        for g, v in sorted(r["groups"].items())
    )
    held = format_bytes(r["held"]) + (f" ({format_bytes(HELD[name])})" if name in HELD else "")
    gap = max(abs(a - b) for a, b in zip(r["losses"], ONE, strict=True))
    print(f"{name:20}{groups:46}{format_bytes(r['inside']):>12}{format_bytes(r['across']):>12}"
          f"{held:>26}{gap:>13.2e}")  # fmt: skip
print("(|loss - one|: the largest gap from one process's loss on the whole batch, over the steps)")

# %%
fig, ax = plt.subplots(figsize=(9, 3.5))
names = [n for n in LAYOUTS if n in LAY[0]]
for r in range(WORLD):  # each rank's bar: what it sends inside its node, what it sends across
    xs = [i + (r - 1.5) * 0.2 for i in range(len(names))]
    ins = [LAY[r][n]["inside"] / 1e6 for n in names]
    ax.bar(xs, ins, 0.2, color="tab:blue", label="inside a node" if r == 0 else None)
    ax.bar(xs, [LAY[r][n]["across"] / 1e6 for n in names], 0.2, bottom=ins, color="tab:red",
           label="across nodes" if r == 0 else None)  # fmt: skip
ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
ax.set_ylabel("MB sent per rank, last step")
ax.set_title(f"4 ranks as 2 nodes × {NODE}, TinyGPT fp32, ranks 0-3 left to right: "
             f"{checks.describe(INFO)}", fontsize=9)  # fmt: skip
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# What to read in it. HSDP's "shard" volume is flat ZeRO's over a world of 2, and its
# "replicate" volume, Ψ/2 per rank all-reduced (counted 2 · Ψ/2), is all that crosses a node:
# every rank sends a little across instead of half the ranks sending everything. FSDP2's HSDP
# trains the same model (its loss matches one process as minizero's does; its collectives are
# not on minizero's ledger). hpZ moves backward's gather into the node ("hpZ", Ψ) and holds Ψ/2
# more from forward to backward; no resharding holds Ψ more and gathers nothing in backward. qwZ
# moves about a quarter of the gather bytes; its loss is off one process's by the quantisation,
# not by rounding. The cost model below prices each of these from the same formulas.
#
# ## 4. The α-β model, once per link class
#
# Lesson 00 fitted t = α · rounds + wire / β to one sweep. Across nodes there are two links: a
# ring inside a node runs on the fast one, and a ring that crosses a node boundary goes at the
# speed of its slowest hop, the network. So the model keeps one (α, β) per **link class**,
# `"intra"` and `"inter"`, each fitted to a sweep on a group of that class: section 1 measured
# one inside each node and one over all 4 ranks. (Here both are the same loopback: the two fits
# differ by the ring size and by noise, not by hardware.)

# %%
GLOO = INFO["backend"] == "gloo"
LINKS = {
    "intra": cost.fit(RUN[0]["intra"], NODE, emulated_rs=GLOO),
    "inter": cost.fit(RUN[0]["inter"], WORLD, emulated_rs=GLOO),
}
for name, link in LINKS.items():
    print(f"{name}: α = {link.alpha * 1e6:7.1f} µs per round, β = {link.beta / 1e9:.3f} GB/s "
          f"({checks.describe(INFO)})")  # fmt: skip

# %% [markdown]
# `cost.step_collectives(cfg, [psi])` lists the collectives one rank issues in one optimizer step
# of a configuration `cfg` (a `cost.Config`: stage, N, node size, HSDP, hpZ, qwZ, micro-batches).
# Each is a `Comm` with `op`, `nbytes` (the payload S), `n` (ranks in its ring), `link`
# ("intra" or "inter") and `times` (how often it runs per step: stages 2 and 3 pay per
# micro-batch). `cost.ring(op, nbytes, n)` gives its (rounds, wire bytes per rank).
#
# ## Exercise 3 — `predict_step_time`
#
# Write `predict_step_time(cfg, links, compute_s, psi)`: the seconds of one optimizer step of
# `cfg` for a model of `psi` parameters, with `compute_s` the forward + backward of one
# micro-batch, and **no overlap** (compute, then communication). Derive it from the α-β model;
# use `cost.step_collectives` and `cost.ring`, not `cost.predict` (the check compares with it).

# %%
for c in cost.step_collectives(cost.Config(stage=3, world=16, node_size=8, micro_batches=2), [PSI]):
    print(c)


# %%
def predict_step_time(cfg: cost.Config, links: dict, compute_s: float, psi: int) -> float:
    """Seconds of one optimizer step of ``cfg``: compute + α-β communication, no overlap."""
    # BEGIN SOLUTION
    # TODO: every micro-batch computes; every collective of the step costs α·rounds + wire/β on
    # TODO: its own link class, as many times as it runs
    total = cfg.micro_batches * compute_s
    for c in cost.step_collectives(cfg, [psi]):
        rounds, wire = cost.ring(c.op, c.nbytes, c.n)
        link = links[c.link]
        total += c.times * (link.alpha * rounds + wire / link.beta)
    return total
    # END SOLUTION


# %% check="predict_step_time"
# Five configurations (stages 0-3, one node, HSDP, hpZ + qwZ, 1-4 micro-batches) against
# minizero.analysis.cost.predict with no overlap.
lesson08.check_predict_step_time(predict_step_time)

# %% [markdown]
# ## 5. Predicted against measured, on this machine
#
# The same model, fed with this machine's fits, its measured compute and the buckets the stages
# made, against the step times section 1 measured. gloo's reduce-scatter is costed as the
# all-reduce it runs (lesson 00). Two predictions bracket the truth: no overlap (compute +
# communication) and full overlap (the longer of the two).

# %%
compute_s = RUN[0]["compute_s"]
rows = []
print(f"{'':8}{'measured ms':>12}{'no overlap':>12}{'error':>8}{'full overlap':>14}{'error':>8}")
for s in range(4):
    res = RUN[0]["stages"][s]
    measured = max(RUN[r]["stages"][s]["step_s"] for r in range(WORLD))  # the slowest rank
    cfg = cost.Config(stage=s, world=WORLD, node_size=NODE, micro_batches=MICRO,
                      param_bytes=4, grad_bytes=4)  # fmt: skip
    p = [cost.predict(cfg, LINKS, compute_s=compute_s, sizes=res["sizes"], emulated_rs=GLOO,
                      overlap=o).step_s for o in (0.0, 1.0)]  # fmt: skip
    rows.append((measured, *p))
    print(f"{NAMES[s]:8}{measured * 1e3:>12.1f}{p[0] * 1e3:>12.1f}{p[0] / measured - 1:>+8.0%}"
          f"{p[1] * 1e3:>14.1f}{p[1] / measured - 1:>+8.0%}")  # fmt: skip

fig, ax = plt.subplots(figsize=(6.5, 3.2))
for k, label in enumerate(("measured", "model, no overlap", "model, full overlap")):
    ax.bar([s + (k - 1) * 0.27 for s in range(4)], [r[k] * 1e3 for r in rows], 0.27, label=label)
ax.set_xticks(range(4), [NAMES[s] for s in range(4)])
ax.set_ylabel("ms per step")
ax.set_title(f"{MICRO} micro-batches of TinyGPT on {checks.describe(INFO)}", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the error as what the model leaves out: the optimizer step and the wrappers' own work
# (hooks, copies into flat buffers) are not in `compute_s`, and 4 processes share this machine's
# cores, so a rank waiting for a core looks like latency. On a GPU the compute and the
# collectives run on different engines and the overlap is real; here they compete for the same
# cores, and the measurement is near or above the no-overlap line.
#
# ## 6. At scale: 7.5B parameters on 64 nodes × 8 GPUs
#
# A scenario, not a measurement: the links are issue 17's example, 400 GB/s inside a node and
# 50 GB/s between nodes, with an assumed α of 10 µs per round on both (measure yours with
# `python -m minizero bench collectives` on a group inside a node and on one across nodes). The
# compute per micro-batch is assumed too: 6 · Ψ · tokens FLOPs at an assumed 300 TFLOP/s
# achieved, for 4 sequences of 4096 tokens per GPU; 4 micro-batches per step; bf16 weights
# and gradients. Memory per rank is `simulate`'s (lesson 05: the real stage code on meta tensors)
# model states, Adam in mixed precision, plus hpZ's secondary shard.

# %%
SCALE_PSI, NODES, GPUS = 7_500_000_000, 64, 8
SCALE_LINKS = {"intra": cost.Link(alpha=10e-6, beta=400e9),
               "inter": cost.Link(alpha=10e-6, beta=50e9)}  # fmt: skip
SCALE_COMPUTE = 6 * SCALE_PSI * 4 * 4096 / 300e12  # seconds per micro-batch (assumed)
CANDIDATES = {
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


@functools.cache
def memory_of(stage, hsdp, hpz, qwz, world, node_size, psi):
    cfg = cost.Config(stage=stage, world=world, node_size=node_size, hsdp=hsdp, hpz=hpz, qwz=qwz)
    return cost.predict_memory(cfg, psi)["total"]


def scale_rows(world=NODES * GPUS, node_size=GPUS, links=SCALE_LINKS, micro=4, psi=SCALE_PSI,
               compute_s=SCALE_COMPUTE, names=CANDIDATES):  # fmt: skip
    out = []
    for name, kw in names.items():
        cfg = cost.Config(world=world, node_size=node_size, micro_batches=micro, **kw)
        p = [cost.predict(cfg, links, compute_s=compute_s, psi=psi, overlap=o) for o in (0, 1)]
        mem = memory_of(cfg.stage, cfg.hsdp, cfg.hpz, cfg.qwz, world, node_size, psi)
        comm = p[0].comm_s
        out.append(dict(name=name, step_s=p[0].step_s, overlapped_s=p[1].step_s, memory=mem,
                        inter=comm.get("inter", 0.0), intra=comm.get("intra", 0.0)))  # fmt: skip
    return out


def show(rows):
    print(f"{'configuration':<16}{'step s':>8}{'overlapped':>11}{'comm inter':>11}"
          f"{'comm intra':>11}{'model states/rank':>19}")  # fmt: skip
    for r in rows:
        print(f"{r['name']:<16}{r['step_s']:>8.2f}{r['overlapped_s']:>11.2f}{r['inter']:>11.2f}"
              f"{r['intra']:>11.2f}{format_bytes(r['memory']):>19}")  # fmt: skip


SCALE = scale_rows()
print(f"{short_psi(SCALE_PSI)} parameters, {NODES} nodes × {GPUS}, compute "
      f"{SCALE_COMPUTE:.2f} s per micro-batch (assumed), 4 micro-batches per step")  # fmt: skip
show(SCALE)

# %% [markdown]
# What the table says: flat rings over 512 ranks go at the network's 50 GB/s, whatever the
# stage; HSDP keeps the big reduce-scatter and all-gather inside the node at 400 GB/s and sends
# across only an all-reduce of Ψ/8, at the cost of memory sharded over 8 ranks instead of 512.
# ZeRO-3 pays 3 collectives per micro-batch; hpZ moves one of them inside the node, qwZ halves
# the bytes of two (int8 instead of bf16, plus a scale per 256 elements).
#
# ## 7. A calculator
#
# Change the scenario and read the prediction (a widget in JupyterLab; where no widget frontend
# runs, the cell prints the default scenario).


# %%
def calculator(nodes=NODES, gpus_per_node=GPUS, intra_GBps=400.0, inter_GBps=50.0,
               alpha_us=10.0, params_B=7.5, micro_batches=4, compute_s=SCALE_COMPUTE):  # fmt: skip
    links = {"intra": cost.Link(alpha_us * 1e-6, intra_GBps * 1e9),
             "inter": cost.Link(alpha_us * 1e-6, inter_GBps * 1e9)}  # fmt: skip
    show(scale_rows(nodes * gpus_per_node, gpus_per_node, links, micro_batches,
                    int(params_B * 1e9), compute_s))  # fmt: skip


try:
    import ipywidgets as widgets
    from IPython.display import display
except ImportError:  # no widgets installed: the table of the default scenario only
    widgets = None
if widgets is None:
    calculator()
else:
    display(widgets.interactive(
        calculator, nodes=(1, 256), gpus_per_node=[1, 2, 4, 8], intra_GBps=(10.0, 900.0),
        inter_GBps=(1.0, 400.0), alpha_us=(1.0, 100.0), params_B=(0.1, 200.0),
        micro_batches=(1, 32), compute_s=(0.01, 10.0),
    ))  # fmt: skip

# %% [markdown]
# ## Exercise 4 — which configuration would you run?
#
# Write `choose(rows, memory)`: `rows` are the table's rows (dicts with `name`, `step_s`, the
# predicted seconds per step, and `memory`, the bytes one rank needs); `memory` the bytes a rank
# has. Return the **name** of the configuration you would run: the fastest that fits; of two
# equally fast, the one that leaves more memory free; `None` if none fits.


# %%
def choose(rows: list[dict], memory: float) -> str | None:
    """The name of the fastest row that fits in ``memory`` (ties: less memory), or None."""
    # BEGIN SOLUTION
    # TODO: keep the rows that fit; of those, the smallest (step_s, memory); None if none fits
    fits = [r for r in rows if r["memory"] <= memory]
    if not fits:
        return None
    return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"]
    # END SOLUTION


# %% check="choose"
# Five small tables: the fastest fits; the fastest does not; a tie; nothing fits; an exact fit.
lesson08.check_choose(choose)

# %% [markdown]
# Now the scenario of section 6 on GPUs of 80 GB, of which we leave an assumed 30 GB for
# activations, buffers and the allocator's slack (lesson 05 predicts that part):

# %%
budget = 80e9 - 30e9
try:
    pick = choose(SCALE, budget)
except NotImplementedError:
    pick = "(write choose() in exercise 4 first)"
print(f"with {format_bytes(budget)} for model states per rank: run {pick}")
for r in sorted(SCALE, key=lambda r: r["step_s"]):
    fits = "fits" if r["memory"] <= budget else "does not fit"
    print(f"  {r['name']:<16}{r['step_s']:>7.2f} s  {format_bytes(r['memory']):>10}  {fits}")

# %% [markdown]
# The answer depends on every number in the scenario: halve the network (or double the
# micro-batches) and watch the flat configurations fall behind HSDP in the calculator. What
# does not change is the method: measure the links once, count the collectives of each
# configuration, and let the memory decide what is allowed before the time decides what is best.
