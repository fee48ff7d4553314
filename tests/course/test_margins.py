"""`python -m minizero margins`: what the checks' comparisons record; the table of both sides."""

import json

import torch

from minizero.course import margins
from minizero.course.checks import common


def test_within_records_each_comparison_under_minizero_margins(tmp_path, monkeypatch):
    log = tmp_path / "m.jsonl"
    monkeypatch.setenv(common.MARGINS_ENV, str(log))
    assert common.within(1e-9, 1e-8, "a")
    assert not common.within(float("nan"), 1e-8, "b")
    assert common.allclose(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), 1e-5, 0.0, "c")
    assert not common.allclose(torch.tensor([2.0]), torch.tensor([1.0]), 1e-5, 0.0, "d")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["what"] for r in rows] == ["a", "b", "c", "d"]
    assert rows[0] == {"what": "a", "err": 1e-9, "tol": 1e-8}
    assert rows[2]["err"] == 0.0  # 0/0 is equal, not NaN
    assert rows[3]["err"] == 1.0 and abs(rows[3]["tol"] - 1e-5) < 1e-12


def test_worst_names_the_element_furthest_past_its_bound():
    got, want = torch.tensor([1.0, 10.0, 0.0]), torch.tensor([1.1, 10.5, 0.0])
    err, tol = common.worst(got, want, 0.0, 0.2)
    assert (round(err, 4), round(tol, 6)) == (0.5, 0.2)
    assert common.worst(torch.tensor([float("nan")]), torch.tensor([1.0]), 0, 1)[0] == float("inf")


def test_tabulate_takes_the_worst_right_answer_and_the_closest_wrong_one():
    rec = lambda what, err, tol, test="t": {"what": what, "err": err, "tol": tol, "test": test}
    right = {"default": [rec("x", 1e-9, 1e-6), rec("y", 0.0, 1e-6)],
             "seed-1": [rec("x", 3e-9, 1e-6)]}  # fmt: skip
    wrong = [rec("x", 1e-9, 1e-6, "passed before failing"), rec("x", 5e-4, 1e-6, "w1"),
             rec("x", 2e-3, 1e-6, "w2"), rec("z", 1.0, 0.0, "w3")]  # fmt: skip
    table = margins.tabulate(right, wrong)
    assert table["x"]["right"] == 3e-9 / 1e-6 and table["x"]["right_at"] == "seed-1"
    assert table["x"]["wrong"] == 5e-4 / 1e-6 and table["x"]["wrong_at"] == "w1"
    assert table["y"]["right"] == 0.0 and table["y"]["wrong"] is None
    assert table["z"] == {"right": None, "wrong": 1e30, "wrong_at": "w3"}
    text = margins.render(table)
    assert "x" in text and "333" in text and "500" in text and "inf" in text
