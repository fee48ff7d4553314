# %% [markdown]
# # Lesson 05 — The memory budget: will a 7B model train on 8 × 80 GB?
#
# Lessons 01–04 built DDP and the three ZeRO stages. This lesson asks the question they exist for:
# **does a model of about 7 billion parameters train on 8 GPUs of 80 GB each, at sequence length
# 4096?** The model has the shape of GPT-3 6.7B (Brown et al. 2020, *Language Models are Few-Shot
# Learners*, Table 2.1: L = 32 layers, width h = 4096, a = 32 heads), GPT-2's vocabulary padded to
# V = 50,304 as nanoGPT does (`model.py` in karpathy/nanoGPT), one sequence of s = 4096 tokens
# per GPU and step (micro-batch b = 1), bf16 mixed precision and AdamW.
#
# At the peak of a step a rank holds:
#
# 1. **model states**: parameters, gradients, optimizer states. ZeRO partitions these (§1, §2);
# 2. **activations**: what forward keeps for backward. ZeRO does not touch them (§3); activation
#    checkpointing does (§4);
# 3. **buffers**: the output layer's logits and the loss's temporaries, the gradient buckets being
#    reduced, stage 3's gathered units, which do not shrink with the number of ranks (§5).
#
# Each term is measured here at small scale, on real ranks or in this process, and scaled with a
# formula that the measurement checks. Then you predict the peak of a step and the notebook
# measures it (the exercise, §6), and your prediction answers the question (§7).
#
# ZeRO: Rajbhandari, Rasley, Ruwase, He, *ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models*, arXiv 1910.02054, SC20. Activations: Korthikanti, Casper, Lym, McAfee,
# Andersch, Shoeybi, Catanzaro, *Reducing Activation Recomputation in Large Transformer Models*,
# arXiv 2205.05198.
#
#     python -m minizero grade my-lessons/05_all_stages.ipynb

# %%
from minizero.course.labs.lesson05 import *  # torch, minizero, budget, hint, lab, the check

NPROCS, INFO = setup()
GB = 1e9  # the paper's GB
BIG = GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
BIG_N, BIG_B, GPU_GB = 8, 1, 80  # 8 GPUs of 80 GB, one sequence of 4096 tokens per GPU
BIG_PSI = budget.gpt_params(BIG)  # TinyGPT(BIG) would have this many parameters
print(f"the question: Ψ = {BIG_PSI:,} parameters, s = {BIG.block_size}, b = {BIG_B}, N = {BIG_N}")

# %% [markdown]
# ## 1. Model states, measured
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
# The cell trains TinyGPT (tiny) and a small MLP for a few steps at every stage in bf16 with AdamW,
# on NPROCS real ranks (`compare.profile_stage` is what each rank runs:
# `minizero/course/compare.py`). For each stage it keeps the model-state bytes at the end of
# backward (`model_state_bytes`), the peak of one step (`MemoryMeter`), every collective of one step
# (`CommLedger`), and a few step times. AdamW runs `fused=True`: one kernel, without the default
# implementation's full-size temporaries.

# %%
STAGES = (0, 1, 2, 3)
PROFILES = lab.profile_stages(NPROCS, models=("gpt", "mlp"), stages=STAGES, steps=5)
GPT = PROFILES["gpt"]  # one profile per stage
lab.show_states(GPT)  # beside paper_model_state_bytes: the table above
lab.plot_memory(GPT, INFO)

# %% [markdown]
# **Model states** (the coloured part of each left bar) are the formula to the byte: TinyGPT tiny's
# tensors split evenly over 2, 4 or 8 ranks (otherwise the padding shows too). The **hatched part**
# is the rest of the step's peak; what it held (on CPU the meter splits the peak; under the CUDA
# allocator only the total is known):

# %%
lab.show_peak(GPT)

# %% [markdown]
# The activations and temporaries are the same at every stage: every rank runs the whole model on
# its own rows. The communication buffers are buckets in flight and stage 3's gathered units (§5).
#
# ## 2. Model states at 6.7B: the stage code on meta tensors (a consistency check)
#
# `minizero.simulate` runs the **same stage code** at 6.7B: it builds the model on PyTorch's meta
# device (tensors with a shape and a dtype but no memory), opens a fake process group of N ranks,
# wraps the model with `minizero.parallelize`, runs one step and reads `model_state_bytes`. Any
# model of Ψ parameters has the same model states, so it uses a `FlatModel` of Ψ parameters. This is
# **not a measurement of memory**, only the sizes the stage code asks for: a check that the code
# allocates what the formula says, which §1 measured at a size that fits.

