"""Checkpoints (minizero/checkpoint.py, lesson 07): resume is exact at the same world size and
stage, and within float rounding of one process after resharding to other world sizes, stages and
precisions; a save that dies leaves the previous checkpoint and is refused by name; bad input is
refused with nothing loaded; consolidation gives a plain state dict (and torch's own
``dcp_to_torch_save`` reads the files); each rank writes (P + K) bytes per element it owns.

The model is the harness's MLP: a frozen weight, a weight tied between two layers, sizes that no
world size divides (padding everywhere), tiny buckets (many per rank). Each launch runs an
uninterrupted run and the interrupted one side by side, on the same ranks."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import TINY_BUCKET_MB, build, local_batch, run, snapshot

import minizero
from minizero.checkpoint import CheckpointError, checkpoint_bytes, consolidate
from minizero.checkpoint import layout as checkpoint_layout

pytestmark = pytest.mark.timeout(240)
N, M = 3, 2  # steps before the save, steps after it


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's groups: weight decay on >= 2-D parameters only, another lr on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return cls(groups, lr=1e-2, betas=(0.9, 0.95))


def wrapped(stage: int, precision: str, opt: str = "adamw", kind: str = "mlp"):
    model = build(kind)
    model, optimizer = minizero.parallelize(
        model,
        stage,
        make_optimizer(opt, model),
        precision=precision,  # stage 3: units
        bucket_cap_mb=None if stage == 3 else TINY_BUCKET_MB,
    )
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)
    return model, optimizer, sched


def train(model, optimizer, sched, start: int, stop: int, kind="mlp", noise=True) -> list[float]:
    """Steps [start, stop) of the global run. ``noise``: add noise from torch's global RNG to the
    inputs (so a resume that did not restore the RNG would differ)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dtype = next(getattr(model, "module", model).parameters()).dtype
    losses = []
    for step in range(start, stop):
        x, y = local_batch(kind, step, rank, world)
        if x.is_floating_point():
            x = x + 0.01 * torch.randn_like(x) if noise else x
            x, y = x.to(dtype), y.to(dtype)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


# -- resume is exact ------------------------------------------------------------------------------
def same_layout_rank(tmp: str, precision: str, opt: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(100 + rank)
        ref = wrapped(stage, precision, opt)
        train(*ref, 0, N + M)
        torch.manual_seed(100 + rank)
        first = wrapped(stage, precision, opt)
        train(*first, 0, N)
        path = f"{tmp}/{precision}-{opt}-{stage}"
        minizero.save_checkpoint(
            path, first[0], first[1], {"step": N, "sched": first[2].state_dict()}
        )
        torch.manual_seed(999)  # the resumed run must take the saved RNG state, not this one
        model, optimizer, sched = wrapped(stage, precision, opt)
        extra = minizero.load_checkpoint(path, model, optimizer)
        sched.load_state_dict(extra["sched"])
        train(model, optimizer, sched, extra["step"], N + M)
        scale = [m.scaler.state_dict() if m.scaler else None for m in (ref[0], model)]
        lrs = [[g["lr"] for g in o.param_groups] for o in (ref[1], optimizer)]
        out[stage] = {"ref": snapshot(ref[0]), "got": snapshot(model), "scale": scale, "lr": lrs}
    return out


@pytest.mark.parametrize(
    "precision, opt", [("fp32", "adamw"), ("bf16", "adamw"), ("fp32", "sgd"), ("fp16", "adam")]
)
def test_resume_is_bitwise_at_the_same_world_and_stage(tmp_path, precision, opt):
    """N steps, save, load into a fresh run, M steps == N + M steps, bit for bit, at stages 0-3;
    with nanoGPT's param groups, an LR scheduler in `extra`, the RNG, fp16's loss scale."""
    for r, res in enumerate(run(same_layout_rank, 2, str(tmp_path), precision, opt)):
        for stage, got in res.items():
            for k, want in got["ref"].items():
                assert torch.equal(got["got"][k], want), f"stage {stage} rank {r}: {k} differs"
            assert got["scale"][0] == got["scale"][1] and got["lr"][0] == got["lr"][1]


def reshard_rank(tmp: str, plan: list, precision: str, opt: str, i: int):
    """Leg i of ``plan`` [(world, stage), ...]: load the previous leg's checkpoint (if any), train
    N steps, save. Returns the full parameters, and right after the load the loaded ones."""
    stage = plan[i][1]
    torch.manual_seed(100 + dist.get_rank())
    model, optimizer, sched = wrapped(stage, precision, opt)
    start, loaded = 0, None
    if i > 0:
        extra = minizero.load_checkpoint(f"{tmp}/leg{i - 1}", model, optimizer)
        sched.load_state_dict(extra["sched"])
        start, loaded = extra["step"], snapshot(model)
    train(model, optimizer, sched, start, start + N, noise=False)
    extra = {"step": start + N, "sched": sched.state_dict()}
    minizero.save_checkpoint(f"{tmp}/leg{i}", model, optimizer, extra)
    return {"final": snapshot(model), "loaded": loaded}


def one_process(opt: str, steps: int) -> dict:
    """The run without minizero: one process, a plain model and optimizer, the whole batch."""
    model = build("mlp")
    optimizer = make_optimizer(opt, model)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)
    train(model, optimizer, sched, 0, steps, noise=False)
    return snapshot(model)


