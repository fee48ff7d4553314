"""Shared test helpers: the tiers, the GPU tests' skip and lock, the heaviest files first, and
each test's CPU-seconds (docs/testing.md).

Two tiers, in pytest's own way (its documented ``--runslow`` recipe): the fast tier is the
README's ``python -m pytest``; ``@pytest.mark.soak`` tests (repeats of a property the fast tier
asserts once, and runs that measure a rate) are skipped unless ``--soak`` is given.
``python -m pytest --soak`` runs everything; ``python -m pytest --soak -m soak`` the soak tier
alone (what ``.ci/run`` adds).

``@pytest.mark.gpu`` tests (``@pytest.mark.gpu(n)``: n GPUs, default 2)
are skipped unless that many GPUs and NCCL are here. GPUs are counted through NVML, without
initialising CUDA, so that forked ranks can still use CUDA afterwards. The tests run on several
xdist workers (pyproject.toml); the ``gpu`` tests among them take turns, since they share the
GPUs."""

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from minizero.launcher import gpu_count


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the project's default, pyproject.toml): one worker per core, at most 4. Many
    tests run 2 to 5 ranks of their own, so more workers would only oversubscribe the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 4))


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in each xdist worker: the workers are one per core already, and a
    second thread per worker only waits (OpenMP spins) for a core the other worker holds. The
    ranks a test launches set their own (one each); kernels and subprocesses keep theirs."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the tests are collected (torch, the test modules, the items) goes to
    Python's permanent generation: the collector no longer walks it at every full collection,
    nor writes to its pages in the ranks forked from here (copy-on-write). test_zero.py on two
    workers: 98 CPU-seconds without, 80 with (docs/testing.md)."""
    import gc

    gc.freeze()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="also run the soak tier: the repeats and rates (@pytest.mark.soak), docs/testing.md",
    )


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--soak"):
        return "minizero tier: fast + soak (--soak: the repeats and rates run too)"
    return "minizero tier: fast (the soak tier's repeats are skipped: add --soak to run them)"


# The test files in the order the xdist workers get them, heaviest first (their CPU-seconds in the
# last full run, tools/test_times.py --write), so that no worker is handed a long file at the end
# while the other idles. A file not listed goes after them, in collection order.
HEAVY = Path(__file__).with_name("heavy_files.txt")


def _weights() -> dict[str, int]:
    if not HEAVY.exists():
        return {}
    names = [ln.split()[-1] for ln in HEAVY.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    return {name: k for k, name in enumerate(names)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = config.getoption("--soak")
    skip_soak = pytest.mark.skip(reason="soak tier: run with --soak (docs/testing.md)")
    for item in items:
        if not soak and item.get_closest_marker("soak") is not None:
            item.add_marker(skip_soak)
    order = _weights()
    if order:  # a stable sort: every worker collects the same order, as xdist requires
        root = Path(config.rootpath)
        rank = {item: order.get(Path(item.path).relative_to(root).as_posix(), len(order))
                for item in items}  # fmt: skip
        items.sort(key=rank.__getitem__)
    gpus = None
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            continue
        gpus = gpu_count() if gpus is None else gpus
        need = mark.args[0] if mark.args else 2
        if gpus < need or not dist.is_nccl_available():
            why = f"needs {need} GPUs and NCCL; found {gpus} GPUs"
            why += "" if dist.is_nccl_available() else ", no NCCL"
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _one_gpu_test_at_a_time(request, tmp_path_factory):
    """A ``gpu`` test holds a lock file that every xdist worker of this run shares, so that no two
    run their ranks on the same GPUs at once (a skipped test never gets here)."""
    if request.node.get_closest_marker("gpu") is None or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "gpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(autouse=True)
def _margins_per_test(request, monkeypatch):
    """Under ``python -m minizero margins``: each test's tolerance comparisons go to a file of
    their own (``$MINIZERO_MARGINS_DIR/<test>.jsonl``), so that the table can tell a solution's
    comparisons from a wrong answer's."""
    import re

    folder = os.environ.get("MINIZERO_MARGINS_DIR")
    if folder:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
        monkeypatch.setenv("MINIZERO_MARGINS", os.path.join(folder, f"{name}.jsonl"))


# -- where the time goes: each test's CPU-seconds -------------------------------------------------
def _cpu_seconds() -> float:
    """This process's and its waited-for children's user + system time (the ranks, the kernels,
    the torchrun launches a test starts are children of its xdist worker)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_STARTED: dict[str, float] = {}  # nodeid -> CPU-seconds when its protocol began


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _STARTED[item.nodeid] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Each test's CPU-seconds (setup, call and teardown, its children included) ride on its
    teardown report as the user property ``cpu_s``, so that they reach the xdist controller."""
    outcome = yield
    if call.when == "teardown" and item.nodeid in _STARTED:
        cpu = round(_cpu_seconds() - _STARTED.pop(item.nodeid), 2)
        report = outcome.get_result()
        report.user_properties = [*report.user_properties, ("cpu_s", cpu)]


_CPU: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "cpu_s":
                _CPU[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Writes every test's CPU-seconds to ``runs/test-cpu.json``, which ``python
    tools/test_times.py`` reads (the soak tier alone, ``--soak -m soak``, to
    ``runs/test-cpu-soak.json``, so that CI's run keeps both), and prints the total and the
    heaviest ten."""
    if not _CPU or hasattr(config, "workerinput"):
        return
    import json

    soak_only = config.getoption("--soak") and config.getoption("markexpr") == "soak"
    out = Path(config.rootpath) / "runs" / ("test-cpu-soak.json" if soak_only else "test-cpu.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(dict(sorted(_CPU.items(), key=lambda kv: -kv[1])), indent=1))
    top = sorted(_CPU.items(), key=lambda kv: -kv[1])[:10]
    tr = terminalreporter
    tr.section("CPU-seconds per test (its process and children)")
    tr.write_line(f"{sum(_CPU.values()):.0f} CPU-s in {len(_CPU)} tests; all in {out}")
    for nodeid, cpu in top:
        tr.write_line(f"{cpu:8.1f}  {nodeid}")
