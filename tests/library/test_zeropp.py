"""ZeRO++ at stage 3 (Wang et al., arXiv 2306.10209): hpZ as FSDP2's ``reshard_after_forward``
(True, False, or k ranks per node) and qwZ (``quantize_weights=True``, int8 block all-gathers).

hpZ changes where backward's all-gather runs, never what is computed: every setting trains what
one process trains (1e-5, fp32), and k=2 what FSDP2's ``fully_shard(reshard_after_forward=2)``
trains. The ledger shows backward's all-gather over the world (True),
absent (False) or within the block of k ranks ("hpZ", no byte crossing a node of k ranks), and
the memory meter shows what it costs between forward and backward: nothing (True), the whole
units (False, in "comm") or the secondary shards, padded / k elements per unit (k, in "params").
qwZ's bytes are asserted exactly (int8 payload + fp32 scales against bf16 and fp32 gathers); it
changes the weights forward sees by at most 1/254 of a block's largest magnitude, and training
with it stays within a stated tolerance of the unquantised run. qgZ (``quantize_gradients=True``)
replaces each unit's reduce-scatter by all-to-alls of int8 rows and fp32 scales (bytes exact)
and trains within the same tolerance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import (
    ATOL,
    STEPS,
    assert_same_run,
    build,
    local_batch,
    optimizer_fn,
    reference,
    run,
    run_steps,
)

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import model_state_bytes
from minizero.zeropp import (
    QUANT_BLOCK,
    ZeROPlusPlus,
    dequantize_blockwise,
    quantization_error,
    quantize_blockwise,
)

pytestmark = pytest.mark.timeout(600)
OPT = {"mlp": "adam", "gpt": "adamw"}  # harness.ATOL's pairs


def _records(ledger: CommLedger) -> list[dict]:
    fields = ("op", "group", "ranks", "world", "numel", "nbytes", "tag")
    return [{f: getattr(r, f) for f in fields} | {"dtype": str(r.dtype)} for r in ledger.records]


def _measured_step(model, opt, kind: str, step: int, node_size: int) -> dict:
    """One more step, forward and backward under their own ledgers, with the model-state bytes
    (comm included) before the forward and between forward and backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = local_batch(kind, step, rank, world)
    before = model_state_bytes(model, opt, include_comm=True)
    with CommLedger(node_size=node_size) as fwd:
        loss = model(x, y)
    between = model_state_bytes(model, opt, include_comm=True)
    with CommLedger(node_size=node_size) as bwd:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return dict(
        fwd=_records(fwd),
        bwd=_records(bwd),
        bwd_nodes=bwd.node_bytes(),
        before=before,
        between=between,
        padded=[b.padded for b in model.buckets],
    )