# %%
FORMULA = {s: sum(paper_model_state_bytes(BIG_PSI, BIG_N, s, "bf16").values()) for s in STAGES}
lab.show_simulated(lab.simulated_states(BIG_PSI, BIG_N, STAGES), FORMULA, BIG_PSI, BIG_N)

# %% [markdown]
# DDP holds 107 GB of model states per GPU: more than 80 GB before a single activation. Stage 1
# brings it to 37 GB, stage 2 to 25 GB, stage 3 to 13 GB.
#
# The same meta-tensor run reproduces every cell of the paper's Table 1 (7.5B, 128B and 1T
# parameters at N_d = 1 … 1024). Beside it, per parameter at N = NPROCS: what §1 **measured**, the
# meta run at 7.5B, and the formula.

# %%
rows = table1()  # 3 model sizes x 6 values of N_d x 4 stages, each one step on meta tensors
lab.show_table1(rows, GPT, NPROCS)  # and its figure

# %% [markdown]
# ## 3. Activations: measured at small scale, scaled by a formula
#
# Korthikanti et al. (§4.1, eq. 1) count the bytes one transformer layer keeps for backward, with
# 16-bit values, 1-byte dropout masks, and no tensor or sequence parallelism:
#
# **activations per layer = sbh (34 + 5as/h)**
#
# The 34 sbh: attention 11 sbh (the QKV projection's input 2, Q and K 4, V 2, the output
# projection's input 2, its dropout mask 1), MLP 19 sbh (input 2, the GeLU's input 8 and output 8,
# dropout mask 1), two LayerNorm inputs 4 sbh. The 5as²b: the softmax output (2 bytes a score), its
# dropout mask (1) and dropout output (2). Without dropout: **32 sbh + 2as²b**. A flash-attention
# kernel (Dao et al. 2022, arXiv 2205.14135) recomputes the scores in backward and keeps none: **32
# sbh**. PyTorch's `scaled_dot_product_attention`, which TinyGPT calls, picks such a kernel when it
# can, else a "math" kernel that stores the scores.
#
# The measurement: PyTorch's `MemTracker` (`torch.distributed._tools.mem_tracker`: every storage an
# op creates) around one forward and backward of a small TinyGPT in bf16, in this process; a hook
# around each block reads what it left alive (`budget.measure_activations`). Dropout is 0.

# %%
SMALL = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)  # §6 trains it
B = 2  # micro-batch
h, a = SMALL.n_embd, SMALL.n_head
FORMULA = lambda s, kernel: 32 if kernel == "default" else 32 + 2 * a * s / h  # / sbh, no dropout
ACTS = lab.layer_activations(SMALL, B, lengths=(64, 128), kernels=("default", "math"))
lab.show_layer_activations(ACTS, SMALL, B, FORMULA)

# %% [markdown]
# The default kernel keeps about 32 sbh at both lengths (Korthikanti's 34 less the two dropout
# masks, plus a few bytes of statistics per token) and no s² term: it is a flash kernel. The math
# kernel grows with s: it keeps the scores, here in fp32 (4 bytes, not the formula's 2). The formula
# models an implementation; the measurement decides.
#
# Beyond the layers, the **output layer** keeps the logits (s·b·V) and, at the start of backward,
# their gradient. Measured by widening the vocabulary alone:

# %%
WIDE_V = 1024
wide = budget.measure_activations(dataclasses.replace(SMALL, vocab_size=WIDE_V), B)
base = ACTS[(128, "default")]
s = SMALL.block_size
LAYER = base["layers"][0] / (s * B * h)  # bytes per layer, / sbh (this kernel)
LOGIT_BYTES = (wide["peak"] - base["peak"]) / (s * B * (WIDE_V - SMALL.vocab_size))
OTHER = (base["peak"] - SMALL.n_layer * LAYER * s * B * h - LOGIT_BYTES * s * B * 64) / (s * B * h)
print(f"measured: {LAYER:.2f} sbh per layer; {LOGIT_BYTES:.2f} bytes per logit at the peak; ")
print(f"          {OTHER:.2f} sbh more (the embeddings' output, the final LayerNorm)")

