# %% [markdown]
# # Lesson 05 — All stages side by side
#
# Lessons 01–04 built DDP and the three ZeRO stages one at a time. This lesson runs all four on
# the same model and the same ranks, and puts what each rank **holds**, **moves** and **spends**
# next to the paper's numbers:
#
# 1. memory per rank, measured, beside the paper's formula (you write the formula: the exercise);
# 2. communication volume, bandwidth and step time per stage;
# 3. the paper's Table 1 at 7.5B, 128B and 1T parameters, measured from the same stage code;
# 4. a calculator for any Ψ, N_d, stage and precision.
#
# ZeRO comes from Microsoft's DeepSpeed team (Rajbhandari, Rasley, Ruwase, He, *ZeRO: Memory
# Optimizations Toward Training Trillion Parameter Models*, arXiv 1910.02054, SC20). ZeRO-DP is
# **plain synchronous data parallelism with the redundancy removed**: every rank still runs the
# whole model on its own micro-batch, and the stages differ only in which model states each rank
# keeps between uses and which collectives bring them back.
#
#     python -m minizero grade lessons/05_all_stages.ipynb

# %%
import statistics
from collections import Counter

import matplotlib.pyplot as plt
import torch

# torch.optim imports torch's compiler on first use (~10 s per process). The ranks of a CPU launch
# are forked from this kernel: importing it once here saves every launch below that time.
import torch._dynamo  # noqa: F401

import minizero
from minizero import checks, plots
from minizero.memory import PAPER_TABLE1, TABLE1_PSI, format_bytes
from minizero.simulate import format_table1, printed_as, table1

NPROCS = checks.default_nprocs()
INFO = minizero.launch(checks.run_info, NPROCS)[0]  # where this lesson's measurements are made
print(checks.describe(INFO), f"· torch {torch.__version__}")

# %% [markdown]
# ## 1. Memory per rank
#
# The paper (§3.1) counts **model states** per parameter for mixed-precision Adam: 2 bytes of
# 16-bit parameters, 2 bytes of 16-bit gradients, and **K = 12** bytes of optimizer states (an
# fp32 master copy of the parameters, Adam's momentum and variance: 4 + 4 + 4). Ψ parameters,
# N ranks:
#
# | stage | partitions | parameters | gradients | optimizer states | per rank |
# |---|---|---|---|---|---|
# | 0: DDP | nothing | 2Ψ | 2Ψ | KΨ | (2 + 2 + K)Ψ |
# | 1: P_os | optimizer states | 2Ψ | 2Ψ | KΨ/N | 2Ψ + 2Ψ + KΨ/N |
# | 2: P_os+g | + gradients | 2Ψ | 2Ψ/N | KΨ/N | 2Ψ + (2 + K)Ψ/N |
# | 3: P_os+g+p | + parameters | 2Ψ/N | 2Ψ/N | KΨ/N | (2 + 2 + K)Ψ/N |
#
# The cell below trains TinyGPT (tiny) and a small MLP (`models.MLP` with sizes 32, 64, 64, 16:
# three linear layers and an output gain) for a few steps at every stage in bf16 with AdamW, on
# NPROCS ranks (`plots.profile_stage` is what each rank runs; read it in `minizero/plots.py`).
# For each stage it keeps the model-state bytes at the end of backward (`model_state_bytes`: the
# storages the stage holds, hidden flat buffers included), the peak of one step (`MemoryMeter`:
# every live byte on CPU, the CUDA allocator's figures on a GPU), every collective of one step
# (`CommLedger`), and the times of a few more steps.

# %%
STAGES = (0, 1, 2, 3)
res = checks.launch_with_progress(
    plots.profile_stages,
    NPROCS,
    models=("gpt", "mlp"),
    stages=STAGES,
    precision="bf16",
    steps=5,
    total=8,
    desc="stages (bf16)",
    verbose=False,
)[0]  # {"info": ..., "profiles": [one dict per model and stage]}
PROFILES = {m: [p for p in res["profiles"] if p["model"] == m] for m in ("gpt", "mlp")}
GPT = PROFILES["gpt"]
print(f"TinyGPT: Ψ = {GPT[0]['psi']:,}; MLP: Ψ = {PROFILES['mlp'][0]['psi']:,}")
print(f"{'bf16, TinyGPT':24}" + "".join(f"{c:>26}" for c in plots.CATS))
for p in GPT:
    paper = minizero.paper_model_state_bytes(p["psi"], p["world"], p["stage"], "bf16")
    cells = [f"{format_bytes(p['states'][c])} [{format_bytes(paper[c])}]" for c in plots.CATS]
    print(f"stage {p['stage']} {plots.STAGES[p['stage']]:16}" + "".join(f"{s:>26}" for s in cells))
