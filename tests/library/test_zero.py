"""ZeRO stages 1-3 (minizero/zero1.py .. zero3.py, lessons 02-04) through ``parallelize``: against
one process on the global batch, DDP (stage 0), ZeroRedundancyOptimizer (stage 1) and FSDP2
(stage 3), step by step on gloo; mixed precision; communication volume and structure."""

import pytest
import torch
from harness import (
    ATOL,
    CLIP,
    STEPS,
    assert_same_run,
    build,
    check_ranks,
    drift,
    ledger_step,
    psi,
    reference,
    run,
    snapshot,
    train_rank,
    wrap,
)

import minizero
from minizero.launcher import launch

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 60  # seconds per launch (a test needs < 10)
CASES = [("mlp", "adam"), ("gpt", "adamw"), ("mlp", "sgd")]
STAGES = [1, 2, 3]


# -- fp32: equal to one process, to DDP, to PyTorch's ZeRO-1 and FSDP2 ------------------------
@pytest.mark.parametrize("kind,opt", CASES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_matches_single_process_and_ddp(stage, world, kind, opt):
    """Tied weights, a frozen weight, sizes that need padding at 2 and 3 ranks."""
    spec = f"stage{stage}"
    results = run(train_rank, world, [spec, "stage0"], kind, opt)
    check_ranks(results, spec, kind, opt, ATOL[kind, opt])
    for r, res in enumerate(results):
        assert_same_run(res[spec], res["stage0"], ATOL[kind, opt], f"{spec} rank {r} vs DDP")


@pytest.mark.parametrize("kind,opt", [("mlp", "adam"), ("gpt", "adamw")])
@pytest.mark.parametrize("world", [2, 3])
def test_stage1_matches_zero_redundancy_optimizer(world, kind, opt):
    """torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=Adam[W])."""
    results = run(train_rank, world, ["stage1", "torch_zero"], kind, opt)
    check_ranks(results, "torch_zero", kind, opt, ATOL[kind, opt])
    for r, res in enumerate(results):
        assert_same_run(res["stage1"], res["torch_zero"], ATOL[kind, opt], f"rank {r}")


@pytest.mark.parametrize("kind,opt", [("mlp", "adam"), ("gpt", "adamw")])
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_matches_fsdp2(world, kind, opt):
    """FSDP2: fully_shard on each transformer block, then the root, on a CPU DeviceMesh."""
    results = run(train_rank, world, ["stage3", "fsdp2"], kind, opt)
    check_ranks(results, "fsdp2", kind, opt, ATOL[kind, opt])
    for r, res in enumerate(results):
        assert_same_run(res["stage3"], res["fsdp2"], ATOL[kind, opt], f"rank {r}")


@pytest.mark.parametrize("no_sync", [False, True], ids=["sync_every_backward", "no_sync"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation(stage, world, no_sync):
    """Two backwards per step (loss / 2 each) == one backward on the whole global batch. Under
    no_sync() stages 2 and 3 accumulate the full gradient locally and reduce-scatter the sum at
    the last backward, as FSDP2 under set_requires_gradient_sync(False) (test_no_sync.py)."""
    results = run(train_rank, world, [f"stage{stage}"], "mlp", "sgd", accum=2, no_sync=no_sync)
    check_ranks(results, f"stage{stage}", "mlp", "sgd", ATOL["mlp", "sgd"])


@pytest.mark.parametrize("kind,opt", [("mlp", "adam"), ("gpt", "sgd")])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_norm(stage, world, kind, opt):
    """optimizer.clip_grad_norm_ (the global norm, summed over shards) ==
    torch.nn.utils.clip_grad_norm_ on the single-process model: same norms, same parameters."""
    spec = f"stage{stage}"
    results = run(train_rank, world, [spec], kind, opt, clip=CLIP)
    check_ranks(results, spec, kind, opt, ATOL[kind, opt], clip=CLIP)
    assert all(n > CLIP for n in results[0][spec]["norms"]), "clipping never engaged"


# -- mixed precision ---------------------------------------------------------------------------
# Tolerances on drift() (distance between runs / distance travelled), per optimizer: (stage k vs
# stage 0 in the same precision, 16-bit vs fp32 from the same initial weights). Measured at 3
# ranks, max over stages and bf16/fp16: SGD 0.005 and 0.005; AdamW 0.027 and 0.08 (Adam turns
# rounding noise in tiny gradients into full-size steps). Stage k and stage 0 differ because the
# 16-bit gradient is averaged in another order: DDP divides before its all-reduce, ZeRO after its
# reduce-scatter (at 2 ranks both are exact: halving is exact in binary).
MP_TOL = {"sgd": (0.01, 0.02), "adamw": (0.06, 0.2)}


@pytest.mark.parametrize("kind,opt", [("gpt", "adamw"), ("mlp", "sgd")])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision(stage, precision, kind, opt):
    """fp32 masters: stage k agrees with stage 0 and tracks fp32. fp16 skips the steps whose
    scaled gradients overflow (the first, at scale 2^16), as the fp32 reference is told to."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    spec = f"stage{stage}"
    results = run(train_rank, 3, [spec, "stage0"], kind, opt, precision=precision,
                  init_dtype=dtype)  # fmt: skip
    init = snapshot(build(kind, dtype))
    scales = results[0]["stage0"]["scales"]
    skip = tuple(i for i, s in enumerate(scales) if s < ([2.0**16] + scales)[i])
    assert (precision == "fp16") == bool(skip) and len(skip) < STEPS, scales
    want = reference(kind, opt, skip=skip, init_dtype=dtype)
    for r, res in enumerate(results):
        assert res[spec]["scales"] == scales, f"rank {r}: loss scales differ from stage 0"
        for name in res:
            last = res[name]["states"][-1]
            assert all(v.dtype == torch.float32 for v in last.values()), name
            # the masters hold what 16 bits cannot: the updates are not rounded away
            assert any(not torch.equal(v, v.to(dtype).float()) for v in last.values()), name
        vs_stage0, vs_fp32 = MP_TOL[opt]
        apart = drift(res[spec], res["stage0"], init)
        assert apart <= vs_stage0, f"rank {r}: {spec} vs stage 0 in {precision}: {apart:.3g}"
        apart = drift(res[spec], want, init)
        assert apart <= vs_fp32, f"rank {r}: {spec} {precision} vs fp32: {apart:.3g}"


# -- full_state_dict ---------------------------------------------------------------------------
def state_after_wrap(stage, kind, precision):
    model, _ = wrap(f"stage{stage}", build(kind), "adam", precision=precision)
    return minizero.full_state_dict(model)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("stage", STAGES)
def test_full_state_dict(stage, kind, precision):
    """Every rank gets the unwrapped model's keys, full fp32 tensors, equal to the initial model:
    in bf16 too, since the fp32 masters are taken before the cast (a frozen weight has no master:
    it is its bf16 working copy)."""
    want = build(kind).state_dict()
    if precision == "bf16":
        frozen = {n for n, p in build(kind).named_parameters() if not p.requires_grad}
        want = {k: v.bfloat16().float() if k in frozen else v for k, v in want.items()}
    for r, got in enumerate(run(state_after_wrap, 3, stage, kind, precision)):
        assert list(got) == list(want), f"rank {r}"
        for k in want:
            assert got[k].dtype == torch.float32, f"rank {r} {k}: {got[k].dtype}"
            torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=f"rank {r} {k}")


# -- communication: volume and structure -------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "mlp_untied", "gpt"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_ledger_volume(stage, world, kind):
    """Per step (after the first), stages 1 and 2 move 2Ψ and stage 3 moves 3Ψ up to padding
    (§7.2): every bucket / unit is reduce-scattered once and all-gathered once (stage 3: twice,
    forward and backward; a tied unit too, however many modules use it). Padding is under
    ``world`` elements per bucket; S of a reduce-scatter or all-gather is the full padded bucket."""
    n = psi(kind)
    for res in run(ledger_step, world, f"stage{stage}", kind):
        padded = res["padded"]
        assert n <= sum(padded) < n + world * len(padded)
        by_op: dict[str, int] = {}
        for r in res["records"]:
            by_op[r["op"]] = by_op.get(r["op"], 0) + r["numel"]
            assert r["nbytes"] == r["numel"] * 4 and r["numel"] in padded, r
        gathers = 2 if stage == 3 else 1
        assert by_op == {"reduce_scatter": sum(padded), "all_gather": gathers * sum(padded)}
        assert res["volume"] == (1 + gathers) * sum(padded)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("stage", STAGES)
def test_communication_structure(stage, kind):
    """Each synced backward ends with a "backward end" mark. Stage 1 communicates only in the
    step (after it); stage 2's first reduce-scatter starts during backward (before it); stage 3
    gathers no unit again after reducing its gradient, and frees every unit after the step."""
    res = run(ledger_step, 2, f"stage{stage}", kind)[0]
    ends = [i for i, label in res["marks"] if label == "backward end"]
    assert len(ends) == 1, f"marks: {res['marks']}"
    recs = res["records"]
    if stage == 1:
        assert all(r["index"] > ends[0] for r in recs)
    else:
        first = min(r["index"] for r in recs if r["op"] == "reduce_scatter")
        assert first < ends[0]
    if stage == 3:
        reduced: set[str] = set()
        for r in recs:
            unit = r["tag"].rsplit(" ", 1)[-1]
            if r["op"] == "reduce_scatter":
                reduced.add(unit)
            elif r["index"] < ends[0]:
                assert unit not in reduced, f"unit {unit} gathered after its reduce-scatter"
        assert all(res["freed"]), f"units still gathered after the step: {res['freed']}"


# -- errors ------------------------------------------------------------------------------------
def lbfgs_error(stage, precision):
    try:
        minizero.parallelize(build("mlp"), stage, lambda ps: torch.optim.LBFGS(ps),
                             precision=precision)  # fmt: skip
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")])
def test_non_elementwise_optimizer_is_refused(stage, precision):
    """Sharded or master-weight optimizers step flat 1-D tensors: LBFGS would mix elements."""
    (msg,) = run(lbfgs_error, 1, stage, precision)
    assert msg is not None and "LBFGS" in msg and "elementwise" in msg, msg


def test_lbfgs_allowed_for_fp32_ddp():
    """Stage 0 in fp32 steps the model's own parameters, so any optimizer works."""
    assert run(lbfgs_error, 1, 0, "fp32") == [None]


@pytest.mark.parametrize("stage", [4, -1, "1", None])
def test_bad_stage(stage):
    with pytest.raises(ValueError, match=r"stage must be 0 \(DDP\), 1, 2 or 3"):
        minizero.parallelize(build("mlp"), stage, lambda ps: torch.optim.Adam(ps))


# -- the same on GPUs, NCCL, one rank per GPU --------------------------------------------------
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.gpu(1)), pytest.param(2, marks=pytest.mark.gpu(2))]
)
@pytest.mark.parametrize("stage", STAGES)
def test_nccl_matches_single_process_and_ddp(stage, world):
    """On the GPU the kernels differ from the CPU reference's, so 1e-5 instead of 1e-6."""
    spec = f"stage{stage}"
    results = launch(train_rank, world, [spec, "stage0"], "mlp", "adam", backend="nccl",
                     timeout=TIMEOUT, verbose=False)  # fmt: skip
    check_ranks(results, spec, "mlp", "adam", 1e-5)
    for r, res in enumerate(results):
        assert_same_run(res[spec], res["stage0"], 1e-5, f"{spec} rank {r} vs DDP")