@pytest.mark.slow
@pytest.mark.parametrize("precision, opt", [("fp32", "adamw"), ("fp32", "sgd"), ("bf16", "adam")])
def test_resume_reshards_to_any_world_size_and_stage(tmp_path, precision, opt):
    """Saved at stage 2 on 3 ranks, resumed at stage 3 on 2, then at stage 0 on 1: right after
    each load the parameters are exactly those saved (bf16 included: the fp32 masters move bit for
    bit), and the run ends within float rounding of one process (fp32)."""
    plan = [(3, 2), (2, 3), (1, 0)]
    legs = [run(reshard_rank, w, str(tmp_path), plan, precision, opt, i) for i, (w, _) in
            enumerate(plan)]  # fmt: skip
    for i in range(1, len(plan)):
        saved = legs[i - 1][0]["final"]
        for r, res in enumerate(legs[i]):
            for k, v in saved.items():
                assert torch.equal(res["loaded"][k], v), f"leg {i} rank {r}: {k} not as saved"
    if precision == "fp32":
        final = legs[-1][0]["final"]
        for k, v in one_process(opt, N * len(plan)).items():
            torch.testing.assert_close(final[k], v, atol=1e-6, rtol=0, msg=k)


def precision_change_rank(tmp: str, precision: str, stage: int) -> dict:
    model, optimizer, _ = wrapped(stage, precision)
    extra = minizero.load_checkpoint(tmp, model, optimizer)
    return {"state": snapshot(model), "extra": extra["step"]}


def test_a_bf16_checkpoint_loads_into_fp32_and_back_with_the_fp32_masters(tmp_path):
    run(reshard_rank, 2, str(tmp_path), [(2, 2)], "bf16", "adamw", 0)
    masters = consolidate(tmp_path / "leg0")
    for r, res in enumerate(run(precision_change_rank, 3, str(tmp_path / "leg0"), "fp32", 3)):
        for k, v in res["state"].items():
            assert torch.equal(v, masters[k]), f"rank {r}: {k}"
        assert res["extra"] == N


# -- atomic saves ---------------------------------------------------------------------------------
def killed_save_rank(tmp: str) -> dict:
    rank = dist.get_rank()
    model, optimizer, sched = wrapped(2, "fp32")
    train(model, optimizer, sched, 0, 1)
    minizero.save_checkpoint(f"{tmp}/ckpt", model, optimizer, {"step": 1})
    train(model, optimizer, sched, 1, 2)
    minizero.save_checkpoint(f"{tmp}/ckpt", model, optimizer, {"step": 2})  # replaces step 1
    saved = snapshot(model)
    try:
        minizero.save_checkpoint(tmp, model, optimizer)  # a directory that is not a checkpoint
        not_a_checkpoint = None
    except CheckpointError as e:
        not_a_checkpoint = str(e)
    train(model, optimizer, sched, 2, 3)
    if rank == 2:  # dies while writing, after ranks 0 and 1 have finished their part
        writer = checkpoint_layout.Writer

        def die(self, plan, planner):
            part = Path(self.path)
            deadline = time.monotonic() + 60
            while not all((part / f"rank-{r}.done").exists() for r in (0, 1)):
                assert time.monotonic() < deadline, "ranks 0 and 1 never finished"
                time.sleep(0.05)
            raise RuntimeError("killed")

        writer.write_data = die
    errors = []
    for name in ("ckpt", "other"):  # over the previous checkpoint, and into a new path
        try:
            minizero.save_checkpoint(f"{tmp}/{name}", model, optimizer, {"step": 3})
        except RuntimeError as e:
            errors.append(str(e))
    fresh, opt2, _ = wrapped(2, "fp32")
    extra = minizero.load_checkpoint(f"{tmp}/ckpt", fresh, opt2)  # the previous one
    refused = []
    for name in ("ckpt.incomplete", "other", "other.incomplete"):
        try:
            minizero.load_checkpoint(f"{tmp}/{name}", fresh, opt2)
        except CheckpointError as e:
            refused.append(str(e))
    return {"errors": errors, "step": extra["step"], "loaded": snapshot(fresh), "saved": saved,
            "refused": refused, "not a checkpoint": not_a_checkpoint}  # fmt: skip


