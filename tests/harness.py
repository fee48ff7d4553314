"""What the data-parallel tests share: models, data, wrappers, training loops, references.

Every equivalence test has the same shape. ``train_rank(specs, ...)`` runs on each rank (through
``minizero.launch``): for each *spec* (a minizero wrapper, or one of PyTorch's) it builds the model
from the same seed, wraps it, trains ``STEPS`` steps on this rank's slice of each global batch and
records the full fp32 parameters after every step. The test then compares those records, on every
rank, with :func:`reference`: one process, the plain model, the whole global batch. With equal
local batches the mean of the ranks' mean losses is the global mean loss, so the two must agree up
to float rounding (lessons 01_ddp .. 04_zero3 state this; these tests hold the code to it).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.data_parallel import DataParallel
from minizero.ddp import DDP
from minizero.habits import Habits
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.naive_ddp import NaiveDDP

LAUNCH_TIMEOUT = 180  # seconds per launch (a test needs < 30): a hang fails the test, with stacks


def run(fn, world: int, *args, backend: str = "gloo", timeout: float = LAUNCH_TIMEOUT, **kwargs):
    """``fn(*args, **kwargs)`` on ``world`` ranks through ``minizero.launch``, quietly; every
    rank's result, in rank order. The one launch helper of the test suite."""
    return minizero.launch(
        fn, world, *args, backend=backend, timeout=timeout, verbose=False, **kwargs
    )


GLOBAL_BATCH = 12  # divides by world sizes 1, 2, 3 and, per rank, by 2 micro-batches
SEQ_LEN = 16  # TinyGPT tokens per row
STEPS = 3
TINY_BUCKET_MB = 2e-3  # 2 KiB: one bucket per parameter or two, so DDP has many buckets
HSDP_NODE = 2  # ranks per "node" of the "hsdpN" and "fsdp2_hsdp" specs' mesh
CLIP = 0.05  # below every model's gradient norm at these steps, so clipping really scales

# Largest |difference| allowed between a data-parallel run and the single process, per model and
# optimizer, in fp32. Adam divides each gradient by its own running magnitude, so an element whose
# gradient is at float-rounding level (TinyGPT's attention weights at init reach 1e-9, sums that
# cancel) moves by the sign of the rounding noise: up to ~1e-3 * lr per step, the same for PyTorch's
# DDP and FSDP2 as for minizero. SGD is linear in the gradient and also catches a gradient that
# is off by a factor (a missing or doubled average), which Adam's normalisation would hide.
ATOL = {("mlp", "adam"): 1e-6, ("mlp", "sgd"): 1e-6, ("gpt", "adamw"): 1e-5, ("gpt", "sgd"): 1e-6}


def build(kind: str, init_dtype: torch.dtype | None = None) -> nn.Module:
    """The same model on every rank and in the reference: seed 0.

    "mlp": sizes 13-37-29-7 (no size divides by 2 or 3), a frozen weight, two layers sharing one
    weight, an output gain owned by the root module. "mlp_untied": the same without the tie.
    "gpt": TinyGPT (vocabulary 101, prime; lm_head tied to the embedding), narrowed to width 32 so
    a test step takes milliseconds. ``init_dtype``: round the initial weights through that dtype
    (mixed precision starts its fp32 masters from the 16-bit working copy, so a fp32 run that is to
    be compared with it must start from the same, representable, weights).
    """
    torch.manual_seed(0)
    if kind in ("mlp", "mlp_untied"):
        model = MLP((13, 37, 29, 7), frozen_first=True, tied=kind == "mlp")
    elif kind == "gpt":
        model = TinyGPT(GPTConfig.tiny(n_embd=32, block_size=SEQ_LEN))
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    if init_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(init_dtype))
    return model


def psi(kind: str) -> int:
    """Ψ: unique trainable parameters (the tied weight once, the frozen one not at all)."""
    return count_params(build(kind))


