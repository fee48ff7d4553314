"""The measured collectives (minizero/collectives.py, lesson 00_collectives): same results as
torch.distributed, nccl-tests' sizes and bus-bandwidth factors, the ZeRO paper's volumes, and a
ledger that records only while it is open."""

import time

import pytest
import torch
import torch.distributed as dist
from harness import build, local_batch, optimizer_fn, run

import minizero
from minizero import collectives as C
from minizero.analysis.ledger import CommLedger, CommRecord, WrongGroup, name_group

pytestmark = pytest.mark.timeout(120)


# -- sizes and factors, on a record made by hand -------------------------------------------------
@pytest.mark.parametrize(
    "op,world,factor,volume",
    [
        ("all_reduce", 4, 1.5, 2000),  # 2(n-1)/n; the paper counts an all-reduce of n as 2n
        ("all_reduce", 2, 1.0, 2000),
        ("reduce_scatter", 4, 0.75, 1000),  # (n-1)/n
        ("all_gather", 4, 0.75, 1000),
        ("all_gather", 3, 2 / 3, 1000),
        ("broadcast", 4, 1.0, 1000),
    ],
)
def test_record_bandwidth_and_volume(op, world, factor, volume):
    rec = CommRecord(op, torch.bfloat16, 1000, world, False, "t", 0, seconds=1e-3)
    assert rec.nbytes == 2000  # S = numel * 2 bytes for bf16
    assert rec.algbw == pytest.approx(2000 / 1e-3)
    assert rec.busbw == pytest.approx(2000 / 1e-3 * factor)
    assert rec.volume_elements == volume


def test_unfinished_record_has_no_bandwidth():
    rec = CommRecord("all_reduce", torch.float32, 10, 2, True, "", 0)  # async, not waited on
    assert rec.nbytes == 40 and rec.algbw != rec.algbw  # NaN


# -- the wrappers against torch.distributed -----------------------------------------------------
def on_group(group_ranks: list[int] | None):
    """(group, N, this rank in it) of ``dist.new_group(group_ranks)`` (None: the world), made on
    every rank; None on a rank outside it."""
    group = dist.new_group(group_ranks) if group_ranks is not None else None
    if group_ranks is not None and dist.get_rank() not in group_ranks:
        return None
    return group, dist.get_world_size(group), dist.get_rank(group)


def members(results: list, world: int, group_ranks: list[int] | None):
    """(rank, result, N) of each rank in the group; a rank outside it must have returned None."""
    n = len(group_ranks) if group_ranks is not None else world
    for rank, res in enumerate(results):
        if group_ranks is not None and rank not in group_ranks:
            assert res is None
            continue
        assert res["n"] == n
        yield rank, res, n


def all_four(dtype, group_ranks=None, src=0):
    """On every rank: each wrapper and torch.distributed on the same data, under a ledger.
    ``group_ranks``: run on dist.new_group(group_ranks) (ranks outside it return None)."""
    if (on := on_group(group_ranks)) is None:
        return None
    group, n, me = on
    g = torch.Generator().manual_seed(dist.get_rank())
    x = (torch.randn(n * 5, generator=g) * 4).round().to(dtype)  # integers: sums are exact
    out = {}
    with CommLedger() as ledger:
        a, b = x.clone(), x.clone()
        C.all_reduce(a, group=group, tag="sum")
        dist.all_reduce(b, group=group)
        out["all_reduce"] = (a, b)
        a, b = x.clone(), x.clone()
        assert C.all_reduce(a, op=C.ReduceOp.MAX, group=group) is None  # blocking: no work
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=group)
        out["all_reduce max"] = (a, b)
        shard = torch.empty(5, dtype=dtype)
        work = C.reduce_scatter(shard, x.clone(), group=group, async_op=True)
        pending = ledger.records[-1].seconds
        work.wait()
        b = x.clone()
        dist.all_reduce(b, group=group)
        out["reduce_scatter"] = (shard, b[me * 5 : (me + 1) * 5])  # chunk `me` of the sum
        full = torch.empty(n * 5, dtype=dtype)
        C.all_gather(full, x[:5].clone(), group=group)
        parts = [torch.empty(5, dtype=dtype) for _ in range(n)]
        dist.all_gather(parts, x[:5].clone(), group=group)
        out["all_gather"] = (full, torch.cat(parts))
        a, b = x.clone(), x.clone()
        C.broadcast(a, src=src, group=group)  # src: a rank *in the group*
        global_src = src if group is None else dist.get_global_rank(group, src)
        dist.broadcast(b, src=global_src, group=group)
        out["broadcast"] = (a, b)
    with torch.no_grad():  # the source's own tensor, for the broadcast check
        src_x = x.clone()
        dist.broadcast(src_x, src=global_src, group=group)
    rows = [(r.op, r.numel, r.nbytes, r.dtype, r.world, r.async_op, r.seconds is not None)
            for r in ledger.records]  # fmt: skip
    volume = ledger.volume_elements
    return dict(out=out, rows=rows, pending=pending, src_x=src_x, n=n, volume=volume)