def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_and_is_refused(tmp_path):
    for r, res in enumerate(run(killed_save_rank, 3, str(tmp_path))):
        assert res["not a checkpoint"] == (
            f"{tmp_path} exists and is not a minizero checkpoint: save_checkpoint replaces only a "
            "checkpoint; choose another path"
        )
        for err, name, was in zip(res["errors"], ("ckpt", "other"), ("is unchanged",
                                  "was not created"), strict=True):  # fmt: skip
            assert err == (
                f"save_checkpoint failed on rank 2 (RuntimeError: killed); {tmp_path}/{name} {was} "
                f"and {tmp_path}/{name}.incomplete is left incomplete"
            ), r
        assert res["step"] == 2
        for k, v in res["saved"].items():
            assert torch.equal(res["loaded"][k], v), f"rank {r}: {k}"
        assert len(res["refused"]) == 3
        for msg, part in zip(res["refused"], ("ckpt", "other", "other"), strict=True):
            assert msg == (
                f"incomplete checkpoint: rank 2 never finished ({tmp_path}/{part}.incomplete is a "
                "save that stopped before its commit; load an earlier checkpoint)"
            )
    with pytest.raises(CheckpointError, match="^incomplete checkpoint: rank 2 never finished"):
        consolidate(tmp_path / "other")


# -- bad input: a clear error, nothing loaded ---------------------------------------------------
def save_rank(tmp: str, stage: int, precision: str, opt: str = "adamw", kind: str = "mlp"):
    model, optimizer, sched = wrapped(stage, precision, opt, kind)
    train(model, optimizer, sched, 0, 2, kind)
    minizero.save_checkpoint(tmp, model, optimizer, {"step": 2})
    return {"state": model.state_dict(), "buckets": [b.numel for b in model.buckets]}


OTHER_MODELS = {  # MLP keyword arguments; the checkpoint's is sizes=(13, 37, 29, 7)
    "another shape": dict(sizes=(13, 40, 29, 7)),
    "another layer": dict(sizes=(13, 37, 29, 7, 7)),
    "fewer entries": dict(sizes=(13, 37, 29, 7), bias=False),
}


