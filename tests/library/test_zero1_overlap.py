"""Stage 1 with ``overlap_comm=True`` (minizero/zero1.py; DeepSpeed's option): each bucket's
reduce-scatter starts in backward, as soon as the bucket is complete, and the step uses what
backward reduced. The same sums as stage 1's reduce-scatter at the step, so the same run, bit
for bit; against one process; under no_sync(), clipping, fp16, and every habit that changes the
local gradients between a backward and the step (the reduction backward made is then stale)."""

import pytest
import torch
import torch.distributed as dist
from harness import (
    ATOL,
    CLIP,
    assert_same_run,
    build,
    check_ranks,
    ledger_step,
    local_batch,
    psi,
    run,
    snapshot,
    train_rank,
    wrap,
)

import minizero
from minizero.tools.train import TrainConfig

pytestmark = pytest.mark.timeout(180)
SPEC = "stage1_overlap"


def _habits(spec: str, precision: str = "fp32") -> list[dict]:
    """Steps whose local gradients change after a synchronised backward, before the step (fp16:
    an MLP and SGD, whose local sums come back from the division before the sum)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, opt, dtype = ("gpt", "adamw", None) if precision == "fp32" else ("mlp", "sgd", torch.half)
    model, opt = wrap(spec, build(kind, dtype), opt, precision=precision)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = local_batch(kind, step, rank, world)
        return (x, y) if dtype is None else (x.to(dtype), y.to(dtype))

    states = []
    # a synchronised backward, then one under no_sync(): the step reduces the sum of both
    model(*batch(0)).backward()
    with model.no_sync():
        model(*batch(1)).backward()
    opt.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()
    states.append(snapshot(model))
    # two steps on one backward: the second reduces the local sums again (clipping scaled the
    # first reduction in place)
    model(*batch(2)).backward()
    opt.clip_grad_norm_(CLIP)
    opt.step()
    opt.step()
    opt.zero_grad()
    states.append(snapshot(model))
    # p.grad = None by hand between two synchronised backwards: that gradient forgotten
    model(*batch(3)).backward()
    next(model.module.parameters()).grad = None
    model(*batch(4)).backward()
    opt.step()
    opt.zero_grad()
    states.append(snapshot(model))
    return states


def _everything() -> dict:
    out = {"clip": train_rank([SPEC, "stage1"], "gpt", "adamw", clip=CLIP)}
    out["accum"] = train_rank([SPEC, "stage1"], "mlp", "sgd", accum=2, no_sync=True)
    out["fp16"] = train_rank([SPEC, "stage1"], "mlp", "sgd", precision="fp16",
                             init_dtype=torch.float16)  # fmt: skip
    out["habits"] = {spec: _habits(spec) for spec in (SPEC, "stage1")}
    out["habits fp16"] = {spec: _habits(spec, "fp16") for spec in (SPEC, "stage1")}
    out["ledger"] = ledger_step(SPEC, "gpt")
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request) -> list[dict]:
    return run(_everything, request.param, timeout=120)


def test_it_trains_what_one_process_trains_bit_equal_to_stage_1(ranks):
    clipped = [r["clip"] for r in ranks]
    check_ranks(clipped, SPEC, "gpt", "adamw", ATOL["gpt", "adamw"], clip=CLIP)
    assert all(n > CLIP for n in clipped[0][SPEC]["norms"]), "clipping never engaged"
    accumulated = [r["accum"] for r in ranks]
    check_ranks(accumulated, SPEC, "mlp", "sgd", ATOL["mlp", "sgd"])
    for r, res in enumerate(ranks):
        for case in ("clip", "accum", "fp16"):
            got, want = res[case][SPEC], res[case]["stage1"]
            assert_same_run(got, want, 0.0, f"{case}, rank {r}")
            assert got["scales"] == want["scales"], f"{case}, rank {r}"
    assert ranks[0]["fp16"][SPEC]["scales"][0] < 2.0**16, "fp16 never skipped an overflow"


def test_a_stale_reduction_is_never_stepped(ranks):
    """no_sync() after a synchronised backward, a second step(), p.grad = None: each changes
    what the step must reduce; overlap_comm then reduces again, as stage 1 does at the step."""
    for r, res in enumerate(ranks):
        # fp16 divides each bucket by N before the sum and multiplies its local sums back after:
        # exact at N = 2 but for subnormals, which lose their last bit. Stage 1 makes that round
        # trip at each step, overlap_comm at each synchronised backward, so the p.grad = None
        # case (two backwards, one step) differs by 1.5e-6; a local sum left divided, 5e-3.
        for case, atol in (("habits", 0.0), ("habits fp16", 1e-4)):
            got, want = res[case][SPEC], res[case]["stage1"]
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                for k in w:
                    what = f"{case}, rank {r}, case {step}, {k}"
                    torch.testing.assert_close(g[k], w[k], atol=atol, rtol=0, msg=what)


def test_its_reduce_scatters_run_in_backward_and_move_stage_1s_bytes(ranks):
    res = ranks[0]["ledger"]
    assert res["quiet"] == 0, "a no_sync() backward communicated"
    (end,) = [i for i, label in res["marks"] if label == "backward end"]
    scatters = [r for r in res["records"] if r["op"] == "reduce_scatter"]
    gathers = [r for r in res["records"] if r["op"] == "all_gather"]
    assert len(scatters) == len(res["padded"]) >= 2, res["padded"]
    assert all(r["index"] < end for r in scatters), "a reduce-scatter waited for the step"
    assert all(r["index"] > end for r in gathers)
    padded = sum(res["padded"])
    assert psi("gpt") <= padded
    assert sum(r["numel"] for r in scatters) == sum(r["numel"] for r in gathers) == padded
    assert res["volume"] == 2 * padded


def _refusals() -> dict:
    out = {}
    for stage in (0, 2, 3):
        try:
            minizero.parallelize(build("mlp"), stage, overlap_comm=True)
        except TypeError as e:
            out[stage] = str(e)
    return out


def test_only_stage_1_takes_it():
    (got,) = run(_refusals, 1)
    for stage in (0, 2, 3):
        assert got[stage].startswith("['overlap_comm']: only stage 1 takes this option"), got
    assert "always reduce-scatter their gradients in backward" in got[2]
    with pytest.raises(ValueError, match="overlap_comm is a stage 1 option .stage 2 "
                                         "reduce-scatters in backward already"):  # fmt: skip
        TrainConfig(stage=2, overlap_comm=True)
    assert TrainConfig(stage=1, overlap_comm=True).stage_options() == {"overlap_comm": True}
    assert TrainConfig(stage=1).stage_options() == {}
