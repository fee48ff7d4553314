"""The course machinery: what turns the library into lessons, checks them and grades them.

A student reads the library (``minizero/*.py``: launch, collectives, DDP, the ZeRO stages, memory,
simulate...); this package is what the course adds around it, kept apart as d2l and nbgrader keep
theirs (a reader of ``minizero/zero2.py`` never meets notebook plumbing):

===================  =========================================================================
file                 what it does
===================  =========================================================================
build.py             ``python -m minizero lessons``: the sources ``course/NN_name.py`` (percent
                     format, read with jupytext) -> ``lessons/`` and ``solutions/``;
                     fingerprints, so that a notebook someone edited is never overwritten
save.py              ``# @save`` above a lesson's definition: ``lessons`` copies it into
                     ``labs/saved.py``, which the labs import (one source, as d2l's ``#@save``)
exercise.py          an exercise in a source: its one ``# TODO:`` (the result), its ``# HINT:``
                     lines, its code
hints.py             ``hint("MyZeRO2")`` in a notebook: an exercise's hints, one per call, read
                     from ``hints.json`` (written by ``lessons``, shipped with the package)
workflow.py          ``python -m minizero start``: the student's own copies (``my-lessons/``)
grade.py             ``python -m minizero grade``: run notebooks, PASS/FAIL per check cell
kit.py               what the kit says a lesson is, read from its source: each exercise's check
                     cell, the parts a student writes, the names the check reads
restore.py           the notebook grading runs: the student's, with the kit's check cells put
                     back
grading.py           the grader's side of the kernel: the cells ``grade`` adds to a notebook it
                     runs (``begin``, ``capture``, ``run_check``)
seal.py              what a check relies on, taken before any student code runs (``Seal``)
gradebook.py         ``python -m minizero gradebook``: a class's grades from its submissions
margins.py           ``python -m minizero margins``: how far every check is from failing a
                     right answer and from passing a wrong one
checks/              the check cells' code, one file per lesson: ``checks/lessonNN.py`` holds
                     lesson NN's checks; ``checks/common.py`` what every check shares;
                     ``checks/common_zero.py`` what the ZeRO checks of lessons 02-04 share
labs/                the experiments the lessons run, one file per lesson: ``labs/lessonNN.py``
                     measures (functions returning rows or a dataclass) and shows (``show_*``,
                     ``plot_*``) what lesson NN measures, and its ``__all__`` is the lesson's one
                     import line; ``labs/common.py`` what several lessons measure alike;
                     ``labs/saved.py`` (generated) the lessons' ``# @save`` definitions
plots.py             the lessons' figures of measured stages and of the paper's formulas
plots_budget.py      lesson 05's memory budget figure and its ipywidgets calculator
compare.py           every stage measured side by side (``profile_stages``, ``workload``) and
                     ``python -m minizero compare``
===================  =========================================================================

Why the rest stays outside: ``budget.py`` (the memory budget of a step) and ``timeline.py`` (when
each collective ran, from the profiler) are library a lesson calls, like ``memory.py``; the
benchmarks (``bench.py``, ``bench_steps.py``), ``demo.py`` and ``doctor.py`` are tools for a
command line, which no notebook needs; ``cli.py`` is what those commands' parsers share.

A lesson opens with ``from minizero.course.labs.lessonNN import *`` and ``NPROCS, INFO =
setup()``: the libraries its own code uses, ``hint``, its checks (``lessonNN``) and its lab
(``lab``).
"""

from minizero.course.hints import hint

__all__ = ["hint"]
