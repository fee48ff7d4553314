"""ZeRO-3 units (minizero/units.py, zero3.py) on models no one here wrote: which modules are
units by default (torch's ``nn.TransformerEncoderLayer``, Hugging Face's GPT-2 blocks, torchvision's
``BasicBlock``), by class or predicate; training equal to one process and to FSDP2 (``fully_shard``
on the same units) on gloo, with a tied head, a parent that reads ``emb.weight``, and
``nn.MultiheadAttention`` as the whole model; graphs that change between steps; ranks that run
different modules; a module that reads a parameter of a unit it does not call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import zoo
from torch import nn
from zero3_lm import (
    Attention,
    D,
    EncoderLM,
    V,
    assert_same,
    build,
    full_params,
    loss_of,
    run,
    train,
    wrap,
)

import minizero
from minizero.launcher import LaunchError, LaunchTimeout
from minizero.models import MLP, GPTConfig, TinyGPT
from minizero.units import ShardedParameterError, assign_params, select_units

pytestmark = pytest.mark.timeout(180)


# -- which modules are units -----------------------------------------------------------------------
def names(model: nn.Module, units=None, min_params: int = 0) -> list[str]:
    where = {m: n or "(root)" for n, m in model.named_modules()}
    return [where[m] for m in select_units(model, units, min_params)]


def test_default_units_are_the_repeated_blocks():
    assert names(EncoderLM()) == ["(root)", "layers.0", "layers.1", "layers.2"]
    assert names(TinyGPT(GPTConfig.tiny())) == ["(root)", "blocks.0", "blocks.1"]
    assert names(MLP(tied=True)) == ["(root)", "layers.0", "layers.1", "layers.2"]
    assert names(Attention()) == ["(root)"]  # out_proj is read directly: never a unit alone
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 2, 32), 2, enable_nested_tensor=False)
    assert names(enc) == ["(root)", "layers.0", "layers.1"]
    seq = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D),
                        nn.LayerNorm(D))  # fmt: skip
    assert names(seq) == ["(root)", "1", "3"]  # the repeated class only; ReLU has no parameters


def test_default_units_of_hugging_face_gpt2_and_torchvision_resnet18():
    """Built as tests/zoo.py builds them (which also mends torchvision's import on a CPU torch)."""
    assert names(zoo.ZOO["gpt2"].build()) == ["(root)", "transformer.h.0", "transformer.h.1"]
    got = names(zoo.ZOO["resnet18"].build())
    assert got == ["(root)"] + [f"layer{i}.{j}" for i in range(1, 5) for j in (0, 1)]


def test_units_by_class_or_predicate_and_ownership():
    model = EncoderLM()
    assert names(model, nn.LayerNorm)[:3] == ["(root)", "layers.0.norm1", "layers.0.norm2"]
    assert names(model, lambda m: m is model.norm) == ["(root)", "norm"]
    with pytest.raises(TypeError, match="units must be a module class, a tuple of module"):
        select_units(model, "layers")
    units = select_units(model, (nn.TransformerEncoderLayer, nn.MultiheadAttention))
    groups, owners, needs = assign_params(model, units)
    where = {m: n or "(root)" for n, m in model.named_modules()}
    assert [where[o] for o in owners][:3] == ["(root)", "layers.0", "layers.0.self_attn"]
    root = {id(p) for p in groups[0]}
    assert id(model.emb.weight) in root and id(model.pos) in root  # the tied head's weight once
    assert len(groups[0]) == len({id(p) for p in groups[0]}) == 4  # emb, pos, norm weight, bias
    assert sum(len(g) for g in groups) == len(list(model.parameters()))
    assert needs[model] == [0]


def test_units_under_min_params_join_the_unit_around_them():
    """``min_unit_params``: a block with fewer own parameters is no unit; innermost first, so a
    dropped inner unit's parameters count for the one around it."""
    gpt = TinyGPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    block = sum(p.numel() for p in gpt.blocks[0].parameters())  # 196,864
    assert names(gpt, None, block) == ["(root)"] + [f"blocks.{i}" for i in range(4)]
    assert names(gpt, None, block + 1) == ["(root)"]  # the capstone at train's default: one unit
    model = EncoderLM()
    inner = (nn.TransformerEncoderLayer, nn.MultiheadAttention)
    attn = sum(p.numel() for p in model.layers[0].self_attn.parameters())
    layer = sum(p.numel() for p in model.layers[0].parameters())
    assert names(model, inner, attn)[:3] == ["(root)", "layers.0", "layers.0.self_attn"]
    # attention under the floor joins its layer, and the layer (now all of it) stays a unit
    assert names(model, inner, attn + 1) == ["(root)", "layers.0", "layers.1", "layers.2"]
    assert names(model, inner, layer + 1) == ["(root)"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_params must be an int >= 0"):
            select_units(model, None, bad)


# -- equivalence: one process and FSDP2 ------------------------------------------------------------
def _vs_fsdp2(kind: str) -> dict:
    return {spec: train(spec, kind) for spec in ("stage3", "fsdp2")}


@pytest.mark.parametrize("kind", ["pre_norm", "post_norm", "matmul", "attention"])
@pytest.mark.parametrize("world", [2, 3])
def test_matches_one_process_and_fsdp2(world, kind):
    """TransformerEncoderLayer LM with a tied head (norm_first and not); the same with
    h @ emb.weight.T in the parent; nn.MultiheadAttention as the whole model."""
    want = train("one", kind)
    assert any(not torch.equal(want[-1][k], v) for k, v in full_params(build(kind)).items())
    for r, res in enumerate(run(_vs_fsdp2, world, kind)):
        assert_same(res["fsdp2"], want, f"rank {r}: FSDP2 vs one process")
        assert_same(res["stage3"], want, f"rank {r}: stage 3 vs one process")
        assert_same(res["stage3"], res["fsdp2"], f"rank {r}: stage 3 vs FSDP2")


# -- changing graphs -------------------------------------------------------------------------------
ORDERS = {
    "late": [[0, 1], [0, 1, 2], [0, 2, 1]],  # layer 2 first used in step 1
    "reordered": [[0, 1, 2], [2, 1, 0], [1, 2, 0, 1]],  # other orders, a layer twice
}


@pytest.mark.parametrize("case", ["late", "reordered"])
@pytest.mark.parametrize("world", [2, 3])
def test_changing_graphs(world, case):
    """A module first used after the first step; modules run in another order (one twice)."""
    want = train("one", "pre_norm", ORDERS[case])
    for r, got in enumerate(run(train, world, "stage3", "pre_norm", ORDERS[case])):
        assert_same(got, want, f"rank {r}, {case}")


def _diverge(case: str) -> None:
    model, opt = wrap("stage3", build("pre_norm"))
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_of(model, "pre_norm", 0, rank, world).backward()
    opt.step()
    if case == "other layer":  # the same size: without the check, silently wrong parameters
        model.module.order = [0, 1] if rank == 0 else [0, 2]
    elif case == "extra layer":
        model.module.order = [0, 1] if rank == 0 else [0, 1, 2]
    elif case == "rank 0 evaluates" and rank == 0:  # nanoGPT: if master_process: estimate_loss()
        with torch.no_grad():
            loss_of(model, "pre_norm", 5, rank, world)
    loss_of(model, "pre_norm", 1, rank, world).backward()


@pytest.mark.parametrize("case", ["other layer", "extra layer", "rank 0 evaluates"])
def test_ranks_that_run_different_modules_get_an_error(case):
    with pytest.raises(LaunchError) as err:
        run(_diverge, 2, case, timeout=60)
    assert not isinstance(err.value, LaunchTimeout)
    msg = str(err.value)
    assert "minizero ZeRO-3: the ranks ran different modules at the same point" in msg
    if case == "other layer":
        assert "rank 0: forward of 'layers.1'; rank 1: forward of 'layers.2'" in msg
    elif case == "extra layer":
        assert "rank 1: forward of 'layers.2'" in msg and "rank 0: backward" in msg
    else:  # rank 0's second forward met rank 1's backward: the pattern and its fix are named
        assert "rank 0: forward of" in msg and "rank 1: backward" in msg, msg
    assert "`if master_process: losses = estimate_loss()`" in msg, msg
    assert "every rank evaluates and rank 0 prints" in msg, msg


def _read_outside_unit() -> str:
    model, _ = wrap("stage3", build("pre_norm"), units=(nn.Linear,))  # out_proj alone
    try:
        loss_of(model, "pre_norm", 0, dist.get_rank(), dist.get_world_size())
    except ShardedParameterError as e:
        return str(e)
    return ""


def test_reading_another_units_parameter_in_forward_names_it():
    """units=(nn.Linear,) makes MultiheadAttention's out_proj a unit that MHA never calls."""
    msg = run(_read_outside_unit, 2)[0]
    assert "layers.0.self_attn.out_proj.weight, which is sharded" in msg, msg
    assert "its unit (layers.0.self_attn.out_proj)" in msg and "pass units=..." in msg, msg


def test_stage_3_refuses_bucket_cap_mb_its_buckets_are_the_units():
    """FSDP2 has no bucket size either: passing one is a mistake to name, not to ignore."""
    from minizero.zero3 import ZeRO3

    with pytest.raises(TypeError, match="ZeRO3 has no bucket_cap_mb: its buckets are the units"):
        ZeRO3(nn.Linear(2, 2), bucket_cap_mb=1)
    opt = lambda params: torch.optim.SGD(params, lr=0.1)
    with pytest.raises(TypeError, match="stage 3 takes no bucket_cap_mb"):
        minizero.parallelize(nn.Linear(2, 2), 3, opt, bucket_cap_mb=1)