sbh = BIG.block_size * BIG_B * BIG.n_embd
shape = (BIG.block_size, BIG_B, BIG.n_embd, BIG.n_head)  # s, b, h, a
big = dict(
    measured=BIG.n_layer * LAYER * sbh,
    formula_flash=BIG.n_layer * budget.layer_activation_bytes(*shape, dropout=False, flash=True),
    formula_paper=BIG.n_layer * budget.layer_activation_bytes(*shape),
)
BIG_LOGITS = LOGIT_BYTES * BIG.block_size * BIG_B * BIG.vocab_size
print(f"\n6.7B, s = 4096, b = 1: activations of the {BIG.n_layer} layers, per rank, at any stage:")
print(f"  this kernel's measured {LAYER:.1f} sbh per layer:   {big['measured'] / GB:6.1f} GB")
print(f"  formula, flash, no dropout (32 sbh):       {big['formula_flash'] / GB:6.1f} GB")
print(f"  formula, scores stored, dropout (eq. 1):   {big['formula_paper'] / GB:6.1f} GB")
print(f"  the output layer ({LOGIT_BYTES:.1f} bytes per logit, s·b·V):  {BIG_LOGITS / GB:6.1f} GB")

# %% [markdown]
# At s = 4096 the 5as/h term is 160 against 34: stored scores would be 80% of the activations. With
# a flash kernel and no dropout the 6.7B model keeps about 17 GB of activations per sequence of 4096
# tokens, on **every** rank, whatever the stage.
#
# ## 4. Activation checkpointing, measured
#
# `torch.utils.checkpoint` runs a block's forward keeping only its input, and runs it again in
# backward just before the block's backward (Chen et al. 2016, arXiv 1604.06174). Korthikanti et al.
# count 2sbh per layer: the 16-bit input. The price is one more forward, about a third more
# arithmetic. `budget.checkpoint_blocks(model)` wraps each block of a TinyGPT; the same measurement:

# %%
CKPT = budget.measure_activations(SMALL, B, checkpointing=True)
print("TinyGPT (L = 2, h = 64, s = 128, b = 2), bf16, one process on the CPU, MemTracker:")
lab.show_checkpointing({"without checkpointing": base, "with checkpointing": CKPT}, s * B * h)
ck_big = BIG.n_layer * budget.checkpointed_layer_bytes(*shape[:3]) + LAYER * sbh
kept = f"{BIG.n_layer} x 2sbh kept + one layer rebuilt"
print(f"\n6.7B: {kept} = {ck_big / GB:.1f} GB (instead of {big['measured'] / GB:.1f} GB)")

# %% [markdown]
# Each checkpointed block keeps exactly 2 sbh, its bf16 output. The peak comes in backward, when one
# block has been rebuilt. For the 6.7B model that is under 2 GB instead of 17.
#
# ## 5. Buffers, and the ZeRO-3 floor
#
# Beyond model states and activations a rank holds, at moments:
#
# * **gradient buckets** (stages 0–2): the one being filled and the one being reduced (25 MiB by
#   default, `bucket_cap_mb`; §1 used small ones). On gloo a reduce-scatter also receives into a
#   buffer the size of its input (lesson 03);
# * **stage 3's gathered units**: the root's (embeddings, tied to the output layer), the block
#   computing, the prefetched one, and a unit's full gradient before its reduce-scatter. DeepSpeed
#   caps what is gathered with `stage3_max_live_parameters` and `stage3_prefetch_bucket_size`.
#
# These do not shrink with N, nor do the activations: stage 3's memory per rank goes to a **floor**.
# Measured in §1 (TinyGPT tiny, at the peak, CPU only):