def check_all_four(res, dtype):
    for name, (got, want) in res["out"].items():
        assert torch.equal(got, want), name
    assert torch.equal(res["out"]["broadcast"][0], res["src_x"])
    n, size = res["n"], torch.empty((), dtype=dtype).element_size()
    assert res["rows"] == [
        ("all_reduce", n * 5, n * 5 * size, dtype, n, False, True),
        ("all_reduce", n * 5, n * 5 * size, dtype, n, False, True),
        ("reduce_scatter", n * 5, n * 5 * size, dtype, n, True, True),  # S: the full input
        ("all_gather", n * 5, n * 5 * size, dtype, n, False, True),  # S: the full output
        ("broadcast", n * 5, n * 5 * size, dtype, n, False, True),
    ]
    assert res["pending"] is None, "an async record was timed before wait()"
    assert res["volume"] == 2 * 2 * n * 5 + 3 * n * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3])
def test_wrappers_match_torch_distributed(world, dtype):
    for res in run(all_four, world, dtype):
        check_all_four(res, dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_from_a_nonzero_rank(world):
    for res in run(all_four, world, torch.float32, src=world - 1):
        check_all_four(res, torch.float32)


def test_subgroup():
    """A group made with dist.new_group([1, 2]) of a world of 3; src is a rank in that group."""
    results = run(all_four, 3, torch.float32, [1, 2], src=1)
    assert results[0] is None
    for res in results[1:]:
        check_all_four(res, torch.float32)
        assert res["n"] == 2


# -- gloo's reduce-scatter: sends to the owners and a local fold, against torch's --------------
_TORCH_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_vs_torch(group_ranks=None):
    """On every rank: minizero's reduce-scatter (out of place, blocking; in place, async) and
    torch's ``reduce_scatter_tensor`` on the same data, per dtype, op, size and data (random
    floats, integers), with what a ledger recorded; then both given an input that is not N x the
    output. Per case: (name, max |ours - torch's| out of place, in place, torch's max |value|)."""
    if (on := on_group(group_ranks)) is None:
        return None
    group, n, me = on
    g = torch.Generator().manual_seed(dist.get_rank())
    cases, rows = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for op in (C.ReduceOp.SUM, C.ReduceOp.AVG, C.ReduceOp.MAX):
            for shard in (1, 7, 40_000):  # 40,000: gloo's all-reduce splits it along its ring
                for data in ("random", "integers"):
                    x = torch.randn(n * shard, generator=g) * 4
                    x = (x.round() if data == "integers" else x).to(dtype)
                    theirs, ours = torch.empty(shard, dtype=dtype), torch.empty(shard, dtype=dtype)
                    _TORCH_RS(theirs, x.clone(), op=op, group=group)
                    with CommLedger() as ledger:
                        C.reduce_scatter(ours, x.clone(), op=op, group=group)
                        inplace = x.clone()  # (n * shard,) chunk `me` gets the result, in place
                        mine = inplace[me * shard : (me + 1) * shard]
                        C.reduce_scatter(mine, inplace, op=op, group=group, async_op=True).wait()
                    rows += [(r.op, r.numel, r.world, r.volume_elements) for r in ledger.records]
                    diff = lambda a: (a.float() - theirs.float()).abs().max().item()  # noqa: B023
                    name = (str(dtype), str(op), shard, data)
                    cases.append((name, diff(ours), diff(mine), theirs.float().abs().max().item()))
    x, polled, theirs = torch.randn(n * 5, generator=g), torch.empty(5), torch.empty(5)
    work = C.reduce_scatter(polled, x.clone(), group=group, async_op=True)
    while not work.is_completed():  # complete: the chunks arrived and were summed, no wait()
        time.sleep(0)
    _TORCH_RS(theirs, x.clone(), group=group)
    cases.append((("polled",), (polled - theirs).abs().max().item(), 0.0, 1.0))
    refused = []
    for fn in (_TORCH_RS, C.reduce_scatter):
        try:  # 2n + 1 elements into 2: neither runs it (before anything is sent: no hang)
            fn(torch.empty(2), torch.ones(2 * n + 1), group=group)
        except RuntimeError as e:
            refused.append(type(e).__name__)
    return dict(n=n, cases=cases, rows=rows, refused=refused)


@pytest.mark.parametrize("world,group_ranks", [(2, None), (3, None), (3, [0, 2])])
def test_gloo_reduce_scatter_equals_torchs(world, group_ranks):
    """gloo's ``reduce_scatter_tensor`` all-reduces a clone of the input; minizero's sends each
    chunk to its owner (``isend``/``irecv``) and folds the N - 1 it gets into its own, in place
    too. Against torch's, on the world and on a subgroup, fp32 and bf16, SUM, AVG and MAX, out of
    place and in place (the output a chunk of the input): equal on 2 ranks (one addition: the
    order cannot matter), equal on integers on 3; on 3 ranks' random floats the order of the two
    additions may differ from gloo's ring (whose chunks are its own), so within a rounding of the
    result. The ledger records each as one reduce-scatter of the full input; an input that is
    not N x the output goes to torch's, which refuses it; an async one that ``is_completed()``
    says is done holds the sum, without ``wait()``."""
    results = run(reduce_scatter_vs_torch, world, group_ranks)
    for rank, res, n in members(results, world, group_ranks):
        assert len(res["cases"]) == 37
        assert res["cases"][-1][1] <= (0 if n == 2 else 2 * 2.0**-23 * 16), res["cases"][-1]
        for name, out, inplace, scale in res["cases"][:-1]:
            if n == 2 or name[3] == "integers" or "MAX" in name[1]:
                assert out == inplace == 0, (rank, name)
            else:  # one rounding of the result's magnitude: 2^-23 (fp32), 2^-8 (bf16)
                ulp = 2.0**-23 if name[0] == "torch.float32" else 2.0**-8
                assert max(out, inplace) <= 2 * ulp * scale, (rank, name, out, inplace)
        shards = [shard for _dtype in (0, 1) for _op in (0, 1, 2)
                  for shard in (1, 7, 40_000) for _data in (0, 1) for _call in (0, 1)]  # fmt: skip
        assert res["rows"] == [("reduce_scatter", n * s, n, n * s) for s in shards]
        assert res["refused"] == ["RuntimeError", "RuntimeError"]  # minizero passes it to torch


# -- gloo's all-gather: sends and receives into place, against torch's --------------------------
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_vs_torch(group_ranks=None):
    """On every rank: minizero's all-gather (out of place, blocking; in place, async; two in
    flight at once, of different sizes, waited in reverse order; polled) and torch's
    ``all_gather_into_tensor`` on the same data, with what a ledger recorded."""
    if (on := on_group(group_ranks)) is None:
        return None
    group, n, me = on
    g = torch.Generator().manual_seed(dist.get_rank())
    same, rows = [], []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shard in (1, 7, 40_000):
            x = (torch.randn(shard, generator=g) * 100).to(dtype)
            theirs = torch.empty(n * shard, dtype=dtype)
            _all_gather_tensor(theirs, x, group=group)
            with CommLedger() as ledger:
                ours = torch.empty(n * shard, dtype=dtype)
                C.all_gather(ours, x, group=group)
                inplace = torch.full((n * shard,), -1).to(dtype)  # chunk `me` is the input
                inplace[me * shard : (me + 1) * shard] = x
                mine = inplace[me * shard : (me + 1) * shard]
                C.all_gather(inplace, mine, group=group, async_op=True).wait()
            rows += [(r.op, r.numel, r.world, r.volume_elements) for r in ledger.records]
            same.append(torch.equal(ours, theirs) and torch.equal(inplace, theirs))
    a, b = torch.randn(3, generator=g), torch.randn(11, generator=g)
    out_a, out_b = torch.empty(3 * n), torch.empty(11 * n)
    works = [C.all_gather(out_a, a, group=group, async_op=True),
             C.all_gather(out_b, b, group=group, async_op=True)]  # fmt: skip
    for w in reversed(works):
        w.wait()
    polled = torch.empty(5 * n)
    work = C.all_gather(polled, torch.full((5,), float(me)), group=group, async_op=True)
    while not work.is_completed():  # (gloo's receives complete in their wait: it waits)
        time.sleep(0)
    theirs_a, theirs_b = torch.empty(3 * n), torch.empty(11 * n)
    _all_gather_tensor(theirs_a, a, group=group)
    _all_gather_tensor(theirs_b, b, group=group)
    same.append(torch.equal(out_a, theirs_a) and torch.equal(out_b, theirs_b))
    same.append(torch.equal(polled, torch.arange(n).float().repeat_interleave(5)))
    refused = []
    for fn in (_all_gather_tensor, C.all_gather):
        try:  # 2 elements into 2n + 1: neither runs it (before anything is sent: no hang)
            fn(torch.empty(2 * n + 1), torch.ones(2), group=group)
        except (RuntimeError, ValueError) as e:
            refused.append(type(e).__name__)
    return dict(n=n, same=same, rows=rows, refused=refused)


@pytest.mark.parametrize("world,group_ranks", [(2, None), (3, None), (3, [0, 2])])
def test_gloo_all_gather_equals_torchs(world, group_ranks):
    """minizero's all-gather on gloo sends this rank's chunk to each other rank and receives
    theirs straight into their chunks of the output. Equal to torch's, on the world and on a
    subgroup, in fp32, bf16 and int64, out of place and in place (the input a chunk of the
    output), two in flight at once waited in reverse order, and polled (``is_completed()`` waits
    for gloo's sends and receives, which complete only there, so polling ends); the ledger
    records one all-gather of the full output each; a size that does not fit goes to torch's,
    which refuses it."""
    results = run(all_gather_vs_torch, world, group_ranks)
    for rank, res, n in members(results, world, group_ranks):
        assert res["same"] == [True] * 11, (rank, res["same"])
        shards = [s for _dtype in range(3) for s in (1, 7, 40_000) for _call in range(2)]
        assert res["rows"] == [("all_gather", n * s, n, n * s) for s in shards]
        assert len(res["refused"]) == 2 and res["refused"][0] == res["refused"][1], res


# -- the ledger records only while open ------------------------------------------------------------
def ledger_scopes():
    t = torch.ones(4)
    C.mark("nobody listens")  # no ledger open: nothing to label, no error
    C.all_reduce(t)  # no ledger open: nothing recorded anywhere
    assert C.recorder is None  # every ledger closed
    with CommLedger() as outer:
        C.all_reduce(t, tag="a")
        with CommLedger() as inner:
            C.mark("m")
            C.broadcast(t, src=0, tag="b")
        C.all_gather(torch.empty(4 * dist.get_world_size()), t, tag="c")
    C.all_reduce(t)  # after exit: still nothing
    assert C.recorder is None  # every ledger closed
    return dict(
        outer=[(r.tag, r.index) for r in outer.records], outer_marks=outer.marks,
        inner=[(r.tag, r.index) for r in inner.records], inner_marks=inner.marks,
    )  # fmt: skip


def test_ledger_records_only_while_open():
    """Records and marks share one timeline per ledger; nested ledgers each see what ran inside."""
    for res in run(ledger_scopes, 2):
        assert res["outer"] == [("a", 0), ("b", 2), ("c", 3)]
        assert res["outer_marks"] == [(1, "m")]
        assert res["inner"] == [("b", 1)]
        assert res["inner_marks"] == [(0, "m")]


# -- groups and nodes: 4 ranks as 2 "nodes" x 2 ------------------------------------------------
def node_traffic():
    """On each of 4 ranks (nodes {0,1}, {2,3}): one of each collective on the world group, an
    all-reduce on the named "shard" group (this node) and "replicate" group (the same position
    on the other node), and one on an unnamed group; fp32, 8 elements = S = 32 bytes each."""
    me = dist.get_rank()
    shards = [name_group(dist.new_group(r), "shard") for r in ([0, 1], [2, 3])]
    replicas = [name_group(dist.new_group(r), "replicate") for r in ([0, 2], [1, 3])]
    other = dist.new_group([0, 3])  # every rank makes every group, in the same order
    x = torch.ones(8)
    with CommLedger(node_size=2) as ledger:
        C.all_reduce(x.clone())
        C.reduce_scatter(torch.empty(2), x.clone())
        C.all_gather(torch.empty(8), torch.ones(2))
        C.broadcast(x.clone(), src=0)
        C.all_reduce(x.clone(), group=shards[me // 2])
        C.all_reduce(x.clone(), group=replicas[me % 2])
        if me in (0, 3):
            C.all_reduce(x.clone(), group=other)
    with pytest.raises(ValueError, match=r"CommLedger\(node_size=k\)"):
        CommLedger().node_bytes()
    return dict(
        groups=[r.group for r in ledger.records],
        by_group=ledger.by_group(),
        node_bytes=ledger.node_bytes(),
    )


def test_records_name_their_group_and_split_bytes_at_node_boundaries():
    res = run(node_traffic, 4)
    for rank, r in enumerate(res):
        extra = ["ranks [0, 3]"] if rank in (0, 3) else []
        assert r["groups"] == ["world"] * 4 + ["shard", "replicate"] + extra
        # paper volumes, elements: all-reduce 2*8, reduce-scatter 8, all-gather 8, broadcast 8
        assert r["by_group"] == {"world": 40, "shard": 16, "replicate": 16} | (
            {"ranks [0, 3]": 16} if extra else {}
        )
    # The ring over the world is 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send across, 0 and 2 inside.
    # all-reduce 2(n-1)/n * 32 = 48 bytes; reduce-scatter and all-gather (n-1)/n * 32 = 24 each;
    # broadcast from 0 along the chain 0 -> 1 -> 2 -> 3: 32 bytes from every rank but 3. (The ring
    # model's split: on gloo minizero's reduce-scatter sends its 24 bytes to the owners directly.)
    world = [(48 + 24 + 24 + 32, 0), (0, 48 + 24 + 24 + 32), (48 + 24 + 24 + 32, 0), (0, 96)]
    for rank, r in enumerate(res):
        nb = r["node_bytes"]
        assert (nb["world"]["inside"], nb["world"]["across"]) == world[rank], rank
        # a 2-rank ring sends 2(2-1)/2 * 32 = 32 bytes: inside for a node's own group, across
        # for the group of the same position on the two nodes
        assert nb["shard"] == {"inside": 32, "across": 0}
        assert nb["replicate"] == {"inside": 0, "across": 32}
        if rank in (0, 3):  # ranks 0 and 3 are on different nodes: both hops cross
            assert nb["ranks [0, 3]"] == {"inside": 0, "across": 32}
        total = [sum(row[k] for g, row in nb.items() if g != "total") for k in ("inside", "across")]
        assert [nb["total"]["inside"], nb["total"]["across"]] == total


def test_group_names_and_node_size_are_checked():
    with pytest.raises(ValueError, match="positive int"):
        CommLedger(node_size=0)
    with pytest.raises(ValueError, match="always named 'world'"):
        name_group(None, "shard")
    with pytest.raises(ValueError, match="non-empty string"):
        name_group(None, "")


def stage1_step_bytes():
    """On each of 4 ranks (nodes {0,1}, {2,3}): one ZeRO-1 step over the world, then one over
    this node's named "shard" group, each under a ledger with node_size=2."""

    me = dist.get_rank()
    shards = [name_group(dist.new_group(r), "shard") for r in ([0, 1], [2, 3])]
    out = {}
    for name, group in (("world", None), ("shard", shards[me // 2])):
        model, opt = minizero.parallelize(
            build("mlp"), 1, optimizer_fn("adam"), process_group=group
        )
        x, y = local_batch("mlp", 0, dist.get_rank(group), dist.get_world_size(group))
        with CommLedger(node_size=2) as ledger:
            model(x, y).backward()
            opt.step()
        with CommLedger(node_size=2) as rebuild:  # the first zero_grad() cuts the buckets again
            opt.zero_grad()  # in ready order and moves the states (minizero/optimizer/state.py)
        out[name] = dict(
            rebuild=sorted({r.group for r in rebuild.records}),
            ops=sorted({(r.op, r.group) for r in ledger.records}),
            nbytes=sum(r.nbytes for r in ledger.records),
            node_bytes=ledger.node_bytes()["total"],
        )
    return out


def test_a_zero1_step_on_a_named_group_stays_inside_the_node():
    for rank, r in enumerate(run(stage1_step_bytes, 4)):
        # world: reduce-scatters and all-gathers, (n-1)/n = 3/4 of S each; the ring 0-1-2-3-0
        # sends ranks 1 and 3's bytes across the boundary, ranks 0 and 2's inside
        w = r["world"]
        assert w["ops"] == [("all_gather", "world"), ("reduce_scatter", "world")]
        assert w["rebuild"] == ["world"] and r["shard"]["rebuild"] == ["shard"]
        sent = 3 * w["nbytes"] / 4
        want = {"inside": sent, "across": 0} if rank % 2 == 0 else {"inside": 0, "across": sent}
        assert w["node_bytes"] == want, rank
        # the node's own group: (2-1)/2 = 1/2 of S each, nothing leaves the node
        s = r["shard"]
        assert s["ops"] == [("all_gather", "shard"), ("reduce_scatter", "shard")]
        assert s["node_bytes"] == {"inside": s["nbytes"] / 2, "across": 0}, rank


# -- structure on the timeline: where each collective completed; a ledger bound to a group -------
def waits_and_groups():
    sub = dist.new_group([0, 1])  # every rank makes it; rank 2 is not in it
    out = {}
    t = torch.ones(4)
    with CommLedger() as ledger:
        C.all_reduce(t.clone(), tag="blocking")  # index 0, done before index 1
        work = C.all_reduce(t.clone(), async_op=True, tag="async")  # index 1
        C.mark("backward end")  # index 2
        work.wait()  # returns after the mark
    out["waited"] = [(r.tag, r.index, r.waited_at) for r in ledger.records]
    if dist.get_rank() in (0, 1):
        with CommLedger(only_group=sub) as strict:
            C.all_reduce(t.clone(), group=sub)  # the right group: recorded
            with pytest.raises(WrongGroup, match=r"all_reduce \(tag 'x'\) ran on 'world', not"):
                C.all_reduce(t.clone(), tag="x")  # refused before it is issued: no hang
        out["strict"] = [r.group for r in strict.records]
    return out


def test_waited_at_places_completions_and_only_group_refuses_other_groups():
    for rank, res in enumerate(run(waits_and_groups, 3)):
        assert res["waited"] == [("blocking", 0, 1), ("async", 1, 3)]
        if rank < 2:
            assert res["strict"] == ["ranks [0, 1]"]
