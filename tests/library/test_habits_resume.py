"""Habits of saving and resuming that would train a different model, or hang, at stages 1-3
(issue 16, items 1 and 9): nanoGPT's ``if master_process: torch.save(model.state_dict())``, and
rank 0's ``optimizer.state_dict()`` loaded on every rank. Both refused with one clear message;
the ways that work (every rank calls, rank 0 saves; a rank's own state dict) still work."""

import os

import pytest
import torch
from harness import build, local_batch, run

import minizero
from minizero.launcher import LaunchError

pytestmark = pytest.mark.timeout(180)


def _wrapped(stage: int):
    torch.manual_seed(0)
    model, opt = minizero.parallelize(build("mlp"), stage, lambda p: torch.optim.AdamW(p, lr=1e-2))
    return model, opt


def _step(model, opt, step, rank, world):
    x, y = local_batch("mlp", step, rank, world)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def rank0_only_state_dict(stage: int) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ["MINIZERO_ARRIVAL_S"] = "3"
    model, opt = _wrapped(stage)
    _step(model, opt, 0, rank, world)
    if rank == 0:  # nanoGPT: if master_process: torch.save(raw_model.state_dict(), ...)
        model.state_dict()
    _step(model, opt, 1, rank, world)  # the other ranks go on training


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_on_rank_0_only_is_an_error_not_a_hang(stage):
    with pytest.raises(LaunchError) as e:
        run(rank0_only_state_dict, 2, stage, timeout=60)
    msg = str(e.value)
    assert f"model.state_dict() is collective at ZeRO stage {stage}" in msg, msg
    assert "Call it on every rank, save on rank 0 only: `sd = model.state_dict()" in msg, msg


def every_rank_state_dict(stage: int) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, opt = _wrapped(stage)
    _step(model, opt, 0, rank, world)
    sd = model.state_dict()  # every rank; rank 0 would save it
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("stage", [0, 2])
def test_state_dict_on_every_rank_is_the_same_full_state(stage):
    a, b = run(every_rank_state_dict, 2, stage)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def load_rank0_optimizer_state(stage: int) -> dict:
    """Every rank loads rank 0's optimizer.state_dict(), as nanoGPT resumes."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, opt = _wrapped(stage)
    _step(model, opt, 0, rank, world)
    saved = [opt.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(saved, src=0)  # "torch.load" of rank 0's file
    out = {"own": None, "rank0": None}
    try:
        opt.load_state_dict(opt.state_dict())  # a rank's own state dict: fine
        out["own"] = "ok"
        opt.load_state_dict(saved[0])
        out["rank0"] = "ok"
    except RuntimeError as err:
        out["rank0"] = str(err)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loading_rank_0s_optimizer_state_elsewhere_is_refused_at_stages_1_to_3(stage):
    results = run(load_rank0_optimizer_state, 2, stage)
    assert [r["own"] for r in results] == ["ok", "ok"]
    assert results[0]["rank0"] == "ok"  # rank 0 loads its own
    if stage == 0:  # DDP: every rank holds the same whole states, as torch DDP
        assert results[1]["rank0"] == "ok"
    else:
        msg = results[1]["rank0"]
        assert f"saved by rank 0 of 2 at stage {stage}" in msg, msg
        assert "here is rank 1 of 2" in msg and "minizero.save_checkpoint" in msg, msg


def grad_norms_for_logging(stage: int, rank0_only: bool) -> list[float]:
    """``p.grad.norm()`` after backward, as a training loop logs it (every rank, or rank 0)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    os.environ["MINIZERO_ARRIVAL_S"] = "3"
    model, opt = _wrapped(stage)
    x, y = local_batch("mlp", 0, rank, world)
    model(x, y).backward()
    if rank0_only and rank != 0:
        return []
    return [float(p.grad.norm()) for p in model.module.parameters() if p.grad is not None]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_p_grad_norm_logs_the_averaged_gradients_norm_at_every_stage(stage):
    """At stages 1-3 no rank holds p.grad whole; its norm is DDP's (stage 0), on every rank."""
    want = run(grad_norms_for_logging, 2, 0, False)[0]  # DDP: the whole averaged p.grad
    for got in run(grad_norms_for_logging, 2, stage, False):
        assert got == pytest.approx(want, rel=1e-5)


def test_p_grad_norm_on_rank_0_only_is_an_error_not_a_hang():
    with pytest.raises(LaunchError) as e:
        run(grad_norms_for_logging, 2, 2, True, timeout=60)
    assert "a gradient norm (p.grad.norm(), clip_grad_norm_) is collective" in str(e.value)
    assert "Call it on every rank, print or save on rank 0 only" in str(e.value)
