"""What a step's collectives moved, and when: the ``CommLedger``. Taught in lesson 0.

While a ledger is open, every call of minizero/collectives.py goes through :class:`OpenLedgers`,
which issues it, times it and writes a :class:`CommRecord` into each open ledger; with none open,
the calls are torch.distributed's alone and nothing here runs.

Sizes follow nccl-tests (``doc/PERFORMANCE.md`` there): the payload ``S`` of a reduce-scatter or
an all-gather is the *full*, unsharded tensor; ``algbw = S / t``; ``busbw = algbw * factor`` with
factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter and all-gather, ``1`` for
broadcast. Volumes follow the ZeRO paper (§7.1): an all-reduce of ``n`` elements moves ``2n``
(it is a reduce-scatter then an all-gather), a reduce-scatter or an all-gather of a full tensor of
``n`` elements moves ``n``, a broadcast moves ``n``.

Cost of measuring: with a ledger open, a blocking call is timed from issue to return (on CUDA the
stream is synchronised before and after, so the figure is the collective alone); an asynchronous
call is timed from issue to the end of ``wait()``, which includes whatever overlapped with it.

Structure, not timing: each record also says *where on the ledger's timeline* it completed
(``CommRecord.waited_at``), so that a test can ask "was this all-reduce waited on before or after
the 'backward end' mark?" without reading a clock. ``CommLedger(only_group=g)`` refuses, before it
is issued, any collective on another group than ``g`` (a check run on a subgroup uses it to name a
forgotten ``group=`` instead of hanging on the ranks outside the subgroup).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.analysis.topology import ring_bytes

# nccl-tests' bus-bandwidth factors, as functions of the group size n.
BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
# ZeRO paper §7.1: elements moved per element of payload S.
PAPER_VOLUME = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
                "all_to_all": 1}  # fmt: skip
LATENCY_BOUND = 2**20  # bytes: below this a collective's time is mostly its per-call latency


@dataclass
class CommRecord:
    """One collective issued by this rank while a ledger was open."""

    op: str  # "all_reduce" | "reduce_scatter" | "all_gather" | "broadcast" | "all_to_all"
    dtype: torch.dtype
    numel: int  # S in elements (full, unsharded size for reduce-scatter and all-gather)
    world: int  # size of the process group it ran on
    async_op: bool
    tag: str  # who issued it, e.g. "ddp bucket 2"
    index: int  # position in the ledger's timeline (records and marks share one counter)
    seconds: float | None = None  # issue -> completion; None until an async op is waited on
    start: float | None = None  # time.perf_counter() at issue, to draw timelines
    group: str = "world"  # "world" (the default group), a name_group() name, or "ranks [..]"
    ranks: tuple[int, ...] = ()  # the group's global ranks in group-rank order; () = 0..world-1
    rank: int = 0  # this rank's global rank
    src: int = 0  # broadcast: the source's group rank
    # Timeline position at completion: the call (blocking) or its wait() (async) returned after
    # every ledger entry (record or mark) with index < waited_at and before those >= waited_at.
    # None while an async op has not been waited on. A blocking call: index + 1.
    waited_at: int | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth S/t, in bytes per second."""
        return self.nbytes / self.seconds if self.seconds else float("nan")

    @property
    def busbw(self) -> float:
        """Bus bandwidth, algbw times nccl-tests' factor for this op and group size."""
        return self.algbw * BUSBW_FACTOR[self.op](self.world)

    @property
    def volume_elements(self) -> int:
        """Elements moved in the ZeRO paper's accounting (§7.1)."""
        return PAPER_VOLUME[self.op] * self.numel


