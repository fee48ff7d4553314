"""HSDP's gradient accumulation (``ZeRO2.over_nodes``): ``set_requires_all_reduce(False)`` on
all but the last micro-batch (FSDP2's switch), or on every one (DeepSpeed MiCS: once, at the
step), sends the "replicate" all-reduce once per step instead of once per micro-batch, and the
step is the one one process takes. 4 gloo ranks as 2 "nodes" x 2, in float64 (``fp64``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import hsdp_mesh, run

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.models import MLP, count_params, synthetic_batch

pytestmark = pytest.mark.timeout(600)
MICRO, STEPS, SIZES = 4, 2, (8, 16, 8)  # even sizes: no padding, the volumes are exact


def _run(stage: int, mode: str) -> dict:
    """``mode``: "default" (all-reduce every micro-batch), "fsdp2" (False, then True for the
    last), "mics" (False for every micro-batch: the step averages)."""
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = MLP(SIZES).double()
    torch.manual_seed(0)
    ref = MLP(SIZES).double()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    model, opt = minizero.parallelize(m, stage, opt, mesh=hsdp_mesh(2), precision="fp64")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    replicate = []
    for step in range(STEPS):
        x, y = synthetic_batch("mlp", 8 * w, step, rank=r, world=w, in_features=8, out_features=8)
        with CommLedger() as ledger:
            for k, (xi, yi) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)):
                if mode != "default":
                    model.set_requires_all_reduce(mode == "fsdp2" and k == MICRO - 1)
                (model(xi, yi) / MICRO).backward()
            opt.step()
            opt.zero_grad()
        replicate.append(sum(r.numel for r in ledger.records if r.group == "replicate"
                             and r.op == "all_reduce" and "replicas" in r.tag))  # fmt: skip
        gx, gy = synthetic_batch("mlp", 8 * w, step, in_features=8, out_features=8)
        for xi, yi in zip(gx.double().chunk(MICRO * w), gy.double().chunk(MICRO * w), strict=True):
            (ref(xi, yi) / (MICRO * w)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = minizero.full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"diff": diff, "replicate": replicate, "psi": count_params(ref)}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_replicate_all_reduce_runs_once_per_step_when_asked_and_trains_the_same(stage):
    out = {mode: run(_run, 4, stage, mode) for mode in ("default", "fsdp2", "mics")}
    psi = out["default"][0]["psi"]
    for mode, per_rank in out.items():
        for res in per_rank:
            assert res["diff"] < 1e-12, (mode, res["diff"])  # one process, to float64's rounding
            # this rank's shard, Ψ/2 elements, all-reduced MICRO times per step, or once
            times = MICRO if mode == "default" else 1
            assert res["replicate"] == [times * psi // 2] * STEPS, (mode, res["replicate"])
