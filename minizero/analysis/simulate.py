"""Model states at scale, measured by running the real stage code on nothing. Lesson 05.

``simulate(model_fn, stage, world)`` builds ``model_fn()`` on the meta device (tensors with a shape,
a dtype and a storage size, but no memory), opens PyTorch's fake process group of ``world`` ranks
(collectives that return at once and move nothing), wraps the model with
``minizero.parallelize(..., stage)``, runs one training step (forward, backward, optimizer step)
and reads what this rank holds with ``minizero.model_state_bytes``. No formula is involved: the
bytes are the storages that DDP / ZeRO-1 / ZeRO-2 / ZeRO-3 themselves allocated, padding
included. ``table1()`` does it for the ZeRO paper's Table 1 (arXiv 1910.02054): 7.5B, 128B and 1T
parameters at N_d = 1 ... 1024, 72 cells in about a second on 2 CPU cores (after torch's imports).

Why the meta device and not ``FakeTensorMode``: the stages cast the model with ``module.to(bf16)``,
which in torch 2.13 fails on FakeTensor parameters ("Cannot swap t1 because it has weakref
associated with it"); meta tensors take the same code path as real ones. No device mesh is needed.
Nothing data-dependent may run in the step: meta tensors have no values, so ``.item()`` fails, and
every meta storage sits at address 0, so ``data_ptr()`` comparisons cannot tell tensors apart.

Any model with exactly Ψ trainable parameters has the same model states, so Table 1 uses a
``FlatModel``: a few modules, each one long parameter vector, whose forward is one multiply.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minizero.analysis.memory import (
    PAPER_TABLE1,
    TABLE1_DP,
    TABLE1_PSI,
    model_state_bytes,
    state_tensors,
)
from minizero.parallelize import parallelize

STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


class _Slab(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))  # (n,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()  # (n,) * (1,) -> (n,) -> ()


class FlatModel(nn.Module):
    """``psi`` parameters in ``pieces`` modules (ZeRO-3 units, DDP/ZeRO-1/2 buckets) of one vector
    each; ``model(x)`` with ``x`` of shape (1,) returns a scalar. Meant for the meta device."""

    def __init__(self, psi: int, pieces: int = 4):
        super().__init__()
        if psi < pieces or pieces < 1:
            raise ValueError(f"FlatModel needs psi >= pieces >= 1, got psi={psi}, pieces={pieces}")
        sizes = [psi // pieces] * pieces
        sizes[-1] += psi - sum(sizes)
        self.slabs = nn.ModuleList(_Slab(n) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(slab(x) for slab in self.slabs)  # ()


def _default_batch(model: nn.Module) -> tuple:
    """Smallest inputs for minizero's own models, on the meta device, in the parameters' dtype."""
    from minizero.models import MLP, TinyGPT

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if isinstance(model, FlatModel):
        return (torch.ones(1, dtype=dtype),)  # (1,)
    if isinstance(model, TinyGPT):
        idx = torch.zeros(1, 1, dtype=torch.long)  # (B=1, T=1) token ids
        return idx, idx
    if isinstance(model, MLP):
        x = torch.zeros(1, model.sizes[0], dtype=dtype)  # (B=1, in)
        return x, torch.zeros(1, model.sizes[-1], dtype=dtype)  # (B=1, out) targets
    raise TypeError(
        f"simulate does not know what {type(model).__name__} takes as input: pass "
        "batch_fn=lambda model: (inputs, ...); it runs on the meta device, and the step calls "
        "model(*batch).sum().backward()"
    )


def _one_step(model_fn, stage, precision, optimizer_fn, batch_fn, bucket_cap_mb) -> dict[str, int]:
    """Under an initialised (fake) default group: build on meta, wrap, one step, measure."""
    with torch.device("meta"):
        model = model_fn()
        real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
        if real:
            raise ValueError(
                f"model_fn put {real[0]!r} (and {len(real) - 1} more) on a real device: build "
                "tensors without device=... so that simulate can place them on the meta device"
            )
        wrapped, opt = parallelize(
            model, stage, optimizer_fn, precision=precision,
            bucket_cap_mb=None if stage == 3 else bucket_cap_mb,  # stage 3: units, no buckets
        )  # fmt: skip
        out = wrapped(*batch_fn(wrapped.module))
        (out if out.dim() == 0 else out.float().sum()).backward()
        opt.step()
    # Adam's 0-d `step` counters live on the CPU (4 bytes each); every other state is meta.
    held = [t for ts in state_tensors(wrapped, opt).values() for t in ts if t.dim() > 0]
    if not all(t.is_meta for t in held):
        raise RuntimeError(
            "a stage allocated real memory during simulate: it must follow the parameters' device"
        )
    return model_state_bytes(wrapped, opt)


def simulate(
    model_fn: Callable[[], nn.Module],
    stage: int,
    world: int,
    precision: str = "bf16",
    *,
    optimizer_fn: Callable | None = None,
    batch_fn: Callable[[nn.Module], tuple] | None = None,
    bucket_cap_mb: float = 25,
    rank: int = 0,
) -> dict[str, int]:
    """Per-rank model-state bytes ``{"params", "grads", "optimizer"}`` of ``model_fn()`` trained
    at ZeRO ``stage`` on ``world`` ranks, measured after one step of the real stage code.

    ``model_fn()`` runs under ``torch.device("meta")``; ``optimizer_fn`` defaults to Adam (K = 12 in
    mixed precision); ``batch_fn(model)`` gives the step's inputs (minizero's models, ``FlatModel``
    and ``MLP``/``TinyGPT``, have a default). Nothing is allocated and no rank is started: this
    process plays rank ``rank`` of a fake process group, which is destroyed before returning. Inside
    a process that already has a default group (a launched rank), it runs in a fresh subprocess.
    """
    if not isinstance(world, int) or world < 1 or not 0 <= rank < world:
        raise ValueError(f"need an int world >= 1 and 0 <= rank < world, got {world=}, {rank=}")
    if dist.is_initialized():
        return _in_subprocess(
            simulate, model_fn, stage, world, precision, optimizer_fn=optimizer_fn,
            batch_fn=batch_fn, bucket_cap_mb=bucket_cap_mb, rank=rank,
        )  # fmt: skip
    optimizer_fn = optimizer_fn or (lambda params: torch.optim.Adam(params))
    dist.init_process_group("fake", rank=rank, world_size=world)  # torch's own FakeStore
    try:
        return _one_step(
            model_fn, stage, precision, optimizer_fn, batch_fn or _default_batch, bucket_cap_mb
        )
    finally:
        dist.destroy_process_group()


# -- the paper's Table 1 -------------------------------------------------------------------------
def printed_as(value: float, printed: float) -> bool:
    """Whether ``value`` shows as ``printed`` at the digits printed, rounded half up or truncated
    (the paper does both: 41.25 -> 41.3, 4187.5 -> 4187)."""
    decimals = len(repr(float(printed)).split(".")[1].rstrip("0"))
    scale = 10**decimals
    shown = (math.floor(value * scale + 0.5) / scale, math.floor(value * scale + 1e-9) / scale)
    return any(math.isclose(s, printed) for s in shown)


def table1(
    stages: tuple[int, ...] = (0, 1, 2, 3),
    worlds: tuple[int, ...] = TABLE1_DP,
    psis: tuple[float, ...] = (7.5e9, 128e9, 1e12),
    precision: str = "bf16",
) -> list[dict]:
    """One row per (Ψ, N_d, stage): measured GB (1e9 bytes) per rank next to the paper's value.

    Row keys: model ("7.5B", or Ψ in short: "1.3B"), psi, world, stage, bytes (the measured
    dict), gb, paper_gb (Table 1 as printed; DDP is its N_d = 1 row; None where the paper has no
    such cell, and in fp32), match, precision.
    """
    if dist.is_initialized():
        return _in_subprocess(table1, stages, worlds, psis, precision)
    names = {v: k for k, v in TABLE1_PSI.items()}
    rows = []
    for psi in map(int, psis):
        name = names.get(psi, short_psi(psi))
        for world in worlds:
            for stage in stages:
                got = simulate(lambda psi=psi: FlatModel(psi), stage, world, precision)
                gb = sum(got.values()) / 1e9
                paper = _paper_gb(name, world, stage) if precision != "fp32" else None
                match = paper is not None and printed_as(gb, paper)
                rows.append(
                    dict(model=name, psi=psi, world=world, stage=stage, bytes=got, gb=gb,
                         paper_gb=paper, match=match, precision=precision)
                )  # fmt: skip
    return rows


def _paper_gb(name: str, world: int, stage: int) -> float | None:
    """Table 1 as printed; it has no DDP column, DDP holds what one rank holds (its N_d = 1 row)."""
    cells = PAPER_TABLE1.get(name, {})
    if stage == 0:
        return cells[1][0] if 1 in cells else None
    return cells[world][stage - 1] if world in cells else None


def _fmt(gb: float) -> str:
    return f"{gb:.3f}".rstrip("0").rstrip(".")


def short_psi(psi: float) -> str:
    """7.5e9 -> '7.5B', 1e12 -> '1T', 123456789 -> '123.5M': the model column's name for Ψ."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if psi >= div:
            return f"{psi / div:.4g}{suffix}"
    return f"{psi:.0f}"


