"""Lesson 03's lab (minizero/course/labs/lesson03.py), each on its smallest configuration: 2 ranks,
TinyGPT tiny, one backward or one step. Byte counts and volumes are exact: the paper's formula
plus the padding of the buckets the stages cut (``make_buckets``, as they cut them on the first
step)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from minizero.bucket import make_buckets, trainable_parameters
from minizero.course.labs import lesson03 as lab
from minizero.course.labs.common import GPT, PSI
from minizero.course.plots import GLOO_RS_BUFFER
from minizero.models import TinyGPT

N = 2  # ranks


def padded(bucket_cap_mb: float | None = None) -> int:
    """TinyGPT's elements once every bucket is padded to a multiple of N: Ψ plus the padding."""
    buckets = make_buckets(trainable_parameters(TinyGPT(GPT)), bucket_cap_mb, N)
    return sum(b.padded for b in buckets)


def test_stage1_holds_the_whole_gradient_and_reads_its_chunk(capsys):
    g = lab.stage1_gradients(N)
    assert g["held"] == 2 * PSI  # bf16: 2Ψ, the formula
    assert g["read"] == 2 * padded() // N  # bf16: 2Ψ/N, plus this rank's padding
    lab.show_stage1_gradients(g, {"held": 2, "read": 2 / N})
    out = capsys.readouterr().out
    assert "holds 2.00Ψ bytes of gradients (formula 2.00Ψ)" in out and "reads 1.00Ψ" in out


def test_bucket_peaks_one_bucket_holds_the_whole_gradient(capsys):
    peaks = lab.bucket_peaks(N, [0.03, 25])
    small, whole = peaks["rows"]
    assert (whole["buckets"], whole["peak"], whole["kept"]) == (1, 2 * padded(25), padded(25))
    assert small["kept"] == 2 * padded(0.03) // N  # grad_shards: 2Ψ/N, plus padding
    assert small["buckets"] == 7 and small["peak"] < whole["peak"]  # a few buckets at a time
    lab.plot_bucket_peaks(peaks, kept=2 / N, stage1=2)
    title = plt.gca().get_title()
    assert len(plt.gca().containers) == 2 and GLOO_RS_BUFFER in title
    plt.close("all")
    out = capsys.readouterr().out
    assert "25 MiB,  1 bucket: at most 2.00Ψ in buckets + 1.00Ψ kept (formula 1Ψ)" in out


def test_reduce_scatter_memory_on_gloo_holds_the_other_ranks_chunks(capsys):
    m = lab.reduce_scatter_memory(N, mib=1)
    assert m["before"] == 2**20  # the bucket, fp32
    extra = (N - 1) * 2**20 // N  # gloo: the buffer that receives the other ranks' chunks r
    assert m["peak"] == 2**20 + extra
    assert m["after"] in (2**20, 2**20 + extra)  # it dies once gloo's worker lets go of it
    lab.show_reduce_scatter_memory(m)
    out = capsys.readouterr().out
    peak, held = f"peak {(2**20 + extra) / 2**20:.3g} MiB", f"held {(N - 1) / N:.2f}x the buffer"
    assert peak in out and held in out and GLOO_RS_BUFFER in out


def test_grads_after_backward_are_the_chunks(capsys):
    runs = lab.memory_per_step(N, stages=(2,), precision="bf16", bucket_cap_mb=0.03)
    after = next(m for m in runs[2]["marks"] if m["label"] == "after backward")
    assert after["grads"] == 2 * padded(0.03) // N
    lab.plot_memory_per_step(runs, "title", cats=lab.MEMORY_CATS)
    assert GLOO_RS_BUFFER in plt.gcf()._suptitle.get_text()
    plt.close("all")
    lab.show_grads_after_backward(runs, formula={2: 2 / N})
    assert "stage 2: gradients held after backward 1.00Ψ (formula 1.00Ψ)" in capsys.readouterr().out


def test_stage2_reduce_scatters_in_backward_stage1_after(capsys):
    r = lab.reduce_scatters_in_backward(N, stages=(1, 2), bucket_cap_mb=0.03)
    for stage in (1, 2):
        s = r["stages"][stage]
        assert s["by_op"] == {"reduce_scatter": padded(0.03), "all_gather": padded(0.03)}
        assert s["reduce_scatters"] == 7  # one per bucket
    assert r["stages"][1]["early"] == 0 and r["stages"][2]["early"] == 7
    lab.show_reduce_scatters_in_backward(r, {1: 2, 2: 2})
    assert "7 of 7 reduce-scatters issued during backward" in capsys.readouterr().out


def test_accumulation_volume_per_backward_unless_no_sync(capsys):
    micro = 2
    runs = {(1, False): 2, (2, False): micro + 1, (2, True): 2}  # × Ψ, plus padding
    a = lab.accumulation_volume(N, list(runs), micro=micro)
    assert a["volumes"] == {run: k * padded() for run, k in runs.items()}
    lab.show_accumulation_volume(a, runs)
    assert "stage 2, 2 backwards + 1 step: 3.000Ψ moved (formula 3Ψ)" in capsys.readouterr().out


def test_shard_norms_add_up_in_squares(capsys):
    n = lab.shard_norms(N)
    assert len(n["squares"]) == N and all(sq**0.5 < n["whole"] for sq in n["squares"])
    assert sum(n["squares"]) ** 0.5 == pytest.approx(n["whole"], rel=1e-5)
    lab.show_shard_norms(n)
    assert "sqrt(sum over ranks of their squares)" in capsys.readouterr().out
