"""What the check cells of lessons 05 (05_all_stages) and 06 (06_myths) call.

Same contract as :mod:`minizero.checks`: each check runs on real ranks (``minizero.launch``: gloo on
CPU, or one rank per GPU over NCCL), prints ``PASS`` with what was compared, or raises
:class:`~minizero.checks.CheckFailed` saying what is wrong.

* Lesson 05, ``check_predict_peak``: the student's prediction of the bytes one rank holds at the
  peak of a training step, against ``MemoryMeter`` on real ranks, for a few configurations
  (stage, activation checkpointing). The model-state part must match the measurement closely; the
  total within ``PEAK_RTOL``.
* Lesson 06, ``check_owned_tensors``: a ZeroRedundancyOptimizer-like step (each rank owns whole
  tensors, updates them, broadcasts them) against one process, with AdamW and with Adafactor.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.budget import checkpoint_blocks
from minizero.checks import CheckFailed, default_nprocs, describe, rank_device, run_info
from minizero.launch import LaunchError, gpu_count, launch
from minizero.memory import MemoryMeter, format_bytes, model_state_bytes
from minizero.models import GPTConfig, TinyGPT, count_params

TIMEOUT = 180.0  # seconds for a check's ranks
STATES_RTOL = 0.02  # model states: the formula is exact up to padding (N - 1 elements per buffer)
PEAK_RTOL = 0.15  # the whole peak: activations and temporaries are approximate


def _guard(fn, *args, **kwargs):
    """Run student code; return (value, None) or (None, 'ExcName: message (at line n: ...)')."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[1:]
        where = f" (at line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        return None, f"{type(e).__name__}: {e}{where}"


def on_gpus(world: int) -> bool:
    """Whether ``launch`` runs ``world`` ranks one per GPU over NCCL (its "auto" backend)."""
    return dist.is_nccl_available() and 0 < world <= gpu_count()


def _launch(fn, nprocs: int | None, *args) -> list:
    try:
        return launch(fn, nprocs or default_nprocs(), *args, timeout=TIMEOUT, verbose=False)
    except LaunchError as e:
        raise CheckFailed(f"the ranks did not finish: {str(e).splitlines()[0]}") from e


# -- lesson 05: predict the peak -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PeakCase:
    """One training configuration whose peak the student predicts (bf16, AdamW, TinyGPT)."""

    cfg: GPTConfig  # the model; every micro-batch is cfg.block_size tokens long
    micro_batch: int  # b: sequences per rank per step
    stage: int  # 0 (DDP), 1, 2 or 3
    checkpointing: bool  # every transformer block under torch.utils.checkpoint
    world: int = 2  # N: ranks

    @property
    def seq_len(self) -> int:
        return self.cfg.block_size

    def describe(self) -> str:
        c = self.cfg
        ck = ", checkpointing" if self.checkpointing else ""
        return (
            f"stage {self.stage}{ck}, N={self.world}, L={c.n_layer} h={c.n_embd} a={c.n_head} "
            f"V={c.vocab_size} s={self.seq_len} b={self.micro_batch}"
        )


def peak_cases(world: int, *, gpu: bool = False) -> list[PeakCase]:
    """The configurations the check measures on ``world`` ranks: activations and model states of
    comparable size, so that a missing or wrongly divided term shows. ``gpu``: longer micro-batches,
    so that the CUDA allocator's rounding stays small beside them."""
    cfg = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)
    b = 16 if gpu else 2
    return [
        PeakCase(cfg=cfg, micro_batch=b, stage=0, checkpointing=False, world=world),
        PeakCase(cfg=cfg, micro_batch=b, stage=2, checkpointing=False, world=world),
        PeakCase(cfg=cfg, micro_batch=b, stage=1, checkpointing=True, world=world),
        PeakCase(cfg=cfg, micro_batch=b, stage=3, checkpointing=True, world=world),
    ]


def _baseline(dev: torch.device) -> int:
    """CUDA: bytes this process holds before the model exists (cuBLAS workspaces and the like,
    created here by a throwaway bf16 forward and backward); 0 on CPU, where the meter counts only
    the storages the step touches."""
    if dev.type != "cuda":
        return 0
    x = torch.randn(4, 8, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.nn.functional.scaled_dot_product_attention(x @ w, x, x, is_causal=True)
    y.float().sum().backward()
    del x, w, y
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev)


