"""``python -m minizero train``: the data is nanoGPT's split, every stage trains one process's
curve, a checkpoint resumes at another stage and world size on the same curve, bad options end
in one line, and the NCCL path (``gpu``) trains what the CPU trains.

Runs are a few iterations of a small GPT (2 layers, width 32, 16 characters of context), so each
takes seconds; the 2,000-iteration runs are measurements (``bench nanogpt``), not tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from minizero.__main__ import main
from minizero.launcher import gpu_count
from minizero.models import GPTConfig, TinyGPT
from minizero.tools import shakespeare
from minizero.tools.bench_nanogpt import find_nanogpt
from minizero.tools.full_split import IGNORE, full_split_loss, split_sums, windows
from minizero.tools.report import cpu_name
from minizero.tools.train import TrainConfig, get_lr, single_process
from minizero.tools.train_cli import curve, train

pytestmark = pytest.mark.timeout(300)

SMALL = TrainConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, max_iters=8, warmup_iters=2,
                    eval_interval=4, eval_iters=2, sample_tokens=20, out_dir=None)  # fmt: skip
# fp32 on gloo: the ranks' losses are summed in another order than one process's (a mean over
# 12 / N rows, then over N ranks), rounding of 1e-7 relative that 8 AdamW steps carry into the
# weights; 1e-4 is the tolerance of every equivalence test in this kit (tests/library).
RTOL = 1e-4


def _close(mine: list[float], ref: list[float]) -> float:
    assert len(mine) == len(ref)
    return max(abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True))


def test_the_data_is_nanogpts_character_split():
    data = shakespeare.load()
    assert (len(data.train), len(data.val), data.vocab_size) == (1_003_854, 111_540, 65)
    assert (
        data.chars == "\n !$&',-.3:;?" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz"
    )
    assert data.decode(data.train[:14]) == "First Citizen:"
    assert data.decode(data.encode("To be, or not")) == "To be, or not"
    with pytest.raises(ValueError, match="not in the vocabulary: \\['#'\\]"):
        data.encode("a#")
    whole = shakespeare.get_batch(data, "train", 12, 16, 5)
    parts = [shakespeare.get_batch(data, "train", 12, 16, 5, rank=r, world=3) for r in range(3)]
    for i in (0, 1):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
    assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])  # y is x shifted by one
    with pytest.raises(ValueError, match="must split evenly over 5 ranks"):
        shakespeare.get_batch(data, "train", 12, 16, 0, rank=0, world=5)


@pytest.mark.parametrize("n, block", [(50, 7), (50, 49), (57, 8), (10, 3)])
def test_full_split_windows_score_every_character_once(n, block):
    ids = torch.arange(n) % 251
    x, y = windows(ids, block)
    assert x.shape == y.shape == (-(-(n - 1) // block), block)
    assert torch.equal(y[y != IGNORE], ids[1:])  # every target once, in order
    kept = y != IGNORE
    assert torch.equal(x[kept], ids[:-1])  # each target's input is the character before it
    with pytest.raises(ValueError, match="longer than the split"):
        windows(torch.arange(5), 5)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_split_loss_is_every_targets_cross_entropy(world):
    """Each rank's share, summed (as the all-reduce sums them), is the mean cross-entropy of
    every target: against a direct loop over the split, one window at a time."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=1, n_embd=8)
    model = TinyGPT(cfg).eval()
    ids = torch.randint(11, (40,))
    want, count = 0.0, 0
    for i in range(0, 39, 6):  # a window at a time: context from its start
        start = min(i, 39 - 6)
        xs, ys = ids[start : start + 6], ids[start + 1 : start + 7]
        logits = model(xs[None])[0]
        first = i - start  # the positions an earlier window scored
        want += F.cross_entropy(logits[first:], ys[first:], reduction="sum").item()
        count += 6 - first
    calls = []

    def logits_fn(x):
        calls.append(len(x))
        return model(x)

    with torch.no_grad():
        parts = [split_sums(logits_fn, ids, 6, rank=r, world=world, batch=2) for r in range(world)]
    total = sum(parts)  # what the all-reduce sums
    assert count == 39 and total[1] == 39
    assert float(total[0] / total[1]) == pytest.approx(float(want) / count, rel=1e-6)
    per_rank = math.ceil(math.ceil(7 / world) / 2)  # 7 windows, dealt; 2 windows a forward
    assert len(calls) == world * per_rank  # every rank: the same number of forwards
    if world == 1:
        assert full_split_loss(model, ids, 6, batch=2) == pytest.approx(float(want) / count)


