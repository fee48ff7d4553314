"""A zoo of models and training habits that no one here wrote, for the equivalence tests.

Each entry of :data:`ZOO` is a model built the way its own library builds it, deterministic from a
seed and small enough for a 2-core CPU test:

- ``"encoder_lm"`` / ``"encoder_lm_prenorm"``: ``minizero.models.EncoderLM``, torch's
  ``nn.TransformerEncoder`` of two ``nn.TransformerEncoderLayer`` (post-norm / ``norm_first=True``),
  a final LayerNorm, and an ``lm_head`` tied to the embedding. ``nn.MultiheadAttention`` reads
  ``out_proj.weight`` without calling ``out_proj``: the case that ZeRO-3 per-module gathering
  breaks on.
- ``"resnet18"``: torchvision's ``resnet18(num_classes=10)`` on 3x32x32 images: BatchNorm, running
  statistics, ``nn.Sequential`` stages of ``BasicBlock``.
- ``"gpt2"``: Hugging Face ``GPT2LMHeadModel`` from a small ``GPT2Config`` (random init, nothing
  downloaded), loss through ``labels=`` the way HF scripts do it; ``Conv1D`` weights, tied head.

Habits: :func:`nanogpt_groups` (weight decay on >= 2-D parameters only, as nanoGPT's
``configure_optimizers``), optionally another lr for the second group; :data:`OPTIMIZERS`.

Trainers, each returning a *run* in ``tests/harness.py``'s format (``{"states": [full fp32
state_dict after each step], "norms": [clip norms]}``, compared by ``harness.assert_same_run``):
:func:`train_reference` (one process), and :func:`train_rank` (on each rank, inside
``minizero.launch``) with :func:`wrap_torch_ddp` (torch DDP, ``broadcast_buffers=True``),
:func:`wrap_fsdp2` (``fully_shard`` on each repeated block, then the root) or any wrapper of the
same shape (e.g. ``minizero.parallelize``).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import GLOBAL_BATCH, STEPS, snapshot
from torch import nn

from minizero import models
from minizero.models import GPTConfig, synthetic_batch

VOCAB = 101  # prime: no size divides by 2 or 3
SEQ_LEN = 16
D_MODEL = 32
N_HEAD = 4
N_LAYER = 2
IMAGE = (3, 32, 32)
CLASSES = 10

Batch = tuple[torch.Tensor, ...]
Run = dict[str, list]


# -- torchvision on a CPU-only torch -------------------------------------------------------------
_TORCHVISION_SCHEMAS: Any = None  # the fallback's torch.library.Library, kept alive while in use


def import_torchvision() -> Any:
    """``import torchvision``, also where its C++ extension cannot load.

    PyPI's torchvision 0.28.0 wheel is built against CUDA torch: its ``_C.so`` links
    ``libc10_cuda.so``, which a CPU-only torch (``torch==2.13.0+cpu``) does not have. torchvision
    then skips the extension quietly, but ``torchvision/_meta_registrations.py`` still registers
    fake (meta) kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, and
    that raises "operator torchvision::nms does not exist", so nothing in torchvision imports,
    not even the pure-Python models (nor ``transformers``' models, which import torchvision when
    it is installed). Here, only when that happens: define those two operators'
    schemas (as ``torchvision/csrc/ops/nms.cpp`` and ``quantized/cpu/qnms_kernel.cpp`` declare
    them) with ``torch.library`` and import again. The models never call them; calling one raises
    torch's "no kernel" error. With a working extension this is a plain import.
    """
    global _TORCHVISION_SCHEMAS
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package, so that it imports afresh
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SCHEMAS = lib
        import torchvision
    return torchvision


# -- the models ----------------------------------------------------------------------------------
def EncoderLM(norm_first: bool = False) -> nn.Module:
    """``minizero.models.EncoderLM`` at the zoo's size: tokens (B, T) -> logits (B, T, VOCAB).
    GPT-2's init, not torch's default: its docstring says why 1e-5 needs it."""
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ_LEN, n_layer=N_LAYER, n_head=N_HEAD,
                       n_embd=D_MODEL)  # fmt: skip
    return models.EncoderLM(config, norm_first=norm_first)


def _lm_batch(step: int, rank: int, world: int, seed: int) -> Batch:
    return synthetic_batch("gpt", GLOBAL_BATCH, step, rank=rank, world=world, seed=seed,
                           vocab_size=VOCAB, seq_len=SEQ_LEN)  # fmt: skip


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    idx, targets = batch  # (b, T) each
    logits = model(idx)  # (b, T, VOCAB)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _build_resnet18() -> nn.Module:
    return import_torchvision().models.resnet18(num_classes=CLASSES)


def _image_batch(step: int, rank: int, world: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the same on every rank
    x = torch.randn(GLOBAL_BATCH, *IMAGE, generator=g)  # (B, 3, 32, 32)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)  # (B,)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows].contiguous(), y[rows].contiguous()


def _image_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def _build_gpt2() -> nn.Module:
    if importlib.util.find_spec("torchvision") is not None:
        import_torchvision()  # transformers imports torchvision when it is installed: mend it first
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=D_MODEL, n_layer=N_LAYER, n_head=N_HEAD,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None,  # GPT-2's 50256 lies outside this vocabulary
    )  # fmt: skip
    model = GPT2LMHeadModel(config)  # random init from torch's RNG; lm_head tied to wte
    model.loss_type = "ForCausalLM"  # what HF falls back to anyway, without a warning
    return model


def _gpt2_batch(step: int, rank: int, world: int, seed: int) -> Batch:
    idx, _ = _lm_batch(step, rank, world, seed)
    return (idx,)  # HF shifts the labels itself


def _gpt2_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    (idx,) = batch
    return model(input_ids=idx, labels=idx).loss  # mean over b * (T - 1) predictions


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One model of the zoo. ``batch(step, rank, world, seed)`` is rank ``rank``'s rows of the
    step's global batch (ranks 0..world-1 concatenated give ``world=1``'s); ``loss(model, batch)``
    is the mean over the batch, so the mean of the ranks' losses is the global loss; ``blocks``
    lists the repeated blocks (the units FSDP2 shards one by one)."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int, int, int, int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]

    def build(self, seed: int = 0) -> nn.Module:
        """The model, initialised from ``seed`` (the same on every rank and in the reference)."""
        torch.manual_seed(seed)
        return self.make()


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel(name="encoder_lm", make=EncoderLM, batch=_lm_batch, loss=_lm_loss,
                 blocks=lambda m: list(m.encoder.layers)),
        ZooModel(name="encoder_lm_prenorm", make=lambda: EncoderLM(norm_first=True),
                 batch=_lm_batch, loss=_lm_loss, blocks=lambda m: list(m.encoder.layers)),
        ZooModel(name="resnet18", make=_build_resnet18, batch=_image_batch, loss=_image_loss,
                 blocks=lambda m: [b for s in (m.layer1, m.layer2, m.layer3, m.layer4) for b in s]),
        ZooModel(name="gpt2", make=_build_gpt2, batch=_gpt2_batch, loss=_gpt2_loss,
                 blocks=lambda m: list(m.transformer.h)),
    ]
}  # fmt: skip


def zoo(model: str | ZooModel) -> ZooModel:
    if isinstance(model, ZooModel):
        return model
    if model not in ZOO:
        raise ValueError(f"unknown zoo model {model!r}: one of {sorted(ZOO)}")
    return ZOO[model]


# -- optimizers: the nanoGPT habit --------------------------------------------------------------
def nanogpt_groups(
    model: nn.Module, weight_decay: float, second_lr: float | None = None
) -> list[dict[str, Any]]:
    """nanoGPT's ``configure_optimizers`` groups: weight decay on every trainable parameter of 2
    or more dimensions (matmul weights, embeddings), none on the rest (biases, norms). A tied
    parameter appears once (``named_parameters`` yields it once). ``second_lr``: the no-decay
    group gets its own lr (the per-group setting a flat shard per optimizer would lose)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    if second_lr is not None:
        groups[1]["lr"] = second_lr
    return groups


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(_trainable(m), lr=0.05, momentum=0.9),
    "adamw_groups": lambda m: torch.optim.AdamW(nanogpt_groups(m, 0.1), lr=1e-3, betas=(0.9, 0.95)),
    "adamw_groups_lr": lambda m: torch.optim.AdamW(
        nanogpt_groups(m, 0.1, second_lr=3e-3), lr=1e-3, betas=(0.9, 0.95)
    ),
}