# %%
lab.show_comm_at_peak(GPT)
units = budget.gpt_units(BIG)
work = budget.zero3_floor_bytes(units)  # 3 largest units gathered + the largest one's gradient
print(f"\n6.7B, minizero's units: the root {units[0]:,} (embeddings), each block {units[1]:,}")
print(f"stage 3's working set: {work / GB:.2f} GB, at any N")
floor = big["measured"] + BIG_LOGITS + work
for n in (8, 64, 1024):
    states = sum(paper_model_state_bytes(BIG_PSI, n, 3, "bf16").values())
    rest = f"activations, logits and working set {floor / GB:5.1f} GB"
    print(f"stage 3, N = {n:5}: model states {states / GB:6.2f} GB + {rest}")

# %% [markdown]
# At N = 1024 the 6.7B model's states are 0.1 GB per rank, and the rank still needs about 20 GB: the
# activations of one micro-batch, which only checkpointing (or a smaller micro-batch, or model
# parallelism) reduces.
#
# ## 6. Exercise: predict the peak, then measure it
#
# Write `predict_peak(case)`: the bytes one rank holds at the peak of a training step, as
# `{"model_states": ..., "activations": ...}`. A `PeakCase` gives `case.cfg` (a `GPTConfig`:
# `n_layer`, `n_embd`, `n_head`, `vocab_size`), `case.seq_len`, `case.micro_batch`, `case.stage`,
# `case.checkpointing` and `case.world` (N). The step is the one measured above: TinyGPT in bf16,
# AdamW (K = 12).
#
# * `"model_states"`: first derive Ψ(L, h, V) yourself from TinyGPT's definition
#   (`minizero/models.py`), not from a library call;
# * `"activations"`: everything else alive at the peak, from §3 and §4 (`LAYER`, `LOGIT_BYTES`,
#   `OTHER`). Which of these does N divide?
#
# The last configuration has GPT-2's vocabulary: there the logits are most of the peak. The check
# measures each configuration on max(NPROCS, 3) real ranks (`measure_peak` in
# `minizero/course/checks/lesson05.py`): model states within 2%, total within 15%.

# %%
CASES = peak_cases(NPROCS, gpu=on_gpus(NPROCS))  # longer micro-batches on GPUs
for case in CASES:
    print(case.describe())


# %%
def predict_peak(case: PeakCase) -> dict[str, float]:
    """Bytes one rank holds at the peak of a step: {"model_states": ..., "activations": ...}."""
    cfg, s, b = case.cfg, case.seq_len, case.micro_batch
    sbh = s * b * cfg.n_embd
    # BEGIN SOLUTION
    # TODO: the bytes one rank holds at the peak of a step: its model states and its activations
    # HINT: Model states depend on Ψ, N and the stage only: count Ψ from TinyGPT's definition
    #       (minizero/models.py); paper_model_state_bytes(Ψ, case.world, case.stage, "bf16") gives
    #       their parts, a dict: sum its values.
    # HINT: Ψ(L, h, V): the token embedding V·h (tied to the output layer: count it once), the
    #       positions block_size·h, per block attention 4h² and MLP 8h² of weights, 9h of biases and
    #       two LayerNorms 4h (12h² + 13h), and the final LayerNorm 2h.
    # HINT: Activations do not shrink with N. Without checkpointing every layer keeps LAYER·sbh
    #       bytes. With it each layer keeps its input only (2·sbh bytes, bf16), and one layer at a
    #       time is recomputed in full: LAYER·sbh more.
    # HINT: The rest: the output layer keeps LOGIT_BYTES per logit, s·b·V of them, whatever N; and
    #       OTHER·sbh (the embeddings' output, the final LayerNorm):
    #       states = sum(paper_model_state_bytes(psi, case.world, case.stage, "bf16").values())
    #       layers = ...  # L * LAYER * sbh, or with checkpointing L * 2 * sbh + LAYER * sbh
    #       rest = LOGIT_BYTES * s * b * V + OTHER * sbh
    #       return {"model_states": states, "activations": layers + rest}
    L, h, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    block = 12 * h * h + 13 * h  # attention 4h², MLP 8h² of weights; biases 9h, 2 LayerNorms 4h
    psi = V * h + cfg.block_size * h + L * block + 2 * h  # tied V·h, positions, final LayerNorm
    states = sum(paper_model_state_bytes(psi, case.world, case.stage, "bf16").values())
    if case.checkpointing:
        layers = cfg.n_layer * 2 * sbh + LAYER * sbh
    else:
        layers = cfg.n_layer * LAYER * sbh
    rest = LOGIT_BYTES * s * b * V + OTHER * sbh  # the logits: s·b·V, whatever N
    return {"model_states": states, "activations": layers + rest}
    # END SOLUTION


