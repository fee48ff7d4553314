"""Lesson 02's lab (minizero/course/labs/lesson02.py) and the shared memory-per-step run, each on
its smallest configuration."""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import minizero  # noqa: E402
from minizero.analysis.memory import paper_model_state_bytes  # noqa: E402
from minizero.course.labs import lesson02 as lab  # noqa: E402
from minizero.course.labs.common import PSI  # noqa: E402


def test_adam_in_pieces_is_adam_whole(capsys):
    r = lab.adam_in_pieces(steps=2, numel=4)
    assert r["diff"] == 0 and r["whole"][1:] == [(4,), (4,)] and r["half"][1:] == [(2,), (2,)]
    lab.show_adam_in_pieces(r)
    assert "max |whole - halves| after 2 Adam steps: 0" in capsys.readouterr().out


def test_bucket_ownership_covers_every_element_once(capsys):
    buckets = lab.bucket_ownership(minizero.models.MLP(), bucket_cap_mb=0.002, world=3)
    for b in buckets:
        owned = sum(hi - lo for rank in b["owned"] for _, lo, hi in rank)
        assert owned == b["numel"] and owned + sum(b["padding"]) == b["padded"] == 3 * b["shard"]
    lab.show_bucket_ownership(buckets)
    assert "rank 2 owns" in capsys.readouterr().out


def test_model_states_of_stage_1_are_the_papers(capsys):
    per_rank = lab.model_states(2, [("bf16", 1)])
    ((_, _, got),) = per_rank[0]
    paper = paper_model_state_bytes(PSI, 2, 1, "bf16")
    assert got["params"] == paper["params"] and got["grads"] == paper["grads"]
    assert got["optimizer"] >= paper["optimizer"]  # plus the padding of each bucket
    lab.show_model_states(per_rank)
    fp32_grads = minizero.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lab.show_model_states(lab.model_states(2, [(fp32_grads, 0)]), label="fp32 gradients")
    out = capsys.readouterr().out
    assert "bf16 stage 1 paper" in out and "fp32 gradients, stage 0, rank 0: params 2.000Ψ" in out


def test_states_over_world_measure_each_n(capsys):
    swept = lab.states_over_world(2, stages=(1,))
    assert sorted((n, s) for n, s, _ in swept["rows"]) == [(1, 1), (2, 1), (2, 1)]
    lab.plot_states_over_world(swept, {1: lambda n: 4 + 12 / n}, up_to=4)
    assert len(plt.gcf().axes[0].lines) == 2
    plt.close("all")
    lab.show_table1("7.5B", world=64, stages=(1,))
    assert "paper's Table 1: 31.4 GB" in capsys.readouterr().out


def test_memory_per_step_marks_the_step(capsys):
    runs = lab.memory_per_step(2, stages=(1,))
    marks = runs[1]["marks"]
    assert [m["label"] for m in marks] == ["start", "after forward", "after backward", "after step"]
    assert marks[-1]["optimizer"] > marks[0]["optimizer"]  # Adam's moments, made by the step
    lab.plot_memory_per_step(runs, "title")
    plt.close("all")
    lab.show_after_step(runs)
    assert "stage 1, after the step: params 2.00Ψ" in capsys.readouterr().out


def test_fp16_gradients_overflow_at_2_to_16(capsys):
    rows = lab.fp16_gradients(log2_scales=(0, 16), rows=2)
    assert rows[0]["bad"] == 0 and rows[0]["flushed"] > 0 and rows[0]["error"] < 0.1
    assert rows[1]["bad"] == 1 and math.isnan(rows[1]["error"])
    lab.show_fp16_gradients(rows)
    assert "2^16" in capsys.readouterr().out


def test_step_volume_is_2psi_at_stages_0_and_1(capsys):
    v = lab.step_volume(2, stages=(0, 1))
    assert v["volumes"][0] == {"all_reduce": 2 * PSI}
    assert sum(v["volumes"][1].values()) >= 2 * PSI  # plus the padding
    lab.show_step_volume(v)
    assert "stage 1: reduce_scatter" in capsys.readouterr().out


def test_optimizer_share_splits_the_states(capsys):
    rows = lab.optimizer_share(2)
    assert sum(r["theirs"] for r in rows) == 1 and sum(r["ours"] for r in rows) >= 1
    lab.show_optimizer_share(rows)
    assert "minizero ZeRO1" in capsys.readouterr().out
