"""Command line: ``python -m minizero COMMAND ...`` (also installed as ``minizero``)."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from minizero.tools.cli import Parser


class CommandList(argparse.HelpFormatter):
    """argparse measures the commands two columns to the left of where it prints them: measure
    them where they are printed, so that a long name (consolidate) keeps its help on its line."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS:
            for sub in self._iter_indented_subactions(action):
                self._action_max_length = max(
                    self._action_max_length, len(self._format_action_invocation(sub)) + 6
                )


# Every command hands its arguments to a function of its own, which parses them (and --help):
# name -> ("module:function" under minizero, one line for the command list)
PASS_THROUGH = {
    "demo": ("tools.demo:main", "DDP or a ZeRO stage on 2 CPU ranks (or one per GPU), checked "
             "against PyTorch and one process; volume and memory against the paper"),
    "doctor": ("tools.doctor:main", "is this machine ready? torch, CUDA/NCCL, GPUs and links, how "
               "the ranks will run, a 2-second all-reduce probe, Jupyter"),
    "compare": ("course.compare:main", "every stage measured side by side: a table and one figure"),
    "simulate": ("tools.simulate:main", "ZeRO's Table 1 (7.5B-1T parameters) from the real "
                 "stage code on meta tensors"),
    "bench": ("tools.bench:main", "benchmarks: collectives, ddp, stages (each against PyTorch's "
              "own), checkpoints, zeropp"),
    "train": ("tools.train_cli:main", "nanoGPT's CPU Shakespeare model learns Tiny "
              "Shakespeare at a ZeRO stage: live loss, evaluations, checkpoint, samples, plot"),
    "run": ("tools.run:torchrun_main", "run a script under torchrun (one rank per GPU, "
            "multi-node)"),
    "start": ("course.workflow:start_main", "copy the lessons into a folder of your own "
              "(my-lessons/)"),
    "grade": ("course.grade:grade_main", "grade your lesson notebooks (runs their check cells)"),
    "gradebook": ("course.gradebook:main", "grade a class: one folder per student, a CSV of "
                  "every exercise"),
    "lessons": ("course.build:lessons_main", "regenerate lessons/ and solutions/ from course/"),
    "margins": ("course.margins:main", "every check's margin: solutions under other CPU kernels, "
                "ranks, seeds and threads; the plausible wrong answers (in the kit's clone)"),
    "consolidate": ("checkpoint:consolidate_main", "a checkpoint -> one full fp32 state dict file"),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(
        prog="minizero",
        formatter_class=CommandList,
        description="minizero: data parallelism and ZeRO stages 1-3, built from scratch and "
        "measured. python -m minizero COMMAND --help describes a command's options.",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    for name, (_, text) in PASS_THROUGH.items():
        sub.add_parser(name, add_help=False, help=text)
    args = p.parse_args(argv[:1])  # the command's own parser reads the rest, --help included
    if args.cmd is None:
        p.error(
            f"say which command to run: {', '.join(PASS_THROUGH)} (e.g. python -m minizero demo)"
        )
    module, function = PASS_THROUGH[args.cmd][0].split(":")
    try:
        code = getattr(import_module(f"minizero.{module}"), function)(argv[1:])
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
    except BrokenPipeError:  # `python -m minizero start | head -3`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # 128 + SIGPIPE, as a shell reports a command whose reader left
    return code


if __name__ == "__main__":
    sys.exit(main())
