"""Names PyTorch users call on torch DDP's and FSDP2's wrappers, on minizero's (issue 16, going
further: nanoGPT's, the ImageNet example's, the FSDP tutorial's and Hugging Face's loops).

nanoGPT's ``model.require_backward_grad_sync = (micro == last)``, FSDP2's
``set_requires_gradient_sync``, nanoGPT's ``raw_model.state_dict()`` (the wrapped model itself),
``model.config``-style attributes, and an optimizer built after wrapping (the FSDP tutorial's
order)."""

import io

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, run, snapshot

import minizero
from minizero.analysis.ledger import CommLedger

pytestmark = pytest.mark.timeout(240)
STAGES = [0, 1, 2, 3]


def sgd(params):
    return torch.optim.SGD(params, 0.05, 0.9)


def accumulate_loop(model, opt, rank, world, set_sync, steps=2):
    states = []
    for step in range(steps):
        x, y = local_batch("mlp", step, rank, world)
        for micro, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            if set_sync is not None:
                set_sync(model, micro == 1)
            (model(xm, ym) / 2).backward()
        opt.step()
        opt.zero_grad()
        states.append(snapshot(model))
    return states


def nanogpt_sync(model, last):
    model.require_backward_grad_sync = last  # nanoGPT's train.py, on torch DDP


def fsdp2_sync(model, last):
    model.set_requires_gradient_sync(last)


def accumulate_rank(stage, how):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("mlp")
    model, opt = minizero.parallelize(model, stage, sgd)
    setter = {"nanogpt": nanogpt_sync, "fsdp2": fsdp2_sync}[how]
    try:
        with CommLedger() as ledger:
            states = accumulate_loop(model, opt, rank, world, setter)
    except RuntimeError as e:
        return {"error": str(e)}
    grads = [r for r in ledger.records if r.op == "all_reduce" and r.tag.startswith("ddp")]
    return {"states": states, "ddp_reductions": len(grads), "buckets": len(model.buckets)}


@pytest.mark.parametrize("how", ["nanogpt", "fsdp2"])
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_sync_switched_off_on_all_but_the_last_micro_batch(stage, how):
    model = build("mlp")
    want = accumulate_loop(model, sgd(model.parameters()), 0, 1, None)
    for r, got in enumerate(run(accumulate_rank, 2, stage, how)):
        assert "error" not in got, got  # stages 2-3 accumulate full gradients locally too
        for step, (g, w) in enumerate(zip(got["states"], want, strict=True)):
            for k in w:
                torch.testing.assert_close(g[k], w[k], atol=1e-6, rtol=0, msg=f"{step} {k}")
        if stage == 0:  # one all-reduce per bucket per step, not per micro-batch
            assert got["ddp_reductions"] == 2 * got["buckets"], (r, got["ddp_reductions"])