def _heading(precision: str) -> str:
    if precision == "fp32":
        return "fp32 Adam: 4 + 4 + 8 bytes per parameter (params, grads, m and v; K = 8)."
    return f"Mixed-precision Adam ({precision}): 2 + 2 + K bytes per parameter, K = 12."


def format_table1(rows: list[dict]) -> str:
    """``table1()`` rows laid out as the paper's Table 1: measured [paper], a column per stage.

    ``!`` marks a cell whose paper value prints differently; cells the paper does not have (other
    Ψ or N_d, fp32) show no paper value and no mark.
    """
    stages = sorted({r["stage"] for r in rows})
    precision = {r.get("precision", "bf16") for r in rows}
    cell = {(r["model"], r["world"], r["stage"]): r for r in rows}
    text = {}
    for key, r in cell.items():
        paper = "" if r["paper_gb"] is None else f" [{r['paper_gb']:g}]"
        mark = " !" if r["paper_gb"] is not None and not r["match"] else ""
        text[key] = _fmt(r["gb"]) + paper + mark
    keys = list(dict.fromkeys((r["model"], r["world"]) for r in rows))
    wm = max(len("model"), *(len(m) for m, _ in keys))
    ww = max(len("N_d"), *(len(str(w)) for _, w in keys))
    wc = max(len(STAGE_NAMES[s]) for s in stages)
    wc = 2 + max(wc, *(len(t) for t in text.values()))
    known = [r for r in rows if r["paper_gb"] is not None]
    lines = [
        "Model states per rank in GB (1e9 bytes), measured: minizero's stage code on meta tensors,",
        "under a fake process group. " + ", ".join(_heading(p) for p in sorted(precision)),
        *(["[in brackets: the paper's Table 1]"] if known else []),
        f"{'model':>{wm}} {'N_d':>{ww}}" + "".join(f"{STAGE_NAMES[s]:>{wc}}" for s in stages),
    ]
    for model, world in keys:
        line = f"{model:>{wm}} {world:>{ww}}"
        lines.append(line + "".join(f"{text[(model, world, s)]:>{wc}}" for s in stages))
    if known:
        lines.append(f"{sum(r['match'] for r in known)}/{len(known)} cells with a paper value "
                     "print as the paper's (rounded or truncated; ! marks the others)")  # fmt: skip
    elif precision == {"fp32"}:
        lines.append("the paper's Table 1 is for mixed precision: no fp32 cell has a paper value")
    else:
        grid = ", ".join(map(str, TABLE1_DP))
        lines.append(f"no cell here is in the paper's Table 1 (Ψ = {', '.join(TABLE1_PSI)} at "
                     f"N_d = {grid}): nothing to compare")  # fmt: skip
    return "\n".join(lines)


