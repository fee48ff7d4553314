"""``python -m minizero doctor``: is this machine ready for the course? Run it on a lab machine.

Like ``python -m torch.utils.collect_env`` or ``accelerate env``, but it answers the course's
questions, each with the fix when the answer is a problem (a note when it is worth knowing only):

1. python and torch: versions, the CUDA and NCCL that torch was built with, usable CPU cores;
2. GPUs: what ``nvidia-smi`` lists, what torch counts (through NVML, without initialising CUDA),
   how the GPUs are linked (``nvidia-smi topo -m``), shared memory for NCCL;
3. how ``minizero.launch`` will run the lessons' ranks: backend, mechanism and why
   (``minizero.launch.plan``, the function ``launch`` itself calls);
4. an all-reduce probe of about two seconds through ``minizero.launch`` and
   ``minizero.collectives``: the bus bandwidth a lesson will see here;
5. Jupyter: JupyterLab, ipywidgets and its JupyterLab extension, the course's packages, and the
   ``python3`` kernel, started and asked which Python and which minizero it runs.

Exit code: 0 when nothing needs fixing, 1 otherwise.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from importlib import metadata

import torch
import torch.distributed as dist

import minizero.launcher as _L  # the package (minizero.launch is the function)
from minizero.tools.cli import Parser, positive_int

TESTED_TORCH = "2.13.0"  # requirements.txt
MIN_TORCH = (2, 9)  # pyproject's floor: an older FSDP2 trains wrong over gloo (docs/setup.md)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass
class Finding:
    """One line of the report: ``label``, what was found, and what to do if it is a problem."""

    label: str
    value: str
    problem: str = ""  # what is wrong; "" when nothing is
    fix: str = ""  # the command or step that fixes it
    note: str = ""  # worth knowing, nothing to fix (not a problem)


def _smi(args: list[str]) -> str | None:
    """``nvidia-smi ARGS`` output; None where nvidia-smi is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    parts = version.split("+")[0].split(".")
    return tuple(int(p) for p in parts[:3] if p.isdigit())


