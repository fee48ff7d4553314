"""ZeRO++ measured: ``python -m minizero bench zeropp [--nprocs 4 --node-size 2 --steps 20]``.
For lesson 08 (beyond one node); the library side is minizero/zeropp.py (``ZeROPlusPlus``, ZeRO3
with ``reshard_after_forward``, ``quantize_weights``: SecondaryShards, QuantizedGather and the
block quantiser). Wang et al., arXiv 2306.10209.

:func:`measure` trains the same TinyGPT at stage 3 under each configuration on gloo ranks and
reads, on the last step, per rank: bytes all-gathered in forward and in backward per group, the
bytes of backward that cross a node boundary (``CommLedger.node_bytes``, the ring model of
minizero/analysis/topology.py, nodes = blocks of ``node_size`` consecutive ranks), the bytes
reduce-scattered, and the model-state bytes that forward leaves behind for backward (hpZ's
cost). Every configuration's loss per step is kept, to set qwZ's against the unquantised run's.

:func:`unit_errors` measures qwZ's quantisation error per unit (what forward sees, against the
full-precision weights). qgZ (§3.3) is built (``quantize_gradients=True``: one all-to-all of
int8 blocks, measured above) and its schemes are *simulated* by :func:`qgz_simulation`: every
rank's gradient quantised block-wise (int8, int4) and dequantised before it is summed, in one hop
(what minizero builds), in ZeRO++'s two hierarchical hops, and as a ring would (the partial sum
quantised again at each of the N-1 hops), against the exact sum.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist

import minizero
from minizero.analysis.ledger import CommLedger
from minizero.analysis.memory import format_bytes, model_state_bytes
from minizero.analysis.topology import ring_bytes
from minizero.models import GPTConfig, TinyGPT, synthetic_batch
from minizero.tools.cli import Parser, positive_int
from minizero.tools.report import header, measured_on, write_json
from minizero.units import assign_params, select_units
from minizero.zeropp import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise

GLOBAL_BATCH = 16


def configurations(world: int, node_size: int) -> dict[str, dict]:
    """name -> stage-3 options: hpZ's three settings (the int one when it is non-trivial) and
    qwZ against the unquantised gathers in fp32 and bf16."""
    out = {"hpZ True (ZeRO-3)": {"reshard_after_forward": True},
           "hpZ False": {"reshard_after_forward": False}}  # fmt: skip
    if 1 < node_size < world and world % node_size == 0:
        out[f"hpZ {node_size}"] = {"reshard_after_forward": node_size}
    out["bf16 gathers"] = {"precision": "bf16"}
    out["qwZ (int8)"] = {"quantize_weights": True}
    out["qgZ (int8)"] = {"quantize_gradients": True}
    if f"hpZ {node_size}" in out:
        both = {"quantize_weights": True, "reshard_after_forward": node_size}
        out[f"qwZ + hpZ {node_size}"] = both
    return out


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig.tiny())


def _gathered(ledger: CommLedger) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger.records:
        if r.op == "all_gather":
            out[r.group] = out.get(r.group, 0) + r.nbytes
    return out


def _across(ledger: CommLedger, node_size: int) -> float:
    """Bytes this rank's all-gathers sent to another node (analysis/topology.py's ring model)."""
    return sum(ring_bytes(r.op, r.nbytes, r.ranks, r.rank, node_size)[1]
               for r in ledger.records if r.op == "all_gather")  # fmt: skip


def _rank(configs: dict[str, dict], steps: int, node_size: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, kw in configs.items():
        opt_fn = lambda ps: torch.optim.AdamW(ps, lr=3e-3)
        wrapped, opt = minizero.parallelize(model(), 3, opt_fn, **kw)
        losses, row = [], {}
        for step in range(steps):
            x, y = synthetic_batch("gpt", GLOBAL_BATCH, step, rank=rank, world=world, seq_len=32)
            last = step == steps - 1  # measured: forward's order is recorded by then
            fwd = CommLedger(node_size=node_size) if last else nullcontext()
            bwd = CommLedger(node_size=node_size) if last else nullcontext()
            before = model_state_bytes(wrapped, opt, include_comm=True)
            with fwd:
                loss = wrapped(x, y)
            between = model_state_bytes(wrapped, opt, include_comm=True)
            with bwd:
                loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)  # equal local batches: the global mean loss
            losses.append(float(mean) / world)
            if last:
                row = dict(
                    fwd=_gathered(fwd),
                    bwd=_gathered(bwd),
                    rs=sum(r.nbytes for r in bwd.records if r.op != "all_gather"),  # grads
                    across=_across(fwd, node_size) + _across(bwd, node_size),
                    bwd_across=_across(bwd, node_size),
                    held=sum(between.values()) - sum(before.values()),
                )
        out[name] = dict(row, losses=losses)
    return {"where": measured_on(), "rows": out}


def measure(world: int = 4, node_size: int = 2, steps: int = 20, timeout: float = 600) -> dict:
    """Every configuration on ``world`` gloo ranks: rank 0's figures (the payloads, memory and
    losses are the same on every rank), with ``across`` and ``bwd_across`` summed over the ranks
    (in a ring, only the ranks whose successor is on another node send across)."""
    configs = configurations(world, node_size)
    ranks = minizero.launch(
        _rank, world, configs, steps, node_size, backend="gloo", timeout=timeout, verbose=False
    )
    out = ranks[0]
    for name, row in out["rows"].items():
        for key in ("across", "bwd_across"):
            row[key] = sum(r["rows"][name][key] for r in ranks)
    return out


def unit_errors(net: torch.nn.Module, world: int) -> list[dict]:
    """qwZ's error per unit of ``net`` (stage 3's default units): each unit flat, padded to a
    multiple of N, split in N shards each quantised in blocks of 256 as the gather does."""
    groups, owners, _ = assign_params(net, select_units(net))
    names = {m: n or "(root)" for n, m in net.named_modules()}
    rows = []
    for params, owner in zip(groups, owners, strict=True):
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])  # (Ψ_unit,)
        padded = -(-flat.numel() // world) * world
        full = torch.zeros(padded)
        full[: flat.numel()] = flat
        back = torch.cat([dequantize_blockwise(*quantize_blockwise(s)).view(-1)
                          for s in full.view(world, -1)])  # fmt: skip
        err = back - full
        rows.append(dict(unit=names[owner], numel=flat.numel(),
                         max_rel=float(err.abs().max() / full.abs().max()),
                         rms_rel=float(err.norm() / full.norm())))  # fmt: skip
    return rows


def _qdq(x: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(x, QUANT_BLOCK, bits)).view(-1)


def qgz_simulation(world: int = 4, node_size: int = 2, seed: int = 0) -> dict:
    """qgZ simulated on one process. The N ranks' gradients (each from its slice of one global
    batch) are summed exactly, and as a quantised reduce-scatter would sum them, in int8 and in
    int4 (ZeRO++'s choice), with fp32 scales per block of 256 and sums in fp32:

    * ``all_to_all``: one hop; every rank's contribution quantised once;
    * ``hierarchical``: ZeRO++'s two hops: quantised, summed within each node (``node_size``
      consecutive ranks), the node's partial sum quantised again and summed across nodes;
    * ``ring``: what a ring reduce-scatter would do, the partial sum quantised at each of the
      N - 1 hops (the error ZeRO++ avoids by using all-to-all).

    Returns the relative errors of the sum (``max_rel``, ``rms_rel``) per scheme and width, and
    the bytes each rank sends in one reduce-scatter: fp32 ring (N-1)/N * 4Ψ, one-hop int8 and
    int4 (N-1)/N * (Ψ * bits / 8 + 4 * blocks), int4 if packed two to a byte."""
    net = model(seed)
    grads = []
    for r in range(world):
        x, y = synthetic_batch("gpt", GLOBAL_BATCH, 0, rank=r, world=world, seq_len=32)
        net.zero_grad()
        net(x, y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))  # (Ψ,)
    exact = torch.stack(grads).sum(0)  # (Ψ,)
    psi = exact.numel()
    rel = lambda s: dict(max_rel=float((s - exact).abs().max() / exact.abs().max()),
                         rms_rel=float((s - exact).norm() / exact.norm()))  # fmt: skip
    out = dict(psi=psi, world=world, node_size=node_size)
    for bits in (8, 4):
        a2a = torch.stack([_qdq(g, bits) for g in grads]).sum(0)
        nodes = [torch.stack([_qdq(g, bits) for g in grads[s : s + node_size]]).sum(0)
                 for s in range(0, world, node_size)]  # fmt: skip
        hier = torch.stack([_qdq(n, bits) for n in nodes]).sum(0)
        ring = _qdq(grads[0], bits)
        for g in grads[1:]:  # each hop: receive the quantised partial sum, add, quantise, send
            ring = _qdq(ring + g, bits)
        out[f"int{bits}"] = dict(all_to_all=rel(a2a), hierarchical=rel(hier), ring=rel(ring))
    blocks = -(-psi // world // QUANT_BLOCK) * world
    share = (world - 1) / world
    out.update(fp32_bytes=4 * psi * share, int8_bytes=(psi + 4 * blocks) * share,
               int4_bytes=(psi / 2 + 4 * blocks) * share)  # fmt: skip
    return out


def report(res: dict, node_size: int) -> str:
    """The table :func:`measure`'s figures make, per rank and step."""
    where, rows = res["where"], res["rows"]
    base = rows["hpZ True (ZeRO-3)"]["losses"]
    cols = ("fwd gather", "bwd gather", "bwd group", "bwd across", "held fwd->bwd", "grad reduce",
            "final loss")  # fmt: skip
    # gather columns: the payload S of the all-gathers of one step, per rank; "bwd across": bytes
    # backward's all-gathers send over a node boundary, all ranks together (the ring model);
    # "grad reduce": the payload of the gradients' reduce-scatter (qgZ: its all-to-alls);
    # "vs ZeRO-3": the final loss against hpZ True's, "worst step": the largest |relative| gap.
    head = f"{'configuration':22}" + "".join(f"{c:>14}" for c in cols)
    head += f"{'vs ZeRO-3':>10}{'worst step':>11}"
    lines = [header("zeropp", where),
             f"ZeRO++ at stage 3: TinyGPT, nodes of {node_size} ranks; one step (gathers: "
             "payload per rank; across: all ranks, analysis/topology.py's ring)", head]  # fmt: skip
    for name, row in rows.items():
        bwd = sum(row["bwd"].values())
        group = ",".join(row["bwd"]) or "-"
        loss = row["losses"][-1]
        sizes = [sum(row["fwd"].values()), bwd, group, row["bwd_across"], row["held"], row["rs"]]
        cells = [format_bytes(c) if not isinstance(c, str) else c for c in sizes]
        cells.append(f"{loss:.4f}")
        worst = max(abs(q / b - 1) for q, b in zip(row["losses"], base, strict=True))
        lines.append(f"{name:22}" + "".join(f"{c:>14}" for c in cells)
                     + f"{loss / base[-1] - 1:+10.2%}{worst:11.2%}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = Parser(prog="minizero bench zeropp",
               description="ZeRO++ at stage 3 on gloo ranks: hpZ (reshard_after_forward True, "
               "False, node size), qwZ (int8 weight all-gathers) against fp32 and bf16, qgZ "
               "(int8 all-to-all gradient reduce-scatter), qwZ's error per unit, qgZ's schemes "
               "simulated.")  # fmt: skip
    p.add_argument("--nprocs", type=positive_int, default=4, help="ranks (default 4)")
    p.add_argument("--node-size", type=positive_int, default=2, help="ranks per node (default 2)")
    p.add_argument("--steps", type=positive_int, default=20, help="steps per configuration")
    p.add_argument("--json", default="runs/bench_zeropp.json",
                   help="where to write the results ('' for nowhere)")  # fmt: skip
    a = p.parse_args(argv)
    if a.nprocs % a.node_size:
        p.error(f"--node-size ({a.node_size}) must divide --nprocs ({a.nprocs})")
    res = measure(a.nprocs, a.node_size, a.steps)
    print(report(res, a.node_size))
    res["unit_errors"] = unit_errors(model(), a.nprocs)
    print(f"\nqwZ error per unit (int8, blocks of {QUANT_BLOCK}, fp32 scales), initial weights:")
    for row in res["unit_errors"]:
        print(f"  {row['unit']:18}{row['numel']:>9,} elements  max {row['max_rel']:.2e}  "
              f"rms {row['rms_rel']:.2e}")  # fmt: skip
    q = res["qgz"] = qgz_simulation(a.nprocs, a.node_size)
    print(
        f"\nqgZ's schemes, simulated: the gradient sum of {q['world']} ranks, Ψ={q['psi']:,}, "
        "relative error (rms / max) per scheme; bytes each rank sends per reduce-scatter"
    )
    for bits in (8, 4):
        row = q[f"int{bits}"]
        cells = "  ".join(f"{k} {v['rms_rel']:.1e} / {v['max_rel']:.1e}" for k, v in row.items())
        print(f"  int{bits}: {cells}; {format_bytes(q[f'int{bits}_bytes'])}")
    print(f"  fp32 ring: exact; {format_bytes(q['fp32_bytes'])}")
    if a.json:
        write_json(a.json, res)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("zeropp", help="ZeRO++ at stage 3: hpZ, qwZ, qgZ: bytes, memory, loss",
                   add_help=False)  # fmt: skip