def test_the_schedule_is_nanogpts_warmup_then_cosine():
    cfg = TrainConfig()
    assert get_lr(0, cfg) == pytest.approx(1e-3 / 101)
    assert get_lr(100, cfg) == pytest.approx(1e-3)
    assert get_lr(1050, cfg) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert get_lr(2000, cfg) == pytest.approx(1e-4)
    assert get_lr(5000, cfg) == 1e-4


@pytest.mark.slow
def test_every_stage_on_two_ranks_trains_one_process_curve():
    one = single_process(SMALL)
    assert one["loss"][-1] < one["loss"][0]  # it learns
    # stage 3 three times: this model in one unit (train's min_unit_params), that unit kept
    # gathered through backward (--no-reshard-root), and a unit per block
    for stage, units in ((0, {}), (1, {}), (2, {}), (3, {}), (3, {"reshard_root": False}),
                         (3, {"min_unit_params": 0})):  # fmt: skip
        results = train(replace(SMALL, stage=stage, **units), 2, timeout=240, quiet=True)
        assert _close(curve(results), one["loss"]) <= RTOL, stage
        evals = results[0]["evals"]
        assert [e[0] for e in evals] == [0, 4, 8]
        assert all(r["evals"] == evals for r in results)  # every rank: the same average
        for a, b in zip(evals, one["evals"], strict=True):
            assert _close(a[1:], b[1:]) <= RTOL, (stage, a, b)
        # the whole validation split, each rank its share of the windows (stage 3: collective)
        assert all(r["val_full"] == results[0]["val_full"] for r in results)
        assert _close([results[0]["val_full"]], [one["val_full"]]) <= RTOL, stage
        assert len(results[0]["sample"]) == SMALL.sample_tokens


@pytest.mark.slow
def test_hsdp_mesh_trains_one_process_curve():
    one = single_process(SMALL)
    results = train(replace(SMALL, stage=3, mesh=(2, 2)), 4, timeout=240, quiet=True)
    assert _close(curve(results), one["loss"]) <= RTOL
    assert results[0]["checkpoint"] is None  # save_checkpoint takes no mesh


@pytest.mark.slow
def test_resume_at_another_stage_and_world_continues_the_curve(tmp_path):
    whole = train(replace(SMALL, out_dir=str(tmp_path / "whole")), 2, timeout=240, quiet=True)
    first = replace(SMALL, max_iters=4, lr_decay_iters=SMALL.max_iters, sample_tokens=0,
                    out_dir=str(tmp_path / "a"))  # the schedule of the whole run  # fmt: skip
    assert train(first, 2, timeout=240, quiet=True)[0]["checkpoint"] == str(tmp_path / "a/ckpt")
    again = replace(SMALL, stage=3, resume=str(tmp_path / "a/ckpt"), out_dir=str(tmp_path / "b"))
    resumed = train(again, 3, timeout=240, quiet=True)  # stage 0 on 2 ranks -> stage 3 on 3
    assert resumed[0]["start"] == 4
    assert len(resumed[0]["loss"]) == len(resumed[2]["loss"]) == 4  # this run's iterations
    assert len(curve(resumed)) == SMALL.max_iters  # after the checkpoint's curve
    assert _close(curve(resumed)[4:], curve(whole)[4:]) <= RTOL
    assert _close(curve(resumed)[:4], curve(whole)[:4]) <= 1e-12  # the saved curve, carried on
    assert [e[0] for e in resumed[0]["evals"]] == [0, 4, 8]  # iteration 4 evaluated once
    assert _close(resumed[0]["evals"][-1][1:], whole[0]["evals"][-1][1:]) <= RTOL


