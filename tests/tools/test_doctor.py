"""``python -m minizero doctor`` (minizero/doctor.py): on this CPU machine it runs for real (gloo,
fork, the cores, a busbw); the GPU branches read a faked nvidia-smi, NVML count and torch build."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

import minizero.launcher as L  # the package (minizero.launch is the function)
from minizero.tools import doctor

pytestmark = pytest.mark.timeout(180)

H100 = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559 MiB, 550.54.15\n" for i in range(2))
TOPO_NVLINK = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tSYS\t0-55\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\t0-55\t0\t\tN/A\n"
    "NIC0\tSYS\tSYS\t X \n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
TOPO_PCIE = (
    "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tPHB\tSYS\t0-15\t0\n"
    "GPU1\tPHB\t X \tSYS\t0-15\t0\n"
    "GPU2\tSYS\tSYS\t X \t16-31\t1\n\nLegend:\n"
)


def fake_machine(monkeypatch, gpus: int, smi: dict | None, cuda: str | None = "12.8"):
    """A machine whose NVML counts ``gpus``, whose nvidia-smi answers ``smi`` (None: absent)
    and whose torch was built with ``cuda`` and NCCL 2.27.5."""
    monkeypatch.setattr(L, "gpu_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: cuda is not None)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    answer = lambda args: None if smi is None else smi.get(args[0])
    monkeypatch.setattr(doctor, "_smi", answer)
    monkeypatch.setattr(doctor, "_shm_bytes", lambda: 64 * 2**20)


def values(findings):
    return {f.label: f.value for f in findings}


# -- GPU machines, faked ------------------------------------------------------------------------
def test_two_gpus_with_nvlink_plan_nccl_torchrun_and_show_the_topology(monkeypatch):
    smi = {"--query-gpu=index,name,memory.total,driver_version": H100, "topo": TOPO_NVLINK}
    fake_machine(monkeypatch, 2, smi)
    got = values(doctor.torch_findings())
    assert got["build"] == "CUDA 12.8" and got["NCCL"] == "2.27.5 (in this torch build)"
    gpus = doctor.gpu_findings()
    v = values(gpus)
    assert v["GPUs"] == "torch counts 2; nvidia-smi lists 2"
    assert v["  GPU 1"] == "NVIDIA H100 80GB HBM3, 81559 MiB, driver 550.54.15"
    assert v["links"] == "every GPU pair over NVLink (NV18)"
    matrix = [f.value for f in gpus if f.label == ""]
    assert matrix[1].startswith("GPU0") and "NV18" in matrix[1] and len(matrix) == 4
    shm = next(f for f in gpus if f.label == "/dev/shm")
    assert (
        shm.value == "64 MiB"
        and shm.fix == "in a container: docker run --ipc=host (or --shm-size=8g)"
    )
    plan, n, backend = doctor.launch_findings()
    assert (n, backend) == (2, "nccl")
    assert values(plan) == {
        "ranks": "2 (the lessons' default: one per GPU with 2 or more, else 2)",
        "backend": "nccl on one GPU per rank",
        "mechanism": "torchrun",
        "why": "2 GPUs found; NCCL needs one GPU per rank, nprocs=2; NCCL ranks start fresh "
        "under torchrun (CUDA cannot be forked)",
    }
    assert [f.problem for f in plan] == ["", "", "", ""]


def test_more_ranks_than_gpus_fall_back_to_gloo(monkeypatch):
    fake_machine(monkeypatch, 2, None)
    plan, n, backend = doctor.launch_findings(4)
    assert (n, backend) == (4, "gloo")
    assert values(plan)["why"].startswith("2 GPUs found; NCCL needs one GPU per rank, nprocs=4;")


def test_links_without_nvlink_say_pcie():
    assert doctor._links(TOPO_PCIE) == (
        "no NVLink: every pair over PCIe or the CPU (PHB, SYS); NCCL is PCIe-bound"
    )
    mixed = TOPO_PCIE.replace("GPU0\t X \tPHB", "GPU0\t X \tNV4").replace("GPU1\tPHB", "GPU1\tNV4")
    assert doctor._links(mixed) == "NVLink (NV4) between some pairs, PCIe or the CPU (SYS)"


def test_gpus_torch_cannot_see_are_a_problem_with_the_fix(monkeypatch):
    smi = {"--query-gpu=index,name,memory.total,driver_version": H100}
    fake_machine(monkeypatch, 0, smi, cuda=None)  # the CPU wheel on a GPU machine
    first = doctor.gpu_findings()[0]
    assert first.problem == "nvidia-smi lists 2 GPUs but torch sees none"
    assert first.fix == "this torch is the CPU build; pip install torch==2.13.0 (CUDA)"
    fake_machine(monkeypatch, 0, smi, cuda="12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert doctor.gpu_findings()[0].fix == "CUDA_VISIBLE_DEVICES='' hides them: unset it"


def test_cuda_wheel_without_gpus_points_at_the_cpu_wheel(monkeypatch):
    fake_machine(monkeypatch, 0, None, cuda="12.8")
    wheel = values(doctor.gpu_findings())["wheel"]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in wheel


def test_one_gpu_runs_the_lessons_on_gloo(monkeypatch):
    fake_machine(
        monkeypatch, 1, {"--query-gpu=index,name,memory.total,driver_version": H100.splitlines()[0]}
    )
    assert "the lessons' 2 ranks run gloo on the CPU" in values(doctor.gpu_findings())["note"]
    plan, n, backend = doctor.launch_findings()
    assert (n, backend) == (2, "gloo") and values(plan)["mechanism"] == "fork"


def test_a_torch_older_than_the_floor_is_a_problem(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    f = next(f for f in doctor.torch_findings() if f.label == "torch")
    assert f.problem.startswith("minizero needs torch >= 2.7") and "2.13.0" in f.fix
    monkeypatch.setattr(torch, "__version__", "2.7.0+cpu")
    assert next(f for f in doctor.torch_findings() if f.label == "torch").problem == ""


def test_render_prints_problem_and_fix_under_the_finding():
    f = doctor.Finding("torch", "2.4.0", "minizero needs torch >= 2.6", "pip install torch==2.13.0")
    assert doctor.render("python and torch", [f]).splitlines() == [
        "python and torch",
        "  torch       2.4.0",
        "              PROBLEM: minizero needs torch >= 2.6",
        "              fix: pip install torch==2.13.0",
    ]


# -- this machine, for real ---------------------------------------------------------------------
def test_doctor_on_this_cpu_machine(capsys, monkeypatch):
    if L.gpu_count():
        pytest.skip("checks the CPU answers")
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)  # not root: see below
    assert doctor.main(["--probe-seconds", "0.5", "--no-kernel"]) == 0
    out = capsys.readouterr().out
    cores = len(os.sched_getaffinity(0))
    assert f"  CPU cores   {cores} usable (of {os.cpu_count()} in the machine)" in out
    assert "  backend     gloo on the CPU\n  mechanism   fork\n" in out
    assert re.search(r"  busbw       \d+\.\d\d GB/s \(algbw \d+\.\d\d GB/s, ", out)
    assert "all-reduce of 8 MiB fp32" in out and "2 ranks, gloo on" in out
    assert out.rstrip().endswith("ready: nothing to fix")


def test_probe_busbw_is_algbw_times_the_all_reduce_factor():
    (busbw, measured) = doctor.probe_findings(3, "gloo", seconds=0.3, mib=1)
    bus, alg = (float(x) for x in re.findall(r"(\d+\.\d+) GB/s", busbw.value))
    assert bus == pytest.approx(alg * 4 / 3, abs=0.011)  # 2(n-1)/n at n = 3, 2 decimals shown
    assert "all-reduce of 1 MiB fp32" in measured.value and "3 ranks, gloo on" in measured.value


def test_kernel_that_imports_another_minizero_is_a_problem(tmp_path, monkeypatch):
    fake = tmp_path / "elsewhere" / "minizero"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python",
        "env": {"PYTHONPATH": str(fake.parent)},
    }))  # fmt: skip
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    f = doctor._kernel_finding()
    assert f.label == "kernel" and f.value.startswith(f"python3 runs {sys.executable} ")
    assert f.problem == (
        f"the kernel imports another minizero: {fake / '__init__.py'}, not "
        f"{os.path.dirname(L.__path__[0])}"  # the minizero package
    )
    assert f.fix.startswith("from this environment: python -m ipykernel install --user")


def test_more_cpu_ranks_than_cores_is_oversubscription(monkeypatch):
    fake_machine(monkeypatch, 0, None, cuda=None)
    cores = len(os.sched_getaffinity(0))
    findings, n, backend = doctor.launch_findings(64)
    assert (n, backend) == (64, "gloo")
    (ranks,) = [f for f in findings if f.label == "ranks"]
    assert ranks.problem.startswith(f"64 CPU ranks on {cores} usable cores: oversubscribed")
    assert ranks.fix == f"--nprocs {cores} or fewer (one core per gloo rank)"
    findings, _, _ = doctor.launch_findings(cores)
    assert not [f for f in findings if f.problem]


@pytest.mark.parametrize("uid", [0, 1000])
def test_root_is_told_that_jupyter_lab_needs_allow_root(monkeypatch, uid):
    monkeypatch.setattr(os, "geteuid", lambda: uid, raising=False)
    users = [f for f in doctor.jupyter_findings(kernel=False) if f.label == "user"]
    if uid:
        assert users == []
    else:  # a note, not a problem: a lab image that runs as root needs no fixing
        (user,) = users
        assert user.problem == user.fix == ""
        assert user.note == (
            "`jupyter lab` refuses to run as root: start it with jupyter lab --allow-root "
            "my-lessons/"
        )
        text = doctor.render("Jupyter", [user])
        assert "note: `jupyter lab` refuses to run as root" in text and "PROBLEM" not in text


def test_doctor_as_root_on_a_ready_machine_exits_0(capsys, monkeypatch):
    if L.gpu_count():
        pytest.skip("checks the CPU answers")
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    assert doctor.main(["--no-probe", "--no-kernel"]) == 0
    out = capsys.readouterr().out
    assert "start it with jupyter lab --allow-root" in out and "ready: nothing to fix" in out