def bad_load_rank(paths: dict[str, str]) -> dict:
    out = {}
    for what, path in paths.items():
        torch.manual_seed(0)
        inner = minizero.MLP(**OTHER_MODELS.get(what, {}), frozen_first=True, tied=True)
        opt = make_optimizer("sgd" if what == "another optimizer" else "adamw", inner)
        model, optimizer = minizero.parallelize(inner, 1, opt, bucket_cap_mb=TINY_BUCKET_MB)
        train(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1), 0, 1)
        before = snapshot(model), torch.optim.Optimizer.state_dict(optimizer)  # its fragments
        try:
            minizero.load_checkpoint(path, model, optimizer)
            out[what] = None
        except CheckpointError as e:
            out[what] = str(e)
        if out[what] is not None:  # nothing loaded: parameters and optimizer state as they were
            after = snapshot(model), torch.optim.Optimizer.state_dict(optimizer)
            for k, v in before[0].items():
                assert torch.equal(v, after[0][k]), (what, k)
            for i, st in before[1]["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, after[1]["state"][i][k]), (what, i, k)
            assert before[1]["param_groups"] == after[1]["param_groups"], what
    return out


def test_bad_input_gets_a_clear_error_and_nothing_is_loaded(tmp_path):
    good = tmp_path / "good"
    run(save_rank, 2, str(good), 2, "fp32")
    paths = {"good": good, "missing": tmp_path / "nothing here", "not a checkpoint": tmp_path}
    for what in ("truncated", "corrupted", "bad record"):
        shutil.copytree(good, tmp_path / what)
        paths[what] = tmp_path / what
    data = tmp_path / "truncated" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    data = tmp_path / "corrupted" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    (tmp_path / "bad record" / "minizero.json").write_text("{not json")
    for what in (*OTHER_MODELS, "another optimizer"):
        paths[what] = good
    size = (good / "__1_0.distcp").stat().st_size
    want = {
        "good": None,
        "missing": f"no checkpoint at {tmp_path}/nothing here",
        "not a checkpoint": f"{tmp_path} is not a minizero checkpoint (no minizero.json): pass a "
        "directory that minizero.save_checkpoint wrote",
        "truncated": f"checkpoint {tmp_path}/truncated is damaged: __1_0.distcp has {size - 100} "
        f"bytes, {size} were written (truncated or overwritten)",
        "corrupted": f"checkpoint {tmp_path}/corrupted is damaged: __0_0.distcp does not match "
        "its CRC32 (corrupted)",
        "another shape": "the checkpoint holds another model: 'layers.0.weight' has shape (37, 13) "
        "there and (40, 13) here",
        "another layer": "the checkpoint holds another model: it has no 'layers.3.weight', which "
        "this model has (first missing of 2)",
        "fewer entries": "the checkpoint holds another model: it has 'layers.0.bias', which this "
        "model lacks (5 such entries)",
        "another optimizer": "the checkpoint was saved with optimizer torch.optim.adamw.AdamW, "
        "this one is torch.optim.sgd.SGD: build the same optimizer class to resume "
        "(minizero.consolidate gives the weights)",
    }
    results = run(bad_load_rank, 2, {k: str(v) for k, v in paths.items()})
    for r, got in enumerate(results):
        for what, msg in want.items():
            assert got[what] == msg, f"rank {r}, {what}: {got[what]}"
        assert got["bad record"].startswith(
            f"checkpoint {tmp_path}/bad record is damaged: minizero.json is not valid JSON"
        )


def test_save_and_load_take_only_what_parallelize_returned():
    model = build("mlp")
    with pytest.raises(TypeError, match="^save_checkpoint takes the model that minizero.par"):
        minizero.save_checkpoint("x", model, make_optimizer("adamw", model))


# -- consolidation: a plain state dict, readable without minizero ---------------------------------
@pytest.mark.parametrize("stage, precision, kind", [(3, "bf16", "gpt"), (1, "fp32", "mlp")])
def test_consolidate_gives_the_wrappers_state_dict_to_a_plain_model(tmp_path, stage, precision,
                                                                    kind):  # fmt: skip
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from minizero.__main__ import main

    ckpt = tmp_path / "ckpt"
    want = run(save_rank, 2, str(ckpt), stage, precision, "adamw", kind)[0]["state"]
    assert main(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 0
    state = torch.load(tmp_path / "out.pt", weights_only=True)  # no minizero class inside
    plain = build(kind)
    plain.load_state_dict(state, strict=True)
    got = plain.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k
    if precision != "fp32":  # the 16-bit working copy the ranks computed with: the masters, cast
        working = consolidate(ckpt, working=True)
        assert all(torch.equal(working[k], v.to(torch.bfloat16)) for k, v in state.items())
    dcp_to_torch_save(ckpt, tmp_path / "dcp.pt")  # torch's own tool reads the format
    everything = torch.load(tmp_path / "dcp.pt", weights_only=False)
    names = {n for n, p in build(kind).named_parameters()}  # each stored once (tied: first name)
    for n in names:
        assert torch.equal(everything[f"model/{n}"], state[n].reshape(-1)), n
    safetensors = pytest.importorskip("safetensors.torch")  # optional (transformers brings it)
    assert main(["consolidate", str(ckpt), str(tmp_path / "out.st"), "--safetensors"]) == 0
    again = safetensors.load_file(tmp_path / "out.st")
    build(kind).load_state_dict(again, strict=True)
    assert all(torch.equal(again[k], v) for k, v in state.items())


# -- bytes written per rank -----------------------------------------------------------------------
def bytes_rank(tmp: str, precision: str, opt: str) -> dict[int, list[int]]:
    buckets = {}
    for stage in (0, 1, 2, 3):
        buckets[stage] = save_rank(f"{tmp}/s{stage}", stage, precision, opt)["buckets"]
    return buckets


@pytest.mark.parametrize("precision, opt, per_element", [("bf16", "adamw", 2 + 12),
                         ("fp32", "adamw", 4 + 8), ("bf16", "sgd", 2 + 8)])  # fmt: skip
def test_each_rank_writes_its_share_of_p_plus_k_psi(tmp_path, precision, opt, per_element):
    """(P + K) bytes per element owned (P: the working copy, 2 in bf16; K: fp32 master 4 (it is the
    parameter in fp32), Adam's momentum and variance 4 + 4, SGD's momentum 4). Stages 1-3: rank r
    owns min(shard, numel - r shard) elements of each bucket (shard = ceil(numel / N)); no rank
    writes what it does not own. Stage 0: each parameter written once in all, (P + K)Ψ."""
    psi = minizero.count_params(build("mlp"))
    world = 3
    buckets = run(bytes_rank, world, str(tmp_path), precision, opt)[0]
    for stage in (0, 1, 2, 3):
        got = checkpoint_bytes(tmp_path / f"s{stage}")
        assert sum(g["elements"] for g in got) == psi
        assert sum(g["shards"] for g in got) == per_element * psi
        if stage == 0:
            continue
        for r, g in enumerate(got):
            owned = sum(min(math.ceil(n / world), max(0, n - r * math.ceil(n / world)))
                        for n in buckets[stage])  # fmt: skip
            assert g["elements"] == owned and g["shards"] == per_element * owned, (stage, r)
            assert g["files"] > g["shards"]
    record = json.loads((tmp_path / "s3" / "minizero.json").read_text())
    assert record["saved_with"]["world"] == world and record["saved_with"]["stage"] == 3
