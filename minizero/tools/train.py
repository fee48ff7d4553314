"""``python -m minizero train``: nanoGPT's Shakespeare model learns Tiny Shakespeare at any stage.

The loop a nanoGPT user knows (github.com/karpathy/nanoGPT, ``train.py``), with the defaults of
its README's CPU command line, which shrinks its "baby GPT" (``config/train_shakespeare_char.py``:
6 layers, n_embd 384, block 256) for a CPU: 4 layers, 4 heads, n_embd 128, block 64, batch 12,
2,000 iterations, AdamW (lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on matrices only), 100
warm-up iterations then a cosine decay to 1e-4 at iteration 2,000, gradient clipping at 1.0,
dropout 0. What distributed
training changes, and nothing else:

- the model and optimizer go through ``minizero.parallelize(model, stage, optimizer)``;
- the global batch (12) is split over the ranks: each rank draws the same global batch and keeps
  its rows (``minizero/tools/shakespeare.py``), so every world size trains on the same rows;
- with micro-batches (``gradient_accumulation_steps``), each a global batch, the loss is divided
  by their number and the gradients are reduced on the last one only (``no_sync()`` on the
  others, as nanoGPT's ``require_backward_grad_sync``);
- the evaluation is each rank's share of the eval batches, averaged over the ranks
  (:func:`estimate_loss`); at stage 3 every rank must run it, since each forward gathers the
  parameters from every rank;
- checkpoints are ``minizero.save_checkpoint`` (each rank writes what it owns), resumable at any
  stage and world size; samples come from the full weights (``full_state_dict``, collective).

The command itself (options, progress bar, report, plot) is in ``minizero/tools/train_cli.py``.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from minizero.models import GPTConfig, TinyGPT
from minizero.tools import shakespeare


@dataclass(kw_only=True)
class TrainConfig:
    """One training run; the defaults are nanoGPT's README's CPU command line."""

    stage: int = 0  # 0: DDP, 1-3: ZeRO P_os, P_os+g, P_os+g+p
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64  # characters of context
    dropout: float = 0.0
    batch_size: int = 12  # the GLOBAL batch, split evenly over the ranks
    gradient_accumulation_steps: int = 1  # micro-batches per step, each a global batch (nanoGPT's)
    max_iters: int = 2000  # optimizer steps; the last evaluation is after the last step
    lr_decay_iters: int | None = None  # where the cosine reaches min_lr (None: max_iters)
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0: no clipping
    eval_interval: int = 250
    eval_iters: int = 20  # global batches per split per evaluation
    precision: str = "fp32"  # "fp32", "bf16" or "fp16" (minizero.parallelize's precision=)
    mesh: tuple[int, int] | None = None  # (replicate, shard): HSDP (minizero/hsdp.py)
    # stage 3: a block with fewer parameters is no unit of its own (minizero/units.py): below
    # about 1M (4 MB in fp32) a gloo all-gather's time is its per-call latency, not its bytes, so
    # this model (0.8M) is one unit; nanoGPT's 6-layer baby GPT (1.8M a block) keeps its blocks
    min_unit_params: int = 1_000_000
    # stage 3: False keeps the root unit (this model: all of it) gathered from the end of forward
    # to the end of backward, as FSDP2 does for its root: one all-gather fewer, 2Ψ a step, not 3Ψ
    reshard_root: bool = True
    seed: int = 1337
    out_dir: str | None = None  # checkpoint ``out_dir/ckpt`` at each evaluation (not with mesh)
    resume: str | None = None  # a checkpoint to continue from (any stage, any world size)
    sample_tokens: int = 500  # characters generated at the end (0: none)
    val_full: bool = True  # after the last step, the loss over the whole validation split

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3 (ZeRO), got {self.stage!r}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_iters",
                     "gradient_accumulation_steps", "eval_interval", "eval_iters"):  # fmt: skip
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be >= 0, got {self.sample_tokens!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if not isinstance(self.min_unit_params, int) or self.min_unit_params < 0:
            raise ValueError(f"min_unit_params must be an int >= 0, got {self.min_unit_params!r}")
        if not self.reshard_root and self.stage != 3:
            raise ValueError(f"reshard_root=False is a stage 3 option (stage {self.stage} gathers "
                             "no parameters): pass --stage 3, or leave it out")  # fmt: skip
        if self.mesh is not None and self.resume is not None:
            raise ValueError("resume takes no mesh: minizero.load_checkpoint refuses HSDP")

    def stage_options(self) -> dict:
        """``parallelize``'s options beyond the stage and precision (stage 3: the unit floor and
        whether the root unit is resharded after forward)."""
        if self.stage != 3:
            return {}
        return {"min_unit_params": self.min_unit_params, "reshard_root": self.reshard_root}

    def gpt(self, vocab_size: int) -> GPTConfig:
        """nanoGPT's model for this run: no biases (its ``bias=False``), weights tied."""
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, bias=False,
                         dropout=self.dropout)  # fmt: skip


