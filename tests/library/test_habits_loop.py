"""Training-loop habits at every stage (issue 16, items 2-8): each trains what one process trains
with the same loop (or what torch DDP does), or is refused by one message that names the habit.

dtypes other than fp32; unfreezing mid-run; ``p.grad = None`` by hand; ``step()`` twice per
backward and never calling ``zero_grad()``; LAMB-like subclasses of elementwise optimizers;
BatchNorm evaluated between steps; ``parallelize`` called twice on one module; the arrival check
of a wrapper over a subgroup."""

import os

import pytest
import torch
import torch.distributed as dist
from harness import bn_wrapped, build, local_batch, run, snapshot
from torch import nn

import minizero

pytestmark = pytest.mark.timeout(240)
STAGES = [0, 1, 2, 3]
STEPS = 3


# -- the loop, with one habit, in one process or on every rank ------------------------------------
def habit_loop(model, opt, rank, world, habit):
    """SGD with momentum (linear in the gradient: a lost or doubled gradient shows)."""
    states = []
    for step in range(STEPS):
        x, y = local_batch("mlp", step, rank, world)
        model(x, y).backward()
        if habit == "skip_one":  # p.grad = None between backward and step: p is not stepped
            for name, p in model.named_parameters():
                if name.endswith("gain"):
                    p.grad = None
        opt.step()
        if habit == "step_twice":
            opt.step()
        if habit in ("grad_none", "grad_none_before_forward"):
            for p in model.parameters():
                p.grad = None
        elif habit == "grad_none_some":  # the matrices cleared, the rest accumulates
            for p in model.parameters():
                if p.dim() >= 2:
                    p.grad = None
        elif habit != "no_zero_grad":
            opt.zero_grad()
        states.append(snapshot(model))
    return states


def sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 0.05, 0.9)


def habit_rank(habit, stages):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        model = build("mlp")
        model, opt = minizero.parallelize(model, stage, sgd(model))
        out[stage] = habit_loop(model, opt, rank, world, habit)
    return out


HABITS = ["grad_none", "grad_none_some", "skip_one", "step_twice", "no_zero_grad"]


@pytest.mark.parametrize("habit", HABITS)
def test_loop_habits_train_what_one_process_trains(habit):
    """``p.grad = None`` by hand (all, some, or one between backward and step), ``step()`` twice,
    no ``zero_grad()`` at all (accumulation across steps): stages 1-3 kept stale gradients, or
    mixed averaged and local chunks at stage 1, before."""
    model = build("mlp")
    want = habit_loop(model, sgd(model), 0, 1, habit)
    for r, got in enumerate(run(habit_rank, 2, habit, STAGES)):
        for stage in STAGES:
            for step, (g, w) in enumerate(zip(got[stage], want, strict=True)):
                for k in w:
                    where = f"{habit} stage {stage} rank {r} step {step} {k}"
                    torch.testing.assert_close(g[k], w[k], atol=1e-6, rtol=0, msg=where)


def test_the_habits_differ():
    """The loop test can fail: each habit trains another model than the plain loop."""
    model = build("mlp")
    plain = habit_loop(model, sgd(model), 0, 1, "plain")[-1]
    for habit in ("grad_none_some", "skip_one", "step_twice", "no_zero_grad"):
        model = build("mlp")
        other = habit_loop(model, sgd(model), 0, 1, habit)[-1]
        assert any(not torch.allclose(other[k], plain[k], atol=1e-4) for k in plain), habit


