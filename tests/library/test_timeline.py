"""minizero.analysis.timeline: the profiler's view of a step pairs every collective the ledger saw
with the backend's run of it, and hidden_fraction does the interval arithmetic lesson 01 reports."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import minizero
from minizero.analysis import timeline
from minizero.collectives import mark
from minizero.ddp import DDP
from minizero.models import MLP, synthetic_batch


def test_hidden_fraction_is_the_union_of_runs_inside_the_backward_window():
    tl = {
        "marks": {"backward start": 10.0, "backward end": 20.0},
        "comm": [
            {"start": 5.0, "end": 15.0},  # overlaps the next one: counted once
            {"start": 12.0, "end": 25.0},
            {"start": 30.0, "end": 35.0},  # entirely after backward
        ],
    }
    hidden, total, exposed = timeline.hidden_fraction(tl)
    assert (hidden, total, exposed) == (10.0, 25.0, 15.0)
    assert timeline.hidden_fraction({**tl, "comm": []}) == (0.0, 0.0, 0.0)


def _profiled_ddp_step(cap):
    torch.manual_seed(0)
    model = DDP(MLP(), bucket_cap_mb=cap)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_batch("mlp", 4 * world, 0, rank=rank, world=world)

    def step():
        mark("forward start")
        loss = model(x, y)
        mark("backward start")
        loss.backward()

    return timeline.profile_step(step), len(model.buckets)


@pytest.mark.parametrize("cap", [0.002, 25])
def test_profile_step_pairs_every_bucket_all_reduce_with_its_run(cap):
    tl, n_buckets = minizero.launch(_profiled_ddp_step, 2, cap, verbose=False)[0]
    marks = tl["marks"]
    assert list(marks) == ["forward start", "backward start", "backward end"]
    assert marks["forward start"] == 0.0 < marks["backward start"] < marks["backward end"]
    assert len(tl["comm"]) == n_buckets and (n_buckets > 1) == (cap < 1)
    for c in tl["comm"]:
        assert c["op"] == "all_reduce" and c["tag"].startswith("ddp bucket")
        assert marks["backward start"] < c["issued"] <= c["start"] <= c["end"]
    assert sum(c["numel"] for c in tl["comm"]) == sum(p.numel() for p in MLP().parameters())


def _no_marks():
    return timeline.profile_step(lambda: None)


def test_profile_step_without_marks_says_what_to_do():
    with pytest.raises(minizero.LaunchError, match="made no mark; call mark"):
        minizero.launch(_no_marks, 2, verbose=False)