def get_lr(it: int, cfg: TrainConfig) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay to ``min_lr`` at ``lr_decay_iters``."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """nanoGPT's AdamW groups: weight decay on every matrix and embedding, none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, batches, group=None) -> float:
    """The mean loss over every rank's ``batches`` (this rank's rows of each eval batch): each
    rank's mean, summed over ``group`` by an all-reduce and divided by its size (the shares are
    equal, so the mean of means is the mean). Collective: every rank of ``group`` calls it."""
    from minizero.collectives import all_reduce

    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        total += model(x, y).double().cpu()  # 0-d
    local = total / len(batches)  # this rank's mean over its batches
    if dist.is_initialized():
        dev = next(iter(getattr(model, "module", model).parameters())).device
        local = local.to(dev)
        all_reduce(local, group=group, tag="eval loss")  # sum over the ranks, in place
        local = local / dist.get_world_size(group)
    model.train(was_training)
    return float(local)


@torch.no_grad()
def generate(model: TinyGPT, idx: torch.Tensor, new_tokens: int, *, temperature: float = 0.8,
             top_k: int | None = 200, seed: int = 1337) -> torch.Tensor:  # fmt: skip
    """nanoGPT's sampler (``model.py``, ``GPT.generate``; temperature and top_k as its
    ``sample.py``): append ``new_tokens`` ids to ``idx`` (B, T), each drawn from the model's
    distribution at the last position, the context cropped to ``block_size``."""
    g = torch.Generator().manual_seed(seed)
    model.eval()
    for _ in range(new_tokens):
        logits = model(idx[:, -model.config.block_size :])[:, -1, :].float().cpu()  # (B, V)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
            logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)  # (B, 1)
        idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
    return idx


def eval_batches(data, cfg: TrainConfig, split: str, rank: int, world: int, device) -> list:
    """This rank's rows of the ``eval_iters`` fixed eval batches of ``split`` (streams -1, -2, ...:
    never a training batch; the same batches at every evaluation, so the curve is not noise)."""
    return [shakespeare.get_batch(data, split, cfg.batch_size, cfg.block_size, -1 - k, rank=rank,
                                  world=world, seed=cfg.seed, device=device)
            for k in range(cfg.eval_iters)]  # fmt: skip


def train_batch(data, cfg: TrainConfig, step: int, rank: int, world: int, device) -> tuple:
    """This rank's rows ``(x, y)`` of global training batch number ``step``; with micro-batches,
    micro-batch ``m`` of iteration ``it`` is batch ``it * cfg.gradient_accumulation_steps + m``."""
    return shakespeare.get_batch(data, "train", cfg.batch_size, cfg.block_size, step, rank=rank,
                                 world=world, seed=cfg.seed, device=device)  # fmt: skip


def train_loop(model, opt, cfg: TrainConfig, *, rank: int = 0, world: int = 1, group=None,
               device=None, start: int = 0, history: dict | None = None, progress=None,
               on_eval=None) -> dict:  # fmt: skip
    """nanoGPT's loop on this rank: evaluate every ``eval_interval`` iterations and after the last
    step, else one step on this rank's rows of global batch ``it``. ``history`` (from a
    checkpoint: its evaluations, and its curve as "prior") is continued. Returns the history:
    the loss of this rank's rows at each iteration of this run, the evaluations, the loss over the
    whole validation split after the last step ("val_full", ``tools/full_split.py``; not with
    ``cfg.val_full`` False), this rank's step times, the model-state bytes at the end of a
    backward."""
    from minizero.analysis.memory import model_state_bytes
    from minizero.tools.full_split import eval_full

    device = device or torch.device("cpu")
    data = shakespeare.load()
    h = {"evals": [], **(history or {}), "loss": [], "step_s": []}  # losses, times: this run's
    evals = {s: eval_batches(data, cfg, s, rank, world, device) for s in shakespeare.SPLITS}
    for it in range(start, cfg.max_iters + 1):
        due = it % cfg.eval_interval == 0 or it == cfg.max_iters
        if due and not (h["evals"] and h["evals"][-1][0] == it):  # a resumed run has this one
            losses = {s: estimate_loss(model, evals[s], group) for s in shakespeare.SPLITS}
            h["evals"].append([it, losses["train"], losses["val"]])
            if on_eval is not None:
                on_eval(it, h)
        if it == cfg.max_iters:  # and the whole validation split, beside the estimate
            if cfg.val_full:
                h["val_full"] = eval_full(model, data.val, cfg.block_size, rank=rank, world=world,
                                          group=group, device=device)  # fmt: skip
            break
        lr = get_lr(it, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        micro = cfg.gradient_accumulation_steps
        total = torch.zeros((), device=device)
        for m in range(micro):  # the gradients are reduced on the last micro-batch only
            x, y = train_batch(data, cfg, it * micro + m, rank, world, device)
            last = m == micro - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(x, y) / micro  # the step's gradient: the mean over its micro-batches
                loss.backward()
            total += loss.detach()
        if it == start + 1:  # Adam's states exist now; gradients are alive: the step's peak set
            h["states"] = model_state_bytes(model, opt)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lossf = total.item()  # waits for the device: the step is over
        h["step_s"].append(time.perf_counter() - t0)
        h["loss"].append(lossf)
        if progress is not None:
            progress.tick(loss=lossf)
    return h


def single_process(cfg: TrainConfig, progress=None, threads: int = 1) -> dict:
    """One process, plain PyTorch (no minizero, no process group): the reference every stage's
    curve is compared with. The same data, model, optimizer and schedule, on ``threads`` CPU
    threads (1, as each forked rank: on a busy machine more threads than free cores can make
    every step many times slower)."""
    data = shakespeare.load()
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.gpt(data.vocab_size))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return train_loop(model, make_optimizer(model, cfg), cfg, progress=progress)
    finally:
        torch.set_num_threads(before)