print("measured [paper's formula]")

# %%
fig = plots.memory_figure(GPT, INFO)
plt.show()

# %% [markdown]
# **Model states** (the coloured part of each left bar) are the formula to the byte here: TinyGPT
# tiny's tensors split evenly over 2, 4 or 8 ranks. Where a flat buffer does not, a stage pads it
# with at most N − 1 elements, and the measurement shows that padding too.
#
# Going from DDP to stage 1 removes the largest term: the optimizer states are 12 of the 16
# bytes per parameter. Stage 2 divides the gradients, stage 3 the parameters, and at large N the
# per-rank model states of stage 3 go to zero as 16Ψ/N.
#
# The **hatched part** is the rest of the step's peak. What it holds, measured (on CPU the meter
# splits the peak; under the CUDA allocator only the total is known):

# %%
for p in GPT:
    rest = p["peak"] - sum(p["states"].values())
    line = f"stage {p['stage']}: peak {format_bytes(p['peak'])}, {format_bytes(rest)} beyond states"
    if p["at_peak"] is not None:  # CPU: the split at the moment of the peak
        comm = p["at_peak"]["comm"]
        other = format_bytes(rest - comm)
        line += f" = comm buffers {format_bytes(comm)} + activations and temporaries {other}"
    print(line)

# %% [markdown]
# ZeRO-DP partitions model states, not activations: the activations of a micro-batch are the same
# at every stage (every rank runs the whole model on its rows). Stage 2's peak also holds the
# bucket being filled and the one being reduce-scattered; stage 3's holds the units gathered at
# that moment: the current layer's, the prefetched one's, and the tied embedding's, which stays
# gathered from its first use to its last (lesson 04). Activations have their own remedies
# (checkpointing; the paper's ZeRO-R, §6, for model parallelism), outside ZeRO-DP.
#
# ## Exercise — the paper's formula
#
# Write `expected_bytes(psi, world, stage, precision)`: the per-rank bytes of
# `{"params", "grads", "optimizer"}` by the paper's formula. For `"bf16"` and `"fp16"`: 2, 2 and
# K = 12 bytes per parameter. For `"fp32"`: 4 and 4, and K = 8, because fp32 parameters are their
# own master copy (Adam keeps only momentum and variance). Stage 1 divides the optimizer states by
# N, stage 2 the gradients too, stage 3 the parameters too.
#
# The check compares your formula with what the real stages held on NPROCS ranks, in bf16 (above)
# and in fp32 (measured by the next cell), and with every cell of the paper's Table 1 as printed.

# %%
fp32 = checks.launch_with_progress(
    plots.profile_stages,
    NPROCS,
    models=("gpt",),
    stages=STAGES,
    precision="fp32",
    steps=0,
    total=4,
    desc="stages (fp32)",
    verbose=False,
)[0]["profiles"]
MEASURED = GPT + fp32  # model-state bytes of TinyGPT at every stage, bf16 and fp32


def check_expected_bytes(fn, measured) -> None:
    """The exercise's check: ``fn`` against measured bytes, then against Table 1 as printed."""
    name = getattr(fn, "__name__", "your function")
    for p in measured:
        args = (p["psi"], p["world"], p["stage"], p["precision"])
        where = f"Ψ={p['psi']:,}, N={p['world']}, stage {p['stage']}, {p['precision']}"
        try:
            got = fn(*args)
        except Exception as e:
            raise checks.CheckFailed(f"{name}{args} raised {type(e).__name__}: {e}") from e
        if not isinstance(got, dict) or set(got) != set(plots.CATS):
            raise checks.CheckFailed(f"{name}{args} must return a dict with keys {plots.CATS}")
        for c in plots.CATS:
            have = p["states"][c]
            if abs(got[c] - have) > 0.01 * have + 64:  # a stage pads each buffer: N - 1 elements
                raise checks.CheckFailed(
                    f"{where}: your {c!r} is {got[c]:,.0f} bytes, the rank measured {have:,} "
                    f"bytes (= {have / p['psi']:g} bytes per parameter)"
                )
    for model, rows in PAPER_TABLE1.items():
        for world, printed in rows.items():
            for stage, want in zip((1, 2, 3), printed):
                gb = sum(fn(TABLE1_PSI[model], world, stage, "fp16").values()) / 1e9
                if not printed_as(gb, want):
                    raise checks.CheckFailed(
                        f"Table 1, Ψ = {model}, N_d = {world}, stage {stage}: your formula gives "
                        f"{gb:g} GB, the paper prints {want:g}"
                    )
    print(
        f"PASS  {name} equals the bytes measured at stages 0-3 in bf16 and fp32 on "
        f"{checks.describe(INFO)}, and all 54 cells of the paper's Table 1 as printed"
    )


