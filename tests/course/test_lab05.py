"""Lesson 05's lab (minizero/course/labs/lesson05.py), each experiment on its smallest run."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minizero.analysis.memory import paper_model_state_bytes  # noqa: E402
from minizero.course.labs import lesson05 as lab  # noqa: E402
from minizero.models import GPTConfig  # noqa: E402


def test_profile_stages_measure_the_formula(capsys):
    profiles = lab.profile_stages(2, models=("gpt", "mlp"), stages=(0, 1, 2, 3), steps=2)
    gpt = profiles["gpt"]
    for p in gpt:
        assert p["states"] == paper_model_state_bytes(p["psi"], 2, p["stage"], "bf16")
    assert [round(p["volume"] / p["psi"], 3) for p in gpt] == [2, 2, 2, 3]
    lab.show_states(gpt)
    lab.show_peak(gpt)
    lab.show_comm_at_peak(gpt)
    lab.show_volumes(profiles)
    out = capsys.readouterr().out
    assert "measured [paper's formula]" in out and "stage 3: all_gather: 3 units x2" in out
    lab.plot_memory(gpt, profiles["info"])
    lab.plot_comm(profiles)
    plt.close("all")


def test_simulated_states_are_the_formula_at_67b(capsys):
    psi = 6_700_000_000
    got = lab.simulated_states(psi, 8, stages=(0, 3))
    formula = {s: sum(paper_model_state_bytes(psi, 8, s, "bf16").values()) for s in (0, 3)}
    assert got == formula
    lab.show_simulated(got, formula, psi, 8)
    assert "simulate (meta)" in capsys.readouterr().out


def test_layer_activations_flash_keeps_no_scores(capsys):
    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=32)
    acts = lab.layer_activations(cfg, 1, lengths=(32, 64), kernels=("default", "math"))
    per_sbh = {k: m["layers"][0] / (k[0] * cfg.n_embd) for k, m in acts.items()}
    assert per_sbh[64, "math"] - per_sbh[32, "math"] > 1  # the scores grow with s
    assert abs(per_sbh[64, "default"] - per_sbh[32, "default"]) < 1  # no s² term
    lab.show_layer_activations(acts, cfg, 1, lambda s, k: 32 + 2 * 2 * s / 32 * (k == "math"))
    assert "32 (flash)" in capsys.readouterr().out


def test_show_answer_says_what_fits(capsys):
    lab.show_answer({"stage 0": (100e9, 10e9, 0), "stage 3": (10e9, 10e9, 1e9)}, 80, 8)
    out = capsys.readouterr().out.splitlines()
    assert out[1].endswith("does not fit") and out[2].endswith("fits (with stage 3's working set)")


def test_micro_volumes_stage_1_once_stage_2_per_micro_batch(capsys):
    m = lab.micro_volumes(2, stages=(1, 2), micros=(1, 2), rows_per_rank=2)
    vol = m["volumes"]
    assert round(vol[1, 1][0], 3) == round(vol[1, 2][0], 3) == 2  # once per step
    assert vol[2, 2][0] > vol[2, 1][0]  # every backward reduce-scatters
    lab.show_micro_volumes(m)
    assert "1 micro-batch " in capsys.readouterr().out
