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
# The cell below trains TinyGPT (tiny) and a small MLP (`models.MLP` with sizes 32, 64, 64, 16) for
# a few steps at every stage in bf16 with AdamW, on NPROCS real ranks (`compare.profile_stage` is
# what each rank runs; read it in `minizero/course/compare.py`). For each stage it keeps the
# model-state bytes at the end of backward (`model_state_bytes`: the storages the stage holds,
# hidden flat buffers included), the peak of one step (`MemoryMeter`: every live storage on CPU, the
# CUDA allocator's count on a GPU), every collective of one step (`CommLedger`), and a few step
# times. AdamW runs `fused=True`: one kernel per step, without the full-size temporaries of the
# default (foreach) implementation.

# %%
STAGES = (0, 1, 2, 3)
PROFILES = lab.profile_stages(NPROCS, models=("gpt", "mlp"), stages=STAGES, steps=5)
GPT = PROFILES["gpt"]  # one profile per stage
lab.show_states(GPT)  # beside paper_model_state_bytes: the table above
lab.plot_memory(GPT, INFO)

# %% [markdown]
# **Model states** (the coloured part of each left bar) are the formula to the byte here: TinyGPT
# tiny's tensors split evenly over 2, 4 or 8 ranks. Where a flat buffer does not, a stage pads it
# with at most N − 1 elements, and the measurement shows that padding too. The **hatched part** is
# the rest of the step's peak; what it held, measured (on CPU the meter splits the peak; under the
# CUDA allocator only the total is known):

# %%
lab.show_peak(GPT)

# %% [markdown]
# The activations and temporaries are the same at every stage: every rank runs the whole model on
# its own rows. The communication buffers are stage 2's buckets in flight and stage 3's gathered
# units (§5).
#
# ## 2. Model states at 6.7B: the stage code on meta tensors (a consistency check)
#
# Nothing of 6.7B parameters fits in this machine, but `minizero.simulate` can run the **same stage
# code** on it: it builds the model on PyTorch's meta device (tensors with a shape, a dtype and a
# storage size, but no memory), opens a fake process group of N ranks (collectives that return at
# once), wraps the model with `minizero.parallelize`, runs one training step and reads
# `model_state_bytes`. Any model with Ψ parameters has the same model states, so it uses a
# `FlatModel` of Ψ parameters (building the 32-layer GPT on meta tensors takes seconds per stage).
#
# This is **not a measurement of memory**: no allocator is involved, only the sizes the stage code
# asks for. It checks that the code allocates, at 6.7B parameters and N = 8, what the formula
# says, which the small-scale measurement of §1 (real storages, and the CUDA allocator's count on a
# GPU) established for the same code at a size that fits.

# %%
FORMULA = {s: sum(paper_model_state_bytes(BIG_PSI, BIG_N, s, "bf16").values()) for s in STAGES}
lab.show_simulated(lab.simulated_states(BIG_PSI, BIG_N, STAGES), FORMULA, BIG_PSI, BIG_N)

# %% [markdown]
# DDP holds 107 GB of model states per GPU: more than 80 GB before a single activation. Stage 1
# brings it to 37 GB, stage 2 to 25 GB, stage 3 to 13 GB.
#
# The paper's Table 1 gives the model-state memory per device for 7.5B, 128B and 1T parameters at
# N_d = 1 … 1024. The same meta-tensor run reproduces every cell (again a consistency check of the
# code's allocation sizes against the paper's arithmetic). Beside it, per parameter and at
# N = NPROCS: what the ranks of §1 **measured** on real tensors, what the meta run gives at 7.5B,
# and the formula.

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
# The 34 sbh: attention 11 sbh (the input of the QKV projection 2, Q and K 4, V 2, the input of
# the output projection 2, its dropout mask 1), MLP 19 sbh (input 2, the GeLU's input 8 and output
# 8, dropout mask 1), two LayerNorm inputs 4 sbh. The 5as²b: the attention scores' softmax output
# (2 bytes each), its dropout mask (1) and dropout output (2). Without dropout the three masks and
# the dropout output go: **32 sbh + 2as²b**. A flash-attention kernel (Dao et al. 2022,
# *FlashAttention*, arXiv 2205.14135) recomputes the scores in backward and keeps none of them:
# **32 sbh**. PyTorch's `scaled_dot_product_attention`, which TinyGPT calls, picks such a kernel
# when it can, and falls back to a "math" kernel that stores the scores.
#
# The measurement: PyTorch's `MemTracker` (`torch.distributed._tools.mem_tracker`, which tracks
# every storage an op creates, on CPU and GPU alike) around one forward and backward of a small
# TinyGPT in bf16, in this process on the CPU; a hook before and after each transformer block
# reads what the block left alive (`budget.measure_activations`). Dropout is 0, as in TinyGPT.

