"""Hybrid sharding (minizero/hsdp.py) on 4 gloo ranks, 2 "nodes" x 2: ``parallelize(...,
mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))`` trains what one
process trains and what FSDP2's HSDP (``fully_shard(model, mesh=mesh)``) trains; per rank and step
the "shard" group carries 2Ψ (stages 1-2) or 3Ψ (stage 3) and "replicate" 2 x Ψ/2; flat ZeRO-3
and HSDP are compared by the bytes that cross a node boundary. One launch serves every test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import (
    ATOL,
    CLIP,
    assert_same_run,
    build,
    drift,
    hsdp_mesh,
    reference,
    run,
    run_steps,
    snapshot,
    train_rank,
    wrap,
)
from torch import nn

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.models import MLP, count_params

pytestmark = pytest.mark.timeout(900)
WORLD, NODE = 4, 2
EVEN = (8, 16, 8)  # every parameter's size is even: no padding, the volumes are exact in Ψ
PSI = count_params(MLP(EVEN))  # 288


def _even_step(spec: str) -> dict:
    """One step (after a warm-up step) of MLP(EVEN) under a ledger with node size 2."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, opt = wrap(spec, MLP(EVEN), "adam")
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(3, EVEN[0], generator=gen), torch.randn(3, EVEN[-1], generator=gen)
    model(x, y).backward()  # warm-up: stage 3 records its module order in the first step
    opt.step()
    opt.zero_grad()
    with CommLedger(node_size=NODE) as ledger:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return dict(
        groups=ledger.by_group(),
        records=[(r.group, r.op, r.numel) for r in ledger.records],
        nodes=ledger.node_bytes(),
        padded=[b.padded for b in model.buckets],
    )


def _errors() -> dict[str, str]:
    """What bad meshes and an HSDP checkpoint raise, by case."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    cases = {
        "1-D": lambda: init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",)),
        "names": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard")),
        "order": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate")),
    }
    for case, make in cases.items():
        try:
            minizero.parallelize(MLP(EVEN), 1, lambda ps: torch.optim.SGD(ps, lr=0.1), mesh=make())
        except (TypeError, ValueError) as e:
            out[case] = str(e)
    group = dist.new_group([0, 1])  # made by every rank, as new_group must be
    try:
        sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
        minizero.parallelize(MLP(EVEN), 1, sgd, mesh=hsdp_mesh(), process_group=group)
    except TypeError as e:
        out["both"] = str(e)
    model, opt = wrap("hsdp2", MLP(EVEN), "sgd")
    try:
        minizero.save_checkpoint("/nonexistent/hsdp", model, opt)
    except NotImplementedError as e:
        out["checkpoint"] = str(e)
    return out


def _everything() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"train": {}}
    for opt in ("adam", "sgd"):
        specs = ["hsdp0", "hsdp1", "hsdp2", "hsdp3", "fsdp2_hsdp"]
        for spec, res in train_rank(specs, "mlp", opt).items():
            out["train"][spec, opt] = res
    for spec, res in train_rank(["hsdp3", "fsdp2_hsdp"], "gpt", "adamw").items():
        out["train"][spec, "gpt"] = res  # TinyGPT: a unit per block, the tied embedding
    # clipping: the norm is reduced over the shard group only (the replicas hold equal shards).
    # (No accumulation here: 12 rows over 4 ranks leave 3 a rank, no 2 equal micro-batches.)
    for spec in ("hsdp1", "hsdp3"):
        model, o = wrap(spec, build("mlp"), "adam")
        out["clip", spec] = run_steps(model, o, "mlp", rank=rank, world=world, clip=CLIP)
    out["steps"] = {spec: _even_step(spec) for spec in ("hsdp0", "hsdp1", "hsdp2", "hsdp3")}
    out["steps"]["flat3"] = _even_step("stage3")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        specs = ["hsdp1", "hsdp2", "hsdp3", "stage0"]
        out["mp", precision] = train_rank(specs, "mlp", "sgd", precision=precision,
                                          init_dtype=dtype)  # fmt: skip
    out["unused"] = _unused_on_one_node()
    out["errors"] = _errors()
    out["modules"] = _modules_differ_across_nodes()  # last: it leaves a model mid-forward
    return out


class Branchy(nn.Module):
    """Two units; ``b`` is used only where ``use_b`` (on one node, below)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.layers[0](x)
        return (self.layers[1](h) if use_b else h).pow(2).mean()


