"""The scenario at scale (minizero/analysis/scenario.py, lesson 08 sections 6-7): PaLM's FLOPs,
lesson 05's memory budget and the cost model, put together as the lesson states; the choice it
leads to, and what changes it."""

from __future__ import annotations

import pytest

from minizero.analysis import budget, cost, scenario
from minizero.models import GPTConfig

BIG = GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
CANDIDATES = {
    "DDP": dict(stage=0),
    "ZeRO-1": dict(stage=1),
    "ZeRO-1 HSDP": dict(stage=1, hsdp=True),
    "ZeRO-3": dict(stage=3),
    "ZeRO-3 hpZ+qwZ": dict(stage=3, hpz=True, qwz=True),
}


def fastest_that_fits(rows, memory):  # exercise 4's rule
    fits = [r for r in rows if r["memory"] <= memory]
    return min(fits, key=lambda r: (r["step_s"], r["memory"]))["name"] if fits else None


def test_compute_is_palms_flops_per_token():
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16)
    sc = scenario.Scenario(seqs=2, micro=3, tflops=1.0)
    psi, tokens = budget.gpt_params(cfg), 2 * 32 * 3
    attention = 2 * 32 * 16  # L·s·h
    plain = (6 * psi + 12 * attention) * tokens / 1e12
    again = (8 * psi + 16 * attention) * tokens / 1e12  # one more forward
    assert scenario.step_compute_s(cfg, sc, False) == pytest.approx(plain, rel=1e-12)
    assert scenario.step_compute_s(cfg, sc, True) == pytest.approx(again, rel=1e-12)


def test_a_row_is_the_budget_and_the_cost_model():
    sc = scenario.Scenario()
    rows = scenario.predict_rows(BIG, sc, CANDIDATES)
    assert [r["name"] for r in rows] == list(CANDIDATES)
    for r, options in zip(rows, CANDIDATES.values(), strict=True):
        cfg = cost.Config(world=512, node_size=8, micro_batches=4, **options)
        states = cost.predict_memory(cfg, budget.gpt_params(BIG))["total"]
        need = {}
        for ckpt in (False, True):
            b = budget.step_budget(
                BIG, world=cfg.shard_ranks, stage=cfg.stage, micro_batch=4, checkpointing=ckpt
            )
            need[ckpt] = states + b["activations"] + b["logits"] + b["stage 3 working set"]
        assert r["states"] == states and r["plain"] == need[False]
        assert r["ckpt"] == (need[False] > sc.room) and r["memory"] == need[r["ckpt"]]
        compute = scenario.step_compute_s(BIG, sc, r["ckpt"]) / 4
        sizes = scenario.comm_sizes(BIG, options["stage"])
        p = cost.predict(cfg, sc.links(), compute_s=compute, sizes=sizes)
        assert r["step_s"] == p.step_s and r["inter"] == p.comm_s.get("inter", 0.0)
        assert r["overlapped_s"] <= r["step_s"]


def test_the_lessons_answer_and_what_changes_it():
    sc = scenario.Scenario()
    rows = {r["name"]: r for r in scenario.predict_rows(BIG, sc, CANDIDATES)}
    assert rows["DDP"]["memory"] > sc.room  # 107 GB of model states alone
    assert all(r["ckpt"] for r in rows.values())  # 4 sequences of activations need it
    sens = scenario.sensitivity(BIG, sc, CANDIDATES, fastest_that_fits)
    assert sens["pick"] == "ZeRO-1 HSDP" and sens["replicate_once"] == "ZeRO-1 HSDP"
    assert "gpus" not in sens["inputs"]  # the node's shape is kept
    for name in ("nodes", "nvlink_GBps", "nic_GBps", "nics", "alpha_us", "tflops"):
        assert sens["inputs"][name][1] == ["ZeRO-1 HSDP"] * 2, name  # the network: no change
    assert sens["inputs"]["gpu_GB"][1][0] != "ZeRO-1 HSDP"  # half the memory: another answer
    assert sens["inputs"]["headroom_GB"][1][0] == "ZeRO-3 hpZ+qwZ"  # fits without checkpointing