# %%
SMALL = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)  # §6 trains it
B = 2  # micro-batch
h, a = SMALL.n_embd, SMALL.n_head
FORMULA = lambda s, kernel: 32 if kernel == "default" else 32 + 2 * a * s / h  # / sbh, no dropout
ACTS = lab.layer_activations(SMALL, B, lengths=(64, 128), kernels=("default", "math"))
lab.show_layer_activations(ACTS, SMALL, B, FORMULA)

# %% [markdown]
# The default kernel keeps about 32 sbh at both lengths: Korthikanti's 34 less the two dropout
# masks, plus a few bytes per token of statistics (LayerNorm's mean and inverse deviation, the
# softmax's log-sum-exp), and no s² term: it is a flash kernel. The math kernel grows with s: it
# keeps the scores. On the CPU it computes attention in fp32 for bf16 inputs, so each score costs
# 4 bytes, not the formula's 2, and Q, K, V are kept again in fp32: the formula's structure, with
# this kernel's byte counts. The formula is a model of an implementation; the measurement decides.
#
# Beyond the layers, the **output layer** keeps the logits (s·b·V) and, at the start of backward,
# the loss's gradient with respect to them. Measured by widening the vocabulary alone:

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
# At s = 4096 the 5as/h term is 5 · 32 · 4096 / 4096 = 160 against 34: stored attention scores
# would be 80% of the activations. With a flash kernel and no dropout the 6.7B model keeps about
# 17 GB of activations per sequence of 4096 tokens, on **every** rank, whatever the stage.
#
# ## 4. Activation checkpointing, measured
#
# `torch.utils.checkpoint` runs a block's forward without keeping what it computes, only its input;
# in backward it runs the block's forward again, just before the block's backward, and keeps that
# block's activations only until its backward is done (Chen et al. 2016, *Training Deep Nets with
# Sublinear Memory Cost*, arXiv 1604.06174). Korthikanti et al. count 2sbh per layer for it: the
# 16-bit input. The price is one more forward per step, about a third more arithmetic.
# `budget.checkpoint_blocks(model)` wraps each block of a TinyGPT; the same measurement:

# %%
CKPT = budget.measure_activations(SMALL, B, checkpointing=True)
print("TinyGPT (L = 2, h = 64, s = 128, b = 2), bf16, one process on the CPU, MemTracker:")
lab.show_checkpointing({"without checkpointing": base, "with checkpointing": CKPT}, s * B * h)
ck_big = BIG.n_layer * budget.checkpointed_layer_bytes(*shape[:3]) + LAYER * sbh
kept = f"{BIG.n_layer} x 2sbh kept + one layer rebuilt"
print(f"\n6.7B: {kept} = {ck_big / GB:.1f} GB (instead of {big['measured'] / GB:.1f} GB)")