# -- 1. python and torch ---------------------------------------------------------------------------
def torch_findings() -> list[Finding]:
    out = [Finding("python", f"{platform.python_version()} at {sys.executable}")]
    v = torch.__version__
    tested = (
        "" if v.split("+")[0] == TESTED_TORCH else f" (the course is tested with {TESTED_TORCH})"
    )
    out.append(Finding("torch", v + tested))
    if _release(v) < MIN_TORCH:
        out[-1].problem = "minizero needs torch >= 2.9 (an older FSDP2 trains wrong over gloo)"
        out[-1].fix = f"pip install torch=={TESTED_TORCH} (or -r requirements.txt)"
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    out.append(Finding("build", f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU only"))
    if dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        out.append(Finding("NCCL", f"{nccl} (in this torch build)"))
    else:
        out.append(Finding("NCCL", "not in this build: gloo on the CPU only"))
    if not dist.is_gloo_available():
        need = "the lessons need the gloo backend on the CPU"
        out.append(Finding("gloo", "missing", need, "pip install -r requirements.txt"))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out.append(Finding("CPU cores", f"{usable} usable (of {os.cpu_count()} in the machine)"))
    return out


# -- 2. GPUs ---------------------------------------------------------------------------------------
def _links(topo: str) -> str:
    """One line on how the GPUs of an ``nvidia-smi topo -m`` matrix are linked to each other."""
    rows = {m[1]: ln.split()[1:] for ln in topo.splitlines() if (m := re.match(r"(GPU\d+)\s", ln))}
    n = len(rows)  # the matrix's first n columns are GPU0 .. GPU{n-1}, in the rows' order
    kinds = {row[j] for i, row in enumerate(rows.values()) for j in range(n) if j != i}
    if not kinds:
        return "one GPU"
    nv = sorted(k for k in kinds if k.startswith("NV"))
    other = sorted(kinds - set(nv))
    if not other:
        return f"every GPU pair over NVLink ({', '.join(nv)})"
    if not nv:
        return (
            f"no NVLink: every pair over PCIe or the CPU ({', '.join(other)}); NCCL is PCIe-bound"
        )
    return f"NVLink ({', '.join(nv)}) between some pairs, PCIe or the CPU ({', '.join(other)})"


def gpu_findings() -> list[Finding]:
    gpus = _L.gpu_count()  # NVML: CUDA stays uninitialised, so launch can still fork
    listed = _smi(["--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    lines = [ln.strip() for ln in (listed or "").splitlines() if ln.strip()]
    out = []
    if listed is None:
        out.append(Finding("GPUs", f"torch counts {gpus}; nvidia-smi not found"))
    else:
        out.append(Finding("GPUs", f"torch counts {gpus}; nvidia-smi lists {len(lines)}"))
        for ln in lines:
            index, name, mem, driver = (p.strip() for p in ln.split(",", 3))
            out.append(Finding(f"  GPU {index}", f"{name}, {mem}, driver {driver}"))
    if lines and gpus == 0:
        out[0].problem = f"nvidia-smi lists {len(lines)} GPUs but torch sees none"
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        if torch.version.cuda is None:
            out[0].fix = f"this torch is the CPU build; pip install torch=={TESTED_TORCH} (CUDA)"
        elif seen is not None:
            out[0].fix = f"CUDA_VISIBLE_DEVICES={seen!r} hides them: unset it"
        else:
            cuda = torch.version.cuda
            out[0].fix = f"update the driver (nvidia-smi shows it): this torch needs CUDA {cuda}"
    if gpus == 0 and not lines and torch.version.cuda:
        small = f"pip install torch=={TESTED_TORCH} --index-url {CPU_INDEX}"
        text = f"CUDA build, no GPU: fine (gloo on the CPU); the CPU wheel is far smaller: {small}"
        out.append(Finding("wheel", text))
    if gpus == 1:
        text = "one GPU: NCCL needs one GPU per rank, so the lessons' 2 ranks run gloo on the CPU"
        out.append(Finding("note", text))
    if gpus >= 2:
        topo = _smi(["topo", "-m"])
        if topo is not None:
            out.append(Finding("links", _links(topo)))
            matrix = topo.split("\n\n")[0].rstrip("\n").splitlines()
            out += [Finding("", ln.expandtabs(8)) for ln in matrix]
        shm = _shm_bytes()
        if shm is not None and shm < 2**30:
            why = "NCCL moves data between the GPUs of a machine through /dev/shm: too small"
            fix = "in a container: docker run --ipc=host (or --shm-size=8g)"
            out.append(Finding("/dev/shm", f"{shm / 2**20:.0f} MiB", why, fix))
    return out


def _shm_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


# -- 3. how launch will run the lessons -----------------------------------------------------------
def launch_findings(nprocs: int | None = None) -> tuple[list[Finding], int, str | None]:
    """What ``minizero.launch`` picks for the lessons' ranks; returns (findings, ranks, backend)."""
    from minizero.launcher import default_nprocs

    n = nprocs or default_nprocs()
    how = "as asked" if nprocs else "the lessons' default: one per GPU with 2 or more, else 2"
    out = [Finding("ranks", f"{n} ({how})")]
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        out.append(
            Finding(
                "torchrun",
                "this process runs under torchrun: launch runs fn on this "
                "rank only and starts nothing",
            )
        )
    try:
        backend, mechanism, why = _L.plan(n)
    except ValueError as e:
        out.append(Finding("backend", "none", str(e), "pass --nprocs with a smaller number"))
        return out, n, None
    where = "one GPU per rank" if backend == "nccl" else "the CPU"
    out += [Finding("backend", f"{backend} on {where}"), Finding("mechanism", mechanism),
            Finding("why", why)]  # fmt: skip
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if backend == "gloo" and cores and n > cores:
        out[0].problem = (f"{n} CPU ranks on {cores} usable cores: oversubscribed, the ranks "
                          "take turns on the cores (slow, and timings mean little)")  # fmt: skip
        out[0].fix = f"--nprocs {cores} or fewer (one core per gloo rank)"
    return out, n, backend


# -- 4. the all-reduce probe -----------------------------------------------------------------------
def probe_findings(n: int, backend: str, seconds: float = 2.0, mib: float | None = None):
    from minizero.analysis.ledger import BUSBW_FACTOR
    from minizero.launcher import LaunchError
    from minizero.tools.bench import all_reduce_probe

    mib = mib or (256 if backend == "nccl" else 8)
    nbytes = int(mib * 2**20) // 4 * 4
    try:
        res = _L.launch(
            all_reduce_probe, n, seconds, nbytes, timeout=max(60, 10 * seconds), verbose=False
        )
    except (LaunchError, ValueError) as e:
        first = str(e).splitlines()[0]
        fix = (
            "NCCL_DEBUG=INFO python -m minizero doctor shows why NCCL failed"
            if backend == "nccl"
            else "run it again; if it fails the same way, report it with this output"
        )
        return [Finding("busbw", "no result", f"the probe's all-reduce failed: {first}", fix)]
    t = max(r["median"] for r in res)  # the slowest rank's median
    w = res[0]["where"]
    algbw = nbytes / t
    busbw = algbw * BUSBW_FACTOR["all_reduce"](n)
    return [
        Finding(
            "busbw",
            f"{busbw / 1e9:.2f} GB/s (algbw {algbw / 1e9:.2f} GB/s, {t * 1e3:.2f} ms per call)",
        ),
        Finding(
            "measured",
            f"all-reduce of {mib:g} MiB fp32, median of {res[0]['calls']} calls, "
            f"slowest rank; {w['world']} ranks, {w['backend']} on {w['device']}",
        ),
    ]


# -- 5. Jupyter ------------------------------------------------------------------------------------
COURSE_PACKAGES = ("matplotlib", "tqdm", "nbformat", "nbclient", "ipykernel")
_ASK = "import sys, minizero; print(sys.executable); print(minizero.__file__)"


def jupyter_findings(kernel: bool = True) -> list[Finding]:
    install = 'pip install -e ".[course]"  (or pip install -r requirements.txt)'
    lab = _version("jupyterlab")
    out = [Finding("jupyterlab", lab or "missing")]
    if lab is None:
        out[-1].problem, out[-1].fix = "students open the lessons in JupyterLab", install
    widgets, ext = _version("ipywidgets"), _version("jupyterlab_widgets")
    out.append(Finding("ipywidgets", f"{widgets}, JupyterLab extension jupyterlab_widgets {ext}"))
    if widgets is None or _release(widgets) < (8,):
        out[-1].problem = "lesson 05's calculator needs ipywidgets >= 8"
        out[-1].fix = 'pip install "ipywidgets>=8"'
    elif ext is None:
        out[-1].problem = "JupyterLab cannot show widgets without jupyterlab_widgets"
        out[-1].fix = "pip install jupyterlab_widgets"
    missing = [p for p in COURSE_PACKAGES if _version(p) is None]
    have = ", ".join(f"{p} {_version(p)}" for p in COURSE_PACKAGES if p not in missing)
    out.append(Finding("packages", have or "none of the course's"))
    if missing:
        out[-1].problem, out[-1].fix = f"missing: {', '.join(missing)}", install
    if getattr(os, "geteuid", lambda: None)() == 0:  # containers, lab images: a note, no problem
        note = "`jupyter lab` refuses to run as root: start it with jupyter lab --allow-root"
        out.append(Finding("user", "root (uid 0)", note=f"{note} my-lessons/"))
    if kernel and "ipykernel" not in missing:
        out.append(_kernel_finding())
    return out


def _kernel_finding() -> Finding:
    """Start the ``python3`` kernel the notebooks name, ask it which Python and minizero it runs."""
    import minizero

    fix = "from this environment: python -m ipykernel install --user  (then restart JupyterLab)"
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
        from jupyter_client.manager import start_new_kernel

        try:
            argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
        except NoSuchKernel:
            return Finding("kernel", "none named python3", "the notebooks ask for python3", fix)
        t0 = time.perf_counter()
        km, kc = start_new_kernel(
            kernel_name="python3", startup_timeout=60, stderr=subprocess.DEVNULL
        )
    except Exception as e:  # jupyter_client missing or the kernel did not start
        return Finding("kernel", "python3 did not start", f"{type(e).__name__}: {e}", fix)
    said: list[str] = []
    hook = lambda msg: said.append(
        msg["content"].get("text", "") or msg["content"].get("evalue", "")
    )
    try:
        kc.execute_interactive(_ASK, timeout=60, output_hook=hook)
    except Exception as e:  # noqa: BLE001  (a kernel that never answers)
        said.append(f"no answer: {type(e).__name__}")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    answer = "".join(said).strip().splitlines()
    secs = time.perf_counter() - t0
    if len(answer) != 2:
        return Finding(
            "kernel",
            f"python3 ({argv0})",
            "the kernel cannot import minizero: " + " ".join(answer)[-200:],
            fix,
        )
    exe, where = answer
    value = f"python3 runs {exe} (started and asked in {secs:.1f} s)"
    here = os.path.dirname(minizero.__file__)
    if os.path.dirname(where) != here:
        return Finding(
            "kernel", value, f"the kernel imports another minizero: {where}, not {here}", fix
        )
    return Finding("kernel", value + ", imports this minizero")


# -- the report ------------------------------------------------------------------------------------
def render(title: str, findings: list[Finding]) -> str:
    """A section: a title, then one finding per line (long ones wrapped), problems and fixes."""
    lines, pad = [title], " " * 14

    def put(head: str, text: str) -> None:
        if not head.strip():  # pre-formatted (the topology matrix)
            lines.append(f"{head}{text}".rstrip())
            return
        wrapped = textwrap.wrap(text, 100 - len(pad), break_on_hyphens=False) or [""]
        lines.append(f"{head}{wrapped[0]}".rstrip())
        lines.extend(pad + w for w in wrapped[1:])

    for f in findings:
        put(f"  {f.label:<11} " if f.label else pad, f.value)
        for head, text in (("PROBLEM: ", f.problem), ("fix: ", f.fix), ("note: ", f.note)):
            if text:  # (a fix comes with its problem)
                put(pad + head, text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="minizero doctor",
        description="Check that this machine is ready for the course: torch, CUDA and NCCL, the "
        "GPUs and their links, how the lessons' ranks will run, an all-reduce probe of about 2 "
        "seconds, and Jupyter. Every problem comes with its fix; exit code 1 if any.",
    )
    p.add_argument(
        "--nprocs",
        type=positive_int,
        default=None,
        help="ranks to plan and probe with (default: the lessons' own, one per GPU "
        "with 2 or more GPUs, else 2)",
    )
    p.add_argument(
        "--probe-seconds",
        type=float,
        default=2.0,
        help="how long the all-reduce probe runs (default 2)",
    )
    p.add_argument(
        "--probe-mib",
        type=float,
        default=None,
        help="message size of the probe in MiB (default 8 on gloo, 256 on NCCL)",
    )
    p.add_argument("--no-probe", action="store_true", help="skip the all-reduce probe")
    p.add_argument(
        "--no-kernel", action="store_true", help="do not start a Jupyter kernel to check it"
    )
    a = p.parse_args(argv)
    if not 0 < a.probe_seconds <= 600:
        p.error(f"--probe-seconds must be in (0, 600], got {a.probe_seconds:g}")
    print("minizero doctor: is this machine ready for the course?\n", flush=True)
    sections: list[list[Finding]] = []

    def show(title: str, findings: list[Finding]) -> None:
        sections.append(findings)
        print(render(title, findings) + "\n", flush=True)

    show("python and torch", torch_findings())
    show("GPUs", gpu_findings())
    plan, n, backend = launch_findings(a.nprocs)
    show("how minizero.launch runs the lessons' ranks", plan)
    if backend is not None and not a.no_probe:
        print(f"all-reduce probe: {n} ranks for about {a.probe_seconds:g} s ...", flush=True)
        show("all-reduce probe", probe_findings(n, backend, a.probe_seconds, a.probe_mib))
    show("Jupyter", jupyter_findings(kernel=not a.no_kernel))
    problems = [f for fs in sections for f in fs if f.problem]
    if not problems:
        print("ready: nothing to fix")
        return 0
    print(f"{len(problems)} problem{'s' * (len(problems) != 1)} to fix:")
    for i, f in enumerate(problems, 1):
        print(f"  {i}. {f.label}: {f.problem}\n     fix: {f.fix}")
    return 1
