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
# 2. leaves room for hybrid sharding, HSDP, and for ZeRO++ (sections 2 and 3, being added);
# 3. fits the **α-β cost model** of lesson 00 once per link class and has you write the
#    prediction of a step's time (section 4, exercise 1), checked against this machine's steps
#    (section 5);
# 4. predicts steps and memory **at scale** (7.5B parameters, 64 nodes × 8 GPUs) with a
#    calculator (sections 6 and 7), and asks you **which configuration you would run**
#    (exercise 2).
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
from minizero.analysis.simulate import short_psi
from minizero.course import checks
from minizero.course.checks import lesson08
from minizero.memory import format_bytes
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
# *Being added* (issue 17, item 1): `minizero.parallelize(model, stage, optimizer, mesh=mesh)`
# on a 2-D mesh `("replicate", "shard")`, measured here on the same 4 ranks: the shard group
# stays inside a node, and only an all-reduce of Ψ/2 per rank crosses. The cost model below
# already prices HSDP (`cost.Config(hsdp=True)`); the measurement goes in this section.
#
# ## 3. ZeRO++: hpZ and qwZ
#
# *Being added* (issue 17, item 2): hpZ keeps a secondary shard per node after forward, so
# backward's all-gather stays inside the node; qwZ all-gathers int8 weights with a scale per
# block. The cost model prices both (`hpz=True`, `qwz=True`); their measured bytes, memory and
# loss go in this section.
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
# ## Exercise 1 — `predict_step_time`
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
# ## Exercise 2 — which configuration would you run?
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
    pick = "(write choose() in exercise 2 first)"
print(f"with {format_bytes(budget)} for model states per rank: run {pick}")
for r in sorted(SCALE, key=lambda r: r["step_s"]):
    fits = "fits" if r["memory"] <= budget else "does not fit"
    print(f"  {r['name']:<16}{r['step_s']:>7.2f} s  {format_bytes(r['memory']):>10}  {fits}")

# %% [markdown]
# The answer depends on every number in the scenario: halve the network (or double the
# micro-batches) and watch the flat configurations fall behind HSDP in the calculator. What
# does not change is the method: measure the links once, count the collectives of each
# configuration, and let the memory decide what is allowed before the time decides what is best.
