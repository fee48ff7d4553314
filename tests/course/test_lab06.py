"""Lesson 06's lab (minizero/course/labs/lesson06*.py), each myth's experiment on its smallest
run."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from minizero.course.labs import lesson06 as lab  # noqa: E402
from minizero.course.labs.saved import zero_vs_stage1  # noqa: E402
from minizero.models import GPTConfig, TinyGPT, count_params  # noqa: E402


def test_every_rank_computes_the_whole_model(capsys):
    runs = lab.who_computes_what(2)
    for r in runs:
        assert r["flops"] == r["plain_flops"] and r["held"] * 2 >= r["psi"]
        assert all(row[1] == row[2] for row in r["ran"])  # every element present while it runs
    lab.show_who_computes_what(runs)
    assert "rank 1: micro-batch starts with tokens" in capsys.readouterr().out


def test_synchronous_ranks_hold_the_same_parameters(capsys):
    per_rank = lab.synchronous(2, stages=(0, 3), steps=3, delay=0.05)
    lab.show_synchronous(per_rank)
    out = capsys.readouterr().out
    assert out.count("parameters bit-identical on all ranks after every step: True") == 2


def test_step_ledgers_are_the_same_on_every_rank(capsys):
    got = lab.step_ledgers(2, stages=(0, 3))
    assert [round(L.volume_elements / got["psi"], 1) for L in got["ledgers"][3]] == [3.0, 3.0]
    lab.show_step_ledgers(got)
    lab.show_volumes_by_op(got)
    out = capsys.readouterr().out
    assert "same calls on every rank: True" in out and "construction (stage 0, rank 1)" in out
    lab.plot_step_ledgers(got)
    plt.close("all")


def test_not_a_transformer_trains_as_one_process(capsys):
    res = lab.not_a_transformer(2, models=("ConvNet",), stages=(None, 3))
    one, three = res["ConvNet"][None], res["ConvNet"][3]
    assert max((three[k] - one[k]).abs().max().item() for k in one) < 1e-5
    res["ConvNet"][0] = three
    lab.show_not_a_transformer(res, 2)
    assert "ConvNet: 3 steps moved the parameters" in capsys.readouterr().out


def test_activations_are_the_same_at_every_stage(capsys):
    acts = lab.activations_by_stage(2, stages=(0, 3))
    s0, s3 = (acts["stages"][s] for s in (0, 3))
    assert s3["states"] < s0["states"] and s0["fwd"]["activations"] == s3["fwd"]["activations"]
    lab.show_activations_by_stage(acts)
    assert "activations, end of forward" in capsys.readouterr().out


def test_torch_zero_broadcasts_and_stage_1_refuses_adafactor(capsys):
    per_rank = lab.torch_zero_vs_stage1(2, {"Adafactor": torch.optim.Adafactor}, zero_vs_stage1)
    psi = count_params(TinyGPT(GPTConfig.tiny()))
    runs = [p["runs"] for p in per_rank]
    assert runs[0]["torch Adafactor"]["moved"] == {"all_reduce": 2 * psi, "broadcast": psi}
    assert runs[0]["DDP Adafactor"]["moved"] == {"all_reduce": 2 * psi}
    assert "elementwise" in runs[0]["stage 1 Adafactor"]["refused"]
    for r in runs:  # torch's step is DDP's, bit for bit, and its owners split DDP's states
        ddp, zro = r["DDP Adafactor"]["params"], r["torch Adafactor"]["params"]
        assert all(torch.equal(zro[k], ddp[k]) for k in ddp)
    assert sum(r["torch Adafactor"]["states"] for r in runs) == runs[0]["DDP Adafactor"]["states"]
    lab.show_torch_zero_vs_stage1(per_rank)
    out = capsys.readouterr().out
    assert "stage 1 Adafactor: refused" in out and "(bit-identical)" in out


def test_stage2_vs_stage3_and_the_floor(capsys):
    cfgs = [GPTConfig(vocab_size=64, block_size=16, n_layer=L, n_head=4, n_embd=64) for L in (1, 6)]
    sweep = lab.stage2_vs_stage3(2, cfgs)
    assert sorted((r["L"], r["stage"]) for r in sweep["rows"]) == [(1, 2), (1, 3), (6, 2), (6, 3)]
    peak = {(r["L"], r["stage"]): r["peak"] for r in sweep["rows"]}
    # myth 8's measurement: one block, a unit of most of Ψ, gathered whole: stage 3 peaks higher;
    # six blocks: lower
    assert peak[1, 3] > peak[1, 2] and peak[6, 3] < peak[6, 2], peak
    lab.show_stage2_vs_stage3(sweep)
    plt.close("all")
    floor = lab.stage3_by_n(worlds=(1, 2))
    one, two = floor["rows"]
    assert abs(one["states"] / two["states"] - 2) < 0.01  # 16Ψ/N
    lab.show_stage3_by_n(floor, formula_ns=(64,))
    plt.close("all")
    assert "N = 2: peak" in capsys.readouterr().out
