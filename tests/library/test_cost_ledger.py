"""The cost model prices what the library does: for every configuration lesson 08 prices (flat
stages 1-3, HSDP stages 1-3, hpZ, hpZ + qwZ; and qwZ, qgZ), at 1 and 4 micro-batches per step,
the collectives ``analysis.cost.step_collectives`` lists are the ones a 4-rank gloo run (2
"nodes" x 2) records, group by group, op by op, byte for byte. Each run is one optimizer step
after a warm-up step, under a ``CommLedger``; stages 0-1 accumulate under ``no_sync`` as lesson
08 does."""

from __future__ import annotations

from collections import Counter

import harness as H
import pytest
import torch.distributed as dist

import minizero
from minizero.analysis import cost
from minizero.analysis.ledger import CommLedger

pytestmark = pytest.mark.timeout(600)
WORLD, NODE = 4, 2
MICRO = (1, 4)
CONFIGS = {  # name: (cost.Config options, parallelize options; "mesh": the 2 x 2 mesh)
    "stage1": (dict(stage=1), {}),
    "stage2": (dict(stage=2), {}),
    "stage3": (dict(stage=3), {}),
    "hsdp1": (dict(stage=1, hsdp=True), {"mesh": True}),
    "hsdp2": (dict(stage=2, hsdp=True), {"mesh": True}),
    "hsdp3": (dict(stage=3, hsdp=True), {"mesh": True}),
    # FSDP2's switch: set_requires_all_reduce(False) on all but the last micro-batch
    "hsdp2-once": (dict(stage=2, hsdp=True, replicate_every_microbatch=False),
                   {"mesh": True, "once": True}),
    "hsdp3-once": (dict(stage=3, hsdp=True, replicate_every_microbatch=False),
                   {"mesh": True, "once": True}),
    "hpz": (dict(stage=3, hpz=True), {"reshard_after_forward": NODE}),
    "hpz+qwz": (dict(stage=3, hpz=True, qwz=True),
                {"reshard_after_forward": NODE, "quantize_weights": True}),
    "qwz": (dict(stage=3, qwz=True), {"quantize_weights": True}),
    "qgz": (dict(stage=3, qgz=True), {"quantize_gradients": True}),
}  # fmt: skip


def _ledgers() -> dict:
    """On each rank, for each configuration and micro-batch count: the buckets' (units') padded
    sizes and the (group, op, bytes) of every collective of one optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = H.hsdp_mesh(NODE)
    out = {}
    for name, (cfg, opts) in CONFIGS.items():
        stage = cfg["stage"]
        once, opts = opts.get("once", False), {k: v for k, v in opts.items() if k != "once"}
        opts = {**opts, "mesh": mesh} if opts.get("mesh") else opts
        cap = {} if stage == 3 else {"bucket_cap_mb": H.TINY_BUCKET_MB}
        model, opt = minizero.parallelize(H.build("gpt"), stage, H.optimizer_fn("adamw"),
                                          **cap, **opts)  # fmt: skip
        x, y = H.local_batch("gpt", 0, rank, world)
        for micro in MICRO:
            H.accumulate_step(
                model, opt, stage, micro, x, y, once
            )  # warm-up: stage 3 records its order
            with CommLedger(node_size=NODE) as ledger:
                H.accumulate_step(model, opt, stage, micro, x, y, once)
            out[name, micro] = dict(
                sizes=[b.padded for b in model.buckets],
                records=[(r.group, r.op, r.nbytes) for r in ledger.records],
                node_bytes=ledger.node_bytes()["total"],
            )
    return out


@pytest.fixture(scope="module")
def ranks():
    return H.run(_ledgers, WORLD, timeout=540)


@pytest.mark.parametrize("micro", MICRO)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_models_collectives_are_the_ledgers(ranks, name, micro):
    for r, res in enumerate(ranks):
        got = res[name, micro]
        cfg = cost.Config(world=WORLD, node_size=NODE, micro_batches=micro, param_bytes=4,
                          grad_bytes=4, **CONFIGS[name][0])  # fmt: skip
        predicted = cost.step_collectives(cfg, got["sizes"])
        want = Counter()
        for c in predicted:
            want[c.group, c.op, c.nbytes] += c.times
        assert Counter(got["records"]) == want, (name, micro, r)
        by_group = Counter()
        for g, _op, nbytes in got["records"]:
            by_group[g] += nbytes
        print(f"rank {r} {name:8} {micro} micro-batch(es): " + ", ".join(
            f"{g} {b:,} B" for g, b in sorted(by_group.items())))  # fmt: skip
        assert sum(c.wire() for c in predicted) == sum(got["node_bytes"].values())


def test_hsdp_replicate_all_reduce_runs_every_micro_batch_at_stages_2_and_3(ranks):
    """Item 2 of lesson 08's list: minizero's HSDP all-reduces across nodes after every backward
    at stages 2-3 (as FSDP2 does by default), once per step at stage 1. The model prices both the
    library's way and the once-per-step way (MiCS; FSDP2's ``set_requires_all_reduce(False)``)."""
    for stage, every in ((1, False), (2, True), (3, True)):
        once = ranks[0][f"hsdp{stage}", 1]["records"]
        four = ranks[0][f"hsdp{stage}", 4]["records"]
        count = lambda recs: sum(g == "replicate" for g, _, _ in recs)
        assert count(four) == (4 if every else 1) * count(once), stage
        lazy = cost.Config(stage=stage, world=WORLD, node_size=NODE, hsdp=True, micro_batches=4,
                           replicate_every_microbatch=False)  # fmt: skip
        times = {c.times for c in cost.step_collectives(lazy, [64]) if c.group == "replicate"}
        assert times == {1}, stage


def test_hpz_with_qwz_gathers_backward_in_full_precision(ranks):
    """Item 4: the secondary gather ("hpZ") carries the working dtype (fp32 here, 4 bytes an
    element), the forward gather int8 plus fp32 scales."""
    for res in ranks:
        recs, sizes = res["hpz+qwz", 1]["records"], res["hpz+qwz", 1]["sizes"]
        assert sorted(b for g, _, b in recs if g == "hpZ") == sorted(4 * s for s in sizes)
        gathers = [b for g, op, b in recs if g == "world" and op == "all_gather"]
        assert sorted(gathers[0::2]) == sorted(sizes), gathers  # int8: 1 byte an element
