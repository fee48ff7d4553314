"""DDP (minizero/ddp.py, lesson 01_ddp): NaiveDDP and bucketed DDP against one process on the
global batch and against PyTorch's DistributedDataParallel, step by step, on gloo."""

import pytest
import torch
from harness import (
    ATOL,
    CLIP,
    assert_same_run,
    build,
    check_ranks,
    ledger_step,
    psi,
    run,
    train_rank,
    wrap,
)

pytestmark = pytest.mark.timeout(120)
CASES = [("mlp", "adam"), ("gpt", "adamw"), ("mlp", "sgd")]


# -- equivalence -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,opt", CASES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("impl", ["naive", "ddp"])
def test_matches_single_process_and_torch_ddp(impl, world, kind, opt):
    """Tied weights, a frozen weight, sizes that do not divide by the world size."""
    results = run(train_rank, world, [impl, "torch_ddp"], kind, opt)
    atol = ATOL[kind, opt]
    check_ranks(results, impl, kind, opt, atol)
    check_ranks(results, "torch_ddp", kind, opt, atol)  # the reference itself is right
    for r, res in enumerate(results):
        assert_same_run(res[impl], res["torch_ddp"], atol, f"{impl} rank {r} vs torch DDP")


def count_buckets(kind):
    model, _ = wrap("ddp", build(kind), "adam")
    return len(model.buckets)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_tiny_cap_gives_several_buckets(kind):
    """The equivalence tests above really exercise several buckets."""
    assert run(count_buckets, 1, kind)[0] >= 3


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "sync_every_backward"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("impl", ["naive", "ddp"])
def test_gradient_accumulation(impl, world, no_sync):
    """Two backwards per step (loss / 2 each) == one backward on the whole global batch."""
    results = run(train_rank, world, [impl], "mlp", "sgd", accum=2, no_sync=no_sync)
    check_ranks(results, impl, "mlp", "sgd", ATOL["mlp", "sgd"])


@pytest.mark.parametrize("kind,opt", [("mlp", "adam"), ("gpt", "sgd")])
@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm(world, kind, opt):
    """optimizer.clip_grad_norm_ == torch.nn.utils.clip_grad_norm_ on the single-process model:
    same norms, same parameters (stage 0 = DDP through parallelize; NaiveDDP with torch's util)."""
    results = run(train_rank, world, ["stage0", "naive"], kind, opt, clip=CLIP)
    check_ranks(results, "stage0", kind, opt, ATOL[kind, opt], clip=CLIP)
    check_ranks(results, "naive", kind, opt, ATOL[kind, opt], clip=CLIP)
    assert all(n > CLIP for n in results[0]["stage0"]["norms"]), "clipping never engaged"


# -- communication: volume and overlap ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("impl", ["naive", "ddp"])
def test_ledger_volume_is_two_psi(impl, world, kind):
    """One step moves exactly 2Ψ elements (ZeRO §7.1), all of it in all-reduces of Ψ elements in
    total, fp32, S = numel * 4 bytes; nothing moves inside no_sync()."""
    n = psi(kind)
    for res in run(ledger_step, world, impl, kind):
        assert res["quiet"] == 0, "no_sync() backward communicated"
        assert res["volume"] == 2 * n
        assert {r["op"] for r in res["records"]} == {"all_reduce"}
        assert sum(r["numel"] for r in res["records"]) == n
        for r in res["records"]:
            assert r["dtype"] == torch.float32 and r["nbytes"] == r["numel"] * 4, r
            assert r["world"] == world, r


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_overlap_structure(kind):
    """Bucketed DDP starts bucket 0's all-reduce during backward (before the "backward end" mark);
    NaiveDDP issues every all-reduce after it."""
    ddp, naive = (run(ledger_step, 2, impl, kind)[0] for impl in ("ddp", "naive"))
    assert len(ddp["padded"]) >= 2
    (end,) = [i for i, label in ddp["marks"] if label == "backward end"]
    first = [r["index"] for r in ddp["records"] if r["tag"] == "ddp bucket 0"]
    assert len(first) == 1 and first[0] < end, (first, end)
    assert sum(r["index"] < end for r in ddp["records"]) >= 2, "only one bucket overlapped"
    (end,) = [i for i, label in naive["marks"] if label == "backward end"]
    assert naive["records"] and all(r["index"] > end for r in naive["records"])


# -- the same on GPUs, NCCL, one rank per GPU --------------------------------------------------
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.gpu(1)), pytest.param(2, marks=pytest.mark.gpu(2))]
)
@pytest.mark.parametrize("impl", ["naive", "ddp", "stage0"])
def test_nccl_matches_single_process_and_torch_ddp(impl, world):
    """On the GPU the kernels differ from the CPU reference's, so 1e-5 instead of 1e-6."""
    results = run(train_rank, world, [impl, "torch_ddp"], "mlp", "adam", backend="nccl")
    check_ranks(results, impl, "mlp", "adam", 1e-5)
    for r, res in enumerate(results):
        assert_same_run(res[impl], res["torch_ddp"], 1e-5, f"{impl} rank {r} vs torch DDP")