def _train_settings(kind: str, settings: list) -> dict:
    """On one rank: for each reshard_after_forward setting, STEPS steps against one process,
    then one measured step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for raf in settings:
        model, opt = minizero.parallelize(
            build(kind), 3, optimizer_fn(OPT[kind]), reshard_after_forward=raf
        )
        res = run_steps(model, opt, kind, rank=rank, world=world)
        res["measured"] = _measured_step(model, opt, kind, STEPS, node_size=2)
        res["resolved"] = model.reshard_after_forward
        out[raf] = res
    if world == 4 and kind == "gpt":  # FSDP2's own hpZ, on the same units
        out["fsdp2 2"] = run_steps(*_fsdp2(build(kind), 2), kind, rank=rank, world=world)
        model, opt = minizero.parallelize(  # mixed precision: the secondary shards are bf16
            build(kind), 3, optimizer_fn(OPT[kind]), precision="bf16", reshard_after_forward=2
        )
        run_steps(model, opt, kind, rank=rank, world=world, steps=1)
        out["bf16 2"] = _measured_step(model, opt, kind, 1, node_size=2)
    if world == 4:  # FSDP2's rule for an int: a divisor of N; 1 is False, N is True
        errors = {}
        for bad in (3, 0, 2.0):
            try:
                ZeROPlusPlus(build(kind), reshard_after_forward=bad)
            except ValueError as e:
                errors[bad] = str(e)
        every = dist.new_group(list(range(world)))  # the same ranks, but not the world group
        try:  # hpZ makes its blocks with new_group on every rank: over the world only
            ZeROPlusPlus(build(kind), process_group=every, reshard_after_forward=2)
        except ValueError as e:
            out["subgroup"] = str(e)
        out["errors"] = errors
        out["trivial"] = [ZeROPlusPlus(build(kind), reshard_after_forward=k).reshard_after_forward
                          for k in (1, 4)]  # fmt: skip
    return out


def _fsdp2(model, reshard_after_forward):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model, optimizer_fn("adamw")([p for p in model.parameters() if p.requires_grad])


def _gathers(records: list[dict], group: str | None = None) -> list[dict]:
    return [r for r in records if r["op"] == "all_gather" and group in (None, r["group"])]


def _check_hpz(results: list[dict], kind: str, settings: list) -> None:
    want = reference(kind, OPT[kind])
    world = len(results)
    for rank, res in enumerate(results):
        for raf in settings:
            got = res[raf]
            assert_same_run(got, want, ATOL[(kind, OPT[kind])], f"{raf} rank {rank}")
            m = got["measured"]
            psi_padded = sum(m["padded"])  # Ψ plus each unit's padding to a multiple of N
            # forward: one all-gather of every unit over the world, whatever the setting
            assert sum(r["numel"] for r in _gathers(m["fwd"], "world")) == psi_padded
            assert {r["group"] for r in m["fwd"]} == {"world"}
            # backward: the reduce-scatter over the world, and the all-gather as the setting says
            rs = [r for r in m["bwd"] if r["op"] == "reduce_scatter"]
            assert sum(r["numel"] for r in rs) == psi_padded and {r["group"] for r in rs} == {
                "world"
            }
            gathers = _gathers(m["bwd"])
            grown = {c: m["between"][c] - m["before"][c] for c in m["before"]}
            if raf is True:
                assert {r["group"] for r in gathers} == {"world"}
                assert sum(r["numel"] for r in gathers) == psi_padded
                assert grown == {c: 0 for c in grown}, grown
            elif raf is False:
                assert gathers == []  # units stayed whole from forward on
                assert m["before"]["comm"] == 0
                assert grown == {"params": 0, "grads": 0, "optimizer": 0, "comm": 4 * psi_padded}
            else:  # an int k: within the k consecutive ranks of this rank's block
                k = raf
                block = tuple(range(rank - rank % k, rank - rank % k + k))
                assert {(r["group"], r["ranks"], r["world"]) for r in gathers} == {
                    ("hpZ", block, k)
                }
                assert sum(r["numel"] for r in gathers) == psi_padded
                assert sum(r["nbytes"] for r in gathers) == 4 * psi_padded
                # a ring within a node of k ranks: (k-1)/k of S sent, none across
                assert m["bwd_nodes"]["hpZ"] == {"inside": 4 * psi_padded * (k - 1) / k,
                                                 "across": 0.0}  # fmt: skip
                # memory: the secondary shards, padded / k fp32 elements per unit
                assert grown == {"params": 4 * psi_padded // k, "grads": 0, "optimizer": 0,
                                 "comm": 0}  # fmt: skip
            if world == 4 and raf is True:  # the ring over 4 ranks crosses after ranks 1 and 3:
                sent = 2 * 4 * psi_padded * 3 / 4  # backward's all-gather and reduce-scatter
                across = sent if rank % 2 else 0.0
                assert m["bwd_nodes"]["world"] == {"inside": sent - across, "across": across}


def test_hpz_int_on_4_ranks_trains_one_process_and_gathers_backward_within_the_block():
    for kind in ("mlp", "gpt"):
        results = run(_train_settings, 4, kind, [2, True], timeout=600)
        _check_hpz(results, kind, [2, True])
        res = results[0]
        assert res[2]["resolved"] == 2 and res[True]["resolved"] is True
        assert res["trivial"] == [False, True]
        assert set(res["errors"]) == {3, 0, 2.0}
        assert "needs the wrapper over the world group" in res["subgroup"]
        if kind == "gpt":
            for r, rank_res in enumerate(results):  # FSDP2's reshard_after_forward=2: the same
                assert_same_run(rank_res[2], rank_res["fsdp2 2"], ATOL[("gpt", "adamw")], f"{r}")
                m = rank_res["bf16 2"]
                grown = {c: m["between"][c] - m["before"][c] for c in m["before"]}
                assert grown["params"] == 2 * sum(m["padded"]) // 2  # bf16: 2 bytes, over k=2
                assert sum(r["nbytes"] for r in _gathers(m["bwd"], "hpZ")) == 2 * sum(m["padded"])
        for msg in res["errors"].values():
            assert "reshard_after_forward must be True, False or an int dividing" in msg


@pytest.mark.parametrize("world, kind", [(2, "gpt"), (3, "mlp")])
def test_hpz_true_and_false_train_one_process(world, kind):
    _check_hpz(run(_train_settings, world, kind, [True, False], timeout=600), kind, [True, False])


# -- qwZ ---------------------------------------------------------------------------------------
def test_blockwise_int8_round_trip_is_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-3, 1, 1000)  # blocks of very different scales
    q, scales = quantize_blockwise(x)
    assert q.dtype == torch.int8 and q.shape == (1000,) and scales.shape == (math.ceil(1000 / 256),)
    assert int(q.abs().max()) == 127  # each block's largest element maps to +-127
    back = dequantize_blockwise(q, scales).view(-1)
    step = scales.repeat_interleave(QUANT_BLOCK)[:1000]  # each element's block scale
    assert bool(((back - x).abs() <= step / 2 + 1e-7).all())
    err = quantization_error(x)
    assert 0 < err["max_rel"] <= 1 / 254 and 0 < err["rms_rel"] < 0.01
    zeros = quantize_blockwise(torch.zeros(300))
    assert not zeros[0].any() and not dequantize_blockwise(*zeros).any()  # no 0/0
    exact = torch.arange(-127, 128, dtype=torch.float32) * 0.5  # multiples of the scale
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(exact)).view(-1), exact)
    q4, s4 = quantize_blockwise(x, bits=4)  # qgZ's width, simulated: 15 levels, one int8 each
    assert int(q4.abs().max()) == 7 and q4.dtype == torch.int8
    back4 = dequantize_blockwise(q4, s4).view(-1)
    assert bool(((back4 - x).abs() <= s4.repeat_interleave(QUANT_BLOCK)[:1000] / 2 + 1e-7).all())


def _qwz_bytes(kind: str) -> dict:
    """Forward's all-gather records of one step at fp32, bf16 and fp32 with qwZ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, kw in {"fp32": {}, "bf16": {"precision": "bf16"}, "qwZ": {"quantize_weights": True},
                     "qgZ": {"quantize_gradients": True}}.items():  # fmt: skip
        model, opt = minizero.parallelize(build(kind), 3, optimizer_fn(OPT[kind]), **kw)
        x, y = local_batch(kind, 0, rank, world)
        with CommLedger() as fwd:
            loss = model(x, y)
        with CommLedger(node_size=1) as bwd:  # node_size 1: every other rank is away
            loss.backward()
        out[f"{name} nodes"] = bwd.node_bytes()
        padded = [b.padded for b in model.buckets]
        out[name] = dict(fwd=_records(fwd), bwd=_records(bwd), padded=padded)
    return out


