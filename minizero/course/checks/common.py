"""What the lessons' check cells call. Used by lessons 00 (00_collectives) and 01 (01_ddp).

A check runs the student's code on real ranks (``minizero.launch``, gloo on CPU or one rank per GPU
over NCCL), next to the reference implementations: ``torch.distributed`` itself, PyTorch's
``DistributedDataParallel``, minizero's own classes, and one process on the whole batch. It prints
``PASS`` with what was compared, or raises :class:`CheckFailed` saying what differs: which tensor,
which parameter, which step, on which rank, by how much, and what usually causes that.

Each rank catches the student's exceptions and returns them as data, so that the check can say
"your function raised NotImplementedError on rank 0" instead of showing the launcher's traceback.
"""

from __future__ import annotations

import os
import tempfile
import threading
import traceback

import torch
import torch._dynamo  # noqa: F401  imported once here: forked ranks inherit it (else seconds each)
import torch.distributed as dist

from minizero import collectives as C
from minizero.launch import LaunchError, gpu_count, launch

TIMEOUT = 120.0  # seconds: a student's hung collective becomes a CheckFailed, not a stuck cell


class CheckFailed(AssertionError):
    """A lesson exercise does not match the reference; the message says where and by how much."""


# -- what every lesson uses ------------------------------------------------------------------------
def default_nprocs() -> int:
    """One rank per GPU where there are at least two GPUs, else 2 ranks on the CPU (gloo)."""
    n = gpu_count()
    return n if n >= 2 else 2


def rank_device() -> torch.device:
    """Inside a rank: this rank's GPU under NCCL (the launcher has set it), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


class Progress:
    """Passed to a rank function as ``progress``: rank 0 calls ``progress.tick()`` after each unit
    of work and the notebook's bar (see :func:`launch_with_progress`) moves. Same machine only."""

    def __init__(self, path: str):
        self.path = path

    def tick(self, n: int = 1) -> None:
        if dist.get_rank() == 0:
            with open(self.path, "ab") as f:
                f.write(b"." * n)


def launch_with_progress(fn, nprocs: int, *args, total: int, desc: str = "", **kwargs) -> list:
    """``minizero.launch(fn, nprocs, *args, progress=Progress(...), **kwargs)`` with a tqdm bar
    (a widget in Jupyter, text elsewhere) that follows rank 0's ``progress.tick()`` calls."""
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="minizero-progress-") as tmp:
        progress = Progress(os.path.join(tmp, "ticks"))
        bar = tqdm(total=total, desc=desc)
        stop = threading.Event()

        def follow() -> None:  # a thread of the parent: the launch itself runs in the caller
            while True:
                done = stop.wait(0.2)
                ticks = os.path.getsize(progress.path) if os.path.exists(progress.path) else 0
                bar.update(min(ticks, total) - bar.n)
                if done:
                    return

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        try:
            return launch(fn, nprocs, *args, progress=progress, **kwargs)
        finally:
            stop.set()
            watcher.join()
            bar.close()