@pytest.mark.slow
def test_the_command_reports_and_writes_its_plot_history_and_checkpoint(tmp_path, capsys):
    argv = ["train", "--nprocs", "2", "--stage", "2", "--n-layer", "1", "--n-embd", "32",
            "--block-size", "16", "--max-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
            "--sample-tokens", "30", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "minizero train: stage 2 = ZeRO-2 (P_os+g), 2 ranks, gloo" in out
    assert "step 0: train loss 4.1" in out and "step 4: train loss" in out
    assert "--- sample (30 characters, temperature 0.8, top_k 200) ---" in out
    assert "\nbeside nanoGPT: " in out  # its ratio, or how bench nanogpt measures it here
    history = json.loads((tmp_path / "history.json").read_text())
    assert [e[0] for e in history["evals"]] == [0, 2, 4] and len(history["loss"]) == 4
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "ckpt" / "minizero.json").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nprocs", "5"], "minizero train: error: --batch-size 12 does not split evenly over 5 "
         "ranks: pass --batch-size 10, or --nprocs dividing 12"),
        (["--stage", "4"], "minizero train: error: argument --stage: invalid choice: 4"),
        (["--max-iters", "0"], "minizero train: error: argument --max-iters: must be a whole "
         "number >= 1, got '0'"),
        (["--nprocs", "2", "--mesh", "2,2"], "minizero train: error: --mesh 2,2 covers 4 ranks, "
         "not the 2 ranks running (--nprocs)"),
        (["--mesh", "2"], "minizero train: error: argument --mesh: give REPLICATE,SHARD, e.g. 2,2"),
        (["--nprocs", "2", "--mesh", "1,2"], "minizero train: error: --mesh 1,2: HSDP needs at "
         "least 2 replicas of at least 2 ranks"),
        (["--nprocs", "2", "--n-embd", "30"], "minizero train: error: n_embd (30) must be "
         "divisible by n_head (4)"),
        (["--resume", "/nonexistent/ckpt"], "minizero train: error: --resume /nonexistent/ckpt: "
         "no such checkpoint directory"),
        (["--precision", "fp8"], "minizero train: error: argument --precision: invalid choice"),
        (["--min-unit-params", "-1"], "minizero train: error: min_unit_params must be an int >= "
         "0, got -1"),
        (["--no-reshard-root"], "minizero train: error: reshard_root=False is a stage 3 option "
         "(stage 0 gathers no parameters): pass --stage 3, or leave it out"),
    ],
)  # fmt: skip
def test_bad_options_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith(message) and err.endswith(" (--help lists the options)\n"), err


def test_resuming_past_the_end_says_what_to_pass(tmp_path):
    from minizero.launcher import LaunchError

    first = replace(SMALL, max_iters=4, out_dir=str(tmp_path), sample_tokens=0)
    train(first, 2, timeout=240, quiet=True)
    with pytest.raises(LaunchError, match="is at iteration 4: pass --max-iters > 4"):
        train(replace(first, resume=str(tmp_path / "ckpt")), 2, timeout=240, quiet=True)


def test_bench_nanogpt_without_nanogpt_says_where_to_place_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIZERO_NANOGPT", str(tmp_path))  # exists, empty: nothing is cloned
    where, why = find_nanogpt()
    assert where is None
    assert why.startswith(f"nanoGPT not found in {tmp_path}: ['train.py', 'model.py'")
    assert f"git clone https://github.com/karpathy/nanoGPT {tmp_path}" in why
    assert main(["bench", "nanogpt", "--max-iters", "2"]) == 0
    assert capsys.readouterr().out.startswith("minizero bench nanogpt: skipped: nanoGPT not found")