def inner_state_dict_rank(stage, precision):
    model = build("mlp")
    raw = model  # nanoGPT's raw_model (= model.module)
    model, opt = minizero.parallelize(model, stage, sgd, precision=precision)
    x, y = local_batch("mlp", 0, dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(raw.state_dict(), buf)  # every rank: collective at stages 1-3 in bf16, stage 3
    buf.seek(0)
    saved = torch.load(buf)
    fresh = build("mlp")
    fresh.load_state_dict(saved)
    assert model.module is raw
    kept = raw.state_dict(keep_vars=True)  # the parameter objects themselves, untouched
    kept = all(isinstance(v, torch.nn.Parameter) for k, v in kept.items() if k in saved)
    return {"saved": saved, "wrapper": model.state_dict(), "kept": kept}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_the_wrapped_models_own_state_dict_is_full_and_fp32(stage, precision):
    """At stage 3 it held the empty shards (torch.save wrote nothing usable), in bf16 the 16-bit
    working copy: now what the wrapper's state_dict() gives, the fp32 masters."""
    for got in run(inner_state_dict_rank, 2, stage, precision):
        for k, v in got["wrapper"].items():
            assert got["saved"][k].dtype == v.dtype, k
            torch.testing.assert_close(got["saved"][k], v, atol=0, rtol=0, msg=k)
        assert got["kept"]


def attribute_rank(stage):
    model = build("mlp")
    model, opt = minizero.parallelize(model, stage, sgd)
    out = {"layers": type(model.layers).__name__, "same": model.layers is model.module.layers}
    try:
        getattr(model, "no_such_attribute")  # noqa: B009 (the attribute access is the test)
    except AttributeError as e:
        out["missing"] = str(e)
    x, y = local_batch("mlp", 0, dist.get_rank(), dist.get_world_size())
    late = torch.optim.SGD(model.parameters(), 0.1)  # the FSDP tutorial's order
    model(x, y).backward()
    try:
        late.step()
        out["late"] = None
    except RuntimeError as e:
        out["late"] = str(e)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_attributes_of_the_model_and_an_optimizer_built_after_wrapping(stage):
    got = run(attribute_rank, 2, stage)[0]
    assert got["layers"] == "ModuleList" and got["same"]
    assert "no_such_attribute" in got["missing"]
    cls = {0: "DDP", 1: "ZeRO1", 2: "ZeRO2", 3: "ZeRO3"}[stage]
    assert got["missing"].startswith(f"'{cls}' object has no attribute"), got["missing"]
    assert got["late"] is None  # adopted at its first step (test_habits_idioms.py trains it)


def grad_scaler_rank(stage):
    from minizero.habits.optimizer import check_elementwise

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("mlp")
    model, opt = minizero.parallelize(model, stage, sgd)
    check_elementwise(opt)  # the optimizer parallelize returned is still the user's class's
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    states = []
    try:
        for step in range(2):  # nanoGPT's loop (fp32 here: the scaler's arithmetic is exact)
            x, y = local_batch("mlp", step, rank, world)
            scaler.scale(model(x, y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            states.append(snapshot(model))
    except RuntimeError as e:
        return {"error": str(e)}
    return {"states": states}


@pytest.mark.parametrize("stage", STAGES)
def test_torchs_grad_scaler_works_on_whole_gradients_and_is_refused_on_shards(stage):
    model = build("mlp")
    want = accumulate_loop(model, sgd(model.parameters()), 0, 1, None)
    for got in run(grad_scaler_rank, 2, stage):
        if stage > 0:
            assert "GradScaler cannot see whole gradients" in got["error"]
            assert "precision='fp16'" in got["error"]
            continue
        for g, w in zip(got["states"], want, strict=True):
            for k in w:
                torch.testing.assert_close(g[k], w[k], atol=1e-6, rtol=0, msg=k)


def typo_rank():
    from minizero.habits import Habits
    from minizero.zero1 import ZeRO1

    class MyZeRO1(ZeRO1):  # a lesson's subclass, with a typo in its own attribute's name
        def finish_grad_sync(self):
            return self.grad_buffer  # grad_buffers

    model = MyZeRO1(build("mlp"), extension=Habits)  # as the lessons' checks compose it
    try:
        model.finish_grad_sync()
    except AttributeError as e:
        return str(e)


def test_a_typo_in_a_subclass_names_the_subclass_and_the_attribute():
    """Issue 23: not the wrapped model's class (which the attribute forwarding asked last)."""
    got = run(typo_rank, 2)[0]
    want = "'MyZeRO1' object has no attribute 'grad_buffer' (nor has the model it wraps, MLP)"
    assert got == want, got


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("on_grad_ready", "post_accumulate_grad_hook"),
        ("reduce_gradients", "finish_grad_sync"),
        ("take_master", "take_optim_params"),
    ],
)
def test_a_subclass_with_a_moments_old_name_is_refused_with_the_new_one(old, new):
    """Issue 40: a lesson's class written before the rename would never be called; it fails where
    it is defined, and the message names what to write."""
    from minizero.zero1 import ZeRO1

    with pytest.raises(TypeError) as e:
        type("MyZeRO1", (ZeRO1,), {old: lambda self, *a: None})
    assert str(e.value) == (
        f"MyZeRO1.{old}: minizero calls this moment {new} now (and self.masters is "
        "self.optim_params); rename it in your class, as the lesson does"
    )
    type("MyZeRO1", (ZeRO1,), {new: lambda self, *a: None})  # the new name is taken