@dataclass
class CommLedger:
    """Records every collective this rank issues through minizero while the ledger is open.

    >>> with CommLedger() as ledger:
    ...     loss = model(x).sum(); loss.backward(); opt.step()
    >>> ledger.volume_elements / n_params   # 2.0 for DDP, ZeRO-1 and ZeRO-2; 3.0 for ZeRO-3
    """

    node_size: int | None = None  # ranks per node (consecutive ranks form a node), for node_bytes
    # When set: every collective issued while the ledger is open must run on this group (None is
    # not "unset" here: pass dist.group.WORLD for the default group); one on another group raises
    # WrongGroup before it is issued, on this rank, instead of waiting for ranks outside the group.
    only_group: dist.ProcessGroup | None = None
    records: list[CommRecord] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (timeline index, label)
    _next: int = 0

    def __post_init__(self) -> None:
        if self.node_size is not None and (
            not isinstance(self.node_size, int) or self.node_size < 1
        ):
            raise ValueError(
                f"node_size must be a positive int (ranks per node), got {self.node_size!r}"
            )

    def __enter__(self) -> CommLedger:
        _open_ledgers.append(self)
        C.recorder = RECORDER
        return self

    def __exit__(self, *exc) -> None:
        _open_ledgers.remove(self)
        if not _open_ledgers:
            C.recorder = None

    def _index(self) -> int:
        self._next += 1
        return self._next - 1

    def mark(self, label: str) -> None:
        """Put a label on the timeline, e.g. "backward end", to order collectives against it."""
        self.marks.append((self._index(), label))

    @property
    def volume_elements(self) -> int:
        """Total elements moved, in the paper's accounting (all-reduce of n counts 2n)."""
        return sum(r.volume_elements for r in self.records)

    def by_op(self) -> dict[str, int]:
        """Elements moved per op, in the paper's accounting."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + r.volume_elements
        return out

    def by_group(self) -> dict[str, int]:
        """Elements moved per group ("world", a :func:`name_group` name, ...), paper accounting."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.group] = out.get(r.group, 0) + r.volume_elements
        return out

    def node_bytes(self) -> dict[str, dict[str, float]]:
        """Bytes this rank sent that stay inside its node and that cross a node boundary, per group
        and in all (``"total"``): ``{group: {"inside": b, "across": b}}``. Needs ``node_size``;
        nodes are blocks of ``node_size`` consecutive global ranks. The ring model and its
        formulas: :func:`minizero.analysis.topology.ring_bytes` (on gloo a reduce-scatter sends its
        chunks to their owners directly: the same bytes, counted here as the ring splits them)."""
        if self.node_size is None:
            raise ValueError("node_bytes needs the node size: CommLedger(node_size=k)")
        out: dict[str, dict[str, float]] = {"total": {"inside": 0.0, "across": 0.0}}
        for r in self.records:
            ranks = r.ranks or tuple(range(r.world))
            inside, across = ring_bytes(r.op, r.nbytes, ranks, r.rank, self.node_size, r.src)
            for key in (r.group, "total"):
                row = out.setdefault(key, {"inside": 0.0, "across": 0.0})
                row["inside"] += inside
                row["across"] += across
        return out

    def table(self) -> str:
        """An nccl-tests-like table of the records."""
        rows = [
            f"{'op':<15}{'dtype':<10}{'bytes':>12}{'time(us)':>11}{'algbw GB/s':>12}"
            f"{'busbw GB/s':>12}  tag"
        ]
        for r in self.records:
            t = f"{r.seconds * 1e6:11.1f}" if r.seconds else f"{'-':>11}"
            rows.append(
                f"{r.op:<15}{str(r.dtype).replace('torch.', ''):<10}{r.nbytes:>12}{t}"
                f"{r.algbw / 1e9:12.3f}{r.busbw / 1e9:12.3f}  {r.tag}"
            )
        return "\n".join(rows)


# Ledgers open on this process, innermost last. A stack, not a singleton: it is empty whenever
# no `with CommLedger()` block is running, so nothing has to be reset between tests.
_open_ledgers: list[CommLedger] = []


# Names given to process groups, by torch's unique ``group_name`` (a string: no group is kept
# alive by being named). Written only by name_group.
_group_names: dict[str, str] = {}


