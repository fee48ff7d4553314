"""Memory meters and the paper's memory formulas. Taught in lessons 02_zero1 .. 05_all_stages.

Three tools, from the most abstract to the most concrete:

* ``paper_model_state_bytes(psi, world, stage)``: ZeRO §3.1 and §5: per-rank model-state bytes
  with mixed-precision Adam (K = 12): DDP (2 + 2 + K)Ψ, stage 1 (P_os) 2Ψ + 2Ψ + KΨ/N,
  stage 2 (P_os+g) 2Ψ + (2 + K)Ψ/N, stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N. ``PAPER_TABLE1`` holds the
  paper's printed Table 1 and ``table1_gb`` recomputes it.
* ``model_state_bytes(model, optimizer)``: what this rank holds right now, read from the live
  tensors, each storage counted once (tied weights, views and flat buffers included). Works on
  meta and fake tensors, so a 1T-parameter model can be "measured" without memory.
* ``MemoryMeter``: labelled marks through a training step (params, grads, optimizer, comm,
  activations, total, peak). On CUDA it reads the caching allocator; on CPU it tracks every storage
  the step creates or touches through a ``TorchDispatchMode`` and sums ``nbytes()`` after every op.

Where the lists of tensors come from: a minizero wrapper's are read from its stage's containers
(:func:`wrapper_tensors`); an object (an optimizer parallelize returned, say) with
``_minizero_state_tensors() -> {"params"|"grads"|"optimizer"|"comm": [tensors]}`` says so itself;
otherwise a module gives ``parameters()`` and their ``.grad``, an optimizer every tensor in
``optimizer.state``. A storage listed under several categories counts once, in the first of
params > grads > optimizer > comm.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minizero.data_parallel import DataParallel
from minizero.models import count_params

CATEGORIES = ("params", "grads", "optimizer", "comm")

# Bytes per parameter (params, grads, optimizer K) for Adam. Mixed precision (ZeRO §3.1): 16-bit
# params and grads; fp32 master copy + momentum + variance = 4 + 4 + 4. In fp32 the params are
# their own master copy, so K = 4 + 4. SGD with momentum: K = 8 mixed, 4 in fp32 (pass k=...).
_BYTES_PER_PARAM = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}


def paper_model_state_bytes(
    psi: int, world: int, stage: int, precision: str = "bf16", k: float | None = None
) -> dict[str, float]:
    """Per-rank model-state bytes by the paper's formula (ZeRO §3.1, §5.1-5.3).

    Stage 0 (DDP) partitions nothing; stage 1 divides the optimizer states by N; stage 2 the
    gradients too; stage 3 the parameters too. ``k`` overrides the optimizer multiplier K.
    """
    if precision not in _BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(_BYTES_PER_PARAM)}, got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    p, g, kk = _BYTES_PER_PARAM[precision]
    kk = kk if k is None else k
    return {
        "params": p * psi / (world if stage >= 3 else 1),
        "grads": g * psi / (world if stage >= 2 else 1),
        "optimizer": kk * psi / (world if stage >= 1 else 1),
    }


# ZeRO Table 1 (arXiv 1910.02054): per-device model-state memory in GB (1e9 bytes), K = 12, for
# N_d = 1, 4, 16, 64, 256, 1024 and stages 1 (P_os), 2 (P_os+g), 3 (P_os+g+p); stage 0 is the
# N_d = 1 row. As printed: values below 100 rounded (41.25 -> 41.3, 0.469 -> 0.47), larger ones
# truncated to an integer (4187.5 -> 4187, 257.75 -> 257).
TABLE1_PSI = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
TABLE1_DP = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE1: dict[str, dict[int, tuple[float, float, float]]] = {
    "7.5B": {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
             64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    "128B": {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128),
             64: (536, 284, 32), 256: (518, 263, 8), 1024: (513, 257, 2)},
    "1T": {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000),
           64: (4187, 2218, 250), 256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}  # fmt: skip


def table1_gb(psi: int, world: int, stage: int) -> float:
    """One cell of Table 1 recomputed: total model-state GB (1e9 bytes) per device, K = 12."""
    return sum(paper_model_state_bytes(psi, world, stage, "fp16").values()) / 1e9


def _tensors_in(obj) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def state_tensors(model=None, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """The tensors behind each model-state category (see the module docstring for the rules)."""
    out: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    for owner in (model, optimizer):
        if owner is None:
            continue
        listed = getattr(owner, "_minizero_state_tensors", None)
        if isinstance(owner, DataParallel):
            for cat, tensors in wrapper_tensors(owner).items():
                out[cat] += tensors
        elif listed is not None:
            for cat, tensors in listed().items():
                if cat not in out:
                    raise ValueError(f"_minizero_state_tensors key {cat!r} not in {CATEGORIES}")
                out[cat] += [t for t in tensors if t is not None]
        elif isinstance(owner, torch.nn.Module):
            params = list(owner.parameters())
            out["params"] += params
            out["grads"] += [p.grad for p in params if p.grad is not None]
        elif isinstance(owner, torch.optim.Optimizer):
            out["optimizer"] += _tensors_in(dict(owner.state))  # nested dicts of states
        else:
            raise TypeError(f"expected an nn.Module or a torch.optim.Optimizer, got {type(owner)}")
    return out


def wrapper_tensors(w: DataParallel) -> dict[str, list[torch.Tensor]]:
    """What a wrapper holds, by category: its working parameters (stages 1-2: and their flat
    buffers; stage 3: only its shards, the frozen parameters, hpZ's secondary shards), its
    gradients (DDP, stage 1: the flat buffers; stages 2-3: the shards), and, stages 2-3, the
    full buffers alive for a collective (a bucket filling or reducing, a gathered unit)."""
    return {**w.held_tensors(), "optimizer": []}  # (the stage's face: data_parallel.Face)


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def _split_by_storage(cats: dict[str, list[torch.Tensor]], *, skip_scalars: bool) -> dict:
    """Bytes per category, each storage once. Keyed by the storage's C++ address (``_cdata``),
    not ``data_ptr()``: every meta or fake storage has data_ptr 0."""
    seen: set[int] = set()
    out = {}
    for cat in CATEGORIES:
        n = 0
        for t in cats[cat]:
            s = None if skip_scalars and t.dim() == 0 else _storage(t)
            if s is not None and s._cdata not in seen:
                seen.add(s._cdata)
                n += s.nbytes()  # 0 for a storage resized to 0 (ZeRO-3's freed full params)
        out[cat] = n
    return out


def model_state_bytes(model=None, optimizer=None, *, include_comm: bool = False) -> dict[str, int]:
    """Bytes of params, grads and optimizer states this rank holds right now (+ "comm" if asked).

    0-d tensors (Adam's ``step``, 4 bytes per parameter tensor) are left out, so that plain fp32
    Adam measures exactly 4Ψ + 4Ψ + 8Ψ; ``MemoryMeter`` counts them, as it counts every live byte.
    """
    split = _split_by_storage(state_tensors(model, optimizer), skip_scalars=True)
    return split if include_comm else {c: split[c] for c in CATEGORIES[:3]}


def format_bytes(n: float, unit: str | None = None) -> str:
    """``format_bytes(3 * 2**20)`` -> '3.00 MiB'. ``unit``: force one of B, KiB, MiB, GiB, KB,
    MB, GB (the paper's GB are 1e9 bytes)."""
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    if unit is None:
        unit = next((u for u in ("GiB", "MiB", "KiB") if abs(n) >= units[u]), "B")
    if unit not in units:
        raise ValueError(f"unit must be one of {list(units)}, got {unit!r}")
    return f"{n:.0f} B" if unit == "B" else f"{n / units[unit]:.2f} {unit}"


def model_state_report(
    model, optimizer, *, stage: int, world: int = 1, precision: str = "fp32",
    psi: int | None = None, k: float | None = None,
) -> str:  # fmt: skip
    """A table of measured vs paper bytes per category (returned, and printed). ``psi`` defaults
    to ``count_params`` of the user's model (``model.module`` for a wrapped one)."""
    if psi is None:
        psi = count_params(model.module if isinstance(model, DataParallel) else model)
    got = model_state_bytes(model, optimizer)
    want = paper_model_state_bytes(psi, world, stage, precision, k)
    header = f"{'':10}{'measured':>14}{'paper':>14}{'ratio':>8}"
    lines = [f"stage {stage}, N={world}, {precision}, Ψ={psi:,}", header]
    for cat in (*CATEGORIES[:3], "total"):
        g = got[cat] if cat != "total" else sum(got.values())
        w = want[cat] if cat != "total" else sum(want.values())
        ratio = f"{g / w:.3f}" if w else "-"
        lines.append(f"{cat:10}{format_bytes(g):>14}{format_bytes(w):>14}{ratio:>8}")
    report = "\n".join(lines)
    print(report)
    return report


def print_states_per_rank(per_rank: list[list[tuple]], psi: int, world: int) -> None:
    """Print bytes per rank / Ψ beside the paper, for ``launch`` results whose rank r returned
    ``[(precision, stage, model_state_bytes(...)), ...]``. Used in lessons 02 and 03."""
    lines = [f"{'':20}{'params':>8}{'grads':>8}{'optim':>8}{'total':>8}"]
    for k, (precision, stage, _) in enumerate(per_rank[0]):
        paper = paper_model_state_bytes(psi, world, stage, precision)
        for r, rows in enumerate(per_rank):
            got = rows[k][2]
            cells = "".join(f"{got[c] / psi:8.3f}" for c in paper)
            lines.append(f"{precision} stage {stage} rank {r}{cells}{sum(got.values()) / psi:8.3f}")
        cells = "".join(f"{v / psi:8.3f}" for v in paper.values())
        lines.append(f"{precision} stage {stage} paper {cells}{sum(paper.values()) / psi:8.3f}\n")
    print("\n".join(lines))


class _StorageTracker(TorchDispatchMode):
    """Sees every aten op; remembers (weakly) each storage an op reads or writes, and after every
    op sums ``nbytes()`` of the storages still alive to keep the peak."""

    def __init__(self, on_op) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}  # storage _cdata -> weak reference to the storage
        self.on_op = on_op

    def track(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is None or s._cdata in self.live:
            return
        live, key = self.live, s._cdata

        def gone(ref, key=key):  # the last tensor on this storage died
            if live.get(key) is ref:
                del live[key]

        live[key] = weakref.ref(s, gone)

    def total(self) -> int:
        return sum(s.nbytes() for r in list(self.live.values()) if (s := r()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.on_op()
        return out


class MemoryMeter:
    """``with MemoryMeter(model, optimizer) as m: ...; m.mark("after backward")``.

    ``m.marks``: one dict per mark with bytes for params, grads, optimizer, comm, activations
    (everything else alive), total, and peak (highest total since the meter opened or the last
    ``reset_peak()``, as ``torch.cuda.max_memory_allocated``), plus ``at_peak`` (the split at the
    peak; CPU only) and ``reserved`` (CUDA only). Peaks are exact per op on CPU: the total is summed
    after every aten op, so do not time a step while it is measured.
    """

    def __init__(self, model=None, optimizer=None, *, device: str | torch.device | None = None):
        self.model, self.optimizer = model, optimizer
        if device is None:
            p = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
            device = p.device if p is not None else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter measures cpu or cuda memory, not {self.device.type}")
        self.marks: list[dict] = []
        self._tracker: _StorageTracker | None = None
        self._peak, self._at_peak = 0, None

    def _split(self) -> dict[str, int]:
        cats = state_tensors(self.model, self.optimizer)
        if self.device.type == "cuda":
            cats = {c: [t for t in ts if t.device == self.device] for c, ts in cats.items()}
            split = _split_by_storage(cats, skip_scalars=False)
            total = torch.cuda.memory_allocated(self.device)
        else:
            for t in (t for ts in cats.values() for t in ts):
                self._tracker.track(t)
            split = _split_by_storage(cats, skip_scalars=False)
            total = self._tracker.total()
        return {**split, "activations": total - sum(split.values()), "total": total}

    def _observe(self) -> None:  # after every op, CPU only
        if self._tracker.total() > self._peak:
            self._at_peak = self._split()
            self._peak = self._at_peak["total"]

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. at the start of each step)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._at_peak = self._split()
            self._peak = self._at_peak["total"]

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            self._tracker = _StorageTracker(self._observe)
            self._tracker.__enter__()
        self.reset_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def mark(self, label: str) -> dict:
        """Record the memory now under ``label``; returns the record (also in ``self.marks``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            rec = {"label": label, **self._split(), "at_peak": None}
            rec["peak"] = torch.cuda.max_memory_allocated(self.device)
            rec["reserved"] = torch.cuda.memory_reserved(self.device)
        else:
            if self._tracker is None:
                raise RuntimeError("call mark() inside `with MemoryMeter(...) as m:`")
            rec = {"label": label, **self._split()}
            if rec["total"] > self._peak:
                self._peak, self._at_peak = rec["total"], {k: rec[k] for k in rec if k != "label"}
            rec.update(peak=self._peak, at_peak=dict(self._at_peak), reserved=None)
        self.marks.append(rec)
        return rec

    def table(self, unit: str | None = None) -> str:
        """The marks as a text table, one row per mark."""
        cols = ("params", "grads", "optimizer", "comm", "activations", "total", "peak")
        rows = [f"{'mark':24}" + "".join(f"{c:>13}" for c in cols)]
        for r in self.marks:
            rows.append(
                f"{r['label'][:24]:24}" + "".join(f"{format_bytes(r[c], unit):>13}" for c in cols)
            )
        return "\n".join(rows)
