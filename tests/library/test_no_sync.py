"""``no_sync()`` and ``require_backward_grad_sync = False`` at stages 2-3 (issue 32): the
micro-batches' full gradients accumulate locally, and the last backward reduce-scatters the sum,
as FSDP2 does under ``set_requires_gradient_sync(False)``. The result is one process's, in fp64
(to 1e-12), and FSDP2's own in fp32; inside ``no_sync()`` no gradient is communicated."""

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, run, snapshot, wrap

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.models import MLP, synthetic_batch

pytestmark = pytest.mark.timeout(180)
MICRO, STEPS = 3, 2


def fp64_rank(stage: int, how: str) -> dict:
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = MLP().double()
    torch.manual_seed(0)
    ref = MLP().double()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    model = minizero.parallelize(m, stage, precision="fp64")  # adopted at its first step
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    quiet = []  # gradient collectives issued by the backwards that accumulate
    for step in range(STEPS):
        x, y = synthetic_batch("mlp", MICRO * 2 * w, step, rank=r, world=w)
        for i, (xi, yi) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)):
            last = i == MICRO - 1
            with CommLedger() as ledger:
                if how == "attribute":  # nanoGPT's way: torch DDP's attribute, set every micro
                    model.require_backward_grad_sync = last
                    (model(xi, yi) / MICRO).backward()
                elif last:
                    (model(xi, yi) / MICRO).backward()
                else:
                    with model.no_sync():
                        (model(xi, yi) / MICRO).backward()
            if not last:  # no gradient leaves the rank (stage 3 still gathers parameters)
                quiet.append(sum(c.op != "all_gather" for c in ledger.records))
        opt.step()
        opt.zero_grad()
        gx, gy = synthetic_batch("mlp", MICRO * 2 * w, step)
        ref(gx.double(), gy.double()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = minizero.full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"diff": diff, "quiet": quiet}


@pytest.mark.parametrize("how", ["no_sync", "attribute"])
@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_accumulates_locally_as_one_process(stage, how):
    for res in run(fp64_rank, 2, stage, how):
        assert res["diff"] < 1e-12, res["diff"]
        assert res["quiet"] == [0] * (STEPS * (MICRO - 1)), res["quiet"]


def fsdp2_rank(spec: str) -> list[dict]:
    """The harness's TinyGPT, two micro-batches, the first without gradient sync: minizero's
    attribute (nanoGPT's) or FSDP2's set_requires_gradient_sync(False)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = wrap(spec, build("gpt"), "adamw")
    out = []
    for step in range(STEPS):
        x, y = local_batch("gpt", step, rank, world)
        for i, (xi, yi) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            if spec == "fsdp2":
                model.set_requires_gradient_sync(i == 1)
            else:
                model.require_backward_grad_sync = i == 1
            (model(xi, yi) / 2).backward()
        opt.step()
        opt.zero_grad()
        out.append(snapshot(model))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_equals_fsdp2_without_gradient_sync(stage):
    got = run(fsdp2_rank, 2, f"stage{stage}")
    want = run(fsdp2_rank, 2, "fsdp2")
    for r in range(2):
        for s in range(STEPS):
            for k, v in want[r][s].items():
                torch.testing.assert_close(got[r][s][k], v, rtol=0, atol=1e-6, msg=f"{k} {s}")