# %% check="predict_peak"
# Your prediction for each configuration above, then the peak measured on max(NPROCS, 3) ranks.
check_predict_peak(predict_peak, NPROCS, CASES)

# %% [markdown]
# ## 7. The answer: 6.7B on 8 × 80 GB at s = 4096
#
# Your function, applied to the question's model (its constants were measured with this machine's
# attention kernel; a GPU's flash kernel keeps about the same 32 sbh):

# %%
try:  # in lessons/, until you write it, the table uses minizero.analysis.budget.step_budget instead
    predict_peak(PeakCase(cfg=BIG, micro_batch=BIG_B, stage=0, checkpointing=False, world=BIG_N))
    mine = True
except NotImplementedError:
    print("predict_peak is not written yet (§6): below, analysis.budget.step_budget answers")
    mine = False


def peak_parts(stage: int, ckpt: bool, **kw) -> tuple[float, float]:
    """(model states, everything else) in bytes for the 6.7B model at ``stage``."""
    case = PeakCase(cfg=BIG, micro_batch=BIG_B, stage=stage, checkpointing=ckpt, world=BIG_N)
    if mine and not kw:
        got = predict_peak(case)
        return got["model_states"], got["activations"]
    kw = dict(world=BIG_N, stage=stage, micro_batch=BIG_B, checkpointing=ckpt, **kw)
    parts = budget.step_budget(BIG, logit_bytes=LOGIT_BYTES, **kw)
    states = sum(parts[c] for c in ("params", "grads", "optimizer"))
    return states, sum(parts.values()) - states - parts["stage 3 working set"]


# %%
ZERO3_WORK = budget.zero3_floor_bytes(units)  # stage 3's gathered units
PEAKS = {
    f"stage {s_}" + (", checkpointing" if ck else ""): (*peak_parts(s_, ck), ZERO3_WORK * (s_ == 3))
    for ck in (False, True)
    for s_ in STAGES
}
lab.show_answer(PEAKS, GPU_GB, BIG_N)
print("\nhad attention stored its scores, with dropout (Korthikanti's eq. 1):")
STORED = {
    "stage 1" + (", checkpointing" if ck else ""): (
        *peak_parts(1, ck, flash=False, dropout=True),
        0,
    )
    for ck in (False, True)
}
lab.show_answer(STORED, GPU_GB, BIG_N)

# %%
lab.plot_budget(BIG, BIG_N, micro_batch=BIG_B, capacity_gb=GPU_GB, logit_bytes=LOGIT_BYTES)

# %% [markdown]
# **DDP does not fit**: its model states alone are 107 GB. **Stages 1, 2 and 3 fit** without
# checkpointing, given a flash kernel: about 55, 44 and 33 GB. Had the scores been stored (over 100
# GB of activations), nothing would fit without checkpointing.
#
# Keep a margin for what this budget leaves out: the CUDA allocator's caching and fragmentation, the
# CUDA context and NCCL's buffers, and fp32 gradients where a system keeps them (FSDP2 with fp32
# parameters, Megatron-LM: [details](../docs/machinery.md#fp32-gradients-in-fsdp2-and-megatron-lm)).
#
# ## 8. A calculator
#
# In JupyterLab or Jupyter Notebook, sliders follow the figure above (the model's shape, s, b, N,
# the GPU's memory, checkpointing, the attention kernel); in a graded run only the static figure is
# drawn. In other front ends start the kernel with `MINIZERO_WIDGETS=1`.

# %%
lab.calculator(BIG, BIG_N, BIG_B, GPU_GB)  # a widget front end only; never in a graded run

# %% [markdown]
# ## 9. What the stages cost in communication
#
# DDP moves 2Ψ per step (§7.1), stages 1 and 2 a reduce-scatter and an all-gather, **2Ψ** (§7.2.1),
# stage 3 two all-gathers and a reduce-scatter, **3Ψ, 1.5× DDP** (§7.2.2). The ledgers of §1's step,
# on rank 0:

# %%
lab.show_volumes(PROFILES)  # the paper: 2Ψ at stages 0-2, 3Ψ at stage 3