def optimizer(name: str | Callable) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """A name of :data:`OPTIMIZERS`, or a callable ``model -> optimizer`` passed through."""
    if callable(name):
        return name
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown zoo optimizer {name!r}: one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


# -- the reference: one process -----------------------------------------------------------------
def _batch_stats(model: nn.Module) -> bool:
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return any(isinstance(m, bn) and m.training for m in model.modules())


def train_reference(
    model: str | ZooModel,
    optimizer_builder: str | Callable[[nn.Module], torch.optim.Optimizer],
    steps: int = STEPS,
    clip: float | None = None,
    *,
    world: int = 1,
    broadcast_buffers: bool = True,
    seed: int = 0,
) -> list[Run]:
    """One process, the plain model, each step's whole global batch. Returns one run per rank of
    a ``world``-rank data-parallel run: what rank r should hold after each step.

    Without BatchNorm every rank holds the same, and the reference is one forward over the global
    batch (the mean of the ranks' mean losses is the global mean loss).

    With BatchNorm in train mode there is no such single-process twin: each rank normalises with
    its own batch's statistics, so the gradient is the mean over ranks of per-shard gradients
    ("ghost batch norm"), not the gradient over the global batch (SyncBatchNorm would make it
    that, but torch has it only for GPUs). So the reference runs the global batch as ``world``
    shards, forward and backward of ``loss / world`` each: exactly the data-parallel gradient.
    Running statistics follow torch DDP's ``broadcast_buffers=True``: every forward starts from
    rank 0's buffers, so rank r ends a step with rank 0's buffers updated by shard r, and rank 0's
    line goes on. ``broadcast_buffers=False`` (FSDP2, which never syncs buffers): each rank's
    buffers follow its own shards only. Parameters are the same either way (train-mode
    BatchNorm normalises with the batch's statistics, never the running ones).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (minizero.launch): the same kernels, the same rounding
    try:
        args = (model, optimizer_builder, steps, clip, world, broadcast_buffers, seed)
        return _train_reference(*args)
    finally:
        torch.set_num_threads(threads)


def _train_reference(model, optimizer_builder, steps, clip, world, broadcast_buffers, seed):
    entry, make_opt = zoo(model), optimizer(optimizer_builder)
    net = entry.build(seed)
    opt = make_opt(net)
    shards = world if _batch_stats(net) else 1
    lines = [{k: b.clone() for k, b in net.named_buffers()} for _ in range(world)]  # per rank
    runs: list[Run] = [{"states": [], "norms": []} for _ in range(world)]
    for step in range(steps):
        ends = []  # each shard's buffers after its forward
        for s in range(shards):
            start = lines[0] if broadcast_buffers else lines[s]
            with torch.no_grad():
                for k, b in net.named_buffers():
                    b.copy_(start[k])
            (entry.loss(net, entry.batch(step, s, shards, seed)) / shards).backward()
            ends.append({k: b.clone() for k, b in net.named_buffers()})
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(_trainable(net), clip))
            for run in runs:
                run["norms"].append(norm)
        opt.step()
        opt.zero_grad()
        params = snapshot(net)  # parameters and buffers; buffers replaced per rank below
        for r, run in enumerate(runs):
            mine = ends[r if shards > 1 else 0]
            run["states"].append({**params, **{k: v.float() for k, v in mine.items()}})
        if broadcast_buffers:
            lines = [ends[0]] * world
        else:
            lines = [ends[r if shards > 1 else 0] for r in range(world)]
    return runs


# -- on each rank: torch DDP, FSDP2, or any wrapper of the same shape ----------------------------
Wrapper = Callable[[nn.Module, Callable[[nn.Module], torch.optim.Optimizer], ZooModel],
                   tuple[nn.Module, torch.optim.Optimizer]]  # fmt: skip


def wrap_torch_ddp(model, make_opt, entry) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``DistributedDataParallel`` with torch's defaults (``broadcast_buffers=True``); the
    optimizer over the plain model's parameters, groups and all."""
    return nn.parallel.DistributedDataParallel(model), make_opt(model)


