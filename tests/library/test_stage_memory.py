"""Proof by measurement (ZeRO §5): the bytes each rank really holds after a training step, for
every stage and precision at 2 and 4 ranks, against the paper's formula, within 1% plus padding."""

import pytest
import torch
import torch.distributed as dist

import minizero
from minizero.analysis.memory import model_state_bytes, paper_model_state_bytes
from minizero.models import GPTConfig, TinyGPT, count_params, synthetic_batch


def _measure(precision: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model, opt = minizero.parallelize(
            TinyGPT(GPTConfig.tiny()), stage, lambda p: torch.optim.AdamW(p, lr=1e-3),
            precision=precision, bucket_cap_mb=None if stage == 3 else 0.1,
        )  # fmt: skip
        x, y = synthetic_batch("gpt", 2 * world, 0, rank=rank, world=world)
        model(x, y).backward()
        opt.step()
        padding = sum(b.padded - b.numel for b in getattr(model, "buckets", []))
        out[stage] = (model_state_bytes(model, opt), padding)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_measured_model_states_match_the_paper(world, precision):
    psi = count_params(TinyGPT(GPTConfig.tiny()))
    results = minizero.launch(_measure, world, precision, timeout=200, verbose=False)
    for rank, per_stage in enumerate(results):
        for stage, (measured, padding) in per_stage.items():
            expected = paper_model_state_bytes(psi, world, stage, precision)
            for key in ("params", "grads", "optimizer"):
                slack = 0.01 * expected[key] + 12 * padding  # 12 bytes per padded element at most
                assert abs(measured[key] - expected[key]) <= slack, (
                    f"rank {rank}, stage {stage}, {precision}, {key}: measured {measured[key]} "
                    f"bytes, the paper's formula gives {expected[key]:.0f}"
                )
            if stage == 0:  # nothing is partitioned, nothing is padded: exact
                assert measured == {k: int(v) for k, v in expected.items()}