def test_qwz_gathers_int8_blocks_and_fp32_scales_exactly():
    world = 2
    res = run(_qwz_bytes, world, "gpt")[0]
    padded = res["fp32"]["padded"]
    assert res["qwZ"]["padded"] == padded == res["bf16"]["padded"]
    for phase in ("fwd", "bwd"):  # reshard_after_forward=True: backward gathers again
        fp32, bf16, qwz = (_gathers(res[n][phase]) for n in ("fp32", "bf16", "qwZ"))
        assert sorted(r["nbytes"] for r in fp32) == sorted(4 * p for p in padded)
        assert sorted(r["nbytes"] for r in bf16) == sorted(2 * p for p in padded)
        int8 = [r for r in qwz if r["dtype"] == "torch.int8"]
        scales = [r for r in qwz if r["dtype"] == "torch.float32"]
        assert sorted(r["nbytes"] for r in int8) == sorted(padded)  # 1 byte per element
        blocks = [world * math.ceil(p // world / QUANT_BLOCK) for p in padded]  # per rank's shard
        assert sorted(r["nbytes"] for r in scales) == sorted(4 * b for b in blocks)
        total = sum(r["nbytes"] for r in qwz)
        assert total == sum(padded) + 4 * sum(blocks)
        assert total < 0.6 * sum(r["nbytes"] for r in bf16)
    # qgZ: no reduce-scatter; per unit one all-to-all of int8 rows and one of fp32 scales
    fp32_rs = [r for r in res["fp32"]["bwd"] if r["op"] == "reduce_scatter"]
    assert sorted(r["nbytes"] for r in fp32_rs) == sorted(4 * p for p in padded)
    ops = {r["op"] for r in res["qgZ"]["bwd"]}
    assert ops == {"all_gather", "all_to_all"}, ops
    a2a = [r for r in res["qgZ"]["bwd"] if r["op"] == "all_to_all"]
    int8 = sorted(r["nbytes"] for r in a2a if r["dtype"] == "torch.int8")
    scales = sorted(r["nbytes"] for r in a2a if r["dtype"] == "torch.float32")
    assert int8 == sorted(padded) and scales == sorted(4 * b for b in blocks)
    # all-to-all sends (N-1)/N of S straight to the owners: with N = 2, half, all away
    sent = sum(int8) + sum(scales)
    assert (
        res["qgZ nodes"]["total"]["across"]
        == res["fp32 nodes"]["total"]["across"] - sum(4 * p for p in padded) / 2 + sent / 2
    )


def _losses(kind: str, steps: int, **quantize: bool) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = minizero.parallelize(build(kind), 3, optimizer_fn(OPT[kind]), **quantize)
    losses = []
    for step in range(steps):
        x, y = local_batch(kind, step, rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # equal local batches: the mean of the means is the global mean
        losses.append(float(mean) / world)
    return losses


QWZ_STEPS = 30
# measured on TinyGPT width 32, 2 gloo ranks, 30 steps: qwZ 0.087%, qgZ 0.007% at worst
QWZ_LOSS_RTOL = 0.005


@pytest.mark.parametrize("what", ["quantize_weights", "quantize_gradients"])
def test_qwz_and_qgz_train_within_tolerance_of_unquantised(what):
    plain = run(_losses, 2, "gpt", QWZ_STEPS)[0]
    quant = run(_losses, 2, "gpt", QWZ_STEPS, **{what: True})[0]
    assert sum(quant[-5:]) < 0.9 * sum(quant[:5])  # it trains
    for step, (q, p) in enumerate(zip(quant, plain, strict=True)):
        assert abs(q - p) <= QWZ_LOSS_RTOL * p, f"step {step}: {what} loss {q}, unquantised {p}"


def test_all_to_all_sends_a_chunk_straight_to_each_peer():
    from minizero.analysis.topology import ring_bytes

    # 4 ranks, nodes of 2, S = 400 bytes: 100 to each of the 3 others, 1 inside, 2 across
    assert ring_bytes("all_to_all", 400, (0, 1, 2, 3), 0, node_size=2) == (100.0, 200.0)
    assert ring_bytes("all_to_all", 400, (0, 1, 2, 3), 3, node_size=4) == (300.0, 0.0)
    assert ring_bytes("all_to_all", 400, (2, 3), 2, node_size=1) == (0.0, 200.0)


def _with_mesh(steps: int) -> dict:
    """HSDP (a 2 x 2 mesh): qwZ and qgZ over the "shard" group, the replicas' average as
    without them; hpZ's int is checked against the shard group (2 there: k = 2 means True)."""
    from harness import hsdp_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, kw in {"plain": {}, "quantized": dict(quantize_weights=True,
                                                    quantize_gradients=True)}.items():  # fmt: skip
        model, opt = minizero.parallelize(build("gpt"), 3, optimizer_fn("adamw"),
                                          mesh=hsdp_mesh(), **kw)  # fmt: skip
        losses = []
        for step in range(steps):
            x, y = local_batch("gpt", step, rank, world)
            with CommLedger() as ledger:
                loss = model(x, y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        ops = sorted({(r.op, r.group, str(r.dtype)) for r in ledger.records})
        out[name] = dict(losses=losses, ops=ops)
    model, _ = minizero.parallelize(build("gpt"), 3, optimizer_fn("adamw"), mesh=hsdp_mesh(),
                                    reshard_after_forward=2)  # fmt: skip
    out["resolved"] = model.reshard_after_forward
    return out


def test_qwz_and_qgz_with_a_mesh_run_over_the_shard_group():
    res = run(_with_mesh, 4, 10)[0]
    assert res["quantized"]["ops"] == [
        ("all_gather", "shard", "torch.float32"),  # qwZ's scales
        ("all_gather", "shard", "torch.int8"),
        ("all_reduce", "replicate", "torch.float32"),  # the replicas' average of each shard
        ("all_to_all", "shard", "torch.float32"),  # qgZ's scales
        ("all_to_all", "shard", "torch.int8"),
    ]
    plain, quant = res["plain"]["losses"], res["quantized"]["losses"]
    for step, (q, p) in enumerate(zip(quant, plain, strict=True)):
        assert abs(q - p) <= QWZ_LOSS_RTOL * p, f"step {step}: {q} vs {p}"
    assert res["resolved"] is True  # FSDP2's rule: k equal to the shard group's size is True
