"""The zoo (tests/zoo.py): every model builds, trains and is deterministic, in one process; torch
DDP and FSDP2 at world 2 on gloo match the single-process reference within 1e-5, so the zoo's
reference is the right yardstick for minizero's stages."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import zoo
from harness import GLOBAL_BATCH

from minizero.launcher import launch

pytestmark = pytest.mark.timeout(600)
NAMES = list(zoo.ZOO)
SLOW = {"resnet18"}  # 11.7 M parameters: seconds per step on 2 busy cores
CLIP = 0.05  # below every zoo model's gradient norm at the first steps: clipping really scales
ATOL = 1e-5


def slow_marked(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


# -- one process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", slow_marked(NAMES))
def test_builds_deterministically_and_trains(name):
    entry = zoo.ZOO[name]
    model, again, other = entry.build(0), entry.build(0), entry.build(1)
    state, state_again = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert any(not torch.equal(v, other.state_dict()[k]) for k, v in state.items() if v.dim())
    loss = entry.loss(model, entry.batch(0, 0, 1, 0))
    assert loss.shape == () and math.isfinite(float(loss)) and float(loss) > 0
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: no gradient for {missing}"
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    assert float(norm) > CLIP  # so the clipped runs below really clip


@pytest.mark.parametrize("name", slow_marked(NAMES))
def test_rank_batches_are_slices_of_the_global_batch(name):
    entry = zoo.ZOO[name]
    whole = entry.batch(2, 0, 1, 0)
    assert whole[0].shape[0] == GLOBAL_BATCH
    assert not torch.equal(whole[0], entry.batch(3, 0, 1, 0)[0])  # a new batch each step
    for world in (2, 3):
        parts = [entry.batch(2, r, world, 0) for r in range(world)]
        for i, t in enumerate(whole):
            assert torch.equal(torch.cat([p[i] for p in parts]), t)


def test_torchvision_imports_on_this_torch():
    tv = zoo.import_torchvision()
    assert hasattr(torch.ops.torchvision, "nms")  # its own kernel, or the schema zoo defined
    model = tv.models.resnet18(num_classes=zoo.CLASSES)
    assert (
        type(model.layer1[0]).__name__ == "BasicBlock"
        and len(zoo.ZOO["resnet18"].blocks(model)) == 8
    )


def test_nanogpt_groups_split_by_dimension_and_keep_the_tie_once():
    model = zoo.ZOO["encoder_lm"].build()
    groups = zoo.nanogpt_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = sorted(names[id(p)] for p in groups[0]["params"])
    layer = ["self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight",
             "linear2.weight"]  # fmt: skip
    want = [f"encoder.layers.{i}.{n}" for i in range(2) for n in layer] + ["pos_emb.weight",
            "tok_emb.weight"]  # fmt: skip
    assert decay == sorted(want)  # lm_head.weight is tok_emb.weight: once, under its first name
    assert all(p.dim() == 1 for p in groups[1]["params"]) and len(groups[1]["params"]) == 18
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and "lr" not in groups[1]
    opt = zoo.OPTIMIZERS["adamw_groups_lr"](model)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 3e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("name", ["gpt2", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_nanogpt_groups_cover_every_trainable_parameter_once(name):
    model = zoo.ZOO[name].build()
    groups = zoo.nanogpt_groups(model, 0.1)
    got = [id(p) for g in groups for p in g["params"]]
    assert sorted(got) == sorted(id(p) for p in model.parameters())  # parameters() dedups too
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[1]["params"]


def test_reference_with_batchnorm_is_per_rank_statistics():
    """resnet18: one forward over the global batch is not what data parallelism computes (each
    rank normalises with its own batch's statistics): the per-shard reference differs from it,
    and its ranks agree on parameters but not on running statistics."""
    whole = zoo.train_reference("resnet18", "sgd", steps=1)[0]["states"][0]
    r0, r1 = (run["states"][0] for run in zoo.train_reference("resnet18", "sgd", steps=1, world=2))
    params = [k for k in r0 if "running" not in k and "num_batches" not in k]
    assert all(torch.equal(r0[k], r1[k]) for k in params)
    assert not torch.equal(r0["bn1.running_mean"], r1["bn1.running_mean"])
    assert max(float((whole[k] - r0[k]).abs().max()) for k in params) > 1e-3


# -- torch DDP and FSDP2 at world 2 against the reference ----------------------------------------
CASES = [("sgd", None), ("adamw_groups", None), ("adamw_groups_lr", CLIP)]  # (optimizer, clip)


def _compare_rank(name: str, refs: dict) -> dict:
    """On each rank: train every (wrapper, optimizer, clip) and compare with the reference for
    this rank (inherited by the forked rank, not pickled). Returns plain numbers."""
    rank, out = dist.get_rank(), {}
    for (wrapper, opt, clip), want in refs.items():
        got = zoo.train_rank(name, wrapper, opt, clip=clip)
        out[wrapper, opt, clip] = zoo.difference(got, want[rank])
    return out


@pytest.mark.parametrize("name", slow_marked(NAMES))
def test_torch_ddp_and_fsdp2_match_the_reference(name):
    """Every model, every case; resnet18 (11.7 M parameters) with SGD only: its BatchNorm buffers
    are what it adds, and the optimizer and clipping cases are the other models' here."""
    compare_with_torch(name, CASES[:1] if name in SLOW else CASES)


@pytest.mark.soak
@pytest.mark.parametrize("name", sorted(SLOW))
def test_torch_ddp_and_fsdp2_match_the_reference_with_adamw_and_clipping(name):
    """resnet18's other cases: AdamW with nanoGPT's param groups, and clipping (about 12 CPU-s)."""
    compare_with_torch(name, CASES[1:])


def compare_with_torch(name: str, cases: list) -> None:
    refs = {}
    for opt, clip in cases:
        for wrapper in ("torch_ddp", "fsdp2"):
            # FSDP2 never broadcasts buffers: its BatchNorm statistics stay per rank.
            broadcast = wrapper == "torch_ddp"
            refs[wrapper, opt, clip] = zoo.train_reference(
                name, opt, clip=clip, world=2, broadcast_buffers=broadcast
            )
    for rank, result in enumerate(launch(_compare_rank, 2, name, refs, verbose=False)):
        for case, (diff, where) in result.items():
            assert diff <= ATOL, f"{name}, rank {rank}, {case}: off by {diff:.3g} at {where}"