def wrap_fsdp2(
    model, make_opt, entry, mp_policy: Any = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each repeated block, then on the root
    (the rest: embeddings, tied head, stem). The optimizer is built afterwards, over the DTensor
    parameters, with the same groups. ``mp_policy``: a ``MixedPrecisionPolicy``, or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = mp_policy or MixedPrecisionPolicy()
    for block in entry.blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, make_opt(model)


WRAPPERS: dict[str, Wrapper] = {"torch_ddp": wrap_torch_ddp, "fsdp2": wrap_fsdp2}


def train_rank(
    model: str | ZooModel,
    wrapper: str | Wrapper,
    optimizer_builder: str | Callable[[nn.Module], torch.optim.Optimizer],
    steps: int = STEPS,
    clip: float | None = None,
    seed: int = 0,
) -> Run:
    """On one rank of a launch: build from ``seed``, wrap, train ``steps`` steps on this rank's
    rows of each global batch (forward, backward, optional clip by the global norm, step,
    zero_grad: the user's loop) and snapshot the full state after each step (collective)."""
    entry, make_opt = zoo(model), optimizer(optimizer_builder)
    wrap = WRAPPERS[wrapper] if isinstance(wrapper, str) else wrapper
    net, opt = wrap(entry.build(seed), make_opt, entry)
    rank, world = dist.get_rank(), dist.get_world_size()
    run: Run = {"states": [], "norms": []}
    for step in range(steps):
        entry.loss(net, entry.batch(step, rank, world, seed)).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(_trainable(net), clip)
            run["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        run["states"].append(snapshot(net))
    return run


def difference(got: Run, want: Run) -> tuple[float, str]:
    """The largest |got - want| over every step and every entry of the state (parameters and
    buffers), and the largest relative difference of the clip norms, with where it is; inf when
    the steps, keys or norms do not line up. Plain data, to return from a rank."""
    if len(got["states"]) != len(want["states"]) or len(got["norms"]) != len(want["norms"]):
        return math.inf, f"{len(got['states'])} steps / {len(got['norms'])} norms, not " \
                         f"{len(want['states'])} / {len(want['norms'])}"  # fmt: skip
    worst, where = 0.0, ""
    for step, (g, w) in enumerate(zip(got["states"], want["states"], strict=True)):
        if g.keys() != w.keys():
            return math.inf, f"step {step}: keys differ: {sorted(g.keys() ^ w.keys())}"
        for k in w:
            d = float((g[k] - w[k]).abs().max()) if w[k].numel() else 0.0
            if not d <= worst:  # also catches nan
                worst, where = d, f"step {step}, {k}"
    for step, (g, w) in enumerate(zip(got["norms"], want["norms"], strict=True)):
        d = abs(g - w) / abs(w)
        if not d <= worst:
            worst, where = d, f"step {step}, clip norm {g} vs {w}"
    return worst, where
