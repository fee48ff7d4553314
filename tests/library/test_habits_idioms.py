"""The peers' own idioms, as their users write them (issue 25): FSDP2's optimizer built after
wrapping (``model = parallelize(model, s); opt = AdamW(model.parameters())``), with a scheduler
and a checkpoint round trip; the wrapped model's own ``load_state_dict`` of the full state dict
its ``state_dict()`` gives (nanoGPT's ``raw_model``), at stage 3 too. torch DDP's bucket layout
is tested in test_ddp_buckets.py. At 2 and 3 ranks, against one process."""

import io

import pytest
import torch
import torch.distributed as dist
from harness import build, drift, local_batch, run, snapshot

import minizero

pytestmark = pytest.mark.timeout(240)
STAGES = [0, 1, 2, 3]
STEPS, SAVE_AT = 4, 2  # train 4 steps; checkpoint after the 2nd
LR = 1e-2
# bf16 against fp32 from the same (bf16-representable) initial weights: drift() (distance between
# the runs / distance travelled) at most 0.2, test_zero.py's MP_TOL for AdamW (measured there: 0.08
# at worst; Adam turns rounding noise in tiny gradients into full-size steps)
BF16_VS_FP32 = 0.2


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def sgd_groups(params):
    """nanoGPT's groups (weight decay on 2-D weights only), each with its own lr, SGD momentum."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 0.02, "weight_decay": 0}],
        lr=0.05, momentum=0.9,
    )  # fmt: skip


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def loop(model, opt, sched, steps, rank=0, world=1, dtype=torch.float32):
    """The user's loop; returns the full fp32 parameters after each step."""
    states = []
    for step in steps:
        x, y = local_batch("mlp", step, rank, world)
        model(x.to(dtype), y.to(dtype)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        states.append(snapshot(model))
    return states


def one_process(make, init_dtype=None):
    model = build("mlp", init_dtype)
    opt = make(trainable(model))
    return loop(model, opt, scheduler(opt), range(STEPS))


# -- FSDP2's order: the optimizer built after wrapping ---------------------------------------------
def after_wrap_rank(stage, path):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}

    def wrapped(make, precision="fp32", init_dtype=None):
        model = minizero.parallelize(build("mlp", init_dtype), stage, precision=precision)
        opt = make(model.parameters())  # FSDP2: fully_shard(model); opt = AdamW(...)
        return model, opt, scheduler(opt)

    # AdamW and a scheduler; a checkpoint after SAVE_AT steps, resumed into a fresh model and a
    # fresh optimizer that has not stepped yet (load_checkpoint adopts it), trained on
    model, opt, sched = wrapped(adamw)
    out["adamw"] = loop(model, opt, sched, range(SAVE_AT), rank, world)
    minizero.save_checkpoint(path, model, opt, {"sched": sched.state_dict()})
    out["adamw"] += loop(model, opt, sched, range(SAVE_AT, STEPS), rank, world)
    model, opt, sched = wrapped(adamw)
    extra = minizero.load_checkpoint(path, model, opt)
    sched.load_state_dict(extra["sched"])
    out["resumed"] = loop(model, opt, sched, range(SAVE_AT, STEPS), rank, world)
    out["groups"] = loop(*wrapped(sgd_groups), range(STEPS), rank, world)
    # bf16: the same run as the optimizer passed to parallelize (the same arithmetic)
    bf16 = torch.bfloat16
    out["bf16"] = loop(*wrapped(adamw, "bf16", bf16), range(STEPS), rank, world, bf16)
    model, opt = minizero.parallelize(build("mlp", bf16), stage, adamw, precision="bf16")
    out["bf16_passed"] = loop(model, opt, scheduler(opt), range(STEPS), rank, world, bf16)
    return out


def assert_states(got, want, atol, what):
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in w:
            msg = f"{what}, step {step}, {k}"
            torch.testing.assert_close(g[k], w[k], atol=atol, rtol=0, msg=msg)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_an_optimizer_built_after_wrapping_trains_as_one_process(stage, world, tmp_path):
    """It was refused at stages 1-3 (ShardedParameterError at its step): now it is adopted at its
    first step, as if passed to parallelize. fp32 against one process to 1e-6 (harness.ATOL for
    the MLP); the resumed run equals the one that never stopped bitwise; bf16 equals the run with
    the optimizer passed to parallelize bitwise, and tracks fp32 within test_zero's MP_TOL."""
    want = one_process(adamw)
    groups = one_process(sgd_groups)
    bf16 = torch.bfloat16
    init = snapshot(build("mlp", bf16))
    fp32 = {"states": one_process(adamw, bf16)}
    for r, got in enumerate(run(after_wrap_rank, world, stage, str(tmp_path / "ckpt"))):
        assert_states(got["adamw"], want, 1e-6, f"rank {r}: AdamW + StepLR vs one process")
        assert_states(got["resumed"], got["adamw"][SAVE_AT:], 0, f"rank {r}: resumed")
        assert_states(got["groups"], groups, 1e-6, f"rank {r}: SGD param groups vs one process")
        assert_states(got["bf16"], got["bf16_passed"], 0, f"rank {r}: bf16 vs passed in")
        apart = drift({"states": got["bf16"]}, fp32, init)
        assert apart <= BF16_VS_FP32, f"rank {r}: bf16 vs fp32: {apart:.3g}"
        print(f"stage {stage}, {world} ranks, rank {r}: bf16 vs fp32 drift {apart:.3g}")