# -- refusals: dtypes, unfreezing, a second parallelize -------------------------------------------
def refusal_rank(stage):
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except (TypeError, RuntimeError) as e:
            errors[name] = str(e)

    def wrap(model):
        return minizero.parallelize(model, stage, sgd(model))

    attempt("double", lambda: wrap(build("mlp").double()))
    one = build("mlp")
    one.layers[1].bias.data = one.layers[1].bias.data.double()
    attempt("one_double", lambda: wrap(one))
    attempt("bf16_model", lambda: wrap(build("mlp").to(torch.bfloat16)))
    cplx = nn.Linear(3, 3).to(torch.complex64)
    attempt("complex", lambda: wrap(cplx))
    refused = build("mlp").double()  # refused, then fixed: the model is clean, it wraps
    attempt("refused", lambda: wrap(refused))
    plain = refused.float()
    model, opt = wrap(plain)
    attempt("twice", lambda: wrap(plain))
    x, y = local_batch("mlp", 0, dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    frozen = next(p for p in plain.parameters() if not p.requires_grad)
    frozen.requires_grad_(True)  # unfreezing mid-run
    attempt("unfreeze", lambda: model(x, y))
    frozen.requires_grad_(False)
    plain.layers[0].bias.requires_grad_(False)  # freezing mid-run
    attempt("freeze", lambda: model(x, y))
    return errors


@pytest.mark.parametrize("stage", STAGES)
def test_refused_habits_name_themselves(stage):
    errors = run(refusal_rank, 2, stage)[0]
    assert "torch.float64" in errors["double"] and "model.float()" in errors["double"]
    assert "'layers.1.bias' is torch.float64" in errors["one_double"]
    assert "precision='bf16'" in errors["bf16_model"]
    assert "torch.complex64" in errors["complex"]
    assert "torch.float64" in errors["refused"]
    assert "already wrapped by minizero" in errors["twice"] and "fresh" in errors["twice"]
    assert "'layers.0.weight' was unfrozen after minizero.parallelize" in errors["unfreeze"]
    assert "'layers.0.bias' was frozen after" in errors["freeze"]


class TrustRatio:
    """The base class's update scaled per tensor by ||w|| / ||update|| (LAMB's and LARS's trust
    ratio, times ``gain``): a step that is not elementwise."""

    gain = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        before = [p.clone() for g in self.param_groups for p in g["params"]]
        super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        for p, b in zip(params, before, strict=True):
            p.copy_(b + self.gain * (p - b) * b.norm() / (p - b).norm().clamp_min(1e-12))


class LAMBLike(TrustRatio, torch.optim.Adam):
    """LAMB written on Adam."""


class LARSLike(TrustRatio, torch.optim.SGD):
    """LARS written on SGD."""

    gain = 1e-2


class ElementwiseSubclass(torch.optim.AdamW):
    minizero_elementwise = True

    def step(self, closure=None):
        return super().step(closure)


def test_an_optimizer_that_overrides_step_is_refused_by_name():
    model = build("mlp")
    params = [p for p in model.parameters() if p.requires_grad]
    for stage in (1, 2, 3):
        with pytest.raises(TypeError, match="LAMBLike.step overrides Adam.step.*per-tensor"):
            minizero.parallelize(build("mlp"), stage, LAMBLike(params))
        with pytest.raises(TypeError, match="LARSLike.step overrides SGD.step"):
            minizero.parallelize(build("mlp"), stage, LARSLike(params, lr=0.1))
    with pytest.raises(TypeError, match="LAMBLike.step overrides"):  # mixed precision: masters
        minizero.parallelize(build("mlp"), 0, LAMBLike(params), precision="bf16")
    from minizero.habits.optimizer import check_elementwise

    check_elementwise(ElementwiseSubclass(params))  # declared elementwise: accepted
    check_elementwise(type("Plain", (torch.optim.AdamW,), {})(params))  # no step of its own


def lamb_stage0_rank():
    model = build("mlp")
    model, opt = minizero.parallelize(model, 0, lambda ps: LARSLike(ps, lr=0.1))
    x, y = local_batch("mlp", 0, dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    opt.step()
    return snapshot(model)


def test_lars_like_at_stage_0_fp32_trains_what_one_process_trains():
    model = build("mlp")
    opt = LARSLike([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = local_batch("mlp", 0)
    model(x, y).backward()
    opt.step()
    for got in run(lamb_stage0_rank, 2):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)


# -- BatchNorm evaluated between steps: torch DDP's rule -------------------------------------------
def bn_batch(step, rank):
    torch.manual_seed(100 + step + 7 * rank)  # different data per rank
    return torch.randn(6, 5) + rank


def bn_train(model, opt, step, rank, sync=True):
    model.train()
    with model.no_sync() if not sync else torch.enable_grad():
        model(bn_batch(step, rank)).pow(2).mean().backward()
    if sync:
        opt.step()
        opt.zero_grad()


def bn_evaluate(model, step, rank):
    model.eval()
    with torch.no_grad():
        out = model(bn_batch(50 + step, rank))
    model.train()
    return out


def bn_eval_rank(stage):
    rank = dist.get_rank()
    out = {}
    for spec in ("minizero", "torch"):
        model, opt = bn_wrapped(spec, stage)
        seen = []
        for step in range(3):
            bn_train(model, opt, step, rank)
            # follows a synchronised training forward: rank 0's buffers
            seen.append(bn_evaluate(model, step, rank))
            # follows a no_grad forward: this rank's buffers (rank 0's, just broadcast)
            seen.append(bn_evaluate(model, step + 10, rank))
            with torch.no_grad():  # a no_grad "target" forward in train mode, then training
                model(bn_batch(20 + step, rank))
            bn_train(model, opt, 30 + step, rank)
        bn_train(model, opt, 40, rank, sync=False)  # no_sync (stages 2-3: local full grads)
        seen.append(bn_evaluate(model, 41, rank))  # after no_sync: this rank's statistics
        bn_train(model, opt, 42, rank)
        seen.append(bn_evaluate(model, 43, rank))
        seen.append({k: v.clone() for k, v in model.module.named_buffers()})
        out[spec] = seen
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_batchnorm_evaluated_between_steps_follows_torch_ddp(stage):
    """torch DDP broadcasts rank 0's buffers before a forward that follows a synchronised
    training forward (with grad or without), and not after a no_grad or no_sync forward."""
    res = run(bn_eval_rank, 2, stage)
    for r in range(2):
        got, want = res[r]["minizero"], res[r]["torch"]
        for i, (g, w) in enumerate(zip(got[:-1], want[:-1], strict=True)):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0, msg=f"rank {r} eval {i}")
        for k, v in want[-1].items():
            torch.testing.assert_close(got[-1][k], v, atol=1e-6, rtol=0, msg=k)
    # the no_sync part makes the ranks' statistics differ, as with torch DDP
    assert not torch.equal(res[0]["torch"][-2], res[1]["torch"][-2])


# -- a wrapper over a subgroup: the arrival check works there too --------------------------------
def subgroup_rank(stage):
    os.environ["MINIZERO_ARRIVAL_S"] = "3"
    sub = dist.new_group([0, 1])  # every rank makes it, as c10d requires
    if dist.get_rank() == 2:
        return None
    model = build("mlp")
    model, opt = minizero.parallelize(model, stage, sgd(model), process_group=sub)
    full = model.state_dict()  # both members: fine
    try:
        if dist.get_rank() == 0:  # nanoGPT's `if master_process: torch.save(model.state_dict())`
            model.state_dict()
        return {"full": full, "error": None}
    except RuntimeError as e:
        return {"full": full, "error": str(e)}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_subgroup_wrapper_notices_a_missing_rank(stage):
    res = run(subgroup_rank, 3, stage)
    assert res[2] is None
    assert "model.state_dict() is collective at ZeRO stage" in res[0]["error"]
    assert "did not call it within 3 s. Call it on every rank" in res[0]["error"]
    assert res[1]["error"] is None
    want = build("mlp").state_dict()
    for k, v in want.items():
        torch.testing.assert_close(res[1]["full"][k], v.float(), atol=0, rtol=0, msg=k)


# -- add_param_group: a parameter that starts training later --------------------------------------
def later_loop(model, opt, rank, world, late):
    states = []
    for step in range(3):
        if step == 1:  # the body starts training, with its own lr
            opt.add_param_group({"params": late, "lr": 0.02, "momentum": 0.5})
        x, y = local_batch("mlp", step, rank, world)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(model))
    return states


def head_and_body(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    head = [p for n, p in named if n.startswith(("gain", "layers.2"))]
    body = [p for n, p in named if not n.startswith(("gain", "layers.2"))]
    return head, body


def later_rank(stage):
    model = build("mlp")
    head, body = head_and_body(model)
    model, opt = minizero.parallelize(model, stage, torch.optim.SGD(head, 0.05, 0.9))
    return later_loop(model, opt, dist.get_rank(), dist.get_world_size(), body)


@pytest.mark.parametrize("stage", STAGES)
def test_add_param_group_later_trains_what_one_process_trains(stage):
    model = build("mlp")
    head, body = head_and_body(model)
    want = later_loop(model, torch.optim.SGD(head, 0.05, 0.9), 0, 1, body)
    for r, got in enumerate(run(later_rank, 2, stage)):
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for k in w:
                msg = f"stage {stage} rank {r} step {step} {k}"
                torch.testing.assert_close(g[k], w[k], atol=1e-6, rtol=0, msg=msg)


# -- a parameter used on some ranks only: buckets launch in index order ---------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, use_second):
        h = self.layers[0](x)
        return (self.layers[1](h) if use_second else h).pow(2).mean()


def branchy_batch(rank, step):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def branchy_rank(stage):
    rank = dist.get_rank()
    model, opt = minizero.parallelize(
        Branchy(), stage, lambda ps: torch.optim.SGD(ps, lr=0.1),
        find_unused_parameters=True, bucket_cap_mb=1e-5,  # a bucket per parameter
    )  # fmt: skip
    for step in range(2):
        model(branchy_batch(rank, step), rank == 1).backward()
        opt.step()
        opt.zero_grad()
    return snapshot(model)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_used_on_some_ranks_only_trains_what_one_process_trains(stage):
    """Rank 1 alone uses layers.1: its buckets complete in another order than rank 0's. Buckets
    launched as they completed paired different buckets' collectives (0.039 off at stages 0, 2)."""
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        sum(ref(branchy_batch(r, step), r == 1) / 2 for r in range(2)).backward()
        opt.step()
        opt.zero_grad()
    for got in run(branchy_rank, 2, stage):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)
