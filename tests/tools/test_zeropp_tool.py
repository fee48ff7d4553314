"""``python -m minizero bench zeropp``: its figures on 4 gloo ranks (nodes of 2) hold what the
library tests assert (hpZ True/False/2 payloads and memory, qwZ's int8 + scales), qwZ's error
per unit is within half a quantisation step, and qgZ's simulation shows the all-to-all's one
quantisation beating a ring's N-1. No timing asserts."""

from __future__ import annotations

import json
import math

import pytest

from minizero.__main__ import main
from minizero.tools import bench_zeropp
from minizero.zeropp import QUANT_BLOCK

pytestmark = pytest.mark.timeout(600)


def test_bench_zeropp_figures(tmp_path, capsys):
    out = tmp_path / "z.json"
    argv = ["bench", "zeropp", "--nprocs", "4", "--node-size", "2", "--steps", "2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "minizero bench zeropp: 4 ranks, gloo on" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert list(rows) == list(bench_zeropp.configurations(4, 2))
    full = sum(rows["hpZ True (ZeRO-3)"]["fwd"].values())  # 4 bytes x Ψ padded
    psi_padded = full // 4
    assert rows["hpZ True (ZeRO-3)"]["bwd"] == {"world": full}
    assert rows["hpZ False"]["bwd"] == {} and rows["hpZ False"]["held"] == full
    assert rows["hpZ 2"]["bwd"] == {"hpZ": full} and rows["hpZ 2"]["held"] == full // 2
    assert rows["hpZ 2"]["bwd_across"] == 0 and rows["hpZ False"]["bwd_across"] == 0
    # ring over 2 nodes x 2: ranks 1 and 3 send their 3/4 of S to the next node
    assert rows["hpZ True (ZeRO-3)"]["bwd_across"] == 2 * full * 3 / 4
    assert sum(rows["bf16 gathers"]["fwd"].values()) == full // 2
    # qwZ: 1 byte per element and one fp32 scale per block of each rank's shard (TinyGPT's
    # units: the padded sizes are multiples of 4; sum of per-unit blocks >= blocks of the sum)
    qwz = sum(rows["qwZ (int8)"]["fwd"].values())
    assert psi_padded + 4 * 4 * math.ceil(psi_padded / 4 / QUANT_BLOCK) <= qwz
    assert qwz < psi_padded + 4 * 4 * (psi_padded / 4 / QUANT_BLOCK + 3)
    assert rows["qgZ (int8)"]["rs"] == qwz  # the same int8 rows and scales, by all-to-all
    assert rows["hpZ True (ZeRO-3)"]["rs"] == full
    for name in ("hpZ False", "hpZ 2"):  # hpZ moves bytes, not results
        assert rows[name]["losses"] == rows["hpZ True (ZeRO-3)"]["losses"]
    for row in data["unit_errors"]:
        assert 0 < row["max_rel"] <= 1 / 254
    q = data["qgz"]
    for bits in (8, 4):  # one quantisation per contribution beats two (hierarchical) or N-1
        row = q[f"int{bits}"]
        assert row["all_to_all"]["rms_rel"] < row["hierarchical"]["rms_rel"]
        assert row["all_to_all"]["rms_rel"] < row["ring"]["rms_rel"]
    assert q["int8"]["ring"]["rms_rel"] < 0.05 < q["int4"]["all_to_all"]["rms_rel"]
    assert q["int4_bytes"] < q["int8_bytes"] < 0.3 * q["fp32_bytes"]


def test_bench_zeropp_refuses_a_node_size_that_does_not_divide(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "zeropp", "--nprocs", "4", "--node-size", "3"])
    assert e.value.code == 2
    assert "--node-size (3) must divide --nprocs (4)" in capsys.readouterr().err
