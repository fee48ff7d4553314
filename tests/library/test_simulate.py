"""The scale simulation (minizero/simulate.py, lesson 05_all_stages): the real stage code on
meta tensors under a fake process group gives the paper's formulas, its Table 1, and what a real
run holds."""

import resource

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minizero.analysis.memory import (
    PAPER_TABLE1,
    TABLE1_DP,
    TABLE1_PSI,
    model_state_bytes,
    paper_model_state_bytes,
)
from minizero.analysis.simulate import FlatModel, format_table1, printed_as, simulate, table1
from minizero.launcher import launch
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch
from minizero.parallelize import parallelize
from minizero.tools.simulate import main

pytestmark = pytest.mark.timeout(240)
BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}  # params, grads, optimizer (Adam) per element
MODELS = {
    "flat": (lambda: FlatModel(10_007, pieces=3), 3),  # prime Ψ: every world size pads
    "mlp": (lambda: MLP(tied=True), 9),  # frozen weights are not in the formula
    "gpt": (lambda: TinyGPT(GPTConfig.tiny()), 30),
}  # model_fn, trainable parameter tensors (>= buckets or units, each padded < world elements)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("world", [1, 3, 4, 64])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_the_paper_formula_up_to_padding(stage, world, precision, model):
    model_fn, tensors = MODELS[model]
    with torch.device("meta"):
        psi = count_params(model_fn())
    got = simulate(model_fn, stage, world, precision)
    want = paper_model_state_bytes(psi, world, stage, precision)
    assert set(got) == {"params", "grads", "optimizer"}
    for cat, per_element in zip(want, BYTES[precision]):
        padding = got[cat] - want[cat]  # each bucket is padded to a multiple of the world size
        assert 0 <= padding <= per_element * world * tensors, (cat, got, want)
        if stage == 0 or world == 1:
            assert padding == 0


def test_exact_when_nothing_pads():
    for stage in (0, 1, 2, 3):
        got = simulate(lambda: FlatModel(4 * 1024 * 3), stage, 1024, "bf16")
        assert got == paper_model_state_bytes(4 * 1024 * 3, 1024, stage, "bf16")


def test_reproduces_the_papers_table_1():
    rows = table1()
    assert len(rows) == 3 * len(TABLE1_DP) * 4
    for r in rows:
        printed = PAPER_TABLE1[r["model"]][r["world"]]
        want = printed[r["stage"] - 1] if r["stage"] else PAPER_TABLE1[r["model"]][1][0]
        assert r["paper_gb"] == want and r["psi"] == TABLE1_PSI[r["model"]]
        assert printed_as(r["gb"], want), r
        assert r["match"]
    assert rows[0]["bytes"] == {"params": 15e9, "grads": 15e9, "optimizer": 90e9}  # 7.5B, DDP
    one_t = {(r["world"], r["stage"]): r["bytes"] for r in rows if r["model"] == "1T"}
    assert one_t[1024, 3] == {"params": 1953125000, "grads": 1953125000, "optimizer": 11718750000}
    assert "72/72 cells with a paper value print as the paper's" in format_table1(rows)


def test_printed_as_follows_the_papers_rounding():
    assert printed_as(41.25, 41.3) and printed_as(4187.5, 4187) and printed_as(0.1171875, 0.12)
    assert not printed_as(41.2, 41.3) and not printed_as(4189, 4187)


def test_cli_and_cells_outside_the_paper(capsys):
    assert main(["--stages", "3", "--worlds", "4", "--psis", "7.5e9"]) == 0
    out = capsys.readouterr().out
    assert "30 [30]" in out and "1/1 cells with a paper value print as the paper's" in out
    (row,) = table1(stages=(2,), worlds=(8,), psis=(1e9,))
    assert row["paper_gb"] is None and not row["match"] and row["gb"] == 2 + 14 / 8