def test_train_sets_its_step_beside_nanogpts_iteration_measured_here(tmp_path):
    """``train`` prints its median step over nanoGPT's median iteration as ``bench nanogpt``
    recorded it, only for the same machine and configuration; else how to measure it."""
    from minizero.tools.bench_nanogpt_report import SHAPE, beside_nanogpt

    cfg, here = TrainConfig(), {"backend": "gloo", "device": "Some CPU, 2 cores"}
    rows = [{"name": "nanoGPT train.py", "iter_ms": ms} for ms in (50.0, 40.0, 60.0)]  # 3 seeds
    rows.append({"name": "nanoGPT train.py, minizero's batches", "iter_ms": 10.0})  # not its own
    rec = {"machine": "Some CPU, 2 cores", "date": "2026-11-29", "rows": rows,
           "config": {k: getattr(cfg, k) for k in SHAPE}}  # fmt: skip
    path = tmp_path / "bench_nanogpt.json"
    path.write_text(json.dumps(rec))
    assert beside_nanogpt(cfg, 55.0, here, path) == (
        "beside nanoGPT: 1.10x its median iteration (50.0 ms: its own train.py in one process, "
        "this configuration, timed by bench nanogpt on this machine on 2026-11-29; bench nanogpt "
        "times both in one sitting)"
    )
    how = "python -m minizero bench nanogpt measures its iteration here, and train then prints "
    assert beside_nanogpt(replace(cfg, n_layer=2), 55.0, here, path) == (
        f"beside nanoGPT: {path} was measured with another configuration; {how}the ratio"
    )
    assert beside_nanogpt(cfg, 55.0, {**here, "device": "Other CPU, 2 cores"}, path) == (
        f"beside nanoGPT: {path} was measured on another machine; {how}the ratio"
    )
    assert beside_nanogpt(cfg, 55.0, {"backend": "nccl", "device": "H200"}, path) is None
    missing = beside_nanogpt(cfg, 55.0, here, tmp_path / "none.json")
    assert missing == f"beside nanoGPT: {how}the ratio"
    path.write_text(json.dumps({k: v for k, v in rec.items() if k != "machine"}))
    assert beside_nanogpt(cfg, 55.0, here, path).startswith(
        f"beside nanoGPT: {path} records no nanoGPT iteration and machine; python -m minizero"
    )


@pytest.mark.gpu(1)
@pytest.mark.slow
def test_one_rank_per_gpu_over_nccl_trains_the_cpu_curve():
    """The NCCL path: the ranks' GPUs run what one CPU process runs (fp32; GPU and CPU kernels
    round differently, so the tolerance is the GPU equivalence tests' 1e-3)."""
    n = max(k for k in (1, 2, 3, 4, 6) if k <= gpu_count())
    one = single_process(SMALL)
    for stage in (0, 3):
        results = train(replace(SMALL, stage=stage), n, timeout=240, quiet=True, backend="nccl")
        assert results[0]["where"]["backend"] == "nccl"
        assert _close(curve(results), one["loss"]) <= 1e-3, stage


def test_welch_t_and_its_degrees_of_freedom():
    from minizero.tools.bench_nanogpt_report import welch

    t, df = welch([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0])
    vx, vy = 1.0 / 3, (20.0 / 3) / 4  # sample variances over n
    assert t == pytest.approx((2.0 - 5.0) / math.sqrt(vx + vy))
    assert df == pytest.approx((vx + vy) ** 2 / (vx**2 / 2 + vy**2 / 3))


@pytest.mark.soak  # four runs each scoring the whole validation split: ~70 CPU-s (docs/testing.md)
@pytest.mark.timeout(1800)  # four runs, nanoGPT's among them, each a process of its own
def test_bench_nanogpt_scores_every_run_on_the_whole_split(tmp_path, capsys):
    """With a nanoGPT checkout (else skipped): nanoGPT fed minizero's batches, one process and
    stage 0 score the same whole-split loss (the same model, data and loop), nanoGPT's own
    batches another; the table has the one-process row and the difference column."""
    if find_nanogpt(fetch=False)[0] is None:
        pytest.skip("no nanoGPT checkout (see bench nanogpt)")
    out = tmp_path / "bench.json"
    argv = ["bench", "nanogpt", "--max-iters", "4", "--stages", "0", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "one process (plain PyTorch, 1 thread)" in printed and "val all" in printed
    written = json.loads(out.read_text())
    assert written["machine"] == cpu_name() and written["config"]["n_embd"] == 128, written
    rows = {r["name"]: r for r in written["rows"]}
    fed = rows["nanoGPT train.py, minizero's batches"]
    ref = rows["one process (plain PyTorch, 1 thread)"]
    stage0 = rows["minizero train, stage 0, 2 ranks"]
    assert _close([fed["val_full"], stage0["val_full"]], [ref["val_full"]] * 2) <= RTOL
    assert float(stage0["diff"]) <= RTOL and rows["nanoGPT train.py"]["diff"] == "own batches"
    assert all(r["iter"] == 4 for r in rows.values())
