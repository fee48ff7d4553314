"""`gradebook` grades a class (solved, unsolved, broken) into a CSV without touching a student's
file; bad arguments end in one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from cheats import L08, cut, monkeypatches, structural_cheats, write

from minizero.course import gradebook

ROOT = Path(__file__).resolve().parents[2]
LESSON = "00_collectives"  # the quickest lesson to grade (about 30 s on 2 busy cores)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.timeout(600)
def test_gradebook_grades_solved_unsolved_and_broken_without_touching_them(tmp_path, capsys):
    subs = tmp_path / "submissions"
    (subs / "alice").mkdir(parents=True)
    (subs / "bob").mkdir()
    (subs / "carol").mkdir()
    write(cut(LESSON, "solutions"), subs / "alice" / f"{LESSON}.ipynb")
    write(cut(LESSON, "lessons"), subs / "bob" / f"{LESSON}.ipynb")
    (subs / "carol" / f"{LESSON}.ipynb").write_text('{"cells": [{"cell_type": "co')
    write(monkeypatches(solved=True), subs / "gina" / f"{LESSON}.ipynb")
    write(structural_cheats(), subs / "hank" / f"{L08}.ipynb")
    write(monkeypatches(solved=False), subs / "mallory" / f"{LESSON}.ipynb")
    before = snapshot(subs)
    out = tmp_path / "grades.csv"
    assert gradebook.main([str(subs), "--out", str(out), "--jobs", "2"]) == 0
    assert snapshot(subs) == before  # nothing written, nothing added, in any student's folder
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["student", "lesson", "exercise", "status", "message"]
    by = {(r["student"], r["exercise"]): r for r in rows}
    assert {r["student"] for r in rows} == {"alice", "bob", "carol", "gina", "hank", "mallory"}
    alice = by["alice", "all_reduce_via_rs_ag"]
    assert alice["lesson"] == LESSON and alice["status"] == "passed" and alice["message"] == ""
    assert [r["status"] for r in rows if r["student"] == "alice"] == ["passed"]
    bob = by["bob", "all_reduce_via_rs_ag"]
    assert bob["status"] == "failed" and "NotImplementedError" in bob["message"]
    carol = [r for r in rows if r["student"] == "carol"]
    assert len(carol) == 1 and carol[0]["status"] == "error" and carol[0]["lesson"] == LESSON
    assert carol[0]["message"].startswith("not a notebook: not JSON")
    # issue 31: the kit's checks, whatever the notebook did; what was put back is named
    gina = by["gina", "all_reduce_via_rs_ag"]  # her own right answer: the verdict stands
    assert gina["status"] == "passed" and "torch.equal" in gina["message"]
    assert gina["message"].startswith("note: the check cell was edited")
    hank = {e: by["hank", e] for e in ("hsdp_reduce", "quantize", "predict_step_time", "choose")}
    assert {e: r["status"] for e, r in hank.items()} == dict.fromkeys(hank, "failed")
    for r in hank.values():
        assert "NotImplementedError: TODO: write" in r["message"]
    assert "lost its tag" in hank["hsdp_reduce"]["message"]
    assert "was edited" in hank["quantize"]["message"]
    assert "was deleted" in hank["predict_step_time"]["message"]
    said = "rebound lesson08, minizero.course.checks.lesson08.check_choose: the check ran with"
    assert said in hank["choose"]["message"]
    assert len([r for r in rows if r["student"] == "hank"]) == 4  # a row per exercise, no other
    mallory = by["mallory", "all_reduce_via_rs_ag"]  # a wrong answer and every primitive rebound
    assert mallory["status"] == "failed"
    assert mallory["message"].startswith("CheckFailed: wrong sum for a tensor of shape (1,)")
    for name in ("builtins.print", "torch.equal", "torch.allclose", "minizero.launch"):
        assert name in mallory["message"].split("| note: ")[1]
    printed = capsys.readouterr().out
    table = printed.split("student", 1)[1].splitlines()
    assert any(ln.split()[:4] == ["alice", "1", "0", "0"] for ln in table)
    assert any(ln.split()[:4] == ["carol", "0", "0", "1"] for ln in table)
    assert f"wrote {len(rows)} rows to {out}" in printed


def test_a_student_folder_without_notebooks_gets_an_error_row(tmp_path):
    (tmp_path / "dave").mkdir()
    (tmp_path / "dave" / "README").write_text("sorry")
    rows = gradebook.gradebook(tmp_path, timeout=60, log=lambda *_: None)
    assert rows == [gradebook.Row("dave", "", "", "error", "no notebooks (*.ipynb) in this folder")]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["nope"], "nope: no such folder"),
        (["SUBS", "--out", "SUBS/g.csv"], "is inside"),
        (["SUBS", "--jobs", "0"], "--jobs: must be a whole number >= 1"),
        (["SUBS", "--timeout", "0"], "--timeout: '0': give a number of seconds > 0"),
    ],
)
def test_bad_arguments_end_in_one_line(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SUBS").mkdir()
    with pytest.raises(SystemExit) as e:
        gradebook.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


HANG = """
import time
import torch
import torch.distributed as dist

def stuck():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins it
    else:
        time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_a_hung_check_is_stopped_and_reported_and_a_hung_cell_too(tmp_path, monkeypatch):
    import nbformat

    monkeypatch.delenv("MINIZERO_CHECK_TIMEOUT", raising=False)
    subs = tmp_path / "subs"
    (subs / "erin").mkdir(parents=True)
    check = nbformat.v4.new_code_cell(
        "from minizero.course.checks.common import launch_check\nlaunch_check(stuck, 2)"
    )
    check.metadata = {"minizero": {"check": "collective"}}
    cells = [nbformat.v4.new_code_cell(HANG), check]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), subs / "erin" / "01_hang.ipynb")
    # a cell that never returns; asleep, so that the time it waits costs no core
    spun = tmp_path / "spun"
    (spun / "erin").mkdir(parents=True)
    spin = [nbformat.v4.new_code_cell("import time\n\ntime.sleep(10**6)")]
    nbformat.write(nbformat.v4.new_notebook(cells=spin), spun / "erin" / "02_spin.ipynb")
    lesson = cut(LESSON, "solutions")  # a lesson of the kit: every exercise still gets its row
    lesson.cells.insert(0, spin[0])
    write(lesson, spun / "erin" / f"{LESSON}.ipynb")
    rows = {}
    # the hung check's cell needs its imports and the 4 s; the sleeping cells fail at the first
    # --timeout, nothing before them to wait for
    for folder, timeouts in ((subs, ["--check-timeout", "4", "--timeout", "20"]),
                             (spun, ["--timeout", "3"])):  # fmt: skip
        out = tmp_path / f"{folder.name}.csv"
        assert gradebook.main([str(folder), "--out", str(out), *timeouts]) == 0
        with out.open(newline="") as f:
            rows |= {r["lesson"]: r for r in csv.DictReader(f)}
    hang = rows["01_hang"]
    assert hang["exercise"] == "collective" and hang["status"] == "failed"
    assert "ranks [0, 1, 2] had not finished after 4 s" in hang["message"]
    assert "rank 1:" in hang["message"].split("Where they were:")[1]  # each rank's stack
    spin = rows["02_spin"]
    assert spin["status"] == "error" and spin["exercise"] == ""
    assert spin["message"].startswith("CellTimeoutError")
    spun = rows[LESSON]
    assert spun["exercise"] == "all_reduce_via_rs_ag" and spun["status"] == "failed"
    assert "the check did not finish: CellTimeoutError" in spun["message"]