def measure_peak(case: PeakCase) -> dict:
    """Inside a rank: one warm-up step, then one step under ``MemoryMeter``. Returns the peak, the
    model states held at the end of backward, and the split at the peak (CPU only, else None).
    On a GPU the peak counts from what the process held before the model existed."""
    from minizero.parallelize import parallelize

    dev = rank_device()
    base = _baseline(dev)
    torch.manual_seed(0)
    model = TinyGPT(case.cfg)
    if case.checkpointing:
        checkpoint_blocks(model)
    psi = count_params(model)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)  # no foreach temporaries
    net, opt = parallelize(model, case.stage, adamw, precision="bf16", bucket_cap_mb=0.05)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    idx = torch.randint(0, case.cfg.vocab_size, (case.micro_batch, case.seq_len), generator=g)
    idx = idx.to(dev)  # (b, s) token ids, this rank's own
    net(idx, idx).backward()
    opt.step()
    opt.zero_grad()
    with MemoryMeter(net, opt, device=dev) as meter:
        meter.reset_peak()
        net(idx, idx).backward()
        states = model_state_bytes(net, opt)
        opt.step()
        opt.zero_grad()
        mark = meter.mark("step")
    return dict(
        psi=psi, peak=mark["peak"] - base, states=sum(states.values()), at_peak=mark["at_peak"]
    )


def measure_peaks(cases: list[PeakCase]) -> dict:
    """Inside a rank: :func:`measure_peak` for each case, and where it ran."""
    return dict(info=run_info(), peaks=[measure_peak(c) for c in cases])


def _diagnose(case: PeakCase, got: dict, m: dict) -> str:
    """What a prediction that misses the measured peak most likely left out or got wrong."""
    states, peak = m["states"], m["peak"]
    rest = peak - states  # activations, temporaries and communication buffers at the peak
    act = got["activations"]
    close = lambda x, y: abs(x - y) <= 0.15 * max(abs(y), 1)
    if act <= 0.05 * rest:
        return (
            "your activations are (almost) zero: at the peak a rank also holds what forward saved"
        )
    if case.world > 1 and close(act * case.world, rest):
        return (
            f"your activations look divided by N = {case.world}: every rank runs the whole model "
            "on its own micro-batch, so ZeRO divides the model states only, never the activations"
        )
    if act > rest:
        if case.checkpointing:
            return (
                "too many activations: with checkpointing a block keeps only its input (2sbh); "
                "its inside is rebuilt in backward, one block at a time"
            )
        return "too many activations: count each layer's saved bytes once (what section 3 measured)"
    if case.checkpointing:
        return (
            "too few activations: with checkpointing, backward rebuilds one block at a time, and "
            "that block's activations are alive with the kept inputs at that moment"
        )
    return "too few activations: every layer keeps its saved tensors until its backward"


def check_predict_peak(
    fn,
    nprocs: int | None = None,
    cases: list[PeakCase] | None = None,
    *,
    measured: dict | None = None,
) -> None:
    """Lesson 05: ``fn(case) -> {"model_states": bytes, "activations": bytes}`` against the peak
    measured on real ranks for each of ``cases`` (default :func:`peak_cases`). ``measured``: rank
    0's :func:`measure_peaks` of the same cases, to compare without launching again (tests)."""
    name = getattr(fn, "__name__", "your function")
    world = nprocs or default_nprocs()
    cases = cases if cases is not None else peak_cases(world, gpu=on_gpus(world))
    predicted = []
    for case in cases:  # first the predictions: a function that raises fails before any launch
        got, err = _guard(fn, case)
        if err is not None:
            raise CheckFailed(f"{name} raised for {case.describe()}: {err}")
        if not isinstance(got, dict) or set(got) != {"model_states", "activations"}:
            raise CheckFailed(
                f"{name} must return a dict with keys 'model_states' and 'activations' (bytes), "
                f"got {got!r}"
            )
        predicted.append({k: float(v) for k, v in got.items()})
    res = measured or _launch(measure_peaks, world, cases)[0]  # rank 0's; the others: the same
    where = describe(res["info"])
    rows = []
    for case, got, m in zip(cases, predicted, res["peaks"], strict=True):
        total = got["model_states"] + got["activations"]
        rows.append(
            f"  {case.describe():58} predicted {format_bytes(total):>10}, "
            f"measured {format_bytes(m['peak']):>10} ({(total - m['peak']) / m['peak']:+.0%})"
        )
        if abs(got["model_states"] - m["states"]) > STATES_RTOL * m["states"]:
            raise CheckFailed(
                f"{case.describe()}: your model states are {format_bytes(got['model_states'])}, "
                f"the rank held {format_bytes(m['states'])} = {m['states'] / m['psi']:.2f} bytes "
                f"per parameter (Ψ = {m['psi']:,}): which of parameters, gradients and optimizer "
                f"states does stage {case.stage} divide by N?"
            )
        if abs(total - m["peak"]) > PEAK_RTOL * m["peak"]:
            split = ""
            if m["at_peak"] is not None:
                a = m["at_peak"]
                split = (
                    f" At the peak it held model states {format_bytes(m['states'])}, communication "
                    f"buffers {format_bytes(a['comm'])}, activations and temporaries "
                    f"{format_bytes(a['activations'])}."
                )
            raise CheckFailed(
                f"{case.describe()}: you predict a peak of {format_bytes(total)}, the rank "
                f"measured {format_bytes(m['peak'])} ({(total - m['peak']) / m['peak']:+.0%}; "
                f"allowed ±{PEAK_RTOL:.0%}).{split} Likely: {_diagnose(case, got, m)}."
            )
    print("\n".join(rows))
    print(
        f"PASS  {name} predicts the peak of {len(cases)} configurations within ±{PEAK_RTOL:.0%} "
        f"and their model states within ±{STATES_RTOL:.0%}, measured on {where}"
    )


