"""The α-β cost model (minizero/analysis/cost.py): the fit recovers α and β exactly from synthetic
times; the collectives it predicts for a step are the ones a real gloo run records, byte for byte,
at stages 0-3; predicted step times are printed beside measured ones (no timing asserts)."""

from __future__ import annotations

import statistics
import time
from collections import Counter

import harness as H
import pytest
import torch.distributed as dist

import minizero
from minizero import collectives as C
from minizero.analysis import cost
from minizero.topology import ring_bytes

SIZES = [2**k for k in range(10, 25, 2)]


def _synthetic(link: cost.Link, n: int, ops, emulated_rs: bool) -> list[dict]:
    return [
        dict(op=op, nbytes=s, seconds=cost.collective_time(op, s, n, link, emulated_rs=emulated_rs))
        for op in ops
        for s in SIZES
    ]


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("emulated_rs", [False, True])
@pytest.mark.parametrize("relative", [False, True])
def test_fit_recovers_alpha_and_beta_from_synthetic_sweeps(n, emulated_rs, relative):
    truth = cost.Link(alpha=23e-6, beta=3.7e9)
    rows = _synthetic(truth, n, cost.OPS, emulated_rs)
    got = cost.fit(rows, n, emulated_rs=emulated_rs, relative=relative)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert got.beta == pytest.approx(truth.beta, rel=1e-9)
    one_op = _synthetic(truth, n, ["all_gather"], emulated_rs)  # one op, many sizes: enough
    assert cost.fit(one_op, n, emulated_rs=emulated_rs).beta == pytest.approx(truth.beta)


def test_fit_refuses_what_cannot_be_fitted():
    with pytest.raises(ValueError, match="two message sizes"):
        cost.fit([dict(op="all_reduce", nbytes=1024, seconds=1e-4)], 2)
    flat = [dict(op="all_reduce", nbytes=s, seconds=1e-3 - s * 1e-12) for s in SIZES]
    with pytest.raises(ValueError, match="measure larger messages"):
        cost.fit(flat, 2)
    with pytest.raises(ValueError, match="op must be one of"):
        cost.fit([dict(op="gather", nbytes=1, seconds=1)], 2)
    with pytest.raises(ValueError, match="> 0 s"):
        cost.fit([dict(op="all_reduce", nbytes=1, seconds=0)] * 2, 2)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ring_bytes_are_topologys(op, n):
    for rank in range(n):
        inside, across = ring_bytes(op, 4096, tuple(range(n)), rank, node_size=2, src=n - 1)
        if op == "broadcast":  # topology: the chain's last rank sends nothing
            continue
        assert cost.ring(op, 4096, n)[1] == inside + across


def test_gloo_reduce_scatter_costs_an_all_reduce():
    emulated = cost.ring("reduce_scatter", 1000, 4, emulated_rs=True)
    assert emulated == cost.ring("all_reduce", 1000, 4)
    assert cost.ring("reduce_scatter", 1000, 4) == (3, 750.0)


@pytest.mark.parametrize("k", [1, 2, 7, 50])
@pytest.mark.parametrize("backward_s", [0.0, 1e-3, 0.1])
def test_bucket_exposed_is_the_closed_form_for_equal_buckets(k, backward_s):
    link, n, total = cost.Link(alpha=50e-6, beta=1e9), 4, 8e6
    c = cost.collective_time("all_reduce", total / k, n, link)
    want = c + (k - 1) * max(0.0, c - backward_s / k)
    assert cost.bucket_exposed([total / k] * k, backward_s, n, link) == pytest.approx(want)


def test_configs_are_checked():
    with pytest.raises(ValueError, match="multiple of node_size"):
        cost.Config(stage=3, world=6, node_size=4)
    with pytest.raises(ValueError, match="stage 3's"):
        cost.Config(stage=2, world=8, node_size=4, qwz=True)
    with pytest.raises(ValueError, match="stage must be"):
        cost.Config(stage=4, world=8, node_size=4)
    cfg = cost.Config(stage=3, world=8, node_size=4)
    with pytest.raises(ValueError, match="'inter' link"):
        cost.predict(cfg, {"intra": cost.Link(1e-6, 1e9)}, compute_s=1.0, psi=10**6)


