"""The lessons' check cells: one file per lesson, ``lessonNN.py`` for lesson NN.

================  ==========================================================  ===============
file              checks                                                      lesson
================  ==========================================================  ===============
common.py         what every check shares (``CheckFailed``, ``guard``, ...)   every lesson
                  and the helpers lessons call (``run_info``, ``describe``; and,
                  from minizero.launcher, ``rank_device``, ``default_nprocs``,
                  ``launch_with_progress``)
lesson00.py       ``check_all_reduce_via_rs_ag``                              00_collectives
lesson01.py       ``check_allreduce_gradients``, ``check_bucketed_ddp``       01_ddp
common_zero.py    the ZeRO checks' runs side by side, compared step by step   02, 03, 04
lesson02.py       ``check_bucket``, ``check_zero1``, ``check_fp16_step``      02_zero1
lesson03.py       ``check_zero2``, ``check_clip_grad_norm``                   03_zero2
lesson04.py       ``check_zero3_gather``, ``check_zero3_prefetch``            04_zero3
lesson05.py       ``check_predict_peak``                                      05_all_stages
lesson06.py       ``check_owned_tensors``                                     06_myths
lesson07.py       ``check_owned_ranges``, ``check_read_plan``                 07_checkpoints
lesson08.py       ``check_predict_step_time``, ``check_choose``               08_beyond_one_node
lesson09.py       ``check_estimate_loss``                                     09_capstone
================  ==========================================================  ===============

A lesson imports ``from minizero.course import checks`` for the shared helpers
(``checks.rank_device()``, ``checks.describe(info)``: the names of :mod:`.common`, importable from
here) and its own file for its exercises, e.g. ``from minizero.course.checks import lesson02``,
then ``lesson02.check_zero1(MyZeRO1)``.
"""

from minizero.course.checks.common import (
    TIMEOUT,
    CheckFailed,
    describe,
    guard,
    launch_check,
    report_pass,
    run_info,
)
from minizero.launcher import default_nprocs, rank_device
from minizero.launcher.progress import Progress, launch_with_progress

__all__ = [
    "TIMEOUT", "CheckFailed", "Progress", "default_nprocs", "describe", "guard", "launch_check",
    "launch_with_progress", "rank_device", "report_pass", "run_info",
]  # fmt: skip