def guard(fn, *args, **kwargs):
    """Run student code; return (value, None) or (None, short error text naming the line)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]  # drop this frame
        where = f" (at line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        return None, f"{type(e).__name__}: {e}{where}"


def launch_check(fn, nprocs: int | None, *args) -> list:
    """``launch(fn, nprocs, *args)`` for a check: a hang or a crash becomes a CheckFailed."""
    nprocs = nprocs or default_nprocs()
    try:
        return launch(fn, nprocs, *args, timeout=TIMEOUT, verbose=False)
    except LaunchError as e:
        raise CheckFailed(
            f"the ranks did not finish: {str(e).splitlines()[0]}\nEvery rank must issue the same "
            "collectives in the same order, or they wait for each other forever."
        ) from e


def report_pass(msg: str) -> None:
    """What a check prints when everything matched."""
    print(f"PASS  {msg}")


# -- lesson 00: all-reduce = reduce-scatter + all-gather -------------------------------------------
SHAPES = [(1,), (2,), (7,), (12,), (1001,), (3, 5), (4097,)]


def _rs_ag_rank(fn) -> dict:
    rank, dev = dist.get_rank(), rank_device()
    out = {"info": run_info(), "cases": []}
    for i, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(1000 * i + rank)
        # integer values: every summation order gives the same floats, so equality is exact
        t = torch.randint(-50, 50, shape, generator=g).float().to(dev)
        want = t.clone()
        dist.all_reduce(want)  # the reference: torch.distributed itself
        mine = t.clone()
        with C.CommLedger() as ledger:
            ret, err = guard(fn, mine, group=None)
        ops = [r.op for r in ledger.records]
        case = {"shape": shape, "error": err, "ops": ops, "volume": ledger.volume_elements}
        if err is None:
            case["same_object"] = ret is None or ret is mine
            case["got"] = mine.cpu()
            case["want"] = want.cpu()
            case["ret_ok"] = ret is not None and torch.equal(ret.cpu(), want.cpu())
        out["cases"].append(case)
        if err is not None:
            break  # the other ranks may now be out of step; stop here on every rank alike
    return out


def check_all_reduce_via_rs_ag(fn, nprocs: int | None = None) -> None:
    """Lesson 00: ``fn(t, group=None)`` must sum ``t`` over the ranks in place, exactly as
    ``dist.all_reduce`` does, with one reduce-scatter and one all-gather (minizero.collectives)."""
    results = launch_check(_rs_ag_rank, nprocs, fn)
    world = len(results)
    name = getattr(fn, "__name__", "your function")
    for rank, res in enumerate(results):
        for case in res["cases"]:
            shape = tuple(case["shape"])
            n = torch.Size(shape).numel()
            where = f"for a tensor of shape {shape} on rank {rank} (world size {world})"
            if case["error"]:
                raise CheckFailed(f"{name} raised {where}: {case['error']}")
            got, want = case["got"], case["want"]
            if not torch.equal(got, want):
                if case["ret_ok"]:
                    raise CheckFailed(
                        f"{name} returned the right sum {where} but left `t` "
                        "unchanged: like dist.all_reduce, it must update t in place "
                        "(e.g. t.copy_(...))."
                    )
                if got.shape != want.shape:
                    raise CheckFailed(f"{name} changed the shape of t {where}: {tuple(got.shape)}")
                bad = (got != want).reshape(-1).nonzero().reshape(-1)
                k = int(bad[0])
                diff = (got - want).abs().max().item()
                hint = ""
                if n % world:
                    hint = (
                        f" {n} element(s) do not split evenly over {world} ranks: pad the flat "
                        f"tensor to a multiple of the world size ({-(-n // world) * world}), "
                        "then drop the padding."
                    )
                raise CheckFailed(
                    f"wrong sum {where}: element {k} (flat index) is {got.reshape(-1)[k].item():g}"
                    f", dist.all_reduce gives {want.reshape(-1)[k].item():g}; {len(bad)} of {n} "
                    f"elements differ, max |difference| {diff:g}.{hint}"
                )
            if case["ops"] != ["reduce_scatter", "all_gather"]:
                raise CheckFailed(
                    f"{name} issued {case['ops'] or 'no collective'} {where} through "
                    "minizero.collectives; expected exactly ['reduce_scatter', 'all_gather'] "
                    "(call minizero.collectives.reduce_scatter and .all_gather, not "
                    "torch.distributed, so that the CommLedger sees them)"
                )
    info = results[0]["info"]
    report_pass(
        f"{name} equals dist.all_reduce on {len(SHAPES)} shapes, {world} ranks "
        f"({describe(info)}), each with one reduce_scatter + one all_gather"
    )


# -- lesson 01: data-parallel gradients ------------------------------------------------------------
STEPS, ROWS_PER_RANK, LR = 3, 4, 0.1  # global batch: ROWS_PER_RANK * world


def _mlp(dev: torch.device) -> torch.nn.Module:
    from minizero.models import MLP

    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return MLP().to(dev)


def _train(make, rank: int, world: int, dev: torch.device, sync=None, grad_marks: bool = False):
    """Train ``make(model)`` for STEPS steps of SGD; record grads (after sync) and params.

    ``grad_marks``: mark "grad NAME" on the ledger's timeline as each gradient becomes ready
    (hooks registered after the model's own, so they run just after them)."""
    from minizero.data import synthetic_batch

    model = make(_mlp(dev))
    inner = getattr(model, "module", model)
    if grad_marks:
        for name, p in inner.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: C.mark(f"grad {name}"))
    opt = torch.optim.SGD(inner.parameters(), lr=LR)
    trace = {"grads": [], "params": [], "moved": [], "ledgers": []}
    for step in range(STEPS):
        batch = ROWS_PER_RANK * dist.get_world_size()  # the same global batch for every variant
        x, y = synthetic_batch("mlp", batch, step, rank=rank, world=world, device=dev)
        before = [p.detach().clone() for p in inner.parameters()]
        with C.CommLedger() as ledger:
            C.mark("forward start")
            loss = model(x, y)
            C.mark("backward start")
            loss.backward()
            if sync is not None:
                sync(inner)
        trace["moved"].append(
            [
                n
                for (n, p), b in zip(inner.named_parameters(), before, strict=True)
                if not torch.equal(p.detach(), b)
            ]
        )
        trace["ledgers"].append(ledger)
        trace["grads"].append(
            {
                n: p.grad.detach().cpu().clone()
                for n, p in inner.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
        opt.zero_grad()
        trace["params"].append({n: p.detach().cpu().clone() for n, p in inner.named_parameters()})
    return trace


def _ddp_rank(student, kind: str, bucket_cap_mb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from minizero.ddp import DDP, NaiveDDP

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    refs = {"one process on the whole batch": _train(lambda m: m, 0, 1, dev)}
    ids = [dev.index] if dev.type == "cuda" else None
    refs["torch DistributedDataParallel"] = _train(
        lambda m: DistributedDataParallel(m, device_ids=ids, bucket_cap_mb=bucket_cap_mb),
        rank,
        world,
        dev,
    )
    if kind == "naive":
        refs["minizero.ddp.NaiveDDP"] = _train(lambda m: NaiveDDP(m), rank, world, dev)
        mine, err = guard(_train, lambda m: m, rank, world, dev, sync=student)
    else:
        refs["minizero.ddp.DDP"] = _train(
            lambda m: DDP(m, bucket_cap_mb=bucket_cap_mb), rank, world, dev
        )
        make = lambda m: student(m, bucket_cap_mb=bucket_cap_mb)
        mine, err = guard(_train, make, rank, world, dev, grad_marks=True)
    local = _train(lambda m: m, rank, world, dev)  # no communication at all: for the hints
    out = {"info": run_info(), "error": err, "refs": refs, "mine": None, "local": local}
    if mine is not None:
        led = mine.pop("ledgers")
        mine["records"] = [[(r.op, r.numel, r.async_op, r.index) for r in L.records] for L in led]
        mine["marks"] = [L.marks for L in led]
        out["mine"] = mine
    for r in [*refs.values(), local]:
        r.pop("ledgers")
    out["psi"] = sum(p.numel() for p in _mlp(dev).parameters())
    out["n_params"] = len(list(_mlp(dev).parameters()))
    return out


def _compare(mine: dict, refs: dict, local: dict, rank: int, world: int) -> None:
    for step in range(STEPS):
        if mine["moved"][step]:
            raise CheckFailed(
                f"step {step}, rank {rank}: parameters {mine['moved'][step]} changed during "
                "backward. Only gradients may be communicated: the hook's argument is the "
                "parameter itself, its gradient is param.grad."
            )
        for what in ("grads", "params"):
            for ref_name, ref in refs.items():
                for name, want in ref[what][step].items():
                    got = mine[what][step].get(name)
                    label = "gradient" if what == "grads" else "parameter after optimizer.step()"
                    if got is None:
                        raise CheckFailed(f"step {step}, rank {rank}: {name} has no gradient")
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                        diff = (got - want).abs().max().item()
                        ratio = (got * want).sum() / (want * want).sum().clamp_min(1e-30)
                        hint = ""
                        if what == "grads" and abs(ratio - world) < 0.05 * world:
                            hint = (
                                f" Yours is {ratio:.2f}x the reference: the all-reduce sums; "
                                f"divide by the world size ({world}) to average."
                            )
                        elif what == "grads" and torch.equal(got, local["grads"][step][name]):
                            hint = (
                                f" It is rank {rank}'s own local gradient: nothing was averaged "
                                "into p.grad. (A post-accumulate-grad hook receives the "
                                "PARAMETER; all-reducing that argument averages the weights, "
                                "not the gradient.)"
                            )
                        raise CheckFailed(
                            f"step {step}, rank {rank}, {label} of {name!r}: max |yours - "
                            f"{ref_name}| = {diff:.3g} (tolerance 1e-6 + 1e-4 * |ref|).{hint}"
                        )


def _check_ddp(student, kind: str, nprocs: int | None, bucket_cap_mb: float) -> tuple:
    results = launch_check(_ddp_rank, nprocs, student, kind, bucket_cap_mb)
    world = len(results)
    name = getattr(student, "__name__", "your code")
    for rank, res in enumerate(results):
        if res["error"]:
            raise CheckFailed(f"{name} raised on rank {rank} (world size {world}): {res['error']}")
        _compare(res["mine"], res["refs"], res["local"], rank, world)
    res = results[0]
    psi = res["psi"]
    for step, recs in enumerate(res["mine"]["records"]):
        moved = sum(2 * numel for op, numel, _, _ in recs if op == "all_reduce")
        others = sorted({op for op, *_ in recs if op != "all_reduce"})
        if others or moved != 2 * psi:
            raise CheckFailed(
                f"step {step}: the CommLedger saw {len(recs)} collectives moving {moved} elements"
                f"{' and ' + str(others) if others else ''}; DDP moves 2Ψ = {2 * psi} (one "
                "all-reduce of every gradient element, through minizero.collectives.all_reduce)"
            )
    return res, world, name


def check_allreduce_gradients(fn, nprocs: int | None = None) -> None:
    """Lesson 01, naive DDP: ``fn(model, group=None)``, called after ``loss.backward()``, must
    leave in every ``p.grad`` the average over the ranks, as one process on the whole batch gets."""
    res, world, name = _check_ddp(fn, "naive", nprocs, 25)
    refs = ", ".join(res["refs"])
    report_pass(
        f"{name}: gradients and parameters equal {refs} for {STEPS} steps on {world} ranks "
        f"({describe(res['info'])}); moved 2Ψ = {2 * res['psi']} elements per step"
    )


def check_bucketed_ddp(cls, nprocs: int | None = None, bucket_cap_mb: float = 0.002) -> None:
    """Lesson 01, bucketed DDP: ``cls(module, bucket_cap_mb=...)`` must give the same gradients as
    the references, one all-reduce per bucket, and start some of them before backward ends."""
    res, world, name = _check_ddp(cls, "bucketed", nprocs, bucket_cap_mb)
    for step, (recs, marks) in enumerate(
        zip(res["mine"]["records"], res["mine"]["marks"], strict=True)
    ):
        ends = [i for i, label in marks if label == "backward end"]
        if len(ends) != 1:
            raise CheckFailed(
                f"step {step}: expected one 'backward end' mark, found {len(ends)} "
                "(keep the provided lines that queue _finish and call mark())"
            )
        if not all(a for _, _, a, _ in recs):
            raise CheckFailed(
                f"step {step}: some all-reduces were blocking; start each bucket's "
                "all-reduce with async_op=True and wait for it in _finish()"
            )
        if len(recs) >= res["n_params"] and res["n_params"] > 1:
            raise CheckFailed(
                f"step {step}: {len(recs)} all-reduces for {res['n_params']} "
                "parameters: all-reduce each bucket's flat buffer once, not each "
                "gradient"
            )
        last_grad = max(i for i, label in marks if label.startswith("grad "))
        early = [i for _, _, _, i in recs if i < last_grad]
        if not early:
            raise CheckFailed(
                f"step {step}: none of the {len(recs)} bucket all-reduces was issued before the "
                "last gradient was ready, so none overlaps backward. Start each one from the "
                "hook, as soon as its bucket's last gradient is in."
            )
    report_pass(
        f"{name}: gradients and parameters equal {', '.join(res['refs'])} for {STEPS} steps on "
        f"{world} ranks ({describe(res['info'])}); {len(res['mine']['records'][0])} bucket "
        f"all-reduces per step, {len(early)} issued while backward still ran; moved 2Ψ = "
        f"{2 * res['psi']} elements per step"
    )