def test_hsdp_hpz_qwz_volumes_per_rank():
    """Issue 17's volumes, in elements per rank and step (bf16: 2 bytes): HSDP's replicate
    dimension carries an all-reduce of Ψ/k; the shard dimension 2Ψ (stage 2) or 3Ψ (stage 3) in
    payload; qwZ sends int8 + a fp32 scale per block; hpZ moves backward's gather into the node."""
    psi, k = 2**20, 4
    by = lambda cfg: Counter({(c.op, c.what, c.n, c.link): c.nbytes for c in
                              cost.step_collectives(cfg, [psi])})  # fmt: skip
    h2 = by(cost.Config(stage=2, world=16, node_size=k, hsdp=True))
    assert h2[("all_reduce", "grads across", 4, "inter")] == 2 * psi / k
    assert (
        h2[("reduce_scatter", "grads", k, "intra")]
        + h2[("all_gather", "params after step", k, "intra")]
        == 2 * 2 * psi
    )
    q = by(cost.Config(stage=3, world=16, node_size=k, qwz=True, qwz_block=256))
    assert q[("all_gather", "params fwd", 16, "inter")] == psi * (1 + 4 / 256)
    hp = by(cost.Config(stage=3, world=16, node_size=k, hpz=True))
    assert hp[("all_gather", "params bwd", k, "intra")] == 2 * psi


# -- a real gloo run: the model's collectives are the ledger's -----------------------------------
MICRO = 2


def _steps(stage: int, links: dict | None) -> dict:
    """On each rank: warm up, then one optimizer step of MICRO micro-batches under a ledger; then
    timed steps, the compute alone (the plain model) and a small sweep to fit α, β."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cap = None if stage == 3 else 25
    model, opt = minizero.parallelize(H.build("mlp"), stage, H.optimizer_fn("adam"),
                                      bucket_cap_mb=cap)  # fmt: skip
    x, y = H.local_batch("mlp", 0, rank, world)

    def step():
        for m in range(MICRO):
            if m < MICRO - 1 and stage < 2:
                with model.no_sync():
                    model(x, y).backward()
            else:
                model(x, y).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: stage 3 records its order
    with C.CommLedger(node_size=1) as ledger:
        step()
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    plain = H.build("mlp")
    compute = []
    for _ in range(5):
        t0 = time.perf_counter()
        plain(x, y).backward()
        compute.append(time.perf_counter() - t0)
    sweep = cost.sweep([2**12, 2**16, 2**20])
    return dict(
        records=[(r.op, r.nbytes, r.world) for r in ledger.records],
        wire=sum(ledger.node_bytes()["total"].values()),
        sizes=[b.padded for b in model.buckets],
        step_s=statistics.median(times),
        compute_s=statistics.median(compute),
        sweep=sweep,
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_predicted_collectives_are_the_ledgers(stage):
    world = 2
    results = H.run(_steps, world, stage, None, timeout=240)
    cfg = cost.Config(stage=stage, world=world, node_size=1, micro_batches=MICRO,
                      param_bytes=4, grad_bytes=4)  # fmt: skip
    for r in results:
        predicted = cost.step_collectives(cfg, r["sizes"])
        want = Counter()
        for c in predicted:
            want[(c.op, c.nbytes, c.n)] += c.times
        assert Counter(r["records"]) == want
        assert sum(c.wire() for c in predicted) == r["wire"]
    r0 = results[0]
    link = cost.fit(r0["sweep"], world, emulated_rs=True)
    p = cost.predict(cfg, {"inter": link, "intra": link}, compute_s=r0["compute_s"],
                     sizes=r0["sizes"], emulated_rs=True)  # fmt: skip
    print(
        f"\nstage {stage}, gloo {world} ranks: α = {link.alpha * 1e6:.1f} µs, "
        f"β = {link.beta / 1e9:.2f} GB/s; step predicted {p.step_s * 1e3:.2f} ms "
        f"(compute {p.compute_s * 1e3:.2f} + comm {p.comm_total_s * 1e3:.2f}), measured "
        f"{r0['step_s'] * 1e3:.2f} ms ({p.step_s / r0['step_s'] - 1:+.0%})"
    )