# %%
def expected_bytes(psi: int, world: int, stage: int, precision: str = "bf16") -> dict[str, float]:
    """Per-rank bytes of ``{"params", "grads", "optimizer"}`` by the ZeRO paper's formula."""
    # BEGIN SOLUTION
    # TODO: bytes per parameter (params, grads, K): (2, 2, 12) for bf16/fp16, (4, 4, 8) for fp32
    # TODO: divide the optimizer term by world from stage 1, gradients from 2, parameters at 3
    p, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    return {
        "params": p * psi / (world if stage >= 3 else 1),
        "grads": g * psi / (world if stage >= 2 else 1),
        "optimizer": k * psi / (world if stage >= 1 else 1),
    }
    # END SOLUTION


# %% check="expected_bytes"
# Your formula against the model-state bytes the real stages held above (TinyGPT, stages 0-3,
# bf16 and fp32, NPROCS ranks), then against every cell of the paper's Table 1 (K = 12).
check_expected_bytes(expected_bytes, MEASURED)

# %% [markdown]
# ## 2. Communication, bandwidth and step time
#
# Per step, DDP all-reduces Ψ gradient elements: 2Ψ in the paper's accounting (§7.1; lesson 00).
# Stages 1 and 2 replace it with a reduce-scatter of the gradients (Ψ) and an all-gather of the
# updated parameters (Ψ): **2Ψ, the same as DDP** (§7.2.1). Stage 3 all-gathers every layer's
# parameters in forward (Ψ) and again in backward (Ψ), and reduce-scatters the gradients (Ψ):
# **3Ψ, 1.5× DDP** (§7.2.2). The ledgers of the step measured above, on rank 0:

# %%
print(
    f"{'':22}"
    + "".join(f"{plots.MODELS[m]} (Ψ = {ps[0]['psi']:,})".rjust(30) for m, ps in PROFILES.items())
)
for i, s in enumerate(plots.STAGES):
    cells = [
        f"{p['volume'] / p['psi']:.4f}Ψ in {len(p['records'])} calls"
        for p in (PROFILES[m][i] for m in PROFILES)
    ]
    print(f"stage {s} {plots.STAGES[s]:14}" + "".join(f"{c:>30}" for c in cells))

for m, ps in PROFILES.items():  # stage 3: how often was each unit (a module's parameters) moved?
    counts = {
        op: Counter(Counter(r["tag"] for r in ps[3]["records"] if r["op"] == op).values())
        for op in ("all_gather", "reduce_scatter")
    }  # op -> {times a unit went through op: number of units}
    print(
        f"{plots.MODELS[m]}, stage 3: "
        + "; ".join(
            f"{op}: " + ", ".join(f"{units} units x{n}" for n, units in sorted(c.items()))
            for op, c in counts.items()
        )
    )

# %% [markdown]
# Both models move **exactly** 2Ψ at stages 0–2 and 3Ψ at stage 3 (their flat buffers split
# evenly over 2, 4 or 8 ranks; on other counts the ledger also shows the few padding elements):
# at stage 3 every unit is all-gathered twice, for forward and for backward, and reduce-scattered
# once. That includes TinyGPT's token embedding `wte`, **tied** to `lm_head` (one tensor, used
# by two modules): stage 3 keeps its unit gathered from `wte`'s forward to `lm_head`'s, and in
# backward from `lm_head`'s to `wte`'s, where its gradient is complete. It can do that only once
# it knows the order of the modules, which it records in the first step: in that step it gathers
# the tied unit again for `lm_head`, V × C = 101 × 64 = 6,464 elements more (lesson 04 measures
# both steps). `profile_stage` opens its ledger on the third step.
#
# The figure shows volume, the median bus bandwidth of each kind of collective, and the step
# time. Read the bandwidth with care:
#
# * **gloo has no reduce-scatter**: PyTorch's gloo backend runs an all-reduce of the whole input
#   and keeps this rank's chunk, so on gloo a reduce-scatter costs what an all-reduce costs. NCCL
#   has a native one (lesson 00 measured both).
# * The messages here are KiBs: latency-bound, far below what the link can carry (lesson 00's
#   curve).
# * A collective's time starts when *this* rank calls it, so it includes waiting for the other
#   ranks to arrive: the first collective after backward (stage 1's first reduce-scatter, in
#   `optimizer.step()`) absorbs any difference between the ranks' backward times.
# * Asynchronous collectives (DDP's and stage 2's buckets, stage 3's gathers) are timed from issue
#   to `wait()`, so computation that overlapped them counts in their time.

