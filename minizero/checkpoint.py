"""Checkpoints: save sharded, resume exactly, at any world size and stage; consolidate. Lesson 07.

    minizero.save_checkpoint("ckpt/step_100", model, optimizer, extra={"step": 100,
                             "sched": scheduler.state_dict()})        # every rank calls it
    extra = minizero.load_checkpoint("ckpt/step_100", model, optimizer)  # any world/stage/precision
    state = minizero.consolidate("ckpt/step_100")   # full fp32 weights, one process, no ranks
    python -m minizero consolidate ckpt/step_100 model.pt [--safetensors]

Format: ``torch.distributed.checkpoint`` (DCP), which can carry what each rank owns. A rank owns,
of each parameter flattened, one element range ([start, end), minizero/data_parallel.py's
``Fragment``); ranges are uneven and cut across rows, so neither DTensor (even ``Shard(dim)``
placements) nor a rank-0 ``torch.save`` fits, but DCP's metadata describes a saved piece as a chunk
(offsets, sizes) of a tensor, which a 1-D range is. Two small planners (checkpoint_layout.py, the
planner interface DCP documents for this) write each range as a chunk of the parameter's flat
tensor, named by the parameter; DCP then reshards at load time (a rank reads the chunks that
overlap the ranges it now owns) and torch's own tools read it:
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, "all.pt")`` gives every tensor
whole (parameters flat; ``consolidate`` reshapes them and adds the tied names). ShardedTensor would
carry the ranges too, but it is deprecated in favour of DTensor.

A checkpoint is a directory: DCP's ``__<rank>_0.distcp`` (one file per rank) and ``.metadata``;
``rank-<r>.done`` (each rank's completion marker: its files' sizes and CRC32s); ``minizero.json``
(the commit record: what was saved, with which world size, stage, precision and optimizer, and
every file's size and CRC32), written last. The save goes into ``<path>.incomplete`` and is
renamed to ``<path>`` only once every rank has finished, so a save that dies leaves an earlier
checkpoint at ``<path>`` intact and is refused by name ("incomplete checkpoint: rank 2 never
finished"). Loading checks every file's size and checksum (each rank a share of the files) and the
model, optimizer and groups against the record before reading anything into the model: bad input
raises with nothing loaded, on every rank alike. The ranks must see one file system.

Bytes per rank (:func:`checkpoint_bytes`): at stages 1-3 rank r writes (P + K) bytes per element it
owns, its share of (P + K)Ψ (P = 2 for the 16-bit working copy and K = 12 for Adam's fp32
master, momentum and variance in mixed precision; P = 4, K = 8 in fp32, where the parameter is
the master): no rank writes a whole parameter it does not own. At stage 0 every rank owns
everything and DCP writes each tensor once, from the rank that has written least so far.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minizero.data_parallel import DataParallel

# torch.distributed.checkpoint takes a second to import: it (and checkpoint_layout.py, built on it)
# is imported by the functions that use it, so that `import minizero` stays fast.

FORMAT = "minizero checkpoint"
VERSION = 1
RECORD = "minizero.json"  # the commit record, written last
STARTED = "saving.json"  # written first into <path>.incomplete: the world size of the save


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, damaged, or of something else."""


