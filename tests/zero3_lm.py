"""What the ZeRO-3 tests share (test_zero3_units.py, test_zero3_sharded.py): a causal LM on
torch's ``nn.TransformerEncoderLayer`` with a tied head (or ``h @ emb.weight.T`` in the parent),
``nn.MultiheadAttention`` as the whole model, and the loop that trains each of them as stage 3, as
FSDP2 (``fully_shard`` on the same units, then the root) or as one process, returning the full
parameters after every step."""

from __future__ import annotations

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minizero
from minizero.habits import Habits
from minizero.models import synthetic_batch
from minizero.optimizer import attach
from minizero.units import select_units
from minizero.zero3 import ZeRO3

V, T, D, ROWS = 29, 8, 16, 12  # vocabulary, sequence, width, global batch (divides by 1, 2, 3)
STEPS = 3
ATOL = 1e-5


class EncoderLM(nn.Module):
    """torch's TransformerEncoderLayer, causal, with a tied head: a ``head`` Linear sharing the
    embedding's weight, or (``head="matmul"``) ``h @ emb.weight.T`` in this module's forward.
    ``order``: which layers run, in which order (the tests change it between steps)."""

    def __init__(self, norm_first: bool = True, head: str = "linear", layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(0.02 * torch.randn(T, D))  # (T, D), owned by the root
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D, 2, 2 * D, dropout=0.0, batch_first=True, norm_first=norm_first
            )  # fmt: skip
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(D)
        self.head = None
        if head == "linear":
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight  # tied
        self.order = list(range(layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos  # (B, T, D)
        mask = nn.Transformer.generate_square_subsequent_mask(T)  # (T, T)
        for i in self.order:
            h = self.layers[i](h, src_mask=mask, is_causal=True)
        h = self.norm(h)
        logits = self.head(h) if self.head is not None else h @ self.emb.weight.T  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


class Attention(nn.MultiheadAttention):
    """nn.MultiheadAttention as the whole model (it reads out_proj.weight without calling
    out_proj); the loss is taken outside by the loop."""

    def __init__(self):
        super().__init__(D, 2, batch_first=True)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "post_norm":
        return EncoderLM(norm_first=False)
    if kind == "matmul":
        return EncoderLM(head="matmul")
    if kind == "attention":
        return Attention()
    return EncoderLM()


def batch(step: int, rank: int = 0, world: int = 1):
    idx, targets = synthetic_batch("gpt", ROWS, step, rank=rank, world=world, vocab_size=V,
                                   seq_len=T)  # fmt: skip
    return idx, targets


def loss_of(model: nn.Module, kind: str, step: int, rank: int, world: int) -> torch.Tensor:
    idx, targets = batch(step, rank, world)
    if kind == "attention":
        x = F.one_hot(idx, V)[..., :D].float()  # (B, T, D)
        out, _ = model(x, x, x, need_weights=False)
        return F.mse_loss(out, x.roll(1, dims=-1))
    return model(idx, targets)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, ZeRO3):
        return minizero.full_state_dict(model)
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
    return out


def sgd(params) -> torch.optim.Optimizer:
    """SGD with momentum, linear in the gradient. (Adam would turn rounding noise into full
    steps: attention's key bias has a gradient of exactly 0 in exact arithmetic.) A parameter
    first used late moves as in one process even where a stage steps it with zeros before."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def wrap(spec: str, model: nn.Module, **kw):
    """ "stage3": minizero (default units; ``kw`` goes to ZeRO3); "fsdp2": fully_shard on the same
    units, then the root; "one": the plain model."""
    # a module first used in a later step is unused before it: torch DDP's flag, and minizero's
    find = kw.pop("find_unused_parameters", False)
    if spec == "stage3" and not kw:
        return minizero.parallelize(model, 3, sgd, find_unused_parameters=find)
    if spec == "stage3":
        wrapped = ZeRO3(model, find_unused_parameters=find, extension=Habits, **kw)  # parallelize's
        return wrapped, attach(sgd(wrapped.optimizer_params()), wrapped)
    if spec == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in select_units(model)[1:]:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, sgd(model.parameters())


def train(spec: str, kind: str, orders=None, edit=None) -> list[dict]:
    """Train ``steps`` steps; ``orders[s]``: the layers step s runs; ``edit(model)`` before step 1
    (``summon_full_params`` for stage 3). Returns the full parameters after every step."""
    one = spec == "one"
    rank, world = (0, 1) if one else (dist.get_rank(), dist.get_world_size())
    kw = {"find_unused_parameters": True} if orders is not None and spec == "stage3" else {}
    model, optimizer = wrap(spec, build(kind), **kw)
    inner = getattr(model, "module", model)
    states = []
    for step in range(STEPS):
        if orders is not None:
            inner.order = orders[step]
        if edit is not None and step == 1:
            edit(model)
        loss_of(model, kind, step, rank, world).backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(full_params(model))
    return states


def assert_same(got: list[dict], want: list[dict], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), what
        for k in w:
            msg = lambda m, k=k, s=step: f"{what}, step {s}, {k}: {m}"
            torch.testing.assert_close(g[k], w[k], atol=ATOL, rtol=0, msg=msg)


run = harness.run  # (imported from here by the stage-3 tests: one launch helper)