# %%
fig = plots.comm_figure({"mlp": PROFILES["mlp"], "gpt": GPT}, INFO)
plt.show()
print(checks.describe(INFO))
for m, ps in PROFILES.items():
    print(
        f"{plots.MODELS[m]}, per stage: median step (ms) [collectives per step]: "
        + ", ".join(f"{statistics.median(p['step_s']) * 1e3:.1f} [{len(p['records'])}]" for p in ps)
    )

# %% [markdown]
# Step time depends on how many collectives a step issues (each pays a latency), how large they
# are, and how much of them overlaps with computation: DDP and stage 2 start theirs during
# backward, stage 1 issues all of its in `optimizer.step()`, stage 3 prefetches the next layer's
# parameters while the current layer computes. With messages of a few KiB the latencies dominate
# (lesson 00's curve); at scale the payloads do, and stage 3's extra Ψ costs up to 1.5× DDP's
# communication time where the network is the bottleneck, which is why it is overlapped
# (lesson 04). These times come from this machine under whatever else runs on it: compare them
# with each other, not with another machine's.
#
# ## 3. The paper's Table 1, measured
#
# Table 1 of the paper gives the model-state memory per device for 7.5B, 128B and 1T parameters at
# N_d = 1 … 1024. None of that fits here, but `minizero.simulate` can still **run the real stage
# code** on it: it builds the model on PyTorch's meta device (tensors with a shape, a dtype and a
# storage size, but no memory), opens a fake process group of N_d ranks (collectives that return
# at once), wraps the model with `minizero.parallelize`, runs one training step and reads
# `model_state_bytes`, exactly as section 1 did with real tensors. No formula is involved.

# %%
rows = table1()  # 3 model sizes x 6 values of N_d x 4 stages, each one real step on meta tensors
print(format_table1(rows))

# %%
fig = plots.table1_figure(rows)
plt.show()

# %% [markdown]
# Every cell prints as the paper's (the paper rounds some values and truncates others: 41.25 is
# printed 41.3, 4187.5 is printed 4187). DDP needs 120 GB per GPU for 7.5B parameters, more than
# any GPU of 2019 had; stage 1 brings it to about 31 GB at N_d = 64, stage 3 to 1.9 GB.
#
# ## 4. A calculator
#
# The paper's formula for any Ψ, N_d and precision. The figure below is drawn for the 7.5B model
# on 64 ranks. In JupyterLab or Jupyter Notebook, sliders follow it and redraw the bars; in a
# graded run only the static figure is drawn. In other front ends (VS Code, ...) start the kernel
# with `MINIZERO_WIDGETS=1`, or call `display(plots.calculator())` in any cell.

# %%
fig = plots.state_bars(7.5e9, 64, "bf16", stage=3)
plt.show()
if plots.widgets_available():  # a widget front end is there; never in a graded run
    from IPython.display import display

    display(plots.calculator(7.5e9, 64, 3, "bf16"))

# %% [markdown]
# ## Summary
#
# | stage | model states per rank (K = 12) | moved per step |
# |---|---|---|
# | 0: DDP | (2 + 2 + K)Ψ | 2Ψ |
# | 1: P_os | 2Ψ + 2Ψ + KΨ/N | 2Ψ |
# | 2: P_os+g | 2Ψ + (2 + K)Ψ/N | 2Ψ |
# | 3: P_os+g+p | (2 + 2 + K)Ψ/N | 3Ψ (from the second step on, tied weights included) |
#
# Sections 1 and 2 measured every entry of this table on real ranks, section 3 at the paper's
# scale on the same stage code.
#
# Instructors: `plots.compare_stages(NPROCS)` runs every stage and saves this lesson's comparison
# as one figure, `runs/stages.png`.
#
# Next: **lesson 06 — myths and facts**, where claims often made about ZeRO meet a measurement.