# -- saving ------------------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None
) -> Path:
    """Write this rank's part of ``model`` and ``optimizer`` (returned by ``minizero.parallelize``)
    into the directory ``path``; collective. ``extra`` (rank 0's is kept): anything picklable that
    resuming needs, e.g. ``{"step": step, "sched": scheduler.state_dict()}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from minizero import checkpoint_layout as L

    _check_pair(model, optimizer, "save_checkpoint")
    path = Path(path)
    tmp, group, rank, world = _incomplete(path), model.group, model.rank, model.world
    groups = {id(t): gi for gi, g in enumerate(optimizer.param_groups) for t in g["params"]}

    def prepare():
        if path.exists() and not (path / RECORD).exists():
            raise CheckpointError(
                f"{path} exists and is not a minizero checkpoint: save_checkpoint replaces only "
                "a checkpoint; choose another path"
            )
        entries = L.save_entries(model, optimizer, rank, extra)
        where = {f.name: groups.get(id(t)) for f, t in zip(model.fragments, model.frag_tensors)}
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # an earlier save that died
            tmp.mkdir(parents=True)
            write_json(tmp / STARTED, {"format": FORMAT, "world": world})
        return entries, where

    (sd, ranges), where = _everywhere(prepare, group, "save_checkpoint")
    placed: dict[str, int | None] = {}
    for part in _gather(where, group):
        placed.update(part)
    try:
        dcp.save(sd, storage_writer=L.Writer(tmp, rank), planner=L.FlatSavePlanner(ranges),
                 process_group=group)  # fmt: skip
    except CheckpointException as e:
        r, (exc, _) = next(iter(sorted(e.failures.items())))
        raise RuntimeError(
            f"save_checkpoint failed on rank {r} ({type(exc).__name__}: {exc}); {path} is "
            f"unchanged and {tmp} is left incomplete"
        ) from None

    def commit():
        if rank == 0:
            write_json(tmp / RECORD, _record(model, optimizer, world, placed, tmp, extra))
            old = path.with_name(path.name + ".old")
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                path.rename(old)
            tmp.rename(path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)

    _everywhere(commit, group, "save_checkpoint")
    return path


def _record(model, optimizer, world, placed, tmp: Path, extra) -> dict:
    from minizero import checkpoint_layout as L

    module = model.module
    names = L.canonical_names(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    keys = [
        [k, "param", names[id(params[k])]] if k in params else [k, "buffer"]
        for k in module.state_dict(keep_vars=True)
    ]
    files = {}
    for r in range(world):
        files.update(json.loads((tmp / f"rank-{r}.done").read_text())["files"])
    files[".metadata"] = file_info(tmp / ".metadata")
    cls = type(optimizer)
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved_with": {
            "world": world,
            "stage": model.stage,
            "precision": model.precision.name,
            "torch": torch.__version__,
        },  # fmt: skip
        "optimizer": f"{cls.__module__}.{cls.__qualname__}",
        "groups": len(optimizer.param_groups),
        "keys": keys,
        "params": {
            names[id(p)]: {
                "shape": list(p.shape),
                "trainable": p.requires_grad,
                "group": placed.get(names[id(p)]),
            }  # fmt: skip
            for p in module.parameters()
        },
        "scaler": model.scaler.state_dict() if model.scaler is not None else None,
        "extra": extra is not None,
        "files": files,
    }


# -- loading -------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer):
    """Load a checkpoint into ``model`` and ``optimizer`` (returned by ``minizero.parallelize``, at
    any world size, stage and precision); collective. Returns the ``extra`` it was saved with.
    Rank r < the saved world size gets saved rank r's RNG states; other ranks keep theirs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from minizero import checkpoint_layout as L

    _check_pair(model, optimizer, "load_checkpoint")
    group, rank, world = model.group, model.rank, model.world

    def validate():
        path_, record = open_checkpoint(path)
        files = sorted(record["files"])
        verify_files(path_, record, files[rank::world])  # every file, shared among the ranks
        canon = _match(record, model, optimizer)
        md = FileSystemReader(path_).read_metadata()
        targets, ranges = L.load_targets(model, optimizer, md, canon, rank)
        for key, (_numel, start) in ranges.items():
            saved = [(c.offsets[0], c.offsets[0] + c.sizes[0])
                     for c in md.state_dict_metadata[key].chunks]  # fmt: skip
            gap = L.uncovered(saved, (start, start + targets[key].numel()))
            if gap is not None:
                raise CheckpointError(f"checkpoint {path_} lacks elements {gap} of {key}: damaged")
        return path_, record, canon, targets, ranges

    path_, record, canon, targets, ranges = _everywhere(validate, group, "load_checkpoint")
    dcp.load(targets, storage_reader=FileSystemReader(path_), planner=L.FlatLoadPlanner(ranges),
             process_group=group)  # fmt: skip
    extra = L.apply_loaded(model, optimizer, targets, canon, rank)
    if model.scaler is not None and record["scaler"] is not None:
        model.scaler.load_state_dict(record["scaler"])
    return extra


