"""Lesson 00's lab (minizero/course/labs/lesson00.py), each experiment on its smallest run."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minizero.analysis import cost  # noqa: E402
from minizero.course.labs import lesson00 as lab  # noqa: E402


def test_volumes_are_the_papers_an_all_reduce_is_its_two_halves(capsys):
    ledger = lab.volumes(2, elements=12)
    assert ledger.by_op() == {"all_reduce": 24, "reduce_scatter": 12, "all_gather": 12}
    lab.show_volumes(ledger)
    out = capsys.readouterr().out
    assert "reduce-scatter half" in out and "volume (elements): {'all_reduce': 24" in out
    with pytest.raises(ValueError, match="elements=7 must divide by nprocs=2"):
        lab.volumes(2, elements=7)


def test_ledger_cost_times_the_same_calls_twice(capsys):
    c = lab.ledger_cost(2, calls=3)
    assert c.caller >= c.recorded > 0 and c.info["world"] == 2
    lab.show_ledger_cost(c)
    assert "4 KiB all-reduce on gloo · cpu (CPU) · world 2" in capsys.readouterr().out


def test_bandwidth_rows_follow_nccl_tests_and_fit_the_model(capsys):
    ops, sizes = ["all_reduce", "reduce_scatter", "all_gather"], [4096, 65536]
    rows = lab.bandwidth(2, ops, sizes)
    assert [(r["op"], r["nbytes"]) for r in rows] == [(o, s) for o in ops for s in sizes]
    for r in rows:
        factor = 2 * (2 - 1) / 2 if r["op"] == "all_reduce" else (2 - 1) / 2
        assert r["algbw"] == pytest.approx(r["nbytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
    lab.show_ratios(rows)
    assert "time(reduce_scatter) / time(all_reduce) = " in capsys.readouterr().out
    lab.plot_bandwidth(rows)
    left, right = plt.gcf().axes
    assert len(left.lines) == len(right.lines) == 3  # one line per op
    plt.close("all")
    link = cost.Link(alpha=1e-5, beta=1e9)
    model = [cost.collective_time(r["op"], r["nbytes"], 2, link) for r in rows]
    lab.show_fit(rows, link, model)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("fitted on gloo") and len(table) == 2 + len(rows)
    lab.plot_fit(rows, link, model)
    assert len(plt.gcf().axes[0].lines) == 6  # measured and model, per op
    plt.close("all")


def test_default_sizes_stop_at_16_mib_on_a_cpu():
    assert lab.default_sizes({"device": "cpu (CPU)"})[-1] == 2**24
    assert lab.default_sizes({"device": "cuda (H100)"})[-1] == 2**28
