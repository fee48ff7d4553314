"""What every lesson's check cells share, and the helpers the lessons' own code calls.

The contract of a check (the checks themselves are in ``lessonNN.py``, one file per lesson): it
runs the student's code on real ranks (``minizero.launch``, gloo on CPU or one rank per GPU over
NCCL), next to the reference implementations: ``torch.distributed`` itself, PyTorch's
``DistributedDataParallel``, minizero's own classes, and one process on the whole batch. It prints
``PASS`` with what was compared, or raises :class:`CheckFailed` saying what differs: which tensor,
which parameter, which step, on which rank, by how much, and what usually causes that.

Each rank catches the student's exceptions and returns them as data, so that the check can say
"your function raised NotImplementedError on rank 0" instead of showing the launcher's traceback.

The lessons' own cells use the rest: how many ranks (:func:`default_nprocs`), this rank's device
(:func:`rank_device`), where a measurement was made, for figure titles (:func:`run_info`,
:func:`describe`), and a progress bar over a launch (:func:`launch_with_progress`).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch._dynamo  # noqa: F401  imported once here: forked ranks inherit it (else seconds each)
import torch.distributed as dist

from minizero.course.checks import own_code
from minizero.launcher import LaunchError, default_nprocs, launch, rank_device

# Every check runs on at least 3 ranks: a hard-coded 2 and the world size differ. (More with
# $MINIZERO_CHECK_WORLD: `margins` runs them on 4 and 5 too.)
MIN_WORLD = max(3, int(os.environ.get("MINIZERO_CHECK_WORLD", "3") or 3))
SUBGROUP = (0, 1)  # the subgroup of the world a check runs group-taking code on; rank 2 is out
TIMEOUT = 120.0  # seconds: a student's hung collective becomes a CheckFailed, not a stuck cell
TIMEOUT_ENV = "MINIZERO_CHECK_TIMEOUT"  # seconds, overrides every check's own timeout when set


def check_timeout(default: float = TIMEOUT) -> float:
    """Seconds a check's ranks get: ``$MINIZERO_CHECK_TIMEOUT`` when set (``python -m minizero
    grade --check-timeout S`` sets it for the notebooks it runs), else the check's ``default``."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: give a number of seconds > 0, e.g. 600")
    return value


# -- how far a check is from failing: perturbations and margins (python -m minizero margins) -----
SEED_ENV = "MINIZERO_CHECK_SEED"  # an integer added to every check's model and data seeds
THREADS_ENV = "MINIZERO_CHECK_THREADS"  # torch.set_num_threads in each of a check's ranks
MARGINS_ENV = "MINIZERO_MARGINS"  # a file: every tolerance comparison appends a JSON line to it


def check_seed(base: int = 0) -> int:
    """``base`` plus ``$MINIZERO_CHECK_SEED`` (0 when unset): a right answer must pass with any."""
    return base + int(os.environ.get(SEED_ENV, "0") or 0)


def within(err: float, tol: float, what: str) -> bool:
    """``err <= tol`` (False for NaN): one tolerance comparison of a check. Under
    ``$MINIZERO_MARGINS`` it is also recorded, so that ``margins`` can report how close a right
    answer came to failing and a wrong one to passing."""
    ok = err <= tol  # NaN: False
    path = os.environ.get(MARGINS_ENV)
    if path:
        import json

        with open(path, "a") as f:  # one short line per comparison: appends do not interleave
            f.write(json.dumps({"what": what, "err": float(err), "tol": float(tol)}) + "\n")
    return ok


def worst(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple[float, float]:
    """``|got - want| <= atol + rtol |want|`` elementwise, as one pair ``(err, tol)``: the element
    whose ratio err/tol is the largest (a NaN or an infinity anywhere: err is infinite)."""
    if not want.numel():
        return 0.0, 1.0
    diff = (got - want).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    bound = (atol + rtol * want.abs()).nan_to_num(nan=atol)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)  # 0/0: equal, no NaN
    k = int(ratio.reshape(-1).argmax())
    return float(diff.reshape(-1)[k]), float(bound.reshape(-1)[k])