def _branchy_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _unused_on_one_node() -> dict:
    """Stage 1 with a mesh and find_unused_parameters: ``layers.1`` is used on the second node
    only; every rank must still step it (used somewhere), with the world's average."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    model, opt = minizero.parallelize(
        Branchy(), 1, sgd, mesh=hsdp_mesh(), find_unused_parameters=True
    )
    for step in range(2):
        model(_branchy_batch(rank, step), rank >= NODE).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in minizero.full_state_dict(model).items()}


def _branchy_reference() -> dict:
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        sum(model(_branchy_batch(r, step), r >= NODE) / WORLD for r in range(WORLD)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _modules_differ_across_nodes() -> str:
    """Stage 3 with a mesh: the second node runs another unit first. Inside each node the ranks
    agree, so a check over the shard group alone would pass (and the replicas' all-reduces
    would pair up different units); the check runs over every rank."""
    torch.manual_seed(0)
    model, _ = minizero.parallelize(Branchy(), 3, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                    mesh=hsdp_mesh())  # fmt: skip
    inner = model.module
    if dist.get_rank() >= NODE:
        inner.layers[0], inner.layers[1] = inner.layers[1], inner.layers[0]
    try:
        model(torch.ones(3, 4), True)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run(_everything, WORLD, timeout=600)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hsdp_trains_what_one_process_trains(ranks, stage, opt):
    want = reference("mlp", opt)
    for r, res in enumerate(ranks):
        got = res["train"][f"hsdp{stage}", opt]
        assert_same_run(got, want, ATOL["mlp", opt], f"hsdp{stage} {opt} rank {r}")


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_hsdp_stage3_trains_what_fsdp2_hsdp_trains(ranks, opt):
    want = reference("mlp", opt)
    for r, res in enumerate(ranks):
        fsdp2 = res["train"]["fsdp2_hsdp", opt]
        assert_same_run(fsdp2, want, ATOL["mlp", opt], f"FSDP2 HSDP {opt} rank {r}")
        got = res["train"]["hsdp3", opt]
        assert_same_run(got, fsdp2, ATOL["mlp", opt], f"hsdp3 vs FSDP2 HSDP {opt} rank {r}")


def test_hsdp_stage3_trains_tinygpt_as_one_process_and_fsdp2_hsdp(ranks):
    want, atol = reference("gpt", "adamw"), ATOL["gpt", "adamw"]
    for r, res in enumerate(ranks):
        fsdp2, got = res["train"]["fsdp2_hsdp", "gpt"], res["train"]["hsdp3", "gpt"]
        assert_same_run(fsdp2, want, atol, f"FSDP2 HSDP TinyGPT rank {r}")
        assert_same_run(got, want, atol, f"hsdp3 TinyGPT rank {r}")
        assert_same_run(got, fsdp2, atol, f"hsdp3 vs FSDP2 HSDP TinyGPT rank {r}")


def test_clip_grad_norm_with_a_mesh_clips_by_the_global_norm(ranks):
    want = reference("mlp", "adam", clip=CLIP)
    for r, res in enumerate(ranks):
        for spec in ("hsdp1", "hsdp3"):
            got = res["clip", spec]
            assert_same_run(got, want, ATOL["mlp", "adam"], f"{spec} clip rank {r}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_volume_per_group_is_exact(ranks, stage):
    """Paper volumes per rank and step: stage 0 = DDP over the world (2Ψ); stages 1-3: "shard"
    2Ψ or 3Ψ, "replicate" one all-reduce of this rank's shard, Ψ/2 elements, so 2 x Ψ/2."""
    for r, res in enumerate(ranks):
        step = res["steps"][f"hsdp{stage}"]
        assert sum(step["padded"]) == PSI, step["padded"]  # no padding: the sizes are exact
        if stage == 0:
            assert step["groups"] == {"world": 2 * PSI}, (r, step["groups"])
            continue
        shard = 3 * PSI if stage == 3 else 2 * PSI
        assert step["groups"] == {"shard": shard, "replicate": 2 * (PSI // 2)}, (r, step)
        replicas = [(op, n) for g, op, n in step["records"] if g == "replicate"]
        assert {op for op, _ in replicas} == {"all_reduce"}, replicas
        assert sum(n for _, n in replicas) == PSI // 2, replicas


def test_hsdp_keeps_stage3_traffic_inside_the_node(ranks):
    """Ring model (analysis/topology.py), fp32, node size 2. Flat ZeRO-3 over ranks 0-3: three
    collectives of S = 4Ψ bytes, each rank sending 3/4 S to its successor: 9Ψ bytes, across for
    ranks 1 and 3 (successors 2 and 0 are on the other node), inside for ranks 0 and 2. HSDP:
    the same three over a node's 2 ranks, 1/2 S each, 6Ψ inside; plus the replicate all-reduce
    of the shard (2Ψ bytes) over 2 nodes, 2(2-1)/2 x 2Ψ = 2Ψ across, on every rank."""
    for r, res in enumerate(ranks):
        flat, hsdp = res["steps"]["flat3"]["nodes"], res["steps"]["hsdp3"]["nodes"]
        crosses = r % NODE == NODE - 1
        want = {"inside": 0.0, "across": 9.0 * PSI} if crosses else {"inside": 9.0 * PSI,
                                                                      "across": 0.0}  # fmt: skip
        assert flat["total"] == want, (r, flat)
        assert hsdp["shard"] == {"inside": 6.0 * PSI, "across": 0.0}, (r, hsdp)
        assert hsdp["replicate"] == {"inside": 0.0, "across": 2.0 * PSI}, (r, hsdp)
        assert hsdp["total"] == {"inside": 6.0 * PSI, "across": 2.0 * PSI}, (r, hsdp)
    across = lambda key: sum(res["steps"][key]["nodes"]["total"]["across"] for res in ranks)
    assert (across("flat3"), across("hsdp3")) == (18.0 * PSI, 8.0 * PSI)
    print(f"bytes across nodes per step, 4 ranks: flat ZeRO-3 {across('flat3'):.0f}, "
          f"HSDP {across('hsdp3'):.0f} (Ψ = {PSI})")  # fmt: skip


def test_bad_meshes_and_hsdp_checkpoints_are_refused_clearly(ranks):
    for res in ranks:
        e = res["errors"]
        assert set(e) == {"1-D", "names", "order", "both", "checkpoint"}, e
        for case in ("1-D", "names", "order"):
            assert "('replicate', 'shard')" in e[case] and "init_device_mesh" in e[case], e[case]
        assert "1-D mesh" in e["1-D"] and "('dp', 'shard')" in e["names"], e
        assert "not both" in e["both"], e["both"]
        assert "mesh (HSDP)" in e["checkpoint"] and "state_dict()" in e["checkpoint"], e


def test_mixed_precision_with_a_mesh_tracks_stage0_and_fp32(ranks):
    """As test_zero.py's test_mixed_precision (its tolerances, SGD): fp32 masters, 16-bit
    working copy and gradients; fp16 skips the overflowing steps as stage 0 does."""
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        init = snapshot(build("mlp", dtype))
        scales = ranks[0]["mp", precision]["stage0"]["scales"]
        skip = tuple(i for i, s in enumerate(scales) if s < ([2.0**16] + scales)[i])
        want = reference("mlp", "sgd", skip=skip, init_dtype=dtype)
        for r, res in enumerate(ranks):
            runs = res["mp", precision]
            for spec in ("hsdp1", "hsdp2", "hsdp3"):
                assert runs[spec]["scales"] == scales, (precision, spec, r)
                apart = drift(runs[spec], runs["stage0"], init)
                assert apart <= 0.01, f"rank {r}: {spec} vs stage 0 in {precision}: {apart:.3g}"
                apart = drift(runs[spec], want, init)
                assert apart <= 0.02, f"rank {r}: {spec} {precision} vs fp32: {apart:.3g}"


def test_a_parameter_used_on_one_node_only_is_stepped_everywhere(ranks):
    want = _branchy_reference()
    for r, res in enumerate(ranks):
        for k, v in want.items():
            torch.testing.assert_close(res["unused"][k], v, atol=1e-6, rtol=0, msg=f"{k} rank {r}")


def test_stage3_checks_the_modules_across_nodes(ranks):
    for r, res in enumerate(ranks):
        e = res["modules"]
        assert "ranks ran different modules" in e, (r, e)
        assert "rank 0: forward of 'layers.0'" in e and "rank 2: forward of 'layers.1'" in e, e


def test_ddp_refuses_a_replicate_group_it_would_never_average_over():
    """HSDP is data on stages 1-3; DDP (stage 0) over a replicate group would broadcast over it
    and then average over its own group only: a silent wrong answer, refused before anything."""
    with pytest.raises(TypeError, match=r"DDP takes no replicate_group: HSDP shards \(stages 1-3"):
        minizero.DDP(nn.Linear(2, 2), replicate_group=object())