# %% [markdown]
# Each checkpointed block keeps exactly 2 sbh, its bf16 output (the next block's input). The peak
# comes in backward, when one block has been rebuilt: the kept inputs, one layer's activations,
# and what the output layer holds at that moment. For the 6.7B model that is under 2 GB instead
# of 17.
#
# ## 5. Buffers, and the ZeRO-3 floor
#
# Beyond model states and activations a rank holds, at moments:
#
# * **gradient buckets** (stages 0–2): the bucket being filled and the one being reduced. minizero
#   and PyTorch's DDP default to 25 MiB (`bucket_cap_mb`, first bucket 1 MiB); §1 used small
#   buckets on purpose.
#   On gloo a reduce-scatter also clones its input (lesson 03 measured it), one bucket more;
# * **stage 3's gathered units**: the root's unit (gathered through forward and backward), the
#   block computing, the prefetched one, and the full gradient of a unit before its
#   reduce-scatter. minizero's units, like FSDP2's (what you wrap with `fully_shard`), are the
#   transformer blocks (12h² parameters each) plus the root, which holds the embeddings (V × h,
#   tied to the output layer); DeepSpeed caps what is gathered with `stage3_max_live_parameters`
#   and `stage3_prefetch_bucket_size`.
#
# These do not shrink with N. Neither do the activations. So stage 3's memory per rank does not go
# to zero: it goes to a **floor**. Measured in §1 (TinyGPT tiny, at the peak, CPU only):

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
# At N = 1024 the 6.7B model's states are 0.1 GB per rank, and the rank still needs about 20 GB:
# the floor is the activations of one micro-batch, which only checkpointing (or a smaller
# micro-batch, or model parallelism) reduces.
#
# ## 6. Exercise: predict the peak, then measure it
#
# Write `predict_peak(case)`: the bytes one rank holds at the peak of a training step, as
# `{"model_states": ..., "activations": ...}`. A `PeakCase` gives `case.cfg` (a `GPTConfig`:
# `n_layer`, `n_embd`, `n_head`, `vocab_size`), `case.seq_len`, `case.micro_batch`, `case.stage`,
# `case.checkpointing` and `case.world` (N). The step is the one measured above: TinyGPT in bf16,
# AdamW (K = 12).
#
# * `"model_states"`: parameters, gradients and optimizer states at this stage on N ranks. First
#   derive Ψ(L, h, V) yourself from TinyGPT's definition (`minizero/models.py`: the token
#   embedding, tied to the output layer; the positions; per block, attention and MLP with their
#   biases and two LayerNorms; a final LayerNorm), not from a library call;
# * `"activations"`: everything else alive at the peak, from what §3 and §4 measured (`LAYER`,
#   `LOGIT_BYTES`, `OTHER`): what a layer keeps, with and without checkpointing; what the output
#   layer keeps; the rest. Which of these does N divide?
#
# The last configuration has GPT-2's vocabulary, V = 50,257: there the logits (s·b·V) are most
# of the peak. The check first calls your function on each configuration below, then measures
# each one on max(NPROCS, 3) real ranks (3 on a CPU, so that a hard-coded N = 2 shows;
# `measure_peak` in `minizero/course/checks/lesson05.py`: one step under `MemoryMeter`). Your
# model states must be within 2% of what the ranks held, your total within 15% of the measured
# peak.

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
# Your function, applied to the question's model (the constants it uses were measured here, with
# this machine's attention kernel; a GPU's flash kernel keeps about the same 32 sbh):

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
# **DDP does not fit**: its model states alone are 107 GB. **Stages 1, 2 and 3 fit**, without
# checkpointing, as long as attention runs a flash kernel: about 55, 44 and 33 GB. Had the
# attention scores been stored (Korthikanti's eq. 1 with dropout, over 100 GB of activations at
# s = 4096), nothing would fit without checkpointing; with it, stage 1 would need about 42 GB.
#
# What this budget leaves out, so keep a margin: the CUDA allocator's caching and fragmentation
# (`torch.cuda.memory_reserved` exceeds `max_memory_allocated`), the CUDA context and NCCL's own
# buffers, and the gradients' precision: minizero and DeepSpeed's ZeRO keep bf16 gradients (the
# paper's 16Ψ), but FSDP2's default stores them in the parameters' fp32 (it casts each
# reduce-scattered shard back, `_to_dtype_if_needed(reduce_output, orig_dtype)` in pytorch/pytorch
# `torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`; lesson 04 measures it) and
# Megatron-LM's distributed optimizer keeps them in fp32 (its table in
# `docs/source/api-guide/dist_optimizer.md`: 18 bytes per parameter for DDP).
#
# ## 8. A calculator
#
# The figure above is `plots_budget.budget_figure`. In JupyterLab or Jupyter Notebook, sliders
# follow it (the model's shape, s, b, N, the GPU's memory, checkpointing, the attention kernel) and
# redraw it; in a graded run only the static figure is drawn. In other front ends (VS Code, ...)
# start the kernel with `MINIZERO_WIDGETS=1`, or call `display(plots_budget.calculator())` in any
# cell.

# %%
lab.calculator(BIG, BIG_N, BIG_B, GPU_GB)  # a widget front end only; never in a graded run

# %% [markdown]
# ## 9. What the stages cost in communication
#
# Per step, DDP all-reduces Ψ gradient elements: 2Ψ in the paper's accounting (§7.1; lesson 00).
# Stages 1 and 2 replace it with a reduce-scatter of the gradients (Ψ) and an all-gather of the
# updated parameters (Ψ): **2Ψ, the same as DDP** (§7.2.1). Stage 3 all-gathers every layer's
# parameters in forward (Ψ) and again in backward (Ψ), and reduce-scatters the gradients (Ψ):
# **3Ψ, 1.5× DDP** (§7.2.2). The ledgers of the step measured in §1, on rank 0:

