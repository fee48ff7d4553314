# %% [markdown]
# # Lesson 00 — Collectives: the only way ranks talk
#
# Data parallelism, and every ZeRO stage after it, is a handful of **collectives**: operations that
# every rank of a process group calls together. This lesson:
#
# 1. starts N ranks from a notebook cell (`minizero.launch`);
# 2. shows all-reduce, reduce-scatter and all-gather on real ranks;
# 3. has you build **all-reduce = reduce-scatter + all-gather** (the identity ZeRO is built on);
# 4. measures what each collective costs, with the definitions nccl-tests uses.
#
# **Work in your own copy**: `python -m minizero start` copies every lesson into `my-lessons/`
# (regenerating `lessons/` never touches it); open this notebook from there.
#
# **Grade yourself** at any time (runs this notebook in a fresh kernel; your file is not changed):
#
#     python -m minizero grade my-lessons/00_collectives.ipynb
#
# A check whose ranks need longer on a slow or busy machine: `python -m minizero grade
# --check-timeout 600 ...`, or `MINIZERO_CHECK_TIMEOUT=600` set where `jupyter lab` starts.
#
# On a laptop or a CPU machine the ranks are processes talking over **gloo**. On a machine with
# several GPUs the same cells run one rank per GPU over **NCCL**, with no edits: `launch` picks
# the backend (`backend="auto"`), and each rank picks its device from the backend.

# %%
from minizero.course.labs.lesson00 import *  # torch, dist, minizero, C, hint, lab, lesson00

NPROCS, INFO = setup()  # one rank per GPU if there are >= 2 GPUs, else 2 CPU ranks

# %% [markdown]
# ## 1. Ranks
#
# `minizero.launch(fn, nprocs, *args)` runs `fn(*args)` in `nprocs` processes with
# `torch.distributed` already initialised, and returns their results in rank order. What the
# ranks print appears below the cell, prefixed with their rank. `rank_device()` is the device a
# rank computes on: its own GPU under NCCL, the CPU under gloo. (The first cell's `setup()` did
# the same to learn where this lesson measures: `INFO`, which every figure names.)


# %%
def hello():
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    print(f"I am rank {rank} of {world}, backend {dist.get_backend()}, device {device}")


minizero.launch(hello, NPROCS)

# %% [markdown]
# ## 2. Three collectives
#
# Each rank holds a tensor. After the call:
#
# | collective | input on each rank | output on each rank |
# |---|---|---|
# | **all-reduce** | `t` (S elements) | the sum of every rank's `t` (S elements), in place |
# | **reduce-scatter** | `t` (S elements) | chunk r of the sum: S/N elements |
# | **all-gather** | a chunk (S/N elements) | every rank's chunk, end to end (S elements) |
#
# The cell runs each one on small integer tensors so you can check the sums by eye.


# %%
def three_collectives():
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    t = torch.arange(2 * world, device=dev, dtype=torch.float32) + 10 * rank  # (2N,)
    summed = t.clone()
    C.all_reduce(summed)  # in place: every rank gets the sum of every rank's t
    mine = torch.empty(2, device=dev)  # (2,) this rank's chunk of the sum
    C.reduce_scatter(mine, t)
    gathered = torch.empty(2 * world, device=dev)  # (2N,) every rank's chunk, rank r's at r
    C.all_gather(gathered, mine)
    print(
        f"t={t.tolist()}  all_reduce={summed.tolist()}  reduce_scatter={mine.tolist()}  "
        f"all_gather(that)={gathered.tolist()}"
    )
    return torch.equal(summed, gathered)


print(
    "all-gather of the reduce-scatter == all-reduce on every rank:",
    minizero.launch(three_collectives, NPROCS, verbose=False),
)

# %% [markdown]
# The last column already shows the identity of this lesson: **all-gathering the chunks of a
# reduce-scatter gives the all-reduce**. Ring all-reduce is built exactly this way (a
# reduce-scatter pass around the ring, then an all-gather pass), and the ZeRO paper (Rajbhandari
# et al., *ZeRO: Memory Optimizations Toward Training Trillion Parameter Models*, arXiv
# 1910.02054, SC20, §7.1) counts communication with it: an all-reduce of Ψ elements moves 2Ψ,
# Ψ in the reduce-scatter and Ψ in the all-gather. The ZeRO stages use the two halves separately,
# with work in between; lessons 02–04 measure how.
#
# ## Exercise 1 — `all_reduce_via_rs_ag`
#
# Write `all_reduce_via_rs_ag(t, group=None)`: sum `t` over the ranks of `group` **in place**, like
# `dist.all_reduce(t)`, using one `reduce_scatter` and one `all_gather` from
# `minizero.collectives` (their signatures: `reduce_scatter(output, input, group=group)` with
# `input` (N·shard,) and `output` (shard,); `all_gather(output, input, group=group)` with `input`
# (shard,) and `output` (N·shard,)).
#
# The catch: `t` may have any shape and any number of elements. Reduce-scatter cuts its input
# into N **equal** chunks, so pad the flattened tensor with zeros to a multiple of N first, and
# drop the padding at the end. (ZeRO does the same to every flat buffer it shards.)
#
# Stuck? `hint("all_reduce_via_rs_ag")` in any cell shows a hint, and each call the next one, from
# the idea down to near-code; every exercise of the course has them (`hint()` lists them).


