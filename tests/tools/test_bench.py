"""Smoke tests of the benchmarks and the demo: each runs at a tiny size on 2 gloo ranks and writes
what it promises (JSON keys, exact model-state bytes, the paper's volumes). No timing asserts."""

from __future__ import annotations

import json
import re

import pytest

from minizero.__main__ import main
from minizero.analysis.ledger import BUSBW_FACTOR
from minizero.models import EncoderLM, GPTConfig, TinyGPT, count_params
from minizero.tools.bench_steps import bench_ddp, bench_stages
from minizero.tools.demo import demo

PSI_TINY = count_params(TinyGPT(GPTConfig.tiny()))
TINY = ["--nprocs", "2", "--model", "tiny", "--batch", "4", "--warmup", "1", "--steps", "2",
        "--k", "1"]  # fmt: skip


def test_bench_collectives_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["bench", "collectives", "--nprocs", "2", "--min-bytes", "1024", "--max-bytes", "4096",
            "--iters", "2", "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text, err = capsys.readouterr()
    assert text.startswith(
        "minizero bench collectives: 4 ops x 2 sizes (1024 B .. 4,096 B) on 2 "
        "ranks, 2 timed calls each\n"
    )  # printed before the ranks start
    assert "collectives: 100%" in err and "8/8" in err  # the progress bar reached every row
    assert (
        "2 ranks, gloo on" in text and "gloo: minizero's is an all-to-all and a local sum" in text
    )
    assert "rows marked ~ are under 1 MiB" in text
    assert "        1024         256   float32" in text
    data = json.loads(out.read_text())
    assert set(data["where"]) == {"backend", "device", "world", "torch"}
    rows = data["rows"]
    assert [(r["op"], r["nbytes"]) for r in rows] == [
        (op, size) for size in (1024, 4096)
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
    ]  # fmt: skip
    for r in rows:
        assert r["count"] * 4 == r["nbytes"] and r["count"] % 2 == 0
        assert r["algbw"] == pytest.approx(r["nbytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * BUSBW_FACTOR[r["op"]](2))
        assert r["ratio"] == pytest.approx(r["seconds"] / r["torch_seconds"])


def test_bench_ddp_json(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert bench_ddp([*TINY, "--json", str(out)]) == 0
    text, err = capsys.readouterr()
    assert text.startswith(
        "minizero bench ddp: 1 pair on 2 ranks, TinyGPT tiny; each contender: "
        "memory alone, 1 warmup + 2 timed steps, taking turns\n"
    )
    assert "ddp: 100%" in err and "8/8" in err  # 2 contenders x (memory, warmup, 2 rounds)
    assert "minizero DDP / torch DDP:" in text
    data = json.loads(out.read_text())
    assert data["psi"] == PSI_TINY and data["where"]["world"] == 2
    (group,) = data["groups"]
    assert [r["name"] for r in group["rows"]] == ["minizero DDP", "torch DDP"]
    assert group["steps"] == 1 + 2  # warmup + rounds * k, the same for both
    assert group["max_param_diff"] <= 1e-6  # same init, same batches, same AdamW
    for row in group["rows"]:  # fp32 Adam, nothing partitioned: 4Ψ + 4Ψ + 8Ψ, exactly
        assert row["state_bytes"] == {"params": 4 * PSI_TINY, "grads": 4 * PSI_TINY,
                                      "optimizer": 8 * PSI_TINY}  # fmt: skip
        assert row["peak_bytes"] > 16 * PSI_TINY
        assert len(row["times_rank0"]) == 2 and row["median_s"] > 0
    plain = group["rows"][0]["median_s"] / group["rows"][1]["median_s"]
    assert group["median_ratio"] == pytest.approx(plain) and group["ratio"] > 0


def test_bench_stages_json(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert bench_stages([*TINY, "--json", str(out)]) == 0
    text, err = capsys.readouterr()
    assert "stages: 100%" in err and "32/32" in err
    for peer in ("ZeroRedundancyOptimizer(AdamW)", "fully_shard(reshard_after_forward=False)",
                 "fully_shard(reshard_after_forward=True)"):  # fmt: skip
        assert peer in text
    groups = json.loads(out.read_text())["groups"]
    assert [g["rows"][0]["name"] for g in groups] == [f"minizero stage {s}" for s in range(4)]
    for g in groups:
        assert g["max_param_diff"] <= 1e-5 and g["ratio"] > 0
    states = [g["rows"][0]["state_bytes"] for g in groups]  # minizero stage s on one rank
    half = lambda n: pytest.approx(n / 2, rel=0.01)  # a shard of N=2, padding aside
    assert states[0]["optimizer"] == 8 * PSI_TINY
    assert states[1]["optimizer"] == half(8 * PSI_TINY) and states[1]["grads"] == 4 * PSI_TINY
    assert states[2]["grads"] == half(4 * PSI_TINY) and states[2]["params"] == 4 * PSI_TINY
    assert states[3]["params"] == half(4 * PSI_TINY)


def test_bench_stages_on_torchs_transformer(tmp_path, capsys):
    """--model encoder-tiny: EncoderLM (torch's nn.TransformerEncoderLayer, tied head); each
    stage against its peer, FSDP2 on the same blocks; prints the four ratios (no timing assert)."""
    out = tmp_path / "e.json"
    argv = [*TINY, "--json", str(out)]
    argv[argv.index("tiny")] = "encoder-tiny"
    assert bench_stages(argv) == 0
    text = capsys.readouterr().out
    assert "4 pairs on 2 ranks, EncoderLM tiny (torch nn.TransformerEncoderLayer)" in text
    psi = count_params(EncoderLM(GPTConfig.tiny()))
    assert f"Ψ = {psi:,} params" in text
    data = json.loads(out.read_text())
    assert data["psi"] == psi and data["model"] == "encoder-tiny"
    peers = ["torch DDP", "DDP + ZeroRedundancyOpt", "FSDP2 no reshard", "FSDP2 reshard"]
    for s, (g, peer) in enumerate(zip(data["groups"], peers, strict=True)):
        assert [r["name"] for r in g["rows"]] == [f"minizero stage {s}", peer]
        assert g["max_param_diff"] <= 1e-5 and g["ratio"] > 0
        assert re.search(rf"minizero stage {s} / {re.escape(peer)}: \d+\.\d{{3}} wall", text)
    states = [g["rows"][0]["state_bytes"] for g in data["groups"]]
    assert states[0] == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    assert states[3]["params"] == pytest.approx(2 * psi, rel=0.01)  # a shard of N=2
    fsdp2 = data["groups"][3]["rows"][1]["state_bytes"]
    assert states[3] == pytest.approx(fsdp2, rel=0.01)  # the same units: the same shards


@pytest.mark.parametrize(("stage", "volume"), [(0, "2.00"), (3, "3.0")])
def test_demo(stage, volume, capsys):
    assert demo(2, stage) == 0
    text = capsys.readouterr().out
    assert f"stage {stage}" in text and "2 ranks, gloo on" in text
    assert text.count("PASS") == 4  # three equivalence lines and the verdict
    assert f"moved {volume}" in text and f"paper: {2 if stage < 3 else 3}Ψ" in text


def test_demo_rejects_bad_stage_ranks_and_batch():
    with pytest.raises(ValueError, match="stage must be 0 "):
        demo(2, 4)
    with pytest.raises(ValueError, match="nprocs must be a whole number >= 1, got 0"):
        demo(0)
    with pytest.raises(ValueError, match="--batch 16 does not split evenly over 3 ranks: use"):
        demo(3, batch=16)


def test_demo_on_3_ranks_rounds_the_batch_up(capsys):
    assert demo(3, 1) == 0  # the global batch becomes 18: 6 sequences per rank
    text, err = capsys.readouterr()
    assert "global batch 18 sequences (6 per rank)" in text and text.count("PASS") == 4
    assert "steps: 100%" in err and "5/5" in err


def test_bench_checkpoints_json(tmp_path, capsys):
    from minizero.tools.bench_ckpt import bench_checkpoint

    out = tmp_path / "ck.json"
    argv = ["--model", "tiny", "--stages", "0,3", "--repeat", "1", "--nprocs", "2"]
    bench_checkpoint([*argv, "--json", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["where"]["world"] == 2 and data["precision"] == "bf16"
    assert [r["stage"] for r in data["rows"]] == [0, 3]
    for row in data["rows"]:  # bf16 + AdamW: 2 + 12 bytes per element, all of it saved once
        assert row["psi"] == PSI_TINY and row["formula"] == 14 * PSI_TINY / 2
        assert sum(r["shards"] for r in row["ranks"]) == 14 * PSI_TINY
    assert [r["shards"] for r in data["rows"][1]["ranks"]] == [7 * PSI_TINY] * 2  # stage 3: even


@pytest.mark.parametrize(
    "what, model, path",
    [("stages", "small", "runs/bench_stages.json"),
     ("stages", "encoder", "runs/bench_stages_encoder.json"),
     ("ddp", "encoder-tiny", "runs/bench_ddp_encoder_tiny.json")],
)  # fmt: skip
def test_each_model_writes_its_own_json(what, model, path):
    from minizero.tools import bench_steps

    p = bench_steps._duel_options(what, f"runs/bench_{what}.json")
    a = p.parse_args(["--model", model, "--nprocs", "2"])
    bench_steps._check(p, a)
    assert a.json == path
    a = p.parse_args(["--model", model, "--nprocs", "2", "--json", "x.json"])
    bench_steps._check(p, a)
    assert a.json == "x.json"


def test_bench_parts_counts_each_stages_collectives(tmp_path, capsys):
    """The capstone's step at every stage, beside its peers in the same rounds (each rank alone,
    with no communication; torch's DDP, DDP with ZeroRedundancyOptimizer, FSDP2): every part
    printed, each stage's median step over its peer's, and one step's collectives per kind,
    exactly: DDP's two buckets all-reduced; stages 1-2 reduce-scatter and all-gather them, plus
    clip_grad_norm_'s all-reduce of the norms; stage 3, the model in one unit as train runs it
    (min_unit_params), gathers it twice (forward, backward) and reduce-scatters it once. The
    ledger sees minizero's collectives only, so the peers' are "-", not a wrong 0."""
    out = tmp_path / "p.json"
    argv = ["bench", "parts", "--nprocs", "2", "--rounds", "1", "--steps", "1", "--json",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "the capstone's model (0.8M parameters), fp32" in text
    peers = r" +alone +torch DDP +DDP \+ ZRO +FSDP2"
    assert re.search(rf"^ms per step.*{peers} +stage 0 +stage 1 +stage 2 +stage 3$", text,
                     re.M), text  # fmt: skip
    for part in ("forward", "backward", "clip", "optimizer.step", "zero_grad", "median step"):
        assert re.search(rf"^{part}( +[0-9.]+){{8}}$", text, re.M), part
    assert re.search(r"^  of which waits( +-){4}( +[0-9.]+){4}$", text, re.M), text
    assert re.search(r"^all_gather per step( +-){4} +0 +2 +2 +2$", text, re.M)
    assert re.search(r"^all_reduce per step( +-){4} +2 +1 +1 +1$", text, re.M)
    assert re.search(r"^reduce_scatter per step( +-){4} +0 +2 +2 +1$", text, re.M)
    data = json.loads(out.read_text())
    assert data["stages"]["3"]["collectives"] == {"all_gather": 2, "reduce_scatter": 1,
                                                  "all_reduce": 1}  # fmt: skip
    for peer in ("alone", "torch DDP", "DDP + ZRO", "FSDP2"):
        assert data["stages"][peer]["collectives"] is None
        assert data["stages"][peer]["median_ms"] > 0
    # each stage over PyTorch's own: DDP, DDP + ZeroRedundancyOptimizer, FSDP2, FSDP2
    ms = {k: v["median_ms"] for k, v in data["stages"].items()}
    ratios = [ms[s] / ms[p] for s, p in (("0", "torch DDP"), ("1", "DDP + ZRO"), ("2", "FSDP2"),
                                         ("3", "FSDP2"))]  # fmt: skip
    row = re.search(r"^/ peer( +-){4}((?: +[0-9.]+){4})$", text, re.M)
    assert row, text
    assert [float(x) for x in row.group(2).split()] == [round(r, 2) for r in ratios], text


def test_bench_parts_without_peers_or_json_prints_the_stages_asked_only(tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # (the default json would go to runs/ here)
    argv = ["bench", "parts", "--nprocs", "2", "--rounds", "1", "--steps", "1", "--stages",
            "0, 2", "--no-peers", "--json", ""]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert re.search(r"^ms per step.* +stage 0 +stage 2$", text, re.M), text
    assert re.search(r"^all_gather per step +0 +2$", text, re.M), text
    assert "alone" not in text and "wrote" not in text and not list(tmp_path.iterdir())


def test_bench_parts_without_resharding_the_root_gathers_stage_3_once(tmp_path, capsys):
    """``--no-reshard-root`` (train's option, FSDP2's root): the capstone's model, one unit, stays
    gathered from forward to the end of backward: one all-gather a step where the default makes
    two; the header and the JSON say so."""
    out = tmp_path / "p.json"
    argv = ["bench", "parts", "--nprocs", "2", "--rounds", "1", "--steps", "1", "--stages", "3",
            "--no-peers", "--no-reshard-root", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fp32; stage 3's root unit kept gathered through backward" in text, text
    assert re.search(r"^all_gather per step +1$", text, re.M), text
    data = json.loads(out.read_text())
    assert data["reshard_root"] is False
    assert data["stages"]["3"]["collectives"] == {"all_gather": 1, "reduce_scatter": 1,
                                                  "all_reduce": 1}  # fmt: skip


def test_bench_parts_refuses_a_stage_it_does_not_know(capsys):
    for bad in ("4", "x", "0,,1"):
        with pytest.raises(SystemExit):
            main(["bench", "parts", "--stages", bad])
        err = capsys.readouterr().err
        assert f"--stages takes stages 0-3, comma-separated, got {bad!r}" in err, err