def train_rank(cfg: TrainConfig, progress=None) -> dict:
    """Inside a rank of ``minizero.launch``: build, parallelize, resume if asked, train, save,
    sample. Returns this rank's history and measurements (rank 0 adds the sample)."""
    from minizero import load_checkpoint, save_checkpoint
    from minizero.launcher import rank_device
    from minizero.parallelize import full_state_dict, parallelize
    from minizero.tools.report import measured_on

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    if cfg.batch_size % world:
        raise ValueError(f"the global batch {cfg.batch_size} does not split over {world} ranks")
    data = shakespeare.load()
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = TinyGPT(cfg.gpt(data.vocab_size)).to(dev)
    opt = make_optimizer(model, cfg)
    mesh = None
    if cfg.mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, cfg.mesh, mesh_dim_names=("replicate", "shard"))
    model, opt = parallelize(model, cfg.stage, opt, precision=cfg.precision, mesh=mesh,
                             **cfg.stage_options())  # fmt: skip
    start, history = 0, None
    if cfg.resume:
        extra = load_checkpoint(cfg.resume, model, opt)
        start = extra["iter"]
        history = {"evals": extra["history"]["evals"], "prior": extra["history"]["loss"]}
        if start >= cfg.max_iters:
            raise ValueError(f"{cfg.resume} is at iteration {start}: pass --max-iters > {start}")
    ckpt = Path(cfg.out_dir) / "ckpt" if cfg.out_dir and mesh is None else None

    def save(it: int, h: dict) -> None:
        if ckpt is None or it <= start:
            return
        mine = torch.tensor(h["loss"], dtype=torch.float64, device=dev)  # this rank's rows
        dist.all_reduce(mine)  # the curve: each global batch's loss, the mean of equal shares
        curve = h.get("prior", []) + (mine / world).tolist()
        keep = {"loss": curve, "evals": h["evals"]}
        save_checkpoint(ckpt, model, opt, extra={"iter": it, "history": keep,
                                                 "config": asdict(cfg)})  # fmt: skip

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    # every rank is a data-parallel replica (with a mesh too): the rows split over the world
    h = train_loop(model, opt, cfg, rank=rank, world=world, device=dev, start=start,
                   history=history, progress=progress, on_eval=save)  # fmt: skip
    h["seconds"] = time.perf_counter() - t0
    h["start"], h["where"], h["stage"] = start, measured_on(), cfg.stage
    h["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if dev.type == "cuda":
        h["cuda_peak"] = torch.cuda.max_memory_allocated(dev)
    full = full_state_dict(model)  # collective at stage 3: every rank calls it
    if rank == 0 and cfg.sample_tokens:
        plain = TinyGPT(cfg.gpt(data.vocab_size))
        plain.load_state_dict({k: v.cpu() for k, v in full.items()})
        idx = torch.tensor([data.encode("\n")])  # nanoGPT's sample.py starts from a newline
        h["sample"] = data.decode(generate(plain, idx, cfg.sample_tokens, seed=cfg.seed)[0, 1:])
    h["checkpoint"] = str(ckpt) if ckpt is not None else None
    return h
