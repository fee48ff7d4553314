"""``precision="fp64"``: fp32's rule in float64, which the course's checks train in (a different
order of the same sums moves a result by ~1e-16, so a check compares almost exactly)."""

import pytest
import torch
import torch.distributed as dist
from harness import run

import minizero
from minizero.models import MLP, synthetic_batch


def _train(stage: int) -> tuple[float, str]:
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = MLP().double()
    torch.manual_seed(0)
    ref = MLP().double()
    model, opt = minizero.parallelize(m, stage, torch.optim.Adam(m.parameters(), lr=1e-2),
                                      precision="fp64")  # fmt: skip
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = synthetic_batch("mlp", 4 * w, step, rank=r, world=w)
        model(x, y).backward()  # float inputs: cast to float64 as bf16's are to bf16
        opt.step()
        opt.zero_grad()
        gx, gy = synthetic_batch("mlp", 4 * w, step)
        ref(gx.double(), gy.double()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = minizero.full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return diff, str(full["layers.0.weight"].dtype)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp64_trains_as_one_process_in_float64(stage):
    for diff, dtype in run(_train, 3, stage):
        assert dtype == "torch.float64"
        assert diff < 1e-12, diff  # fp32 gives ~1e-7 here: the order of the sums


def test_a_float64_model_without_fp64_is_refused_saying_what_to_pass():
    def wrap():
        minizero.parallelize(MLP().double(), 1, torch.optim.Adam(MLP().parameters()))

    with pytest.raises(Exception, match="pass precision='fp64' to train a float64 model"):
        run(wrap, 2)
