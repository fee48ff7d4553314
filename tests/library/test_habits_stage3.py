"""More PyTorch habits at every stage (issue 16, items 11-15 and what the ImageNet example and the
FSDP tutorial rely on): backward twice over one graph, sparse embeddings, ``torch.compile``,
forward pre-hooks that read parameters (pruning, the old weight norm), ``torch.autograd.grad``
on the inputs (adversarial training, gradient penalties).

Each habit either trains what one process trains on the global batch (FSDP2's answer) or is
refused with one message that names it and says what works instead."""

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, run, snapshot
from torch import nn

import minizero

pytestmark = pytest.mark.timeout(240)
STAGES = [0, 1, 2, 3]
STEPS = 3


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: linear in the gradient, so a gradient off by a factor shows."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def assert_same_states(got: list[dict], want: list[dict], atol: float, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), what
        for k in w:
            torch.testing.assert_close(
                g[k], w[k], atol=atol, rtol=0, msg=lambda m, k=k, s=step: f"{what} {s} {k}: {m}"
            )


# -- 11. backward twice over one graph (retain_graph=True) -----------------------------------------
def twice_loop(model, opt, kind, rank, world):
    states = []
    for step in range(STEPS):
        x, y = local_batch(kind, step, rank, world)
        loss = model(x, y)
        loss.backward(retain_graph=True)  # e.g. two losses on one forward, each backwarded
        (0.5 * loss).backward()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(model))
    return states


def twice_rank(stage, kind):
    model = build(kind)
    model, opt = minizero.parallelize(model, stage, sgd(model))
    return twice_loop(model, opt, kind, dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("stage", STAGES)
def test_backward_twice_accumulates_both(stage, kind):
    """FSDP2's answer: the gradients of both backwards add up, as in one process. It was an
    autograd-internal error at stages 1-3 (the second backward added into the stand-in
    ``p.grad`` that stages 1-3 leave after a backward)."""
    model = build(kind)
    want = twice_loop(model, sgd(model), kind, 0, 1)
    for r, got in enumerate(run(twice_rank, 2, stage, kind)):
        assert_same_states(got, want, 1e-6, f"stage {stage} rank {r}")


def test_backward_twice_is_not_backward_once():
    """The check above can fail: one backward alone trains another model."""
    model = build("mlp")
    opt = sgd(model)
    x, y = local_batch("mlp", 0)
    model(x, y).backward()
    opt.step()
    ref = build("mlp")
    with pytest.raises(AssertionError):
        assert_same_states([snapshot(model)], twice_loop(ref, sgd(ref), "mlp", 0, 1)[:1], 1e-6, "")