# %% [markdown]
# Both models move **exactly** 2Ψ at stages 0–2 and 3Ψ at stage 3 (lesson 04). Read the bandwidths
# with care:
#
# * on gloo minizero's reduce-scatter is an all-to-all and a local sum (lesson 00), with its own
#   costs: torch's there is an all-reduce of a clone;
# * the messages are KiBs: latency-bound;
# * a collective's time includes waiting for the other ranks, and an asynchronous one is timed from
#   issue to `wait()`, overlapped computation included.

# %%
lab.plot_comm(PROFILES)

# %% [markdown]
# Compare these times with each other, not with another machine's. At scale stage 3's extra Ψ costs
# up to 1.5× DDP's communication time where the network is the bottleneck, hence its overlap.
#
# ### 2Ψ and 3Ψ are per *backward* at stages 2 and 3
#
# Real runs step on large global batches (Llama 2: 4M tokens a step, Touvron et al. 2023, §2.2), so
# each rank accumulates many micro-batches per step. Stage 1 keeps the full gradient and
# reduce-scatters once per step; stage 2 keeps only its chunk, so every backward reduce-scatters;
# stage 3 also gathers the parameters for every forward and backward. Measured, one optimizer step
# of TinyGPT tiny after 1 and after 4 micro-batches:


# %%
M = lab.micro_volumes(NPROCS, stages=(1, 2, 3), micros=(1, 4))
lab.show_micro_volumes(M)
MICRO = M["volumes"]  # (stage, k) -> (Ψ moved, bytes)
per_micro = {st: (MICRO[st, 4][0] - MICRO[st, 1][0]) / 3 for st in (1, 2, 3)}  # Ψ per extra one
fixed = {st: MICRO[st, 1][0] - per_micro[st] for st in (1, 2, 3)}  # Ψ once per step
k_big = 4_000_000 // (BIG_N * BIG_B * BIG.block_size)  # micro-batches per step at 4M tokens
tokens = f"4M tokens per step = {k_big} micro-batches of b = {BIG_B}"
print(f"\n6.7B on {BIG_N} GPUs, {tokens}, bf16 (measured Ψ per step above, extrapolated):")
for st in (1, 2, 3):
    psi_moved = fixed[st] + per_micro[st] * k_big
    tb = psi_moved * BIG_PSI * 2 / 1e12  # bf16: 2 bytes per element
    moved = f"{fixed[st]:.2f}Ψ + {per_micro[st]:.2f}Ψ per micro-batch = {psi_moved:7.1f}Ψ"
    print(f"  stage {st}: {moved} = {tb:6.2f} TB per rank per step (paper accounting)")

# %% [markdown]
# Per step, stage 1 moves 2Ψ however many micro-batches; stage 2 about Ψ per micro-batch plus the
# all-gather; stage 3 about 3Ψ per micro-batch. At k micro-batches, the 2Ψ bytes stage 2 saves cost
# about k/2 times the communication: such runs pick stage 1 when the model states fit, and stage 3
# needs its communication overlapped. (DeepSpeed's volumes differ: its stages 1-2 all-reduce buckets
# that span several partitions, about 3Ψ and 9Ψ at 4 micro-batches; its stage 3 keeps recently used
# parameters gathered, `stage3_max_reuse_distance`.)
#
# ## Summary
#
# | per rank, at the peak | DDP | stage 1 | stage 2 | stage 3 | divided by N? |
# |---|---|---|---|---|---|
# | parameters | 2Ψ | 2Ψ | 2Ψ | 2Ψ/N | stage 3 |
# | gradients | 2Ψ | 2Ψ | 2Ψ/N | 2Ψ/N | stages 2, 3 |
# | optimizer states | 12Ψ | 12Ψ/N | 12Ψ/N | 12Ψ/N | stages 1–3 |
# | activations (L layers) | L · sbh(34 + 5as/h) | same | same | same | never |
# | buffers | buckets | buckets | buckets | gathered units + a full gradient | never |
# | moved per step | 2Ψ | 2Ψ | 2Ψ | 3Ψ | |
#
# The 6.7B model at s = 4096 on 8 × 80 GB: not with DDP; with any ZeRO stage, given a flash
# attention kernel. Next: **lesson 06 — myths and facts**.