# -- lesson 06: whole tensors owned by ranks (ZeroRedundancyOptimizer's layout) --------------------
OWNED_STEPS = 3
OWNED_OPTIMIZERS = {  # name -> builder; Adafactor is not elementwise (row and column statistics)
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "Adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
}
OWNER_LISTS = [  # (numels, world): sizes that a careless assignment balances badly
    ([10, 1, 10, 1, 10, 1, 10, 1], 2),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
    ([100] + [1] * 100, 2),
    ([7] * 5, 4),
]


def _check_owners(assign_owners, numels: list[int], world: int, name: str) -> list[int]:
    owners, err = _guard(assign_owners, list(numels), world)
    where = f"{name}({len(numels)} tensors, world={world})"
    if err is not None:
        raise CheckFailed(f"{where} raised: {err}")
    if not isinstance(owners, (list, tuple)) or len(owners) != len(numels):
        raise CheckFailed(f"{where} must return a list of {len(numels)} ranks, got {owners!r}")
    if any(not isinstance(o, int) or not 0 <= o < world for o in owners):
        raise CheckFailed(
            f"{where} returned {list(owners)}: every owner must be a rank in 0..{world - 1}"
        )
    load = [0] * world
    for n, o in zip(numels, owners):
        load[o] += n
    total, bound = sum(numels), sum(numels) / world + max(numels)
    worst = max(range(world), key=load.__getitem__)
    if load[worst] > bound:
        raise CheckFailed(
            f"{where}: rank {worst} owns {load[worst]:,} of {total:,} elements "
            f"({load[worst] / total:.0%}; loads {load}). Whole tensors can be balanced so that no "
            f"rank owns more than total/N + the largest tensor = {bound:,.0f}: give each tensor to "
            "the least-loaded rank, largest tensors first"
        )
    return list(owners)