# %%
lab.show_volumes(PROFILES)  # the paper: 2Ψ at stages 0-2, 3Ψ at stage 3

# %% [markdown]
# Both models move **exactly** 2Ψ at stages 0–2 and 3Ψ at stage 3: every stage-3 unit is
# all-gathered twice, for forward and for backward, and reduce-scattered once, the root's unit
# (TinyGPT's embeddings and tied head) included (lesson 04). The figure shows volume, the
# median bus bandwidth of each kind of collective, and the step time. Read the bandwidth with
# care:
#
# * **PyTorch's gloo emulates reduce-scatter**: its gloo backend runs an all-reduce of a clone of
#   the whole input and keeps this rank's chunk, so on gloo a reduce-scatter costs what an
#   all-reduce costs. NCCL has a native one (lesson 00 measured both).
# * The messages here are KiBs: latency-bound, far below what the link can carry (lesson 00).
# * A collective's time starts when *this* rank calls it, so it includes waiting for the others.
# * Asynchronous collectives (DDP's and stage 2's buckets, stage 3's gathers) are timed from issue
#   to `wait()`, so computation that overlapped them counts in their time.

# %%
lab.plot_comm(PROFILES)

# %% [markdown]
# These times come from this machine under whatever else runs on it: compare them with each
# other, not with another machine's. At scale the payloads dominate, and stage 3's extra Ψ costs
# up to 1.5× DDP's communication time where the network is the bottleneck, which is why it is
# overlapped with computation (lesson 04).
#
# ### 2Ψ and 3Ψ are per *backward* at stages 2 and 3
#
# §7 fitted the 6.7B model with b = 1 sequence of 4096 tokens per GPU: 8 × 4096 = 32,768 tokens
# per forward and backward. Real runs step on far larger global batches (Llama 2 used 4M tokens
# per step: Touvron et al. 2023, §2.2), so each rank accumulates the gradients of many
# micro-batches before each optimizer step. Stage 1 keeps the full gradient on every rank and
# reduce-scatters it once per step; stage 2 keeps only its chunk, so every backward must
# reduce-scatter its gradients; stage 3 also gathers the parameters again for every forward and
# every backward (lesson 03 §6 measured stage 2; FSDP2's `set_requires_gradient_sync(False)` is
# the other side of that trade: full gradients kept, memory paid). Measured with the ledger, one
# optimizer step of TinyGPT tiny on NPROCS ranks, after 1 and after 4 micro-batches (the second
# step: the first one's `zero_grad()` also cuts stages 1-2's buckets again, lesson 04 §7):


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
# Per optimizer step, stage 1 moves 2Ψ however many micro-batches it accumulates; stage 2 moves
# about Ψ per micro-batch plus the final all-gather; stage 3 about 3Ψ per micro-batch. At a
# realistic global batch, the memory stage 2 saves over stage 1 (the gradients: 2Ψ bytes) is paid
# for with about k/2 times the communication, and stage 3's with about 3k/2 times: which is why
# such runs pick stage 1 (or stage 2/3 with full gradients kept across micro-batches) when the
# model states fit, and why stage 3 needs its communication overlapped with computation.
#
# These volumes are minizero's. DeepSpeed's differ: its stages 1-2 all-reduce each gradient
# bucket that spans several ranks' partitions (`use_multi_rank_bucket_allreduce`, on by default
# in `deepspeed/runtime/zero/config.py`), stage 2 every micro-batch, so about 3Ψ (stage 1) and 9Ψ
# (stage 2) per step at 4 micro-batches; its stage 3 re-gathers less, keeping recently used
# parameters gathered (`stage3_max_reuse_distance`) and small ones always
# (`stage3_param_persistence_threshold`).
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
# Per layer, the activations are sbh(34 + 5as/h) with dropout and stored scores, 32 sbh with a
# flash kernel and no dropout (measured here: about the same), 2 sbh with checkpointing.
#
# The 6.7B model at s = 4096 on 8 × 80 GB: not with DDP; with any ZeRO stage, given a flash
# attention kernel; with room to spare at stage 3 or with checkpointing.
#
# Instructors: `compare.compare_stages(NPROCS)` runs every stage and saves §1's and §9's comparison
# as one figure, `runs/stages.png`.
#
# Next: **lesson 06 — myths and facts**, where nine claims about ZeRO meet a measurement.
