"""Lesson 07's lab (minizero/course/labs/lesson07.py), each experiment on its smallest run."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import minizero  # noqa: E402
from minizero.course.checks import lesson07  # noqa: E402
from minizero.course.labs import lesson07 as lab  # noqa: E402


def test_state_sizes_cover_psi_over_the_ranks(capsys):
    per_rank = lab.state_sizes(2, stage=2)
    assert sum(held for held, _, _ in per_rank) == lab.PSI
    assert all(tensors == entries for _, tensors, entries in per_rank)
    lab.show_state_sizes(per_rank)
    assert "rank 1: exp_avg covers" in capsys.readouterr().out


def test_one_checkpoint_on_disk_and_its_chunks(tmp_path, capsys):
    path = lab.save_one(2, stage=2, path=tmp_path / "s2", bucket_cap_mb=0.1)
    lab.show_files(path)
    lab.show_chunks(path)
    out = capsys.readouterr().out
    assert "minizero.json" in out and "lm_head.weight is stored as wte.weight" in out
    assert "parameters are split between ranks" in out


def _train(stage, log, crash_at=None):
    torch.manual_seed(0)
    model = minizero.models.TinyGPT(lab.GPT)
    model, opt = minizero.parallelize(model, stage, lab.nanogpt_adamw(model))
    for step in range(2):
        loss = model(*lab.gpt_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        lab.log_loss(log.with_suffix(".jsonl"), step, loss)
        if step + 1 == crash_at and dist.get_rank() == 1:
            lesson07.crash_during_next_save("rank 1 lost power")
        minizero.save_checkpoint(log / f"step_{step + 1}", model, opt)


def test_a_run_that_dies_leaves_its_last_checkpoint(tmp_path, capsys):
    lab.run_that_dies(_train, 2, 2, tmp_path / "crashed", crash_at=2)
    out = capsys.readouterr().out
    assert "the run died:" in out and "step_2: " in out and "step_2.incomplete" in out
    assert lab.latest_checkpoint(tmp_path / "crashed").name == "step_1"
    minizero.launch(_train, 2, 2, tmp_path / "reference", backend="gloo", verbose=False)
    logs = lab.read_logs(tmp_path, ["crashed", "reference"])
    assert list(logs["reference"]) == [0, 1] and logs["crashed"][0] == logs["reference"][0]
    logs["resumed"] = {1: logs["reference"][1]}
    labels = {"reference": "ref", "crashed": "crashed", "resumed": "resumed"}
    lab.plot_resume(logs, labels, resumed_from=1)
    assert len(plt.gcf().axes[0].lines) == 4  # three runs and the resume's line
    plt.close("all")
    assert "max |Δloss| = 0.0e+00" in capsys.readouterr().out


def test_bytes_per_stage_divide_by_the_ranks(tmp_path, capsys):
    got = lab.bytes_per_stage(2, tmp_path, stages=(0, 3))
    share = (2 + 12) * lab.PSI / 2
    for b in got["bytes"][3]:
        assert abs(b["shards"] - share) / share < 0.01 and b["files"] > b["shards"]
    assert sum(b["elements"] for b in got["bytes"][0]) >= lab.PSI  # whole tensors, each once
    lab.plot_bytes_per_stage(got, per_rank=share, one_rank=2 * share)
    assert len(plt.gcf().axes) == 2
    plt.close("all")
    lab.show_bytes_per_stage(got)
    assert capsys.readouterr().out.count("B of shards") == 4
