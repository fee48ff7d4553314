"""``zero_grad()`` at every stage, as PyTorch does it, on 2 gloo ranks.

What ``zero_grad(set_to_none=True)`` (torch's default) frees: stages 2-3 free their gradient shards,
as FSDP2 frees its sharded gradients, and make them again in the next backward; stage 0 and 1 keep
their flat gradient buffers, as torch DDP keeps its reducer's buckets (``p.grad`` is None at every
stage). The bytes left alive after ``zero_grad()`` are each stage's peer's (torch DDP, DDP +
ZeroRedundancyOptimizer, FSDP2 without and with resharding), and training through every path
(``optimizer.zero_grad()``, the wrapper's, the user's module's) equals one process. ``step()``
with no backward since ``zero_grad()`` changes nothing (torch skips a parameter without a
gradient); after ``zero_grad(set_to_none=False)`` it steps with zero gradients (momentum, decay)."""

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, run, snapshot
from torch import nn

import minizero
from minizero.analysis.memory import MemoryMeter, model_state_bytes, state_tensors
from minizero.models import count_params

pytestmark = pytest.mark.timeout(180)
STAGES = [0, 1, 2, 3]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.5)


def sgd(params) -> torch.optim.Optimizer:
    """Linear in the gradient, so one process and 2 ranks agree to 1e-5 (Adam would turn the
    rounding noise of attention's key-bias gradient, 0 in exact arithmetic, into whole steps);
    momentum and weight decay still move a weight whose gradient is zero."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


# -- what stays alive after zero_grad(), against the stage's peer ---------------------------------
class _Local:
    """A model and optimizer seen by the memory meter, FSDP2's DTensors as their local shards."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def _minizero_state_tensors(self):
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t
        cats = state_tensors(self.model, getattr(self.opt, "optim", self.opt))
        return {c: [local(t) for t in ts] for c, ts in cats.items()}


def _peer(stage: int, model: nn.Module):
    if stage < 2:
        ddp = nn.parallel.DistributedDataParallel(model)
        if stage == 0:
            return ddp, adamw(ddp.parameters())
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                            weight_decay=0.5)  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    return model, adamw(model.parameters())


def _alive_after_zero_grad(stage: int, spec: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = build("gpt")
    model, opt = (
        minizero.parallelize(net, stage, adamw) if spec == "minizero" else _peer(stage, net)
    )
    x, y = local_batch("gpt", 0, rank, world)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    with MemoryMeter(_Local(model, opt)) as meter:  # every storage a step touches, and its fate
        model(*local_batch("gpt", 1, rank, world)).backward()
        grads = model_state_bytes(_Local(model, opt))["grads"]
        opt.step()
        opt.zero_grad()
        alive = meter.mark("after zero_grad")
    inner = getattr(model, "module", model)
    return {"alive": alive["total"], "grads": alive["grads"], "grads_after_backward": grads,
            "params": alive["params"], "optimizer": alive["optimizer"],
            "p_grad": [n for n, p in inner.named_parameters() if p.grad is not None]}  # fmt: skip


@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_frees_what_the_peer_frees(stage):
    psi = count_params(build("gpt"))
    ours_all = run(_alive_after_zero_grad, 2, stage, "minizero")
    theirs_all = run(_alive_after_zero_grad, 2, stage, "peer")
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        assert ours["p_grad"] == theirs["p_grad"] == []
        if stage < 2:  # the flat buffers stay, as torch DDP's buckets (not reachable from p.grad)
            assert ours["grads"] == 4 * psi
            # everything alive after zero_grad(): params, grads, optimizer states (padding aside)
            assert ours["alive"] == pytest.approx(theirs["alive"], rel=0.01), (ours, theirs)
        else:  # freed, as FSDP2's sharded gradients; made again by the next backward
            assert ours["grads"] == theirs["grads"] == 0
            assert ours["grads_after_backward"] == pytest.approx(2 * psi, rel=0.01)
            assert ours["optimizer"] == pytest.approx(theirs["optimizer"], rel=0.01)
            if stage == 3:  # (stage 2 keeps full parameters; FSDP2 shards them between steps)
                assert ours["params"] == pytest.approx(theirs["params"], rel=0.01)
            # FSDP2 keeps more alive after its step (its foreach AdamW over DTensors), not less
            assert ours["alive"] <= 1.01 * theirs["alive"], (ours, theirs)


# -- every zero_grad path trains as one process; step() with no backward ---------------------------
PATHS = ("optimizer", "wrapper", "module")


def _paths_rank(stage: int, precision: str) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    inner = build("gpt")
    model, opt = minizero.parallelize(inner, stage, sgd, precision=precision)
    zero = {"optimizer": opt.zero_grad, "wrapper": model.zero_grad, "module": inner.zero_grad}
    return _script(model, opt, zero, rank, world)


def _script(model, opt, zero: dict, rank: int = 0, world: int = 1) -> list[dict]:
    """Steps 0-2: backward, step, zero_grad() by each path. 3: step() alone (nothing to step).
    4: backward, step, zero_grad(set_to_none=False). 5: step() alone: zero gradients, stepped
    (momentum and weight decay move the weights). The full parameters after each."""
    states = []
    for step, path in enumerate(PATHS):
        model(*local_batch("gpt", step, rank, world)).backward()
        opt.step()
        zero[path]()
        states.append(snapshot(model))
    opt.step()
    states.append(snapshot(model))
    model(*local_batch("gpt", 3, rank, world)).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    states.append(snapshot(model))
    opt.step()
    states.append(snapshot(model))
    return states


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_every_zero_grad_path_and_step_without_backward(stage, precision):
    model = build("gpt")
    opt = sgd(model.parameters())
    want = _script(model, opt, dict.fromkeys(PATHS, opt.zero_grad))  # one process
    atol = 1e-5 if precision == "fp32" else 2e-2
    for r, got in enumerate(run(_paths_rank, 2, stage, precision)):
        for k in want[0]:
            for s, (g, w) in enumerate(zip(got, want, strict=True)):
                where = f"rank {r}, state {s}, {k}"
                torch.testing.assert_close(g[k], w[k], atol=atol, rtol=0, msg=where)
            assert torch.equal(got[3][k], got[2][k]), f"rank {r}, {k}: stepped without a gradient"
            if got[4][k].dim() >= 2:
                assert not torch.equal(got[5][k], got[4][k]), f"rank {r}, {k}: zero grads skipped"
