"""Lesson 01's lab (minizero/course/labs/lesson01.py) and the shared model-states run, each on its
smallest configuration."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minizero.analysis import cost  # noqa: E402
from minizero.analysis.memory import paper_model_state_bytes  # noqa: E402
from minizero.course.labs import lesson01 as lab  # noqa: E402
from minizero.course.labs.common import PSI  # noqa: E402


def test_the_mean_of_local_gradients_is_one_processs(capsys):
    rows = lab.gradient_mean(2, rows_per_rank=1)
    assert rows and all(r["spread"] > 0 and r["error"] < 1e-6 for r in rows)
    lab.show_gradient_mean(rows)
    assert "|mean over ranks - one process|" in capsys.readouterr().out


def test_naive_ddp_sends_2psi_after_backward(capsys):
    v = lab.naive_volume(2)
    assert v["volume"] == 2 * PSI and v["after_backward"] == v["calls"] > 1
    lab.show_naive_volume(v)
    assert "= 2.00 Ψ" in capsys.readouterr().out


def test_model_states_of_ddp_are_the_papers_16_psi(capsys):
    per_rank = lab.model_states(2, [("fp32", 0)])
    for rank in per_rank:
        ((precision, stage, got),) = rank
        assert got == paper_model_state_bytes(PSI, 2, 0, "fp32")  # 4Ψ + 4Ψ + 8Ψ, exactly
    lab.show_model_states(per_rank)
    assert "fp32 stage 0 paper" in capsys.readouterr().out


def test_overlap_timelines_have_a_bucket_per_all_reduce(capsys):
    run = lab.overlap_timelines(2, [25, 0.05], steps=2)
    one, many = run["timelines"][25], run["timelines"][0.05]
    assert len(one["comm"]) == 1 < len(many["comm"])
    lab.show_overlap(run)
    assert capsys.readouterr().out.count("all-reduces ran for") == 2
    lab.plot_timelines(run)
    assert len(plt.gcf().axes) == 2
    plt.close("all")
    lab.timeline_widget(run)  # no widget outside JupyterLab: nothing drawn, nothing raised


def test_ddp_variants_count_minizeros_messages_not_torchs(capsys):
    run = lab.ddp_variants(2, bucket_cap_mb=0.1, steps=3)
    naive, bucketed, torch_ddp = run["rows"]
    assert naive["volume"] == bucketed["volume"] == 2 * PSI and torch_ddp["calls"] == 0
    assert naive["calls"] > bucketed["calls"] > 0
    lab.show_variants(run)
    assert "(not counted)" in capsys.readouterr().out


def test_bucket_sweep_feeds_the_model(capsys):
    s = lab.bucket_sweep(2, [0.05, 0.5], steps=2)
    assert len(s.buckets[0.05]) > len(s.buckets[0.5]) >= 1
    assert sum(s.buckets[0.5]) == PSI * 4  # every fp32 gradient byte, in some bucket
    link = cost.fit(s.sweep, 2, emulated_rs=True)
    predicted = {c: s.forward_s[c] + s.backward_s[c] for c in s.caps}
    lab.show_bucket_sweep(s, link, predicted)
    out = capsys.readouterr().out
    assert "best bucket_cap_mb measured here" in out and out.count("\n") == 5
    lab.plot_bucket_sweep(s, predicted)
    assert len(plt.gcf().axes[0].lines) == 2
    plt.close("all")


@pytest.mark.parametrize("name", ["lab", "lesson01", "torch", "dist", "hint", "setup"])
def test_the_lessons_one_import_brings_what_it_uses(name):
    assert name in lab.__all__ and hasattr(lab, name)
