"""Frozen parameters (``requires_grad=False``), as in fine-tuning: torch's transformer LM of
tests/zoo.py with its token embedding frozen (tied to the head, so the head is frozen too) and a
LayerNorm frozen inside the first block (inside a stage-3 unit). The optimizer is built the usual
way, over ``model.parameters()``, frozen ones included: torch skips a parameter without a gradient.

At every stage, world 2: fp32 training equals torch DDP and one process; a frozen parameter gets no
gradient, no optimizer state and no fragment, and is never changed (AdamW's weight decay would
move it if it were stepped with a zero gradient). In bf16 it is kept once, in bf16: no fp32 master
copy (the masters cover the trainable parameters only). The full state dict loads back at every
stage (stage 3 used to raise a KeyError on the frozen parameter)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import zoo
from zoo import difference, train_rank, train_reference

import minizero
from minizero.analysis.memory import model_state_bytes
from minizero.launcher import launch

pytestmark = pytest.mark.timeout(300)
FROZEN = ("tok_emb.weight", "encoder.layers.0.norm1.weight", "encoder.layers.0.norm1.bias")


def _frozen_lm() -> torch.nn.Module:
    model = zoo.EncoderLM()
    model.tok_emb.weight.requires_grad_(False)  # lm_head.weight is the same Parameter
    model.encoder.layers[0].norm1.requires_grad_(False)
    return model


FROZEN_LM = dataclasses.replace(zoo.ZOO["encoder_lm"], name="encoder_lm_frozen", make=_frozen_lm)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # frozen ones too


def _wrap(stage: int, precision: str = "fp32"):
    def wrap(model, make_opt, entry):
        return minizero.parallelize(model, stage, make_opt(model), precision=precision)

    return wrap


def _frozen_rank(stage: int, precision: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = FROZEN_LM.build(0)
    init = {k: v.detach().clone() for k, v in net.state_dict().items() if k in FROZEN}
    model, opt = _wrap(stage, precision)(net, _adamw, FROZEN_LM)
    frozen = [p for p in net.parameters() if not p.requires_grad]
    grads = []
    for step in range(2):
        FROZEN_LM.loss(model, FROZEN_LM.batch(step, rank, world, 0)).backward()
        grads += [p.grad for p in frozen]
        opt.step()
        opt.zero_grad()
    buckets = getattr(model, "buckets", [])
    bucketed = {id(q) for b in buckets for q in b.params}
    masters = sum(m.numel() for m in model.optim_params if m is not None)
    out = {
        "grads": grads,
        "in_buckets": [
            n for n, p in net.named_parameters() if id(p) in bucketed and not p.requires_grad
        ],
        "fragments": [f.name for f in model.fragments if not f.param.requires_grad],
        "states": [p for p in frozen if p in opt.state],
        "dtypes": {str(p.dtype) for p in frozen},
        "masters": masters,
        "owned": sum(b.shard if stage else b.numel for b in buckets),
        "optimizer_bytes": model_state_bytes(model, opt)["optimizer"],
        "fragment_numel": sum(f.numel for f in model.fragments),
        "init": init,
    }
    sd = model.state_dict()
    out["after"] = {k: sd[k] for k in FROZEN}
    model.load_state_dict(sd)  # every stage takes its own full state dict back
    out["reloaded"] = {k: v for k, v in model.state_dict().items() if k in FROZEN}
    return out


def _fp32_rank(stage: int) -> dict:
    return {
        "minizero": train_rank(FROZEN_LM, _wrap(stage), _adamw),
        "torch_ddp": train_rank(FROZEN_LM, "torch_ddp", _adamw),
        "checks": _frozen_rank(stage, "fp32"),
    }


def _assert_frozen(res: dict, stage: int, precision: str) -> None:
    what = f"stage {stage} {precision}"
    assert res["grads"] == [None] * len(res["grads"]), f"{what}: a frozen parameter got a grad"
    assert res["in_buckets"] == [] and res["fragments"] == [] and res["states"] == [], what
    for k, v in res["init"].items():
        want = v.float() if precision == "fp32" else v.bfloat16().float()  # the working copy
        assert torch.equal(res["after"][k], want), f"{what}: {k} changed"
        assert torch.equal(res["reloaded"][k], want), f"{what}: {k} changed by load_state_dict"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_fp32_match_torch_ddp_and_one_process(stage):
    want = train_reference(FROZEN_LM, _adamw)
    for r, got in enumerate(launch(_fp32_rank, 2, stage, timeout=240, verbose=False)):
        d, where = difference(got["minizero"], got["torch_ddp"])
        assert d <= 1e-5, f"stage {stage} rank {r} vs torch DDP: {d:.2e} at {where}"
        d, where = difference(got["minizero"], want[0])
        assert d <= 1e-5, f"stage {stage} rank {r} vs one process: {d:.2e} at {where}"
        _assert_frozen(got["checks"], stage, "fp32")
        assert got["checks"]["dtypes"] == {"torch.float32"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_bf16_keep_no_fp32_copy(stage):
    for got in launch(_frozen_rank, 2, stage, "bf16", timeout=240, verbose=False):
        _assert_frozen(got, stage, "bf16")
        assert got["dtypes"] == {"torch.bfloat16"}  # the only copy: the working one
        # fp32 masters for this rank's range of the trainable buckets only; AdamW's two states
        # for each fragment (a trainable parameter's part of that range), nothing for the rest
        assert got["masters"] == got["owned"]
        assert got["optimizer_bytes"] == 4 * got["masters"] + 8 * got["fragment_numel"]
