"""Every stage on models no one here wrote (tests/zoo.py): torch's nn.TransformerEncoderLayer LM
with a tied head, torchvision's resnet18 (BatchNorm) and Hugging Face's GPT2LMHeadModel, trained
with nanoGPT's param groups and torch.nn.utils.clip_grad_norm_ in the user's own loop. Each stage
is compared, in the same launch (one per model and world, for the four stages), with torch DDP
(same optimizer, same groups) and with one process; bf16 with FSDP2 under the same
mixed-precision policy."""

import functools

import pytest
import torch
import zoo
from harness import run
from zoo import difference, train_rank, train_reference

import minizero

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
CLIP = 0.5


def minizero_wrapper(stage, precision="fp32"):
    def wrap(model, make_opt, entry):
        return minizero.parallelize(model, stage, make_opt(model), precision=precision)

    return wrap


def zoo_rank(model, opt, clip, want):
    """Torch DDP once, then minizero at every stage, in one launch: the same batches for all.
    Each stage's run is compared here, on its rank, with torch DDP's and with ``want`` (the
    one-process reference per rank, inherited by the forked ranks): the ranks return the
    differences, not every step's full state (resnet18's came to 1.3 GB of results)."""
    rank = torch.distributed.get_rank()
    ddp = train_rank(model, "torch_ddp", opt, clip=clip)
    out = {}
    for stage in STAGES:
        got = train_rank(model, minizero_wrapper(stage), opt, clip=clip)
        out[stage] = {"torch DDP": difference(got, ddp), "one process": difference(got, want[rank])}
    return out


CASES = [  # (model, world): every model at 2 ranks, the transformer at 3 too
    ("encoder_lm", 2), ("encoder_lm", 3), ("encoder_lm_prenorm", 2), ("resnet18", 2), ("gpt2", 2),
]  # fmt: skip
STAGES = (0, 1, 2, 3)


@functools.cache
def trained(model: str, world: int) -> list[dict]:
    """One launch of :func:`zoo_rank` per (model, world), beside the one-process reference, for
    the four stages' tests of this module (a file's tests share a worker: ``--dist loadscope``)."""
    opt = "adamw_groups_lr" if model != "resnet18" else "sgd"
    want = train_reference(model, opt, clip=CLIP, world=world)
    return run(zoo_rank, world, model, opt, CLIP, want, timeout=500)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model,world", CASES)
def test_zoo_stage_matches_torch_ddp_and_one_process(model, world, stage):
    for r, got in enumerate(trained(model, world)):
        assert sorted(got[stage]) == ["one process", "torch DDP"]
        for peer, (d, where) in got[stage].items():
            assert d <= 1e-5, f"stage {stage} rank {r} vs {peer}: {d:.2e} at {where}"


def bf16_rank(model, stage):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = minizero.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "minizero": train_rank(model, minizero_wrapper(stage, policy), "adamw_groups"),
        "fsdp2": train_rank(
            model, lambda m, o, e: zoo.wrap_fsdp2(m, o, e, mp_policy=mp), "adamw_groups"
        ),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_matches_fsdp2_with_the_same_policy(stage):
    """bf16 compute, fp32 reduction and masters, as FSDP2's MixedPrecisionPolicy: the two runs
    stay within bf16 rounding of each other (3 steps of AdamW, lr 1e-3)."""
    for r, got in enumerate(run(bf16_rank, 2, "encoder_lm", stage, timeout=300)):
        d, where = difference(got["minizero"], got["fsdp2"])
        assert d <= 2e-3, f"stage {stage} rank {r} vs FSDP2 bf16: {d:.2e} at {where}"
