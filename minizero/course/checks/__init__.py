"""The lessons' check cells: one file per lesson, ``lessonNN.py`` for lesson NN.

================  ==========================================================  ===============
file              checks                                                      lesson
================  ==========================================================  ===============
common.py         what every check shares (``CheckFailed``, ``guard``,       every lesson
                  ``launch_check``, ``run_info``, ``describe``, ...)
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
lesson09.py       ``check_train``                                             09_capstone
loop_watch.py     ``LoopWatch``, ``state_summary``: what a loop did, seen     09 (check, lab)
                  from outside it
================  ==========================================================  ===============

A lesson calls its own file's checks, e.g. ``lesson02.check_zero1(MyZeRO1)``; its one import
line (:mod:`minizero.course.labs`) brings ``lesson02``. This package holds checks only: the
launcher's helpers a lesson's own cells use (``rank_device``, ``default_nprocs``,
``launch_with_progress``) live in :mod:`minizero.launcher` and come with the lab. A notebook
copied before they moved still reaches them here, as ``checks.rank_device()`` (module
``__getattr__`` below), without their being part of this package.
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

__all__ = ["TIMEOUT", "CheckFailed", "describe", "guard", "launch_check", "report_pass", "run_info"]


def __getattr__(name: str):
    """The launcher's helpers, for a lesson copied (``start``) before they moved out of here."""
    if name in ("default_nprocs", "rank_device"):
        from minizero import launcher

        return getattr(launcher, name)
    if name in ("launch_with_progress", "Progress"):
        from minizero.launcher import progress

        return getattr(progress, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