def _match(record: dict, model: DataParallel, optimizer) -> dict[str, str]:
    """Check the checkpoint against this model and optimizer; return {model name: stored name}."""
    from minizero import checkpoint_layout as L

    saved = {k[0]: k for k in record["keys"]}
    params = record["params"]
    module = model.module
    for k, v in module.state_dict(keep_vars=True).items():
        if k not in saved:
            raise CheckpointError(
                f"the checkpoint holds another model: it has no {k!r}, which this model has "
                f"(first missing of {sum(1 for j in module.state_dict() if j not in saved)})"
            )
        if isinstance(v, torch.Tensor) and saved[k][1] == "param":
            shape = tuple(params[saved[k][2]]["shape"])
            if shape != tuple(v.shape):
                raise CheckpointError(
                    f"the checkpoint holds another model: {k!r} has shape {shape} there and "
                    f"{tuple(v.shape)} here"
                )
    extra_keys = [k for k in saved if k not in module.state_dict(keep_vars=True)]
    if extra_keys:
        raise CheckpointError(
            f"the checkpoint holds another model: it has {extra_keys[0]!r}, which this model "
            f"lacks ({len(extra_keys)} such entries)"
        )
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name != record["optimizer"]:
        raise CheckpointError(
            f"the checkpoint was saved with optimizer {record['optimizer']}, this one is {name}: "
            "build the same optimizer class to resume (minizero.consolidate gives the weights)"
        )
    if len(optimizer.param_groups) != record["groups"]:
        raise CheckpointError(
            f"the checkpoint's optimizer has {record['groups']} param groups, this one "
            f"{len(optimizer.param_groups)}: build the groups as they were when it was saved"
        )
    names = L.canonical_names(module)
    canon = {n: saved[n][2] for n in names.values()}
    groups = {id(t): gi for gi, g in enumerate(optimizer.param_groups) for t in g["params"]}
    for f, t in zip(model.fragments, model.frag_tensors, strict=True):
        was = params[canon[f.name]]["group"]
        if was is not None and groups.get(id(t)) != was:
            raise CheckpointError(
                f"{f.name!r} was in param group {was} when the checkpoint was saved and is in "
                f"{groups.get(id(t))} now: build the groups as they were"
            )
    return canon


