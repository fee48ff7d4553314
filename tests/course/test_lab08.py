"""Lesson 08's lab (minizero/course/labs/lesson08*.py), each experiment on its smallest run: the
ledger's bytes equal the formula's and the cost model's, the layouts' bytes and held memory equal
their formulas and their losses one process's, and every figure keeps its bars inside its axes."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minizero.analysis import cost, scenario  # noqa: E402
from minizero.course.labs import lesson08 as lab  # noqa: E402
from minizero.course.labs.lesson08 import GPT, PSI  # noqa: E402
from minizero.course.labs.lesson08_links import config  # noqa: E402
from minizero.models import GPTConfig  # noqa: E402

WORLD, NODE, MICRO = 4, 2, 2
MORE = {
    "ZeRO-3 HSDP": dict(stage=3, hsdp=True),
    "ZeRO-3 hpZ+qwZ": dict(stage=3, hpz=True, qwz=True),
}


def drawn_inside(fig) -> int:
    """The bars of ``fig`` (asserting each ends inside its axes); closes it."""
    bars = 0
    for ax in fig.axes:
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        for p in ax.patches:
            assert x0 <= p.get_x() and p.get_x() + p.get_width() <= x1, ax.get_title()
            assert y0 <= p.get_y() and p.get_y() + p.get_height() <= y1, ax.get_title()
            bars += 1
    plt.close(fig)
    return bars


@pytest.fixture(scope="module")
def run():
    return lab.on_nodes(WORLD, NODE, MICRO, MORE, repeats=1, sweep=(2**10, 2**14))


def test_on_nodes_the_ledger_is_the_formula_and_the_model(run, capsys):
    ring = (WORLD - 1) / WORLD
    sent = {0: 2 * ring, 1: 2 * ring, 2: (MICRO + 1) * ring, 3: 3 * MICRO * ring}  # × Ψ
    for s in range(4):
        per_rank = [r["stages"][s] for r in run["ranks"]]
        comms = cost.step_collectives(config(run, stage=s), per_rank[0]["sizes"])
        for r, got in enumerate(per_rank):
            nb = got["node_bytes"]
            assert nb["inside"] + nb["across"] == sum(c.wire() for c in comms) == sent[s] * 4 * PSI
            assert (nb["across"] > 0) == (r % NODE == NODE - 1)  # a node's last rank crosses
    for name, options in MORE.items():
        want = {}
        for c in cost.step_collectives(
            config(run, **options), run["ranks"][0]["more"][name]["sizes"]
        ):
            want[c.group] = want.get(c.group, 0) + c.times * c.nbytes
        assert run["ranks"][0]["more"][name]["payload"] == want, name
    lab.show_node_bytes(run)
    lab.show_against_model(run, sent)
    out = capsys.readouterr().out
    assert "ZeRO-3   formula 4.50 Ψ × 4 B =    1,954,944 B" in out and "ZeRO-3 hpZ+qwZ  hpZ" in out
    lab.plot_node_bytes(run)
    assert drawn_inside(plt.gcf()) == 4 * 4 * 2  # 4 panels, 4 ranks, inside and across


def test_step_parts_are_the_prediction_and_the_measured_parts(run, capsys):
    assert {row["op"] for row in run["ranks"][0]["inter"]} == {"all_reduce", "all_gather"}
    truth = {"intra": cost.Link(300e-6, 1e9), "inter": cost.Link(800e-6, 3e9)}  # fit them back
    fitted = dict(run, ranks=[dict(r) for r in run["ranks"]])
    for key, n in (("intra", NODE), ("inter", WORLD)):
        fitted["ranks"][0][key] = [
            dict(
                op=op,
                nbytes=s,
                seconds=cost.collective_time(op, s, n, truth[key]),
            )
            for op in ("all_reduce", "all_gather")
            for s in (2**12, 2**16, 2**20)
        ]
    links = lab.fit_links(fitted)
    for key in truth:
        assert getattr(links, key).alpha == pytest.approx(truth[key].alpha, rel=1e-6)
        assert getattr(links, key).beta == pytest.approx(truth[key].beta, rel=1e-6)
    assert links.nics == 1
    p = lab.step_parts(run, links)
    compute = max(r["compute_s"] for r in run["ranks"])
    assert p["compute_s"] == compute
    for s, row in p["rows"].items():
        comm = cost.predict(
            config(run, stage=s),
            links,
            compute_s=0.0,
            sizes=run["ranks"][0]["stages"][s]["sizes"],
        ).comm_total_s
        assert row["comm"] == comm and row["no_overlap"] == MICRO * compute + comm
        assert row["wrappers"] == pytest.approx(row["local"] - MICRO * compute - row["optimizer"])
        stage = [r["stages"][s] for r in run["ranks"]]
        for m in stage:  # a barrier in place of every collective the ledger saw, no more
            assert m["syncs"] == m["collectives"] > 0
        barrier = max(r["barrier_s"] for r in run["ranks"])
        synced = max(m["synced_s"] for m in stage)
        assert row["sync"] == synced - row["local"] - stage[0]["syncs"] * barrier
        assert row["predicted"] == row["local"] + row["sync"] + comm
        assert row["measured"] == max(m["step_s"] for m in stage) > 0
    lab.show_links(links, run)
    lab.show_step_parts(p)
    assert "sync   comm predicted" in capsys.readouterr().out
    lab.plot_step_parts(p)
    assert drawn_inside(plt.gcf()) == 3 * 4


def test_layouts_bytes_held_and_loss_are_their_formulas(capsys):
    mesh = (WORLD // NODE, NODE)
    layouts = {
        "ZeRO-3 flat": dict(stage=3),
        "ZeRO-3 HSDP": dict(stage=3, mesh=mesh),
        "FSDP2 HSDP (torch)": dict(stage="fully_shard", mesh=mesh),
        "ZeRO-3 hpZ k=2": dict(stage=3, reshard_after_forward=NODE),
        "ZeRO-3 no reshard": dict(stage=3, reshard_after_forward=False),
    }
    runs = lab.layouts(GPT, layouts, world=WORLD, node=NODE, steps=2)
    b = 4 * PSI  # Ψ in fp32 bytes
    formula = {
        "ZeRO-3 flat": {"world": 3 * b},
        "ZeRO-3 HSDP": {"shard": 3 * b, "replicate": 2 * b / NODE},
        "ZeRO-3 hpZ k=2": {"world": 2 * b, "hpZ": b},
        "ZeRO-3 no reshard": {"world": 2 * b},
    }
    held = {"ZeRO-3 flat": 0, "ZeRO-3 HSDP": 0, "ZeRO-3 hpZ k=2": b / NODE, "ZeRO-3 no reshard": b}
    for ranks in runs["ranks"]:
        for name, want in formula.items():
            assert ranks[name]["groups"] == want and ranks[name]["held"] == held[name], name
        torch_run = ranks["FSDP2 HSDP (torch)"]
        assert not torch_run["on_ledger"] and torch_run["held"] is None
        for name in layouts:
            gaps = [abs(a - o) for a, o in zip(ranks[name]["losses"], runs["one"], strict=True)]
            assert max(gaps) < 1e-5, name  # the same model as one process, to rounding
    lab.show_layouts(runs, formula, held, psi_bytes=b)
    out = capsys.readouterr().out
    assert "ZeRO-3 hpZ k=2      hpZ 1.000 (1.000), world 2.000 (2.000)" in out
    assert "(torch's collectives: not on the ledger)" in out
    lab.plot_layouts(runs)
    fig = plt.gcf()
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == list(formula)  # no torch
    assert drawn_inside(fig) == len(formula) * WORLD * 2


def test_link_model_against_nccl_tests_and_zeropp(capsys):
    peak = cost.Links(intra=cost.Link(0.0, 370e9), inter=cost.Link(0.0, 47e9), nics=8)
    assert lab.busbw("all_reduce", 8, 1, peak) == pytest.approx(370)  # NVLink
    assert lab.busbw("all_reduce", 32, 4, peak) == pytest.approx(8 * 47)  # every NIC of a node
    assert lab.busbw("all_reduce", 64, 64, peak) == pytest.approx(47)  # one NIC per group
    across = lab.zeropp_across(psi=2**30, nodes=64, gpus=8)
    assert across["ZeRO-3, fwd + bwd gathers + grads"] == pytest.approx(3)
    assert across["hpZ: backward's gather"] == 0
    assert across["qwZ: forward's gather (int8)"] == pytest.approx(0.5 * (1 + 4 / 256) / 1)
    assert across["qgZ, ZeRO++'s (hierarchical, int4)"] == pytest.approx(0.25, rel=0.02)
    lab.show_validation([("4 nodes", 376.0, 365.84, "#309"), ("64 nodes", 376.0, None, "-")])
    lab.show_zeropp(across, {"hpZ: backward's gather": 0.0})
    out = capsys.readouterr().out
    assert "+3%" in out and "hpZ: backward's gather                   0.000    0.00" in out


def test_scale_tables_figure_choice_and_calculator(capsys, monkeypatch):
    big = GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    candidates = {
        "DDP": dict(stage=0),
        "ZeRO-1": dict(stage=1),
        "ZeRO-1 HSDP": dict(stage=1, hsdp=True),
        "ZeRO-3": dict(stage=3),
    }
    sc = scenario.Scenario()
    rows = scenario.predict_rows(big, sc, candidates)
    lab.show_scale(rows, sc, big, candidates)
    out = capsys.readouterr().out
    assert "(does not fit)" in out and "the old model" in out and "6.667B parameters" in out
    # α (10 µs) on every ring round: 130 buckets x 1022 rounds flat; x (7 + 126 + 7) with HSDP;
    # 33 units x 4 micro-batches x 3 collectives x 511 rounds at stage 3
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert f"{130 * 1022 * 10e-6:.3f}" == "1.329" and " 1.329" in lines["ZeRO-1"]
    assert f"{130 * 140 * 10e-6:.3f}" == "0.182" and " 0.182" in lines["ZeRO-1 HSDP"]
    assert f"{33 * 4 * 3 * 511 * 10e-6:.3f}" == "2.024" and " 2.024" in lines["ZeRO-3"]
    lab.plot_scale(rows, sc)
    assert drawn_inside(plt.gcf()) == 2 * 2 * len(rows)

    def unwritten(q):
        raise NotImplementedError

    from minizero.course.checks.lesson08_choose import decide  # the check's own decision

    q = scenario.question(big, sc)
    assert lab.show_choice(unwritten, q) is None
    assert lab.show_choice(decide, q) == ((1, True), "latency")
    lab.show_sensitivity(scenario.question_sensitivity(big, sc, decide))
    out = capsys.readouterr().out
    assert "write choose() in exercise 4 first" in out
    assert "run ZeRO-1 HSDP, decided by latency" in out
    assert "ZeRO-3 HSDP (memory)" in out  # half the GPU memory
    assert "nodes               64                      =                      =" in out
    monkeypatch.setenv("MINIZERO_WIDGETS", "0")  # no front end: the scenario's table
    lab.calculator(big, candidates, sc)
    assert capsys.readouterr().out.count("(does not fit)") == 1


def test_setup_names_the_nodes(capsys):
    nprocs, info = lab.setup(4, 2)  # NPROCS, INFO = setup(...), as every lesson opens
    assert nprocs == 4 and info["world"] == 4 and info["backend"] == "gloo"
    assert "4 gloo ranks as 2 nodes × 2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="multiple of the node size"):
        lab.setup(4, 3)
