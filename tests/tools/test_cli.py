"""``python -m minizero``: every command's --help describes every option in plain text, and bad
values end in one line that says what is wrong (exit code 2), never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minizero.__main__ import PASS_THROUGH, main

pytestmark = pytest.mark.timeout(120)
HELPED = [["demo"], ["doctor"], ["compare"], ["simulate"], ["bench"], ["bench", "collectives"],
          ["bench", "ddp"], ["bench", "stages"], ["bench", "checkpoints"], ["bench", "zeropp"],
          ["gradebook"], ["train"], ["bench", "nanogpt"]]  # fmt: skip


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> dict[str, str]:
    """``--flag`` -> its help text, from an argparse help page."""
    out, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"  (-[^\s,]+)(?:, (--[^\s,]+))?(.*)$", line)
        if m:
            flag = m[2] or m[1]
            rest = m[3]  # "  help", " METAVAR  help", " METAVAR" (help on the next lines)
            parts = re.split(r"\s{2,}", rest.strip(), maxsplit=1)
            out[flag] = rest.strip() if rest.startswith("  ") else "".join(parts[1:])
        elif flag and line.startswith(" " * 10):
            out[flag] += " " + line.strip()
        else:
            flag = None
    return out


@pytest.mark.parametrize("argv", HELPED, ids=" ".join)
def test_every_option_has_help_in_plain_text(argv, capsys):
    text = help_of(argv, capsys)
    assert "``" not in text and ":func:" not in text
    assert text.startswith(f"usage: minizero {' '.join(argv)} ")
    description = text.split("\n\n")[1]
    assert len(description) > 60  # says what the command does
    opts = options(text)
    usage = text.split("\n\n")[0]
    assert set(re.findall(r"\[(--[\w-]+)", usage)) | {"--help"} == set(opts)
    for flag, words in opts.items():
        assert len(words.strip()) > 10, (flag, words)


def test_the_command_list_names_every_command(capsys):
    text = help_of([], capsys)
    for name in PASS_THROUGH:
        assert re.search(rf"^    {name} +\S", text, re.M), name


def test_run_help_lists_minizeros_defaults_and_torchruns_options(capsys):
    assert main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m minizero run [torchrun options] SCRIPT [script args]")
    assert "--nproc-per-node N       unless given: the number of GPUs here" in text
    assert "torchrun's own options:\n  -h, --help" in text and "--rdzv-endpoint" in text
    ours = text.split("torchrun's own options:")[0]  # torchrun's own text is torchrun's
    assert "``" not in ours and "Returns torchrun's exit code" not in ours


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "minizero: error: say which command to run: demo, doctor, compare, simulate, bench"),
        (["bench"], "minizero bench: error: say what to measure: collectives, ddp, stages, "
         "checkpoints, zeropp, parts or nanogpt"),
        (["bench", "nope"], "minizero bench: error: argument WHAT: invalid choice: 'nope'"),
        (["demo", "--nprocs", "0"], "minizero demo: error: argument --nprocs: must be a whole "
         "number >= 1, got '0'"),
        (["demo", "--nprocs", "-1"], "minizero demo: error: argument --nprocs: must be a whole "
         "number >= 1, got '-1'"),
        (["demo", "--nprocs", "3", "--batch", "16"], "minizero demo: error: --batch 16 does not "
         "split evenly over 3 ranks: use --batch 15"),
        (["demo", "--stage", "4"], "minizero demo: error: argument --stage: invalid choice: 4"),
        (["bench", "ddp", "--nprocs", "2", "--batch", "15"], "minizero bench ddp: error: --batch "
         "15 does not split evenly over 2 ranks: pass --batch 16"),
        (["bench", "collectives", "--min-bytes", "64", "--max-bytes", "8"], "minizero bench "
         "collectives: error: --min-bytes (64) is larger than --max-bytes (8)"),
        (["bench", "collectives", "--ops", "all_reduce,foo"], "minizero bench collectives: error: "
         "--ops: unknown op(s) ['foo']"),
        (["bench", "stages", "--stages", "0,5"], "minizero bench stages: error: --stages takes a "
         "comma-separated subset of 0,1,2,3, got '0,5'"),
        (["bench", "checkpoints", "--stages", "7"], "minizero bench checkpoints: error: argument "
         "--stages: a comma-separated subset of 0,1,2,3, got '7'"),
        (["bench", "checkpoints", "--stages", "abc"], "minizero bench checkpoints: error: "
         "argument --stages: a comma-separated subset of 0,1,2,3, got 'abc'"),
        (["bench", "checkpoints", "--repeat", "0"], "minizero bench checkpoints: error: argument "
         "--repeat: must be a whole number >= 1, got '0'"),
        (["compare", "--steps", "0"], "minizero compare: error: argument --steps: must be a whole "
         "number >= 1, got '0'"),
        (["doctor", "--probe-seconds", "0"], "minizero doctor: error: --probe-seconds must be in "
         "(0, 600], got 0"),
        (["simulate", "--worlds", "0"], "minizero simulate: error: --worlds must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_values_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.startswith(message) and err.endswith(" (--help lists the options)\n"), err
    assert err.count("\n") == 1


def test_run_without_a_script_says_what_to_give(capsys):
    assert main(["run"]) == 2
    assert capsys.readouterr().err == (
        "minizero run: error: give the script to run, e.g. python -m minizero run train.py "
        "(--help: every option)\n"
    )


def test_readme_first_two_commands_and_ci():
    """The README's first two commands set up and run the demo, then set up and pass the tests;
    CI runs the second verbatim."""
    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
    demo, tests = (b.strip() for b in blocks[:2])
    assert demo.startswith("python3 -m venv .venv") and demo.endswith("python -m minizero demo")
    assert tests.startswith("python3 -m venv .venv") and tests.endswith("python -m pytest")
    assert "-r requirements-dev.txt" in tests
    assert tests in (root / ".ci" / "run").read_text().splitlines()