def name_group(group: dist.ProcessGroup, name: str) -> dist.ProcessGroup:
    """Name ``group`` in every ledger's records (e.g. "shard", "replicate"); returns ``group``.
    Call it where ``dist.new_group`` is called, on every rank: on a rank outside the group
    (``new_group`` returns a placeholder there) it does nothing.

    >>> shard = name_group(dist.new_group([0, 1]), "shard")
    """
    if not isinstance(name, str) or not name or name == "world":
        raise ValueError(
            f"a group's name must be a non-empty string other than 'world', got {name!r}"
        )
    if group is None or group == dist.group.WORLD:
        raise ValueError(
            "the default group is always named 'world'; name a group made with dist.new_group"
        )
    if isinstance(group, dist.ProcessGroup):
        _group_names[group.group_name] = name
    return group


def group_label(group) -> str:
    """What records call ``group``: "world" for the default group (None), the name given by
    :func:`name_group`, else its ``group_desc`` (``new_group(ranks, group_desc="hpZ")``; a
    DeviceMesh names its groups after their dims: "shard", "replicate"), else "ranks [a, b, ..]"."""
    if group is None or group == dist.group.WORLD:
        return "world"
    name = _group_names.get(group.group_name)
    if name is None and group.group_desc not in ("undefined", "default_pg"):
        name = group.group_desc.removeprefix("mesh_")  # torch's: a mesh dim's, or new_group's
    return name if name is not None else f"ranks {dist.get_process_group_ranks(group)}"


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class WrongGroup(ValueError):
    """A collective issued on another group than the open ``CommLedger(only_group=...)``'s."""


def _check_group(op: str, group, tag: str) -> None:
    for ledger in _open_ledgers:
        want = ledger.only_group
        if want is None:
            continue
        got = dist.group.WORLD if group is None else group
        if got != want:
            where = f" (tag {tag!r})" if tag else ""
            raise WrongGroup(
                f"{op}{where} ran on {group_label(group)!r}, not on the group this code was "
                f"given ({group_label(want)!r}): pass that group to every collective (group=...)"
            )


def _done(recs: list[tuple[CommLedger, CommRecord]]) -> None:
    for ledger, r in recs:
        if r.waited_at is None:
            r.waited_at = ledger._next


class _TimedWork:
    """Wraps an async Work so that wait() completes the ledger record."""

    def __init__(self, work, recs: list[tuple[CommLedger, CommRecord]], t0: float, tensor):
        self.work, self.recs, self.t0, self.tensor = work, recs, t0, tensor

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        _sync(self.tensor)
        dt = time.perf_counter() - self.t0
        for _, r in self.recs:
            if r.seconds is None:
                r.seconds = dt
        _done(self.recs)
        return ok

    def is_completed(self) -> bool:
        return self.work.is_completed()


class OpenLedgers:
    """The recorder minizero/collectives.py calls while a ledger is open (``C.recorder``)."""

    def issue(
        self, op: str, fn, payload: torch.Tensor, numel: int, group, async_op: bool, tag: str,
        src: int = 0,
    ):  # fmt: skip
        """Issue ``fn(async_op)``, recorded in every open ledger; an async call's record is
        completed by its ``wait()``."""
        _check_group(op, group, tag)
        world = dist.get_world_size(group)
        ranks = tuple(range(world)) if group is None else tuple(dist.get_process_group_ranks(group))
        where = dict(group=group_label(group), ranks=ranks, rank=dist.get_rank(), src=src)
        recs = []
        for ledger in _open_ledgers:
            rec = CommRecord(
                op, payload.dtype, numel, world, async_op, tag, ledger._index(), **where
            )
            ledger.records.append(rec)
            recs.append((ledger, rec))
        if not async_op:
            _sync(payload)
        t0 = time.perf_counter()
        for _, r in recs:
            r.start = t0
        work = fn(async_op)
        if async_op:
            return _TimedWork(work, recs, t0, payload)
        _sync(payload)
        for _, r in recs:
            r.seconds = time.perf_counter() - t0
        _done(recs)
        return None

    def mark(self, label: str) -> None:
        """Label the timeline of every open ledger."""
        for ledger in _open_ledgers:
            ledger.mark(label)


RECORDER = OpenLedgers()