# -- files: the record, completion, integrity ----------------------------------------------------
def open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory and its record; raises :class:`CheckpointError` if there is none,
    or only an incomplete save."""
    path = Path(path)
    if not (path / RECORD).is_file():
        partial = path if (path / STARTED).is_file() else _incomplete(path)
        if (partial / STARTED).is_file():
            raise CheckpointError(_incomplete_message(partial))
        old = path.with_name(path.name + ".old")
        if not path.exists():
            hint = f" (the save that replaced it died while renaming: it is {old})" if (
                old / RECORD).is_file() else ""  # fmt: skip
            raise CheckpointError(f"no checkpoint at {path}{hint}")
        raise CheckpointError(
            f"{path} is not a minizero checkpoint (no {RECORD}): pass a directory that "
            "minizero.save_checkpoint wrote"
        )
    try:
        record = json.loads((path / RECORD).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {RECORD} is not valid JSON ({e})"
        ) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minizero checkpoint ({RECORD} is something else)")
    if record.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {record.get('version')}; this minizero reads "
            f"version {VERSION}"
        )
    return path, record


def _incomplete_message(partial: Path) -> str:
    world = json.loads((partial / STARTED).read_text())["world"]
    missing = [r for r in range(world) if not (partial / f"rank-{r}.done").is_file()]
    if missing:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        return (
            f"incomplete checkpoint: {who} never finished ({partial} is a save that stopped "
            "before its commit; load an earlier checkpoint)"
        )
    return (
        f"incomplete checkpoint: every rank finished but the save was never committed "
        f"({partial} has no {RECORD}; load an earlier checkpoint)"
    )


def verify_files(path: Path, record: dict, names: list[str]) -> None:
    """Each named file has the size and CRC32 the record says; else :class:`CheckpointError`."""
    for name in names:
        want = record["files"][name]
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} has {size} bytes, {want['bytes']} were "
                "written (truncated or overwritten)"
            )
        if file_info(f)["crc32"] != want["crc32"]:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} does not match its CRC32 (corrupted)"
            )


def file_info(f: Path) -> dict:
    crc = 0
    with open(f, "rb") as fh:
        while block := fh.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return {"bytes": f.stat().st_size, "crc32": crc}


def write_json(f: Path, data: dict) -> None:
    tmp = f.with_name(f.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(f)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _incomplete(path: Path) -> Path:
    return path.with_name(path.name + ".incomplete")


# -- collective helpers ------------------------------------------------------------------------
def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _everywhere(fn, group, what: str):
    """Run ``fn`` on every rank; if it raised on any, raise the first failure on all of them."""
    try:
        result, error = fn(), None
    except Exception as e:
        result, error = None, e
    errors = _gather(None if error is None else (type(error).__name__, str(error)), group)
    for r, err in enumerate(errors):
        if err is not None:
            if error is not None and r == dist.get_rank(group):
                raise error
            kind = CheckpointError if err[0] == "CheckpointError" else RuntimeError
            raise kind(err[1] if kind is CheckpointError else f"{what}: rank {r}: {err[1]}")
    return result


def _check_pair(model, optimizer, what: str) -> None:
    if not isinstance(model, DataParallel):
        raise TypeError(
            f"{what} takes the model that minizero.parallelize returned, got "
            f"{type(model).__name__} (a plain model saves with torch.save(model.state_dict()))"
        )
    if getattr(optimizer, "_stage", None) is not model:
        raise TypeError(f"{what} takes the optimizer that minizero.parallelize returned with model")
    if model.params and not model.fragments:
        raise TypeError(f"{what}: {type(model).__name__} has no fragment layout; use parallelize")


# -- consolidation and bytes per rank (one process, no ranks) -------------------------------------
def consolidate(path: str | os.PathLike, *, working: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict in a checkpoint, for ``model.load_state_dict(strict=True)`` on a
    plain model: parameters in fp32 (``working=True``: the 16-bit working copy of a mixed-precision
    run), floating buffers in fp32, tied names sharing one tensor. Reads only the model's part."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from minizero import checkpoint_layout as L

    path, record = open_checkpoint(path)
    verify_files(path, record, sorted(record["files"]))
    md = FileSystemReader(path).read_metadata()
    stored = md.state_dict_metadata
    sd, ranges = {}, {}
    for name in record["params"]:
        key = f"model16/{name}" if working and f"model16/{name}" in stored else f"model/{name}"
        numel = stored[key].size[0]
        sd[key] = torch.empty(numel, dtype=stored[key].properties.dtype)
        ranges[key] = (numel, 0)
    for k in record["keys"]:
        if k[1] == "buffer":
            sd[f"buffer/{k[0]}"] = L.empty_for(stored[f"buffer/{k[0]}"])
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=FileSystemReader(path), planner=L.FlatLoadPlanner(ranges),
                 no_dist=True)  # fmt: skip
    out = {}
    for k in record["keys"]:
        if k[1] == "param":
            name = k[2]
            flat = sd.get(f"model16/{name}", sd.get(f"model/{name}"))
            out[k[0]] = flat.view(record["params"][name]["shape"])
        else:
            v = sd[f"buffer/{k[0]}"]
            out[k[0]] = v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return out


def checkpoint_bytes(path: str | os.PathLike) -> list[dict[str, int]]:
    """Per saving rank: ``files`` (bytes of its files), ``shards`` (bytes of elementwise data of
    trainable parameters it wrote: working copy, masters, optimizer states) and ``elements`` (how
    many parameter elements those cover, counted once)."""
    from torch.distributed.checkpoint import FileSystemReader

    path, record = open_checkpoint(path)
    md = FileSystemReader(path).read_metadata()
    world = record["saved_with"]["world"]
    out = [{"files": 0, "shards": 0, "elements": 0} for _ in range(world)]
    for name, info in record["files"].items():
        if name.startswith("__"):
            out[int(name[2:].split("_")[0])]["files"] += info["bytes"]
    trainable = {n for n, p in record["params"].items() if p["trainable"]}
    for index, where in md.storage_data.items():
        kind, _, rest = index.fqn.partition("/")
        name = rest.rsplit("/", 1)[0] if kind == "optim" else rest
        smd = md.state_dict_metadata[index.fqn]
        if kind not in ("model", "model16", "optim") or name not in trainable or not smd.size:
            continue
        rank = int(where.relative_path[2:].split("_")[0])
        chunk = next(c for c in smd.chunks if tuple(c.offsets) == tuple(index.offset))
        out[rank]["shards"] += chunk.sizes[0] * smd.properties.dtype.itemsize
        if kind == "model":
            out[rank]["elements"] += chunk.sizes[0]
    return out


def consolidate_main(argv: list[str]) -> int:
    """``python -m minizero consolidate CKPT OUT [--safetensors] [--working]``."""
    p = argparse.ArgumentParser(prog="minizero consolidate", description=consolidate.__doc__)
    p.add_argument("checkpoint", help="a directory that minizero.save_checkpoint wrote")
    p.add_argument("out", help="the file to write (torch.save format unless --safetensors)")
    p.add_argument("--safetensors", action="store_true", help="write safetensors instead")
    p.add_argument("--working", action="store_true", help="the 16-bit working copy, not fp32")
    a = p.parse_args(argv)
    try:
        state = consolidate(a.checkpoint, working=a.working)
    except CheckpointError as e:
        p.exit(1, f"minizero consolidate: {e}\n")
    if a.safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            p.exit(1, "minizero consolidate: --safetensors needs `pip install safetensors`\n")
        seen: set[int] = set()
        tensors = {}
        for k, v in state.items():  # safetensors refuses shared storage: tied names get a copy
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(tensors, a.out)
    else:
        torch.save(state, a.out)
    n = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    print(f"wrote {a.out}: {len(state)} entries, {n:,} elements")
    return 0