def test_the_buckets_are_torch_ddps_and_the_units_one_per_block():
    h, s, v = 4096, 4096, 50304
    buckets = scenario.gpt_buckets(BIG)  # backward's order: ln_f and the last block first
    assert buckets[:4] == (
        2 * h + h + 4 * h * h,  # ln_f, the MLP's output bias and weight: over the first 1 MiB
        4 * h * h + 4 * h,  # the MLP's input layer: 128 MiB, over 25 MiB alone
        2 * h + h * h + h,  # ln_2, attention's output projection
        3 * h * h + 3 * h,  # attention's q, k, v
    )
    assert buckets[4] == 2 * h + 4 * h * h + h  # the previous block's ln_1 joins the next bucket
    assert buckets[-2:] == (s * h + 2 * h, v * h)  # block 0's ln_1 with the positions; tokens
    assert len(buckets) == 4 * 32 + 2 and sum(buckets) == budget.gpt_params(BIG)
    assert scenario.comm_sizes(BIG, 3) == budget.gpt_units(BIG) and len(budget.gpt_units(BIG)) == 33
    assert scenario.comm_sizes(BIG, 1) == list(buckets)


def test_alpha_is_paid_on_every_ring_round_of_every_bucket_and_unit():
    sc = scenario.Scenario()  # 64 nodes x 8: a flat ring of 512, a node of 8, 64 replicas
    rows = {r["name"]: r for r in scenario.predict_rows(BIG, sc, CANDIDATES)}
    a, buckets, units, micro = 10e-6, 130, 33, 4
    # ZeRO-1 flat: per bucket a reduce-scatter and an all-gather over 512 ranks, 511 rounds each
    assert rows["ZeRO-1"]["alpha"] == pytest.approx(buckets * (511 + 511) * a, rel=1e-12)
    # DDP: one all-reduce of 2 x 511 rounds per bucket, the same
    assert rows["DDP"]["alpha"] == pytest.approx(buckets * 2 * 511 * a, rel=1e-12)
    # ZeRO-1 HSDP: reduce-scatter over 8 (7), all-reduce over 64 (2 x 63), all-gather over 8 (7)
    assert rows["ZeRO-1 HSDP"]["alpha"] == pytest.approx(buckets * (7 + 126 + 7) * a, rel=1e-12)
    # ZeRO-3: per unit and micro-batch, gather in forward, gather in backward, reduce-scatter
    assert rows["ZeRO-3"]["alpha"] == pytest.approx(units * micro * 3 * 511 * a, rel=1e-12)
    # flat ZeRO-1's network: its α, and twice (511/512)·2Ψ bytes through a node's 8 NICs of 47 GB/s
    psi = budget.gpt_params(BIG)
    wire = 2 * 511 / 512 * 2 * psi / (8 * 47e9)
    assert rows["ZeRO-1"]["inter"] == pytest.approx(buckets * 1022 * a + wire, rel=1e-12)


def test_without_latency_the_flat_ring_wins_again():
    sc = scenario.Scenario(alpha_us=0.01)  # bytes alone: HSDP sends as much across, plus its node
    rows = {r["name"]: r for r in scenario.predict_rows(BIG, sc, CANDIDATES)}
    assert rows["ZeRO-1"]["step_s"] < rows["ZeRO-1 HSDP"]["step_s"]
    assert fastest_that_fits(list(rows.values()), sc.room) == "ZeRO-1"


def test_the_one_nic_model_made_hsdp_look_cheaper():
    sc = scenario.Scenario()
    flat = scenario.one_nic_network_s(BIG, sc, CANDIDATES["ZeRO-1"])
    hsdp = scenario.one_nic_network_s(BIG, sc, CANDIDATES["ZeRO-1 HSDP"])
    assert flat > 4 * hsdp  # with all NICs, bytes alone favour flat (the test above)


def test_scaled_inputs_and_bad_ones():
    sc = scenario.Scenario()
    assert sc.scaled("nodes", 0.5).nodes == 32 and isinstance(sc.scaled("nodes", 0.5).nodes, int)
    assert sc.scaled("nic_GBps", 2).nic_GBps == 94.0 and sc.world == 512
    assert sc.room == 75e9
    with pytest.raises(ValueError, match="headroom_GB must be in"):
        scenario.Scenario(headroom_GB=80.0)
    with pytest.raises(ValueError, match="nodes must be > 0"):
        scenario.Scenario(nodes=0)
