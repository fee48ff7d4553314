"""The check cells of lesson 08 (08_beyond_one_node): ``check_predict_step_time``, ``check_choose``.

Both run in the notebook's own process (no ranks): the student's α-β prediction of a step against
``minizero.analysis.cost.predict`` (no overlap) on configurations that differ where a plausible
mistake shows (micro-batches, link classes, HSDP, hpZ, qwZ), and the student's choice of a
configuration against the rule the lesson states. The contract of every check: :mod:`.common`.
"""

from __future__ import annotations

import math

from minizero.analysis import cost
from minizero.course.checks.common import CheckFailed, guard, report_pass

LINKS = {"intra": cost.Link(alpha=5e-6, beta=200e9), "inter": cost.Link(alpha=20e-6, beta=25e9)}
PSI, COMPUTE_S = 10**9, 0.5
CASES = [
    cost.Config(stage=0, world=16, node_size=4),
    cost.Config(stage=1, world=4, node_size=4, micro_batches=3),  # one node: the intra link only
    cost.Config(stage=2, world=16, node_size=4, micro_batches=4),
    cost.Config(stage=3, world=16, node_size=4, hsdp=True, micro_batches=2),
    cost.Config(stage=3, world=32, node_size=8, hpz=True, qwz=True, micro_batches=3),
]


def _variant(cfg: cost.Config, *, times=True, per_micro=True, one_link=None) -> float:
    """The prediction with one plausible mistake, to name it when a student's answer matches."""
    total = (cfg.micro_batches if per_micro else 1) * COMPUTE_S
    for c in cost.step_collectives(cfg, [PSI]):
        rounds, wire = cost.ring(c.op, c.nbytes, c.n)
        link = LINKS[one_link or c.link]
        total += (c.times if times else 1) * (link.alpha * rounds + wire / link.beta)
    return total


def _describe(cfg: cost.Config) -> str:
    extra = [k for k in ("hsdp", "hpz", "qwz") if getattr(cfg, k)]
    return (
        f"stage {cfg.stage}, N={cfg.world} in nodes of {cfg.node_size}, "
        f"{cfg.micro_batches} micro-batch(es)" + (f", {'+'.join(extra)}" if extra else "")
    )


def check_predict_step_time(fn) -> None:
    """Lesson 08: ``fn(cfg, links, compute_s, psi)`` must return the α-β step time, no overlap."""
    name = getattr(fn, "__name__", "your function")
    for cfg in CASES:
        want = cost.predict(cfg, LINKS, compute_s=COMPUTE_S, psi=PSI).step_s
        got, err = guard(fn, cfg, dict(LINKS), COMPUTE_S, PSI)
        where = f"for {_describe(cfg)}"
        if err:
            raise CheckFailed(f"{name} raised {where}: {err}")
        if not isinstance(got, (int, float)) or not math.isfinite(got):
            raise CheckFailed(f"{name} returned {got!r} {where}: return seconds, a float")
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        close = lambda v: math.isclose(got, v, rel_tol=1e-6)  # noqa: B023 (used right here)
        if close(_variant(cfg, times=False)):
            hint = (
                "you counted each collective once per step; stages 2-3 reduce-scatter (and "
                "stage 3 all-gathers) every micro-batch: a Comm says how often (c.times)"
            )
        elif close(_variant(cfg, per_micro=False)):
            hint = "the compute runs once per micro-batch: cfg.micro_batches × compute_s"
        elif any(close(_variant(cfg, one_link=k)) for k in LINKS):
            hint = "every collective runs over its own link class: links[c.link]"
        elif close(want - cfg.micro_batches * COMPUTE_S):
            hint = "add the compute: the prediction is compute + communication (no overlap)"
        else:
            hint = (
                "a collective costs α · rounds + wire bytes / β, with (rounds, wire) = "
                "cost.ring(c.op, c.nbytes, c.n)"
            )
        raise CheckFailed(f"{name} gave {got:.6g} s {where}, the model gives {want:.6g} s: {hint}")
    report_pass(f"{name}: the α-β step time of {len(CASES)} configurations (stages 0-3, HSDP, "
                "hpZ + qwZ, 1-4 micro-batches)")  # fmt: skip


# Each scenario: rows (name, predicted step seconds, bytes per rank), the memory a rank has, the
# answer. The rule: the fastest configuration that fits; equal times, the one using less memory;
# None when nothing fits.
SCENARIOS = [
    ([("A", 2.0, 50e9), ("B", 1.5, 70e9), ("C", 3.0, 20e9)], 80e9, "B"),
    ([("A", 2.0, 50e9), ("B", 1.5, 90e9), ("C", 3.0, 20e9)], 80e9, "A"),
    ([("A", 2.0, 50e9), ("B", 2.0, 40e9), ("C", 3.0, 20e9)], 80e9, "B"),
    ([("A", 2.0, 90e9), ("B", 1.0, 95e9)], 80e9, None),
    ([("A", 2.0, 80e9), ("B", 1.0, 80.5e9)], 80e9, "A"),  # exactly the memory fits
]


def check_choose(fn) -> None:
    """Lesson 08: ``fn(rows, memory)`` picks the fastest row that fits (ties: less memory)."""
    name = getattr(fn, "__name__", "your function")
    for rows, memory, want in SCENARIOS:
        table = [dict(name=n, step_s=t, memory=m) for n, t, m in rows]
        got, err = guard(fn, [dict(r) for r in table], memory)
        where = f"for rows {rows} and {memory / 1e9:g} GB per rank"
        if err:
            raise CheckFailed(f"{name} raised {where}: {err}")
        if isinstance(got, dict):
            got = got.get("name")
        if got == want:
            continue
        row = next((r for r in table if r["name"] == got), None)
        if want is None:
            hint = "nothing fits: return None (no configuration can run)"
        elif got is None:
            need = next(r["memory"] for r in table if r["name"] == want)
            hint = f"{want} fits: it needs {need / 1e9:g} GB of the {memory / 1e9:g} GB (<= fits)"
        elif row is None:
            hint = f"{got!r} is not a row's name; return the chosen row's name"
        elif row["memory"] > memory:
            hint = f"{got} does not fit: it needs {row['memory'] / 1e9:g} GB per rank"
        elif row["step_s"] == next(r["step_s"] for r in table if r["name"] == want):
            hint = "equal step times: take the one that leaves more memory free"
        else:
            hint = f"{want} fits and is faster"
        raise CheckFailed(f"{name} chose {got!r} {where}; expected {want!r}: {hint}")
    report_pass(f"{name}: {len(SCENARIOS)} choices (fits, faster, ties, nothing fits)")
