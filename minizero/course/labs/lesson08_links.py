"""Lesson 08's link model (``course/08_beyond_one_node.py``, sections 4 and 5): the cost model
against nccl-tests and ZeRO++'s claims, fitted to this machine, and a step predicted against
the steps :func:`minizero.course.labs.lesson08.on_nodes` measured.

``busbw`` / ``show_validation`` the model's busbw beside nccl-tests' measurements;
``zeropp_across`` / ``show_zeropp`` what hpZ, qwZ and qgZ leave crossing nodes, beside ZeRO++;
``fit_links`` / ``show_links`` this machine's two link classes;
``step_parts`` / ``show_step_parts`` / ``plot_step_parts`` the step: measured, predicted, and the
parts the prediction leaves out, measured.
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt

from minizero.analysis import cost
from minizero.course.labs import describe

NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def config(run: dict, **options) -> cost.Config:
    """The ``cost.Config`` of one configuration of an ``on_nodes`` run, in fp32."""
    return cost.Config(
        world=run["world"],
        node_size=run["node"],
        micro_batches=run["micro"],
        param_bytes=4,
        grad_bytes=4,
        **options,
    )


def busbw(op: str, n: int, nodes: int, links: cost.Links, node_size: int = 8) -> float:
    """nccl-tests' busbw of one ``op`` on ``n`` ranks over ``nodes`` nodes in the model, GB/s: ring
    bytes per rank over the time of an 8 GiB payload (large enough that α does not matter)."""
    c = cost.Comm(op, 2**33, n, nodes, node_size, "world", "busbw")
    return c.wire() / c.seconds(links) / 1e9


def show_validation(rows: list[tuple]) -> None:
    """``rows``: ``(what, model GB/s, measured GB/s or None, source)``."""
    print(f"{'H100, NDR 400 Gb/s NICs':34}{'model GB/s':>11}{'measured':>10}{'error':>8}   source")
    for what, model, measured, src in rows:
        got = f"{measured:>10.0f}{model / measured - 1:>+8.0%}" if measured else f"{'-':>10}{'':>8}"
        print(f"{what:34}{model:>11.0f}{got}   {src}")


def zeropp_across(psi: int, nodes: int, gpus: int) -> dict[str, float]:
    """Bytes a node sends across per micro-batch, relative to one fp16 ring collective of ``psi``
    (ZeRO-3's gradient reduce-scatter), in the cost model: ZeRO-3's three collectives; what hpZ
    leaves of backward's gather, qwZ of forward's; ZeRO++'s hierarchical int4 qgZ (reduce inside
    the node, then an all-to-all of each GPU's Ψ/gpus across, one rank per node); minizero's
    one-hop int8 qgZ."""
    world = nodes * gpus

    def across(**kw) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in cost.step_collectives(
            cost.Config(stage=3, world=world, node_size=gpus, **kw), [psi]
        ):
            what = c.what.replace(" int8", "").replace(" scales", "")
            out[what] = out.get(what, 0.0) + c.node_bytes()
        return out

    base = across()
    qgz = cost.Comm("all_to_all", psi / gpus * 0.5, nodes, nodes, gpus, "replicate", "")
    got = {
        "ZeRO-3, fwd + bwd gathers + grads": sum(base.values()),
        "hpZ: backward's gather": across(hpz=True)["params bwd"],
        "qwZ: forward's gather (int8)": across(qwz=True)["params fwd"],
        "qgZ, ZeRO++'s (hierarchical, int4)": qgz.node_bytes(),
        "qgZ, minizero's (one hop, int8)": across(qgz=True)["grads"],
    }
    return {k: v / base["grads"] for k, v in got.items()}


def show_zeropp(model: dict[str, float], paper: dict[str, float | None]) -> None:
    print(f"{'per micro-batch, across nodes':38}{'model':>8}{'ZeRO++':>8}   (× one fp16 ring of Ψ)")
    for what, x in model.items():
        claim = paper.get(what)
        print(f"{what:38}{x:>8.3f}{'' if claim is None else f'{claim:8.2f}'}")


def fit_links(run: dict) -> cost.Links:
    """Section 4: this machine's two link classes, fitted to rank 0's sweeps (each node's ring as
    "intra", the ring over every rank as "inter", one "NIC")."""
    rank0 = run["ranks"][0]
    return cost.Links(
        intra=cost.fit(rank0["intra"], run["node"]),
        inter=cost.fit(rank0["inter"], run["world"]),
        nics=1,
    )


def show_links(links: cost.Links, run: dict) -> None:
    for name, link in (("intra", links.intra), ("inter", links.inter)):
        print(
            f"{name}: α = {link.alpha * 1e6:7.1f} µs per round, β = {link.beta / 1e9:.3f} GB/s "
            f"({describe(run['info'])})"
        )


def step_parts(run: dict, links: cost.Links) -> dict:
    """Section 5: per stage, the slowest rank's measured step against exercise 3's prediction (no
    overlap: ``micro`` x compute, then the cost model's collectives on ``links``) and against the
    prediction from the measured parts (minizero/analysis/step_parts.py): the local step (the
    step without its collectives: compute, optimizer, wrappers) + the ranks' synchronisation
    (the step with a barrier for each collective, less the local step and the barriers' own
    latency) + the model's collectives. Seconds."""
    ranks, micro = run["ranks"], run["micro"]
    compute_s = max(r["compute_s"] for r in ranks)
    barrier_s = max(r["barrier_s"] for r in ranks)
    rows = {}
    for s in range(4):
        stage = [r["stages"][s] for r in ranks]  # every rank's measurements of stage s
        local = max(m["local_s"] for m in stage)
        optimizer = max(r["optimizer_s"]["all" if s == 0 else "shard"] for r in ranks)
        sync = max(m["synced_s"] for m in stage) - local - stage[0]["syncs"] * barrier_s
        comm = cost.predict(  # minizero's reduce-scatter: a reduce-scatter's bytes, gloo too
            config(run, stage=s), links, compute_s=0.0, sizes=stage[0]["sizes"]
        ).comm_total_s
        rows[s] = dict(
            measured=max(m["step_s"] for m in stage),
            no_overlap=micro * compute_s + comm,  # exercise 3's prediction
            optimizer=optimizer,
            wrappers=local - micro * compute_s - optimizer,
            local=local,
            sync=sync,
            comm=comm,
            predicted=local + sync + comm,
        )
    return dict(
        rows=rows, compute_s=compute_s, micro=micro, load=ranks[0]["load"], info=run["info"]
    )


def show_step_parts(p: dict) -> None:
    print(
        f"{'':8}{'measured':>9}{'no overlap':>11}{'error':>7}{'optimizer':>10}{'wrappers':>9}"
        f"{'sync':>6}{'comm':>7}{'predicted':>10}{'error':>7}   ms"
    )
    for s, r in p["rows"].items():
        ms = {k: v * 1e3 for k, v in r.items()}
        print(
            f"{NAMES[s]:8}{ms['measured']:>9.1f}{ms['no_overlap']:>11.1f}"
            f"{r['no_overlap'] / r['measured'] - 1:>+7.0%}{ms['optimizer']:>10.1f}"
            f"{ms['wrappers']:>9.1f}{ms['sync']:>6.1f}{ms['comm']:>7.1f}{ms['predicted']:>10.1f}"
            f"{r['predicted'] / r['measured'] - 1:>+7.0%}"
        )
    print(
        f"compute (forward + backward) {p['compute_s'] * 1e3:.1f} ms × {p['micro']} micro-batches; "
        f"{describe(p['info'])}; load average {p['load']:.1f} on {os.cpu_count()} cores as "
        "section 1 ended (above the cores: other work shared the machine)"
    )


def plot_step_parts(p: dict) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    keys = {
        "measured": "measured",
        "no_overlap": "no overlap (exercise 3)",
        "predicted": "local + sync + comm",
    }
    rows = p["rows"]
    for k, (key, label) in enumerate(keys.items()):
        ax.bar(
            [s + (k - 1) * 0.27 for s in rows],
            [r[key] * 1e3 for r in rows.values()],
            0.27,
            label=label,
        )
    top = max(r[key] for r in rows.values() for key in keys) * 1e3
    ax.set_ylim(0, 1.15 * top)  # no bar reaches the frame
    ax.set_xticks(list(rows), [NAMES[s] for s in rows])
    ax.set_ylabel("ms per step")
    ax.set_title(f"{p['micro']} micro-batches of TinyGPT on {describe(p['info'])}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    plt.show()
