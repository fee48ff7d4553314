"""nanoGPT's resume (issue 32): an optimizer loaded before ``parallelize`` is taken as it is, and
the whole state it needs is written by ``consolidate_state_dict(to=0)`` on every rank; rank 0's
shard alone warns when written and is refused, by name, when a resume adopts it."""

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, run

import minizero

pytestmark = pytest.mark.timeout(180)
SAVE_AT, STEPS = 2, 4


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _groups(model):
    """nanoGPT's configure_optimizers: weight decay on the 2-D weights only."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return _adamw([{"params": [p for p in ps if p.dim() >= 2]},
                   {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}])  # fmt: skip


def _steps(model, opt, steps, rank, world):
    for s in steps:
        x, y = local_batch("gpt", s, rank, world)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in minizero.full_state_dict(model).items()}


def resume_rank(stage: int, handed: bool) -> dict:
    """Train STEPS; and, saved at SAVE_AT the way nanoGPT would with the documented line, a fresh
    model and plain optimizer loaded from the file, then wrapped (or the optimizer handed to
    parallelize), trained to STEPS. Also: rank 0's shard written without the line."""
    rank, world = dist.get_rank(), dist.get_world_size()
    raw = build("gpt")
    opt = _groups(raw)  # nanoGPT: the optimizer is built before the model is wrapped
    model = minizero.parallelize(raw, stage)
    _steps(model, opt, range(SAVE_AT), rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard = opt.state_dict()  # rank 0's alone, as nanoGPT writes it
    opt.consolidate_state_dict(to=0)  # the documented lines, every rank
    sd = raw.state_dict()  # (collective at stage 3 only)
    buf = io.BytesIO()
    if rank == 0:
        torch.save({"model": sd, "optimizer": opt.state_dict()}, buf)
    _steps(model, opt, range(SAVE_AT, STEPS), rank, world)
    straight = _weights(model)
    sent = [buf.getvalue() if rank == 0 else None, shard if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)  # every rank reads rank 0's file
    ckpt = torch.load(io.BytesIO(sent[0]), weights_only=True)
    torch.manual_seed(1)
    fresh = build("gpt")
    fresh.load_state_dict(ckpt["model"])
    opt2 = _groups(fresh)
    if handed == "loaded after":  # wrapped first, then the whole state dict loaded into it
        model2, opt2 = minizero.parallelize(fresh, stage, opt2)
        opt2.load_state_dict(ckpt["optimizer"])
    else:  # a plain optimizer, whole state: nanoGPT's resume
        opt2.load_state_dict(ckpt["optimizer"])
    if handed is True:
        model2, opt2 = minizero.parallelize(fresh, stage, opt2)
    elif handed is False:
        model2 = minizero.parallelize(fresh, stage)  # adopted at its first step
    _steps(model2, opt2, range(SAVE_AT, STEPS), rank, world)
    out = {"straight": straight, "resumed": _weights(model2),
           "warned": [str(w.message) for w in caught]}  # fmt: skip
    # rank 0's shard, loaded into a plain optimizer before wrapping: refused when adopted
    if stage > 0:
        bad = build("gpt")
        opt3 = _groups(bad)
        try:
            opt3.load_state_dict(sent[1])
            model3 = minizero.parallelize(bad, stage)
            _steps(model3, opt3, range(1), rank, world)
            out["shard_resume"] = "ok"
        except ValueError as e:
            out["shard_resume"] = str(e)
    return out


@pytest.mark.parametrize(
    ("stage", "handed"), [(0, False), (1, False), (2, True), (3, False), (2, "loaded after")]
)
def test_an_optimizer_loaded_before_parallelize_resumes_the_same_run(stage, handed):
    for r, got in enumerate(run(resume_rank, 2, stage, handed)):
        for k, v in got["straight"].items():
            torch.testing.assert_close(got["resumed"][k], v, rtol=0, atol=1e-6, msg=k)
        if stage == 0:
            assert got["warned"] == [], got["warned"]
            continue
        (warned,) = got["warned"]
        assert f"at ZeRO stage {stage} holds rank {r}'s shard only" in warned, warned
        assert "optimizer.consolidate_state_dict(to=0) on every rank" in warned, warned
        msg = got["shard_resume"]
        assert "loaded from one rank's shard" in msg and "saved by rank 0 of 2" in msg, msg
        assert "optimizer.consolidate_state_dict(to=0)" in msg, msg


def mismatched_rank() -> str:
    """A plain optimizer loaded from another model's state (same groups, other shapes)."""
    other = torch.nn.Linear(4, 3)
    o = _adamw(other.parameters())
    other(torch.randn(2, 4)).sum().backward()
    o.step()
    model = torch.nn.Linear(5, 3)
    opt = _adamw(model.parameters())
    opt.load_state_dict(o.state_dict())  # torch loads it: the counts match
    try:
        minizero.parallelize(model, 1, opt)
    except ValueError as e:
        return str(e)
    return "ok"


def test_an_optimizer_state_of_other_shapes_is_refused_by_name():
    for msg in run(mismatched_rank, 2):
        assert "state 'exp_avg' of parameter 'weight' has shape (3, 4)" in msg, msg
        assert "the parameter (3, 5)" in msg and "consolidate_state_dict(to=0)" in msg, msg
