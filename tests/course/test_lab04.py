"""Lesson 04's lab (minizero/course/labs/lesson04.py) and the shared states-over-N run, each on
its smallest configuration."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minizero.course.labs import lesson04 as lab  # noqa: E402
from minizero.course.labs.common import PSI  # noqa: E402
from minizero.models import GPTConfig, TinyGPT, count_params  # noqa: E402


def test_units_are_the_blocks_and_the_root(capsys):
    rows = lab.units(TinyGPT(GPTConfig.tiny()))
    assert rows[0]["module"] == "(root)" and "wte.weight" in rows[0]["params"]
    assert [r["module"] for r in rows[1:]] == ["blocks.0", "blocks.1"]
    assert sum(r["numel"] for r in rows) == PSI
    lab.show_units(rows)
    assert "unit 1: blocks.0" in capsys.readouterr().out


def test_params_held_stage_3_below_stage_2(capsys):
    cfg = GPTConfig.tiny()
    runs = lab.params_held(2, cfg, stages=(2, 3))
    two, three = runs[2]["trace"], runs[3]["trace"]
    assert [label for label, *_ in two] == [label for label, *_ in three]
    psi = count_params(TinyGPT(cfg))
    assert all(kept == 2 * psi for _, kept, _ in two)  # bf16: every parameter, all the time
    assert all(kept == psi for _, kept, _ in three)  # bf16 shards, 2Ψ/N on 2 ranks
    lab.plot_params_held(runs, psi)
    plt.close("all")
    assert "stage 3: at most" in capsys.readouterr().out


def test_states_over_world_follow_the_formula_at_stage_3(capsys):
    swept = lab.states_over_world(2, stages=(3,))
    formula = {3: lambda n: 16 / n}
    for n, _, b in swept["rows"]:
        assert abs(b / PSI - formula[3](n)) < 0.01
    lab.plot_states_over_world(swept, formula, log=True)
    plt.close("all")
    lab.show_states_at_world(swept, formula)
    assert "N = 2, stage 3: measured 8.0" in capsys.readouterr().out


def test_stage3_floor_splits_the_peak(capsys):
    floor = lab.stage3_floor(2)
    assert [r["n"] for r in floor["rows"]] == [1, 2]
    for r in floor["rows"]:
        assert r["peak"] > r["states"] + (r["comm"] or 0)
    lab.plot_stage3_floor(floor)
    plt.close("all")
    lab.show_stage3_floor(floor)
    assert "largest units" in capsys.readouterr().out


def test_fsdp2_states_are_16_bytes_per_parameter_over_n(capsys):
    fsdp2 = lab.fsdp2_states(2)
    total = sum(fsdp2[c][0] for c in ("params", "grads", "optimizer"))
    assert abs(total * 2 / PSI - 16) < 0.1  # fp32 params, fp32 grads, two fp32 moments; /N
    lab.show_fsdp2_states(fsdp2, {"params": 2, "grads": 2, "optimizer": 12})
    assert "total: FSDP2 16." in capsys.readouterr().out


def test_step_comm_is_2psi_and_3psi(capsys):
    comm = lab.step_comm(2, stages=(0, 3))
    vol = comm["volumes"]
    assert vol[0, 0]["parts"]["all_reduce"] == vol[0, 1]["parts"]["all_reduce"] == 2 * PSI
    assert vol[0, 1] == {"parts": {"all_reduce": 2 * PSI}, "gathers": {}}  # every later step
    assert sum(vol[3, 1]["parts"].values()) == 3 * PSI
    lab.plot_step_comm(comm, {0: 2, 3: 3})
    plt.close("all")
    lab.show_step_comm(comm, root_tag="zero3 params 0")
    assert "stage 3 all-gathered the root unit 2 times" in capsys.readouterr().out