def print_table1(**kwargs) -> str:
    """Print (and return) ``format_table1(table1(**kwargs))``."""
    text = format_table1(table1(**kwargs))
    print(text)
    return text


# -- inside a process that already has a default group: a fresh interpreter ------------------------
def _in_subprocess(fn, *args, timeout: float = 600, **kwargs):
    """``fn(*args, **kwargs)`` in a new Python process (cloudpickle carries lambdas by value)."""
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="minizero-simulate-") as tmp:
        job, result = Path(tmp, "job.pkl"), Path(tmp, "result.pkl")
        job.write_bytes(cloudpickle.dumps((fn, args, kwargs)))
        root = str(Path(__file__).resolve().parent.parent)  # so the child imports this minizero
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        code = (
            "import sys; from minizero.analysis.simulate import _child; "
            "_child(sys.argv[1], sys.argv[2])"
        )
        try:
            proc = subprocess.run([sys.executable, "-c", code, str(job), str(result)], env=env,
                                  capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"simulate's subprocess ran past {timeout} s") from e
        if proc.returncode != 0:
            raise RuntimeError(f"simulate's subprocess failed:\n{proc.stderr}")
        sys.stdout.write(proc.stdout)
        return cloudpickle.loads(result.read_bytes())


def _child(job: str, result: str) -> None:
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(Path(job).read_bytes())
    Path(result).write_bytes(cloudpickle.dumps(fn(*args, **kwargs)))