def mixed_rank():
    out = {}
    a = minizero.parallelize(build("mlp"), 1)
    b = minizero.parallelize(build("mlp"), 3)
    plain = torch.nn.Linear(3, 3)
    x, y = local_batch("mlp", 0, dist.get_rank(), dist.get_world_size())
    for what, params in [
        ("plain", list(a.parameters()) + list(plain.parameters())),
        ("two", list(a.parameters()) + list(b.parameters())),
    ]:
        opt = torch.optim.SGD(params, lr=0.1)
        a(x, y).backward()
        try:
            opt.step()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
        a.zero_grad()
    # one optimizer per wrapper: each adopted by its own, in one process
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    for model, opt in ((a, oa), (b, ob)):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    out["owners"] = (oa._wrapper is a, ob._wrapper is b)
    out["states"] = (snapshot(a), snapshot(b))
    return out


def test_an_optimizer_over_a_wrapped_model_and_other_tensors_is_refused_one_per_model_trains():
    for got in run(mixed_rank, 2):
        for what in ("plain", "two"):
            msg = got[what]
            assert msg is not None, what
            assert "Build one optimizer per wrapped model" in msg, msg
            assert "other tensor(s)" in msg, msg
        assert got["owners"] == (True, True)
        for state in got["states"]:  # one SGD step of each model, as one process takes it
            model = build("mlp")
            opt = torch.optim.SGD(trainable(model), lr=0.1)
            model(*local_batch("mlp", 0)).backward()
            opt.step()
            for k, v in snapshot(model).items():
                torch.testing.assert_close(state[k], v, atol=1e-6, rtol=0, msg=k)


# -- the wrapped model's own state dict, saved and loaded back --------------------------------
def inner_round_trip_rank(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for precision, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        init = None if precision == "fp32" else dtype
        raw = build("mlp", init)
        model, opt = minizero.parallelize(raw, stage, adamw, precision=precision)
        sched = scheduler(opt)
        loop(model, opt, sched, range(SAVE_AT), rank, world, dtype)
        buf = io.BytesIO()  # nanoGPT: torch.save({"model": raw_model.state_dict(), ...})
        torch.save({"model": raw.state_dict(), "opt": opt.state_dict()}, buf)  # this rank's
        straight = loop(model, opt, sched, range(SAVE_AT, STEPS), rank, world, dtype)
        buf.seek(0)
        saved = torch.load(buf)
        torch.manual_seed(1)  # other initial weights: only the load can make them equal
        fresh = minizero.models.MLP((13, 37, 29, 7), frozen_first=True, tied=True)
        with torch.no_grad():
            for p in fresh.parameters():
                p.copy_(p.to(dtype))
        model, opt = minizero.parallelize(fresh, stage, adamw, precision=precision)
        sched = scheduler(opt)
        for _ in range(SAVE_AT):
            sched.step()  # (a scheduler's own state dict would do the same)
        opt.load_state_dict(saved["opt"])
        keys = fresh.load_state_dict(saved["model"])  # the inner model, as it was saved
        resumed = loop(model, opt, sched, range(SAVE_AT, STEPS), rank, world, dtype)
        out[precision] = {"straight": straight, "resumed": resumed, "keys": tuple(map(list, keys))}
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_the_wrapped_models_state_dict_loads_back_and_training_goes_on(stage, world):
    """``raw_model.load_state_dict(raw_model.state_dict())`` at stage 3 was torch's error
    (copy_ into a sharded parameter); now each rank's ranges go into its shard and its fp32
    masters, so save -> load -> train equals the run that never stopped, bitwise, at every stage."""
    for r, got in enumerate(run(inner_round_trip_rank, world, stage)):
        for precision, res in got.items():
            assert res["keys"] == ([], []), (precision, res["keys"])
            what = f"rank {r} {precision}: resumed vs never stopped"
            assert_states(res["resumed"], res["straight"], 0, what)


def deepcopy_rank():
    import copy

    out = []
    for stage in (0, 1, 2):
        raw = build("mlp")
        model, _ = minizero.parallelize(raw, stage, adamw, precision="bf16")
        before = model.state_dict()
        twin = copy.deepcopy(raw).float()  # a plain copy, e.g. for evaluation
        twin.load_state_dict({k: torch.zeros_like(v) for k, v in twin.state_dict().items()})
        after = model.state_dict()
        out.append(all(torch.equal(before[k], after[k]) for k in before))
    return out


def test_loading_into_a_deepcopy_of_the_wrapped_model_leaves_the_wrapper_alone():
    """The load hooks (the wrapper's params_written and full_module_load_state_dict) are dropped
    by copy.deepcopy: loading into the copy refreshed the wrapper's fp32 masters from its bf16
    working copy (a rounding of every master)."""
    for got in run(deepcopy_rank, 2):
        assert got == [True, True, True]


@pytest.mark.parametrize("given", ["list", "module"])
def test_an_optimizer_argument_of_another_kind_says_what_to_pass(given):
    """Not an optimizer nor a function making one: refused before any rank is touched, by type;
    a list of optimizers (one per param group, a habit from other frameworks) is told to use one
    optimizer with param groups."""
    from minizero.parallelize import build_optimizer

    model = torch.nn.Linear(2, 2)
    arg = [torch.optim.SGD(model.parameters(), lr=0.1)] if given == "list" else model
    with pytest.raises(TypeError) as e:
        build_optimizer(arg, model)
    msg = str(e.value)
    assert msg.startswith("optimizer must be a torch.optim.Optimizer over the model's parameters")
    assert ("one optimizer, with param groups" in msg) == (given == "list"), msg