def _owned_rank(owned_step, owners: list[int], opt_name: str) -> dict:
    """Inside a rank: TinyGPT tiny, gradients averaged by an all-reduce per tensor (DDP's 2Ψ), then
    the student's ``owned_step``; one process on the whole batch beside it."""
    from minizero.data import synthetic_batch
    from minizero.memory import model_state_bytes

    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    make = OWNED_OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.tiny()).to(dev)
    torch.manual_seed(0)
    ref = TinyGPT(GPTConfig.tiny()).to(dev)
    params, names = list(model.parameters()), [n for n, _ in model.named_parameters()]
    opt = make([p for p, o in zip(params, owners) if o == rank])
    ref_opt = make(ref.parameters())
    out = dict(error=None, steps=[], volume=[], ops=[], opt_bytes=0, psi=count_params(model))
    for step in range(OWNED_STEPS):
        x, y = synthetic_batch("gpt", 4 * world, step, rank=rank, world=world, device=dev)
        before = [p.detach().cpu().clone() for p in params]
        model(x, y).backward()
        with C.CommLedger() as ledger:
            for p in params:  # DDP: every rank gets the average gradient of every tensor
                C.all_reduce(p.grad, tag="ddp")
                p.grad.div_(world)
            _, err = _guard(owned_step, params, list(owners), opt)
        if err is not None:
            out["error"] = err
            return out
        for p in params:
            p.grad = None
        gx, gy = synthetic_batch("gpt", 4 * world, step, device=dev)
        ref(gx, gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["steps"].append(
            dict(
                mine=[p.detach().cpu().clone() for p in params],
                before=before,
                want=[p.detach().cpu().clone() for p in ref.parameters()],
            )
        )
        out["volume"].append(ledger.volume_elements)
        out["ops"].append(sorted({r.op for r in ledger.records}))
    out["opt_bytes"] = model_state_bytes(None, opt)["optimizer"]
    out["names"] = names
    return out


def _compare_owned(results: list[dict], owners: list[int], opt_name: str) -> None:
    psi = results[0]["psi"]
    for step in range(OWNED_STEPS):
        for rank, res in enumerate(results):
            s = res["steps"][step]
            for k, (mine, want) in enumerate(zip(s["mine"], s["want"], strict=True)):
                if torch.allclose(mine, want, rtol=1e-3, atol=1e-4):  # a wrong step: ~lr = 1e-2
                    continue
                owner = owners[k]
                where = (
                    f"{opt_name}, step {step}, rank {rank}: parameter {res['names'][k]!r} (owned "
                    f"by rank {owner})"
                )
                if torch.equal(mine, s["before"][k]) and owner != rank:
                    raise CheckFailed(
                        f"{where} still holds its value from before the step: only its owner "
                        f"updates it, so after the update every rank must receive it from rank "
                        f"{owner} (a broadcast with src={owner})"
                    )
                if torch.equal(mine, s["before"][k]):
                    raise CheckFailed(
                        f"{where}: the owner's update was overwritten by a copy from before the "
                        "step: broadcast each tensor after the optimizer's step, from its owner"
                    )
                diff = (mine - want).abs().max().item()
                raise CheckFailed(
                    f"{where} differs from one process on the whole batch by up to {diff:.3g}: "
                    "step the optimizer (it holds this rank's tensors only), then broadcast every "
                    "tensor from its owner"
                )
        ops, volume = results[0]["ops"][step], results[0]["volume"][step]
        if ops != ["all_reduce", "broadcast"] or volume != 3 * psi:
            raise CheckFailed(
                f"{opt_name}, step {step}: the ledger saw {ops or 'nothing'} moving "
                f"{volume / psi:.2f}Ψ; DDP's all-reduce (2Ψ) and one broadcast of each tensor from "
                "its owner (Ψ) make 3Ψ. Broadcast with minizero.broadcast, so that the ledger sees "
                "it, once per tensor"
            )


def check_owned_tensors(assign_owners, owned_step, nprocs: int | None = None) -> None:
    """Lesson 06: ``assign_owners(numels, world) -> [rank per tensor]`` must balance whole tensors;
    ``owned_step(params, owners, optimizer)`` (gradients already averaged, ``optimizer`` built on
    this rank's tensors) must train as one process does, with AdamW and Adafactor, moving 3Ψ."""
    names = f"{getattr(assign_owners, '__name__', 'assign_owners')}"
    step_name = getattr(owned_step, "__name__", "owned_step")
    for numels, w in OWNER_LISTS:
        _check_owners(assign_owners, numels, w, names)
    world = nprocs or default_nprocs()
    torch.manual_seed(0)
    numels = [p.numel() for p in TinyGPT(GPTConfig.tiny()).parameters()]
    owners = _check_owners(assign_owners, numels, world, names)
    lines = []
    for opt_name in OWNED_OPTIMIZERS:
        results = _launch(_owned_rank, world, owned_step, owners, opt_name)
        for rank, res in enumerate(results):
            if res["error"] is not None:
                raise CheckFailed(
                    f"{step_name} raised on rank {rank} with {opt_name}: {res['error']}"
                )
        _compare_owned(results, owners, opt_name)
        per_rank = ", ".join(format_bytes(r["opt_bytes"]) for r in results)
        lines.append(f"{opt_name}: optimizer states per rank {per_rank}")
    print("\n".join(lines))
    print(
        f"PASS  {names} balances whole tensors; {step_name} trains TinyGPT as one process does "
        f"with AdamW and with Adafactor for {OWNED_STEPS} steps on {world} ranks, moving 3Ψ per "
        "step (all-reduce 2Ψ + broadcast Ψ)"
    )
