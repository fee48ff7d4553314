"""What the check cells of lesson 07 (07_checkpoints) call, and the lesson's crash helper.

Same contract as :mod:`minizero.course.checks.common`: each check runs the student's function on
real ranks next to minizero's own (and DCP's) and prints ``PASS`` with what was compared, or raises
:class:`~minizero.course.checks.common.CheckFailed` naming the stage, the rank, the parameter and
both answers.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minizero.course.checks.common import (
    CheckFailed,
    check_timeout,
    graded_launch,
    guard,
    launch_check,
    report_pass,
)
from minizero.launcher import LaunchError, launch
from minizero.models import MLP, GPTConfig, TinyGPT

TIMEOUT = 120.0


def _models() -> dict:
    torch.manual_seed(0)
    return {
        "MLP (a frozen weight, a tied one)": lambda: MLP(frozen_first=True, tied=True),
        "TinyGPT (lm_head tied to wte)": lambda: TinyGPT(GPTConfig.tiny(n_embd=32)),
    }


# -- exercise 1: what each rank owns ---------------------------------------------------------------
def _owned_rank(fn) -> dict:
    import minizero

    out = {"cases": [], "error": None}
    for model_name, build in _models().items():
        for stage in (0, 1, 2, 3):
            for cap in (0.002, 25):  # many small buckets, then one per stage's default
                torch.manual_seed(0)
                opt = lambda p: torch.optim.AdamW(p, lr=1e-3)
                kw = {} if stage == 3 else {"bucket_cap_mb": cap}
                if stage == 3 and cap == 25:
                    continue  # stage 3's buckets are its units, whatever the cap
                model, _ = minizero.parallelize(build(), stage, opt, **kw)
                want = {f.name: (f.start, f.end) for f in model.fragments}
                got, err = guard(fn, model)
                case = {"model": model_name, "stage": stage, "cap": cap, "want": want, "got": got}
                out["cases"].append(case)
                if err is not None:
                    out["error"] = err
                    return out
    return out


def check_owned_ranges(fn, nprocs: int | None = None) -> None:
    """Lesson 07, exercise 1: ``fn(model)`` must give ``{name: (start, end)}``, the elements of
    each trainable parameter this rank owns, as minizero's fragments say, at every stage."""
    results = launch_check(_owned_rank, nprocs, fn)
    world = len(results)
    name = getattr(fn, "__name__", "your function")
    for rank, res in enumerate(results):
        if res["error"]:
            raise CheckFailed(f"{name} raised on rank {rank} (world size {world}): {res['error']}")
        for case in res["cases"]:
            got, want = case["got"], case["want"]
            where = (f"{case['model']}, stage {case['stage']}, bucket_cap_mb {case['cap']}, rank "
                     f"{rank} of {world}")  # fmt: skip
            if not isinstance(got, dict):
                raise CheckFailed(f"{name} returned {type(got).__name__}, not a dict ({where})")
            for n, w in want.items():
                if n not in got:
                    raise CheckFailed(
                        f"{where}: no range for {n!r}; this rank owns its elements {w}"
                    )
                if tuple(got[n]) != w:
                    hint = (" Stage 0 (DDP) owns every element of every bucket." if
                            case["stage"] == 0 else " Ranges count from the parameter's own "
                            "first element, not the bucket's.")  # fmt: skip
                    raise CheckFailed(
                        f"{where}: {n!r} -> {tuple(got[n])}, but this rank owns {w}.{hint}"
                    )
            extra = [n for n in got if n not in want]
            if extra:
                raise CheckFailed(
                    f"{where}: {extra[0]!r} -> {got[extra[0]]}, but no element of it is in this "
                    "rank's chunk of its bucket (leave it out), or it is not trainable"
                )
    cases = len(results[0]["cases"])
    report_pass(f"{name}: the ranges of every parameter on {world} ranks, {cases} layouts each "
                "(stages 0-3, small and large buckets, MLP and TinyGPT), equal minizero's "
                "fragments")  # fmt: skip


# -- exercise 2: reading the ranges a rank now owns ------------------------------------------------
def _random_cases(n: int) -> list[tuple[list[tuple[int, int]], tuple[int, int]]]:
    rnd = random.Random(7)
    cases = [([(0, 10)], (0, 10)), ([(0, 3), (3, 10)], (2, 9)), ([(0, 5), (5, 10)], (5, 10))]
    while len(cases) < n:
        numel = rnd.randint(1, 60)
        cuts = sorted({0, numel, *rnd.sample(range(1, numel + 1), min(numel, rnd.randint(0, 5)))})
        saved = list(zip(cuts[:-1], cuts[1:]))
        a = rnd.randint(0, numel - 1)
        cases.append((saved, (a, rnd.randint(a + 1, numel))))
    return cases


def _apply(plan, saved, want, values: torch.Tensor) -> torch.Tensor:
    """Fill ``want`` from the saved pieces of ``values`` (flat) following ``plan``."""
    pieces = [values[s:e] for s, e in saved]
    out = torch.full((want[1] - want[0],), float("nan"))
    for k, src, dst, n in plan:
        if not (0 <= k < len(pieces) and 0 <= src and src + n <= len(pieces[k]) and 0 <= dst
                and dst + n <= len(out) and n > 0):  # fmt: skip
            raise CheckFailed(
                f"plan entry {(k, src, dst, n)} for saved={saved}, want={want} reaches outside "
                f"piece {k} or the wanted range (src + n <= piece length, dst + n <= "
                f"{len(out)}, n > 0)"
            )
        out[dst : dst + n] = pieces[k][src : src + n]
    return out