# %%
def all_reduce_via_rs_ag(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` in place with a reduce-scatter and an all-gather."""
    # BEGIN SOLUTION
    # TODO: t holds, in place, the sum of every rank's t over the group (any shape, any size)
    # HINT: A reduce-scatter cuts its input into N equal chunks, and t's size need not divide by N.
    #       Lay t out flat at the start of a buffer of zeros N equal chunks long: zeros add nothing
    #       to a sum. Copying back into t, leave them out.
    # HINT: N is the size of `group` (dist.get_world_size(group)): the check also runs on a
    #       subgroup. Each rank's chunk has shard = ceil(numel / N) elements, -(-numel // N) in
    #       integers; the buffer has N * shard, with t's dtype and device.
    # HINT: reduce_scatter(chunk, flat, group=group) leaves in chunk, (shard,), this rank's chunk of
    #       the sum; all_gather(flat, chunk, group=group) puts every rank's summed chunk back in its
    #       place: flat is the whole sum, on every rank. Copy its first numel elements into t,
    #       shaped like t, and return t.
    # HINT: world = dist.get_world_size(group)
    #       shard = -(-t.numel() // world)  # ceil
    #       flat = torch.zeros(world * shard, ...)  # (N * shard,): t's dtype and device
    #       flat[: t.numel()] = t.reshape(-1)
    #       chunk = torch.empty(shard, ...)  # (shard,)
    #       reduce_scatter(chunk, flat, group=group)
    #       all_gather(flat, chunk, group=group)
    #       t.copy_(...)  # flat's first t.numel() elements, shaped like t
    #       return t
    world = dist.get_world_size(group)
    n = t.numel()
    shard = -(-n // world)  # ceil(n / world): the chunk each rank owns
    flat = torch.zeros(world * shard, dtype=t.dtype, device=t.device)  # (N * shard,) padded
    flat[:n] = t.reshape(-1)
    chunk = torch.empty(shard, dtype=t.dtype, device=t.device)  # (shard,) rank r's sum
    reduce_scatter(chunk, flat, group=group)
    all_gather(flat, chunk, group=group)  # flat: every rank's chunk, end to end
    t.copy_(flat[:n].view_as(t))
    return t
    # END SOLUTION


# %% check="all_reduce_via_rs_ag"
# Runs your function on max(NPROCS, 3) real ranks on shapes (1,), (2,), (7,), (12,), (1001,), (3,
# 5), (4097,), compares every element with dist.all_reduce, and checks the collectives it issued.
lesson00.check_all_reduce_via_rs_ag(all_reduce_via_rs_ag, NPROCS)

# %% [markdown]
# ## 3. Measuring a collective
#
# Every collective in minizero goes through `minizero.collectives`, and any open `CommLedger`
# (`minizero/analysis/ledger.py`) records it: op, dtype, size, time, and the ZeRO paper's
# volume. Sizes and bandwidths follow **nccl-tests** (its `doc/PERFORMANCE.md`):
#
# * `S` is the full size in bytes: the tensor of an all-reduce; the *input* of a reduce-scatter;
#   the *output* of an all-gather;
# * **algbw** = S / t, the speed the caller sees;
# * **busbw** = algbw × factor, with factor 2(N−1)/N for all-reduce and (N−1)/N for
#   reduce-scatter and all-gather: the rate at which each rank's link carries data in a ring
#   implementation, comparable across ops and world sizes (and with the hardware's link speed).
#
# A ledger is a `with` block: open it, issue collectives, read its records. On every rank, one
# all-reduce of S = 1200 float32, then its two halves (`tag=` names a call in the ledger's table).
# The prediction, in the paper's accounting (elements moved): 2S for the all-reduce, S for each
# half. (`# @save` above a definition: the lab keeps this very function for later cells and
# lessons, as d2l's `#@save` does.)


# %%
# @save
def one_of_each(elements: int) -> CommLedger:
    """On every rank: an all-reduce, then a reduce-scatter and an all-gather, under a ledger."""
    world, dev = dist.get_world_size(), rank_device()
    full = torch.ones(elements, device=dev)  # (S,)
    shard = torch.empty(elements // world, device=dev)  # (S/N,)
    with CommLedger() as ledger:  # records every call of minizero.collectives until the block ends
        C.all_reduce(full, tag="all-reduce")
        C.reduce_scatter(shard, full, tag="reduce-scatter half")
        C.all_gather(full, shard, tag="all-gather half")
    return ledger


S = 1200  # float32 elements: divisible by 2, 3, 4, 5, 6, 8 ranks
lab.show_volumes(minizero.launch(one_of_each, NPROCS, S, verbose=False)[0])  # rank 0's ledger

# %% [markdown]
# The all-reduce counts 2 × 1200 elements; the reduce-scatter and the all-gather 1200 each:
# together, exactly one all-reduce. (One small call's time is noise; section 4 takes medians.)
#
# **What the ledger's timing costs.** With no ledger open, minizero's wrappers call
# `torch.distributed` directly. With one open, each call also creates a record and reads the clock:
# a blocking call is timed from issue to return (on CUDA the stream is synchronised before and
# after, so the call no longer overlaps queued GPU work); an asynchronous one from issue to the end
# of its `wait()`. The cell times 200 blocking 4 KiB all-reduces both from the caller's side and by
# the ledger: the difference is the ledger's bookkeeping.


# %%
lab.show_ledger_cost(lab.ledger_cost(NPROCS, calls=200))

# %% [markdown]
# Microseconds per call, and only while a ledger is open: open one around the steps you measure, not
# around a whole run (`python -m minizero bench collectives` compares it with bare calls up to 64
# MiB).
#
# ## 4. Bandwidth over message sizes
#
# `time_collective` is what every rank runs for one op and one size S: a warm-up call (the first
# call of a size sets up connections and buffers), then a few timed calls under a ledger, and the
# **median** (one call slowed by the machine moves a mean, not a median). From the median time t
# it computes nccl-tests' algbw and busbw (section 3). The cell after it runs it at sizes from
# 4 KiB up, on every rank, with a progress bar, and keeps rank 0's rows.
#
# **PyTorch's gloo emulates reduce-scatter; minizero does not.** The gloo library (the CPU
# backend) has a reduce-scatter of its own (`ReduceScatterHalvingDoubling`), but PyTorch's
# `ProcessGroupGloo` answers `reduce_scatter_tensor` with an **all-reduce of a clone of the whole
# input** and copies out this rank's chunk: an all-reduce's bytes, 2(N−1)/N · S sent per rank. So
# on gloo `minizero.collectives.reduce_scatter` sends chunk j of its input straight to rank j
# (`isend`), receives the N−1 chunks the others send it (`irecv`) and adds them to its own:
# (N−1)/N · S, a reduce-scatter's bytes, the same sums (`tests/library/test_collectives.py`
# compares them with torch's). Its receive buffer holds those N−1 chunks, (N−1)/N of the input,
# where the clone was all of it (lesson 03 measures it). NCCL implements reduce-scatter natively,
# and minizero calls it there. minizero's all-gather on gloo is its own too: each rank sends its
# chunk to every other rank and receives theirs straight into their places in the output, the
# (N−1)/N · S that gloo's `all_gather_into_tensor` moves (`python -m minizero bench collectives`
# times the two). After the sweep, a cell times minizero's reduce-scatter, torch's and torch's
# all-reduce on the same buffers; the last cell prints the ratios.


# %%
# @save
def time_collective(op: str, nbytes: int) -> dict:
    """On every rank: ``op`` on S = ``nbytes`` of float32, its median call and nccl-tests' rates."""
    world, dev = dist.get_world_size(), rank_device()
    n = max(world, nbytes // 4 // world * world)  # float32 elements, a multiple of N
    full, shard = torch.ones(n, device=dev), torch.empty(n // world, device=dev)  # (S,), (S/N,)
    call = {
        "all_reduce": lambda: C.all_reduce(full),
        "reduce_scatter": lambda: C.reduce_scatter(shard, full),
        "all_gather": lambda: C.all_gather(full, shard),
    }[op]
    call()  # warm-up: connections, buffers
    repeats = max(5, min(25, 2**22 // nbytes))  # more repeats where calls are cheap
    with CommLedger() as ledger:
        for _ in range(repeats):
            call()
    t = sorted(r.seconds for r in ledger.records)[repeats // 2]  # the median call, in seconds
    algbw = 4 * n / t  # S / t: bytes per second, as the caller sees it
    busbw = algbw * (2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world)
    return dict(op=op, nbytes=4 * n, seconds=t, algbw=algbw, busbw=busbw, info=run_info())


# %%
OPS = ["all_reduce", "reduce_scatter", "all_gather"]
SIZES = lab.default_sizes(INFO)  # bytes: 4 KiB to 16 MiB on CPUs, to 256 MiB on GPUs
rows = lab.bandwidth(NPROCS, OPS, SIZES, time_collective)  # rank 0's row at each (op, size)
lab.plot_bandwidth(rows)
lab.show_rs_against_torch(lab.rs_against_torch(NPROCS, SIZES))  # gloo: torch's is an all-reduce
lab.show_ratios(rows)

# %% [markdown]
# What to read in the measurements:
#
# * **Small messages are latency-bound**: below some size the time per call hardly changes with S,
#   so busbw grows with S. Many small tensors cost a latency each: this is why DDP groups gradients
#   into buckets (lesson 01).
# * **torch's reduce-scatter on gloo** is an all-reduce and a copy: set its column beside its
#   all-reduce's. minizero's sends half the bytes; the "torch / minizero" column says what that
#   saves on this machine, less where the per-call latency dominates (small S, a busy machine).
# * **The ratios** printed last, at the largest S: a ring's half moves half an all-reduce's bytes,
#   but half the bytes is not always half the time (a local sum into a fresh buffer on gloo; on
#   NCCL, other algorithms than the ring): a **tree** (all-reduce only, its rounds
#   growing with log N), **NVLS** (NVLink SHARP: the NVSwitch itself reduces) and **CollNet** (the
#   network's switches reduce). NVLS serves reduce-scatter and all-gather too, and NCCL 2.20 added
#   CollNet for both (NVIDIA/nccl `src/device/reduce_scatter.h`), so which is faster on a GPU
#   machine is for `python -m minizero bench collectives` to measure. The *volume* is the same
#   either way: that is what the ZeRO paper counts, and what lessons 02–04 measure.

# %% [markdown]
# ## 5. A cost model: latency + bytes / bandwidth
#
# The two regimes of the curves above fit one formula, the **α-β model** (Hockney's). nccl-tests'
# busbw has no α in it: it is algbw (S / t) times the ring's correction, 2(N−1)/N for an
# all-reduce and (N−1)/N for a reduce-scatter or an all-gather, the wire term below. A ring
# collective on N ranks is a number of *rounds*; in each round every rank sends one chunk to its
# neighbour. A round costs a fixed latency **α** (seconds), and the bytes cost 1/**β** each (β:
# bytes per second of one link):
#
# $$t = \alpha \cdot \text{rounds}(\text{op}, N) + \text{wire}(\text{op}, S, N)\,/\,\beta$$
#
# | op | rounds | wire: bytes each rank sends |
# |---|---|---|
# | all-reduce | 2(N−1) | 2(N−1)/N · S (a reduce-scatter, then an all-gather) |
# | reduce-scatter | N−1 | (N−1)/N · S |
# | all-gather | N−1 | (N−1)/N · S |
#
# wire / t is exactly nccl-tests' busbw, so β is the busbw the largest messages approach, and α
# is what the smallest ones pay. Two unknowns: `minizero.analysis.cost.fit` finds them by least
# squares (each row weighted by 1/t, so a 4 KiB call counts as much as a 16 MiB one) on the rows
# this lesson just measured. minizero's reduce-scatter moves a reduce-scatter's bytes on both
# backends (section 4), so the table applies as it is; `emulated_rs=True` would price torch's own
# on gloo, an all-reduce of S.

# %%
link = cost.fit(rows, NPROCS)
model = [cost.collective_time(r["op"], r["nbytes"], NPROCS, link) for r in rows]
lab.show_fit(rows, link, model)
lab.plot_fit(rows, link, model)

# %% [markdown]
# Where does latency stop mattering? The two terms of an all-reduce are equal at **S½ = N·α·β**: a
# message of S½ reaches half of β. Below it, fewer, larger messages pay. That is why DDP packs
# gradients into buckets of megabytes (lesson 01), and lesson 08 fits the same model once for the
# links inside a node and once for the network, to predict a training step.

# %%
s_half = NPROCS * link.alpha * link.beta
t_half = cost.collective_time("all_reduce", s_half, NPROCS, link)
print(f"S½ = N·α·β = {s_half / 2**10:,.0f} KiB; an all-reduce of S½: {t_half * 1e6:,.0f} µs")

# %% [markdown]
# The fit is a model, not a law: the error column shows where it misses (gloo switches algorithm
# with the message size; on a busy machine the small calls wait for a core). What it gives is two
# numbers per link that predict any collective of any size on any number of ranks of that link.
#
# Next: **lesson 01 — DDP**, where the all-reduce averages gradients.