def test_off_the_papers_grid_nothing_is_flagged_and_the_footer_says_so(capsys):
    assert main(["--psis", "1e9", "--worlds", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "Model states per rank in GB (1e9 bytes), measured: minizero's stage code on meta tensors,",
        "under a fake process group. Mixed-precision Adam (bf16): 2 + 2 + K bytes per parameter, "
        "K = 12.",
        "model N_d       DDP      P_os    P_os+g  P_os+g+p",
        "   1B   8        16       5.5      3.75         2",  # 2+2+12/8, 2+14/8, 16/8 GB
        "no cell here is in the paper's Table 1 (Ψ = 7.5B, 128B, 1T at N_d = 1, 4, 16, 64, 256, "
        "1024): nothing to compare",
    ]


def test_fp32_table_is_headed_fp32_with_k_8(capsys):
    assert main(["--precision", "fp32", "--psis", "7.5e9", "--worlds", "1", "4"]) == 0
    out = capsys.readouterr().out
    assert "fp32 Adam: 4 + 4 + 8 bytes per parameter (params, grads, m and v; K = 8)." in out
    assert "K = 12" not in out and "[" not in out and "!" not in out
    assert " 7.5B   4       120        75      52.5        30" in out  # 16Ψ, 4Ψ+4Ψ+8Ψ/4, ...
    assert out.rstrip().endswith("no fp32 cell has a paper value")


def test_custom_psi_keeps_the_columns_aligned_and_marks_only_paper_mismatches(capsys):
    assert main(["--psis", "123456789", "7.5e9", "--worlds", "1", "64"]) == 0
    table = capsys.readouterr().out.splitlines()[3:-1]  # header and rows
    assert len({len(line) for line in table}) == 1, table
    assert table[1].startswith("123.5M   1") and table[3].startswith("  7.5B   1")
    rows = table1(stages=(3,), worlds=(64,), psis=(7.5e9,))
    rows[0]["gb"], rows[0]["match"] = 2.0, False  # as if the code held 2 GB, not 1.875
    assert format_table1(rows).splitlines()[-2:] == [
        " 7.5B  64  2 [1.88] !",
        "0/1 cells with a paper value print as the paper's (rounded or truncated; ! marks the "
        "others)",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--worlds", "0"], "minizero simulate: error: --worlds must be >= 1, got 0"),
        (["--psis", "2"], "minizero simulate: error: --psis must be between 4 and 1e16"),
        (["--stages", "4"], "minizero simulate: error: argument --stages: invalid choice: 4"),
    ],
)
def test_bad_values_get_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_leaves_no_process_group_and_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for stage in (0, 3):
        got = simulate(lambda: FlatModel(10**12), stage, 8, "bf16")
        assert sum(got.values()) == 16e12 / (8 if stage == 3 else 1)  # 16 TB, 2 TB: never real
        assert not dist.is_initialized()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 2**20  # < 1 GiB of new resident memory for 18 TB of model states


def test_errors_leave_no_process_group():
    with pytest.raises(TypeError, match="pass batch_fn=lambda model"):
        simulate(lambda: nn.Linear(3, 3), 0, 2)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="model_fn put 'weight' .* on a real device"):
        simulate(lambda: nn.Linear(3, 3, device="cpu"), 0, 2)
    with pytest.raises(ValueError, match="stage must be 0"):
        simulate(lambda: FlatModel(8), 4, 2)
    with pytest.raises(ValueError, match="0 <= rank < world"):
        simulate(lambda: FlatModel(8), 1, 2, rank=2)
    assert not dist.is_initialized()


def test_custom_batch_optimizer_and_rank():
    batch = lambda m: (torch.ones(2, 3, dtype=m.weight.dtype),)  # (B, in) on meta
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # K = 4 + 4 in mixed precision
    got = simulate(lambda: nn.Linear(3, 5), 1, 4, batch_fn=batch, optimizer_fn=sgd, rank=3)
    assert got == {"params": 40, "grads": 40, "optimizer": 5 * (4 + 4)}  # Ψ = 20: 5 a rank


def test_fp16_holds_what_bf16_holds():
    """fp16 adds a loss scaler (a Python float) and an inf check that meta tensors skip."""
    for stage in (0, 1, 2, 3):
        got = simulate(lambda: FlatModel(1000), stage, 4, "fp16")
        assert got == simulate(lambda: FlatModel(1000), stage, 4, "bf16")


def _real_states() -> dict:
    """Each stage, one bf16 step on gloo with real tensors; what this rank holds afterwards."""
    out, rank, world = {}, dist.get_rank(), dist.get_world_size()
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model, opt = parallelize(MLP(tied=True, frozen_first=True), stage,
                                 lambda p: torch.optim.Adam(p), precision="bf16")  # fmt: skip
        x, y = synthetic_batch("mlp", 2 * world, 0, rank=rank, world=world)
        model(x.bfloat16(), y.bfloat16()).backward()
        opt.step()
        out[stage] = model_state_bytes(model, opt)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_simulation_holds_what_a_real_run_holds(world):
    real = launch(_real_states, world, backend="gloo", timeout=120, verbose=False)
    for stage in (0, 1, 2, 3):
        for r in range(world):  # ranks differ by Adam's 4-byte step counter per fragment they own
            sim = simulate(lambda: MLP(tied=True, frozen_first=True), stage, world, "bf16", rank=r)
            assert real[r][stage] == sim, (stage, r)


@pytest.mark.slow
def test_inside_a_process_group_runs_in_a_subprocess():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = simulate(lambda: FlatModel(10**12), 3, 1024)  # a lambda travels by value
        assert got == paper_model_state_bytes(10**12, 1024, 3, "bf16")
        assert dist.is_initialized() and dist.get_backend() == "gloo"  # ours is untouched
    finally:
        dist.destroy_process_group()