def allclose(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> bool:
    """``torch.allclose`` (NaN: not close) through :func:`within`, so that it is measured."""
    if got.shape != want.shape:
        return False
    return within(*worst(got.double(), want.double(), rtol, atol), what)


class CheckFailed(AssertionError):
    """A lesson exercise does not match the reference; the message says where and by how much."""


# -- what every lesson uses ------------------------------------------------------------------------
def run_info() -> dict:
    """Inside a rank: where the measurement is made, for figure titles (see :func:`describe`)."""
    dev = rank_device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {
        "backend": dist.get_backend(),
        "device": f"{dev.type} ({name})",
        "world": dist.get_world_size(),
    }


def describe(info: dict) -> str:
    """``"gloo · cpu (CPU) · world 2"``: what every figure's title names."""
    return f"{info['backend']} · {info['device']} · world {info['world']}"


# minizero's and torch's own files: guard() names the deepest line of a traceback outside them
_LIBRARY = (
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    os.path.dirname(torch.__file__),
)


def guard(fn, *args, **kwargs):
    """Run student code; return (value, None) or (None, short error text naming the line)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]  # drop this frame
        theirs = [f for f in frames if not f.filename.startswith(_LIBRARY)]  # the student's line
        frame = (theirs or frames or [None])[-1]
        where = f" (at line {frame.lineno}: {frame.line})" if frame else ""
        return None, f"{type(e).__name__}: {e}{where}"


def launch_check(
    fn, nprocs: int | None, *args, timeout: float = TIMEOUT, min_world: int = MIN_WORLD
) -> list:
    """``launch(fn, nprocs, *args)`` for a check, on at least ``min_world`` ranks (default
    :data:`MIN_WORLD`; with fewer GPUs than that, on the CPU over gloo): a hang or a crash
    becomes a CheckFailed whose message is the launcher's whole report (for a hang: where each
    rank was)."""
    nprocs = max(nprocs or default_nprocs(), min_world)  # 3 ranks: gloo on CPU under 3 GPUs
    timeout = check_timeout(timeout)
    threads = int(os.environ.get(THREADS_ENV, "0") or 0)
    if threads:
        fn, args = _with_threads, (threads, fn, *args)
    try:
        return graded_launch(fn, nprocs, *args, timeout=timeout, verbose=False)
    except LaunchError as e:
        verdict = _rank_verdict(e)
        if verdict is not None:  # a rank's own CheckFailed: the launcher stopped its peers
            raise CheckFailed(verdict) from None
        raise CheckFailed(
            f"the ranks did not finish: {e}\nEvery rank must issue the same collectives in the "
            f"same order, or they wait for each other forever (on the subgroup "
            f"{list(SUBGROUP)} a check runs your code on, a torch.distributed collective left on "
            f"the default group waits for the other ranks forever: pass group=). A check that "
            f"is only slow can get more time: `python -m minizero grade --check-timeout 600` or "
            f"{TIMEOUT_ENV}=600."
        ) from e


def _rank_verdict(e: LaunchError) -> str | None:
    """The message of the :class:`CheckFailed` that the failing rank raised, or None. A rank
    raises one where its peers may be waiting for it in a collective (its student code raised
    half-way through a step): the launcher then stops them at once, where a result returned
    instead would leave them waiting until the timeout."""
    head = f"{CheckFailed.__module__}.{CheckFailed.__qualname__}: "
    at = e.traceback.rfind("\n" + head) if isinstance(e.traceback, str) else -1
    if at < 0 or e.rank is None:
        return None
    return e.traceback[at + 1 + len(head) :].strip()


def graded_launch(fn, nprocs: int, *args, **kwargs) -> list:
    """``launch(fn, nprocs, *args, **kwargs)``; while grading checks an exercise, each rank also
    runs the exercise's wires and seal (:mod:`.own_code`), whose findings join the kernel's."""
    wires = own_code.ACTIVE
    if wires is None:
        return launch(fn, nprocs, *args, **kwargs)
    reports = launch(own_code.in_rank, nprocs, wires, fn, *args, **kwargs)
    for r in reports:
        own_code.TRIPS.extend(r.trips)
        own_code.RANK_TAMPERED.extend(t for t in r.tampered if t not in own_code.RANK_TAMPERED)
    return [r.result for r in reports]


def _with_threads(threads: int, fn, *args):
    torch.set_num_threads(threads)  # reduction order inside a rank's kernels changes with it
    return fn(*args)


def report_pass(msg: str) -> None:
    """What a check prints when everything matched."""
    print(f"PASS  {msg}")


# -- a wrong world and a dropped group -------------------------------------------------------------
def two_ranks_hint(world: int) -> str:
    """What to say when a result is off by world/2 on ``world`` ranks: the evidence of a 2."""
    if world == 2:
        return ""
    return (
        f" This check runs on {world} ranks: your code assumed 2 ranks: use self.world / "
        "dist.get_world_size(group)."
    )


def raised_hint(world: int, error: str) -> str:
    """What to add to the student's exception ``error`` (:func:`guard`'s text) on ``world``
    ranks. Nothing for an exercise not written yet (its TODO's NotImplementedError names it), nor
    on 2 ranks. Otherwise a question, not a diagnosis: an exception is no evidence of a 2."""
    if world == 2 or error.startswith("NotImplementedError") or " NotImplementedError:" in error:
        return ""
    return (
        f" (This check runs on {world} ranks: if your code assumes 2, use self.world / "
        "dist.get_world_size(group).)"
    )


def factor_hint(ratio: float, world: int) -> str:
    """A hint from ``yours / reference`` (``ratio``) on ``world`` ranks, or ``""``."""
    if abs(ratio - world) < 0.05 * world:
        return f" Yours is {ratio:.2f}x the reference: the collective sums; divide by {world}."
    if world != 2 and abs(ratio - world / 2) < 0.05 * world / 2:
        return f" Yours is {ratio:.2f}x the reference (= {world}/2).{two_ranks_hint(world)}"
    return ""


def on_subgroup(fn, *args, **kwargs):
    """Inside a rank of a world of at least 3: build the subgroup :data:`SUBGROUP` (every rank
    calls ``dist.new_group``, as c10d requires), run ``fn(group, *args, **kwargs)`` on its
    members and return what it returns; ``None`` on the ranks outside it. Call it last in a rank
    function: a student's error may leave the members out of step."""
    group = dist.new_group(list(SUBGROUP))
    if dist.get_rank() not in SUBGROUP:
        return None
    return fn(group, *args, **kwargs)


def strict_ledger(group):
    """A ``CommLedger`` that refuses (``WrongGroup``) any collective not issued on ``group``."""
    from minizero.analysis.ledger import CommLedger

    return CommLedger(only_group=group)


def on_world_and_subgroup(per_rank: list[dict], name: str, check) -> int:
    """``check(results, world, name)`` on every rank's results, then on :data:`SUBGROUP`'s
    ``"sub"`` results, whose failure becomes :func:`subgroup_failure`; returns the world size."""
    world = len(per_rank)
    check(per_rank, world, name)
    try:
        check([per_rank[r]["sub"] for r in SUBGROUP], len(SUBGROUP), name)
    except CheckFailed as e:
        raise subgroup_failure(name, world, str(e)) from None
    return world


def subgroup_failure(name: str, world: int, what: str) -> CheckFailed:
    """The failure of a run on :data:`SUBGROUP`: ``what`` went wrong; names the usual mistake."""
    where = (
        f"on a subgroup (ranks {list(SUBGROUP)} of a {world}-rank world, made with "
        f"dist.new_group; rank {world - 1} not in it)"
    )
    if "WrongGroup" in what:
        hint = "a collective ran on the default group: pass group=self.group (or group=group)."
    else:
        hint = (
            "On a subgroup the sizes and ranks come from the group: dist.get_world_size(group), "
            "dist.get_rank(group) (self.world, self.rank), and every collective takes "
            "group=self.group (or group=group)."
        )
    return CheckFailed(f"{where}, {name}: {what} {hint}")