def _dcp_plan(saved, want) -> list[tuple[int, int, int, int]]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    chunks = [Chunk(offsets=torch.Size([s]), sizes=torch.Size([e - s])) for s, e in saved]
    md = TensorStorageMetadata(TensorProperties(), torch.Size([saved[-1][1]]), chunks)
    local = Chunk(offsets=torch.Size([want[0]]), sizes=torch.Size([want[1] - want[0]]))
    items = create_read_items_for_chunk_list("x", md, [local])
    return sorted((i.storage_index.index, i.storage_offsets[0], i.dest_offsets[0], i.lengths[0])
                  for i in items)  # fmt: skip


def _reshard_rank(fn, path: str) -> dict:
    """Load ``path`` (saved elsewhere) at stage 3 here; rebuild each owned master range from the
    saved pieces with ``fn`` and compare it with what ``load_checkpoint`` read."""
    import minizero
    from minizero.checkpoint.files import open_checkpoint

    torch.manual_seed(0)
    model, opt = minizero.parallelize(_models()["TinyGPT (lm_head tied to wte)"](), 3,
                                      lambda p: torch.optim.AdamW(p, lr=1e-3))  # fmt: skip
    minizero.load_checkpoint(path, model, opt)
    full = minizero.consolidate(path)  # every parameter whole, to cut the saved pieces from
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(open_checkpoint(path)[0]).read_metadata()
    bad = []
    for f in model.fragments:
        t = f.tensor  # what the optimizer steps: (numel,) fp32 master view, or the param
        chunks = md.state_dict_metadata[f"model/{f.name}"].chunks
        saved = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks)
        plan, err = guard(fn, saved, (f.start, f.end))
        if err is not None:
            return {"error": err, "bad": []}
        got = _apply(plan, saved, (f.start, f.end), full[f.name].reshape(-1))
        if not torch.equal(got, t.detach().cpu()):
            bad.append((f.name, saved, (f.start, f.end)))
    return {"error": None, "bad": bad, "frags": len(model.fragments)}


def _save_rank(path: str) -> None:
    import minizero

    torch.manual_seed(0)
    model, opt = minizero.parallelize(_models()["TinyGPT (lm_head tied to wte)"](), 2,
                                      lambda p: torch.optim.AdamW(p, lr=1e-3))  # fmt: skip
    minizero.save_checkpoint(path, model, opt)


def check_read_plan(fn) -> None:
    """Lesson 07, exercise 2: ``fn(saved, want)`` must say which saved pieces hold the elements
    ``want`` and where, as DCP's resharding does; then it rebuilds, on 3 ranks at stage 3, the
    ranges that a checkpoint saved on 2 ranks at stage 2 holds in other pieces."""
    name = getattr(fn, "__name__", "your function")
    values = torch.arange(60.0)
    for saved, want in _random_cases(300):
        plan, err = guard(fn, saved, want)
        if err is not None:
            raise CheckFailed(f"{name}(saved={saved}, want={want}) raised {err}")
        got = _apply(plan, saved, want, values)
        if not torch.equal(got, values[want[0] : want[1]]):
            raise CheckFailed(
                f"{name}(saved={saved}, want={want}) returned {plan}, which fills the wanted range "
                f"with {got.tolist()} instead of elements {want[0]}..{want[1] - 1}"
            )
        if sorted(tuple(p) for p in plan) != _dcp_plan(saved, want):
            raise CheckFailed(
                f"{name}(saved={saved}, want={want}) returned {plan}; DCP reads "
                f"{_dcp_plan(saved, want)} (one entry per overlapping piece, none for the others)"
            )
    with tempfile.TemporaryDirectory(prefix="minizero-check-") as tmp:
        try:
            timeout = check_timeout(TIMEOUT)
            launch(_save_rank, 2, f"{tmp}/ckpt", backend="gloo", timeout=timeout, verbose=False)
            results = graded_launch(_reshard_rank, 3, fn, f"{tmp}/ckpt", backend="gloo",
                                    timeout=timeout, verbose=False)  # fmt: skip
        except LaunchError as e:
            raise CheckFailed(f"the ranks did not finish: {e}") from e
    for rank, res in enumerate(results):
        if res["error"]:
            raise CheckFailed(f"{name} raised on rank {rank}: {res['error']}")
        if res["bad"]:
            n, saved, want = res["bad"][0]
            raise CheckFailed(f"rank {rank} of 3: {n!r} range {want} from pieces {saved} differs")
    frags = sum(r["frags"] for r in results)
    report_pass(f"{name}: 300 random layouts, planned as DCP plans them; {frags} ranges of TinyGPT "
                "saved at stage 2 on 2 ranks, rebuilt at stage 3 on 3 ranks, equal what "
                "load_checkpoint read")  # fmt: skip


# -- the lesson's crash ---------------------------------------------------------------------------
def crash_during_next_save(message: str = "this rank lost power") -> None:
    """In this rank only: the next ``save_checkpoint`` raises ``RuntimeError(message)`` here while
    writing, once every other rank has finished its part (so the rank to blame is this one)."""

    from minizero.checkpoint import layout as checkpoint_layout

    me, world = dist.get_rank(), dist.get_world_size()

    def die(self, plan, planner):
        part, deadline = Path(self.path), time.monotonic() + 60
        while not all((part / f"rank-{r}.done").exists() for r in range(world) if r != me):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise RuntimeError(message)

    checkpoint_layout.Writer.write_data = die
