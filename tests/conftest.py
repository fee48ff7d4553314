"""Shared test helpers. ``@pytest.mark.gpu`` tests (``@pytest.mark.gpu(n)``: n GPUs, default 2)
are skipped unless that many GPUs and NCCL are here. GPUs are counted through NVML, without
initialising CUDA, so that forked ranks can still use CUDA afterwards. The tests run on several
xdist workers (pyproject.toml); the ``gpu`` tests among them take turns, since they share the
GPUs."""

import os

import pytest
import torch.distributed as dist

from minizero.launcher import gpu_count


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the project's default, pyproject.toml): one worker per core, at most 4. Many
    tests run 2 to 5 ranks of their own, so more workers would only oversubscribe the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 4))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