OPTIMIZERS = {  # name -> (class, hyperparameters)
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def optimizer_fn(name: str):
    """tensors -> optimizer, as ``parallelize`` takes it."""
    cls, kw = OPTIMIZERS[name]
    return lambda tensors: cls(tensors, **kw)


def local_batch(kind: str, step: int, rank: int = 0, world: int = 1, device: Any = "cpu"):
    """Rank ``rank``'s rows of step ``step``'s global batch; ``world=1`` gives all of it."""
    kind = "mlp" if kind.startswith("mlp") else kind
    return synthetic_batch(
        kind, GLOBAL_BATCH, step, rank=rank, world=world, seq_len=SEQ_LEN, device=device
    )


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def rank_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- wrapping: one name per implementation under test ---------------------------------------------
def wrap(
    spec: str,
    model: nn.Module,
    opt: str,
    *,
    precision: str = "fp32",
    bucket_cap_mb: float = TINY_BUCKET_MB,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` as ``spec`` says and build its optimizer.

    "naive", "ddp": minizero.ddp's classes with a plain torch optimizer. "stage0".."stage3":
    ``minizero.parallelize``; "hsdp0".."hsdp3": the same with ``mesh=hsdp_mesh()``. "torch_ddp":
    DistributedDataParallel. "torch_zero": torch DDP + ZeroRedundancyOptimizer. "fsdp2":
    ``fully_shard`` on each transformer block, then the root; "fsdp2_hsdp": the same on
    ``hsdp_mesh()`` (FSDP2's HSDP).
    """
    make = optimizer_fn(opt)
    if spec.startswith(("stage", "hsdp")):
        stage = int(spec[-1])
        cap = None if stage == 3 else bucket_cap_mb  # stage 3's buckets are its units
        mesh = hsdp_mesh() if spec.startswith("hsdp") else None  # a (nodes, 2) mesh
        return minizero.parallelize(
            model, stage, make, precision=precision, bucket_cap_mb=cap, mesh=mesh
        )
    model = model.to(rank_device())
    if spec == "naive":  # composed as parallelize composes a wrapper: the habits around it
        wrapped = NaiveDDP(model, extension=Habits)
    elif spec == "ddp":
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb, extension=Habits)
    elif spec in ("torch_ddp", "torch_zero"):
        wrapped = nn.parallel.DistributedDataParallel(model)
        if spec == "torch_zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls, kw = OPTIMIZERS[opt]
            return wrapped, ZeroRedundancyOptimizer(trainable(model), optimizer_class=cls, **kw)
    elif spec in ("fsdp2", "fsdp2_hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        hsdp = spec == "fsdp2_hsdp"  # FSDP2's HSDP: the same 2-D mesh as "hsdpN"
        world = (dist.get_world_size(),)
        mesh = hsdp_mesh() if hsdp else init_device_mesh(rank_device().type, world)
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)  # the root: embeddings, tied lm_head, MLP layers
    else:
        raise ValueError(f"unknown spec {spec!r}")
    return wrapped, make(trainable(wrapped))


def hsdp_mesh(node_size: int = HSDP_NODE):
    """A 2-D mesh ("replicate", "shard"): nodes of ``node_size`` consecutive ranks, as FSDP2's
    HSDP takes it (``minizero.parallelize(..., mesh=)``, ``fully_shard(mesh=)``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    shape = (world // node_size, node_size)
    return init_device_mesh(rank_device().type, shape, mesh_dim_names=("replicate", "shard"))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 parameters on the CPU under the plain model's keys. Collective for ZeRO, FSDP2."""
    if isinstance(model, DataParallel):
        state = minizero.full_state_dict(model)
    else:
        state = getattr(model, "module", model).state_dict()
    out = {}
    for k, v in state.items():
        if hasattr(v, "full_tensor"):  # an FSDP2 DTensor shard
            v = v.full_tensor()
        out[k] = v.detach().float().cpu().clone()
    return out


# -- the training loop: the user's loop, unchanged ------------------------------------------------
def run_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    kind: str,
    *,
    rank: int,
    world: int,
    steps: int = STEPS,
    accum: int = 1,
    no_sync: bool = False,
    clip: float | None = None,
) -> dict[str, list]:
    """Train ``steps`` steps; each step is ``accum`` backwards over equal micro-batches of this
    rank's slice (inside ``no_sync()`` for all but the last when ``no_sync``), an optional clip,
    step, zero_grad. Returns {"states": [snapshot after each step], "norms": [clip norms],
    "scales": [fp16 loss scale after each step]}."""
    inner = getattr(model, "module", model)
    dtype = next(p.dtype for p in inner.parameters())  # bf16 when a precision policy cast it
    dev = next(p.device for p in inner.parameters())
    states, norms, scales = [], [], []
    for step in range(steps):
        x, y = local_batch(kind, step, rank, world, dev)
        if x.is_floating_point():
            x, y = x.to(dtype), y.to(dtype)
        for i, (xi, yi) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            ctx = model.no_sync() if no_sync and i < accum - 1 else nullcontext()
            with ctx:
                loss = model(xi, yi) / accum  # mean over the micro-batch, summed to the mean
                loss.backward()
        if clip is not None:
            if hasattr(opt, "clip_grad_norm_"):  # minizero: the global norm over every rank
                norm = opt.clip_grad_norm_(clip)
            else:  # PyTorch's wrappers: their gradients are already full and averaged
                norm = torch.nn.utils.clip_grad_norm_(trainable(model), clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        states.append(snapshot(model))
        if getattr(model, "scaler", None) is not None:  # fp16: the loss scale after the step
            scales.append(model.scaler.scale)
    return {"states": states, "norms": norms, "scales": scales}


def train_rank(specs: list[str], kind: str, opt: str, **kw: Any) -> dict[str, dict]:
    """On one rank: for each spec, a fresh model from seed 0, wrapped and trained. ``kw`` goes to
    :func:`wrap` (precision, bucket_cap_mb) and :func:`run_steps` (steps, accum, no_sync, clip)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrap_kw = {k: kw.pop(k) for k in ("precision", "bucket_cap_mb") if k in kw}
    init_dtype = kw.pop("init_dtype", None)
    out = {}
    for spec in specs:
        model, optimizer = wrap(spec, build(kind, init_dtype), opt, **wrap_kw)
        out[spec] = run_steps(model, optimizer, kind, rank=rank, world=world, **kw)
    return out


@functools.cache
def reference(
    kind: str,
    opt: str,
    steps: int = STEPS,
    clip: float | None = None,
    skip: tuple[int, ...] = (),
    init_dtype: torch.dtype | None = None,
) -> dict:
    """One process, the plain model, the whole global batch, one backward per step. Steps in
    ``skip`` compute gradients but do not update (what fp16 loss scaling does on an overflow)."""
    model = build(kind, init_dtype)
    optimizer = optimizer_fn(opt)(trainable(model))
    states, norms = [], []
    for step in range(steps):
        x, y = local_batch(kind, step)
        model(x, y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable(model), clip)))
        if step not in skip:
            optimizer.step()
        optimizer.zero_grad()
        states.append(snapshot(model))
    return {"states": states, "norms": norms, "scales": []}


def assert_same_run(got: dict, want: dict, atol: float, what: str) -> None:
    """Every parameter after every step within ``atol``; clip norms to 1e-5 relative."""
    assert len(got["states"]) == len(want["states"]), what
    for step, (g, w) in enumerate(zip(got["states"], want["states"], strict=True)):
        assert g.keys() == w.keys(), f"{what}: keys differ: {sorted(g.keys() ^ w.keys())}"
        for k in w:
            msg = lambda m, k=k, s=step: f"{what}, step {s}, {k}: {m}"
            torch.testing.assert_close(g[k], w[k], atol=atol, rtol=0, msg=msg)
    assert len(got["norms"]) == len(want["norms"]), what
    for step, (g, w) in enumerate(zip(got["norms"], want["norms"], strict=True)):
        assert abs(g - w) <= 1e-5 * abs(w) + 1e-7, f"{what}, step {step}: norm {g} != {w}"


def drift(got: dict, want: dict, init: dict[str, torch.Tensor]) -> float:
    """Largest, over steps, of |got - want| / |want - init| over the parameters that moved: how
    far apart two runs are, relative to how far training went (for mixed precision)."""
    out = 0.0
    for g, w in zip(got["states"], want["states"], strict=True):
        moved = [k for k in w if not torch.equal(w[k], init[k])]
        apart = sum(float((g[k] - w[k]).pow(2).sum()) for k in moved) ** 0.5
        went = sum(float((w[k] - init[k]).pow(2).sum()) for k in moved) ** 0.5
        out = max(out, apart / went if moved else 0.0)
    return out


# -- one step under a ledger ------------------------------------------------------------------
def ledger_step(spec: str, kind: str) -> dict[str, Any]:
    """On one rank: two warm-up steps, a ``no_sync()`` backward where the wrapper has one (ledger
    ``quiet``), then one step (backward, step, zero_grad) under a ledger. Returns plain data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = wrap(spec, build(kind), "adam")
    x, y = local_batch(kind, 0, rank, world, rank_device())
    for _ in range(2):  # warm-up: ZeRO-3 records its module order in the first step, and DDP
        model(x, y).backward()  # cuts its buckets again in ready order before the second (at
        opt.step()  # zero_grad(), or at the forward for a plain optimizer), once, as torch DDP
        opt.zero_grad()
    quiet = None
    if spec in ("naive", "ddp", "stage0", "stage1"):
        with CommLedger() as ledger, model.no_sync():
            model(x, y).backward()
        quiet = len(ledger.records)
        opt.zero_grad()
    with CommLedger() as ledger:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    buckets = getattr(model, "buckets", [])
    fields = ("op", "numel", "nbytes", "dtype", "world", "tag", "index")
    return dict(
        quiet=quiet,
        records=[{f: getattr(r, f) for f in fields} for r in ledger.records],
        marks=ledger.marks,
        volume=ledger.volume_elements,
        padded=[b.padded for b in buckets],
        freed=[f.untyped_storage().nbytes() == 0 for f in getattr(model, "flat_params", [])],
    )


def check_ranks(results: list[dict], spec: str, kind: str, opt: str, atol: float, **ref_kw):
    """Every rank's run of ``spec`` against the single process (:func:`reference`)."""
    want = reference(kind, opt, **ref_kw)
    for r, res in enumerate(results):
        assert_same_run(res[spec], want, atol, f"{spec} rank {r} vs one process")


def bn_wrapped(spec: str, stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A BatchNorm model (Linear, BatchNorm1d, ReLU, Linear; seed 0) with SGD and momentum, as
    torch DDP (``spec="torch"``) or minizero at ``stage``: the buffer tests' pair."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    if spec == "torch":
        model = nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return minizero.parallelize(model, stage, torch.optim.SGD(model.parameters(), 0.1, 0.9))


def accumulate_step(model, opt, stage: int, micro: int, x, y, once: bool = False) -> None:
    """One optimizer step of ``micro`` backwards on ``(x, y)``, as lesson 08 runs them: stages 0-1
    accumulate under ``no_sync`` (stages 2-3 reduce every backward); ``once``: HSDP's replicate
    all-reduce at the last micro-batch only (FSDP2's ``set_requires_all_reduce``)."""
    for m in range(micro):
        if once:
            model.set_requires_all_reduce(m == micro - 1)
        if m < micro - 1 and stage < 2:
            with model.no_sync():
                model(x, y).backward()
        else:
            model(x, y).backward()
    opt.step()
    opt.zero_grad()
