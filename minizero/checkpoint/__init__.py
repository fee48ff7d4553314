"""Checkpoints: save sharded, resume exactly, at any world size and stage; consolidate. Lesson 07.

    minizero.save_checkpoint("ckpt/step_100", model, optimizer, extra={"step": 100,
                             "sched": scheduler.state_dict()})        # every rank calls it
    extra = minizero.load_checkpoint("ckpt/step_100", model, optimizer)  # any world/stage/precision
    state = minizero.consolidate("ckpt/step_100")   # full fp32 weights, one process, no ranks
    python -m minizero consolidate ckpt/step_100 model.pt [--safetensors]

Format: ``torch.distributed.checkpoint`` (DCP). A rank owns, of each parameter flattened, one
element range ([start, end): minizero/data_parallel.py's ``Fragment``); the ranges are uneven and
cut across rows. DTensor cannot say that (its placements cut a dimension into ``torch.chunk``
pieces), ShardedTensor can but is deprecated in favour of DTensor, and a rank-0 ``torch.save``
would gather the whole model on one rank. DCP's metadata, though, describes any saved piece as a
chunk (offsets, sizes) of a named tensor, and a 1-D range is one: two small planners
(layout.py; planners are DCP's documented extension point) save each range as a chunk
of the parameter's flat tensor under the parameter's name. DCP then reshards at load time (a
rank reads the saved chunks that overlap the ranges it now owns), and torch's own tools read the
files: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, "all.pt")`` gives every
tensor whole (parameters flat; :func:`consolidate` reshapes them and adds tied names).

On disk (checkpoint_files.py): one data file per rank, DCP's metadata, a completion marker per
rank and a commit record, ``minizero.json``, written last; the save is renamed into place only
once every rank has finished, so a save that dies leaves the previous checkpoint intact and is
refused by name ("incomplete checkpoint: rank 2 never finished"). Loading checks every file's
size and CRC32 and the model, optimizer and groups against the record before reading anything
into the model: bad input raises on every rank alike, with nothing loaded. The ranks must see
one file system.

Bytes per rank (:func:`checkpoint_bytes`): at stages 1-3 rank r writes (P + K) bytes per element
it owns, its share of (P + K)Ψ: P = 2 for the 16-bit working copy and K = 12 for Adam's fp32
master, momentum and variance in mixed precision; P = 4 and K = 8 in fp32, where the parameter
is its own master. No rank writes a parameter it does not own. At stage 0 every rank owns
everything and DCP writes each tensor once, from the rank that has written least so far.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minizero.checkpoint import files as F
from minizero.checkpoint.files import CheckpointError, checkpoint_bytes, open_checkpoint
from minizero.data_parallel import DataParallel
from minizero.optimizer import wrapper_of

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "consolidate_main",
           "checkpoint_bytes", "open_checkpoint", "CheckpointError"]  # fmt: skip

# torch.distributed.checkpoint takes a second to import: it (and layout.py, built on it)
# is imported by the functions that use it, so that `import minizero` stays fast.


# -- saving ------------------------------------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None
) -> Path:
    """Write this rank's part of ``model`` and ``optimizer`` (as ``minizero.parallelize`` returned
    them) into the directory ``path``; collective. ``extra`` (rank 0's is kept): anything picklable
    that resuming needs, e.g. ``{"step": step, "sched": scheduler.state_dict()}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from minizero.checkpoint import layout as L

    _check_pair(model, optimizer, "save_checkpoint")
    path, group, rank = Path(path), model.group, model.rank

    def prepare():
        entries = L.save_entries(model, optimizer, rank, extra)
        if rank == 0:
            F.start(path, model.world)
        return entries

    sd, ranges = _everywhere(prepare, group, "save_checkpoint")
    groups = {id(t): gi for gi, g in enumerate(optimizer.param_groups) for t in g["params"]}
    placed: dict[str, int | None] = {}  # parameter -> its param group, from every rank's fragments
    for part in _gather({f.name: groups.get(id(t)) for f, t in _frags(model)}, group):
        placed.update(part)
    tmp = F.incomplete_path(path)
    try:
        dcp.save(sd, storage_writer=L.Writer(tmp, rank), planner=L.FlatSavePlanner(ranges),
                 process_group=group)  # fmt: skip
    except CheckpointException as e:
        r, (exc, _) = sorted(e.failures.items())[0]
        before = "is unchanged" if (path / F.RECORD).is_file() else "was not created"
        raise RuntimeError(
            f"save_checkpoint failed on rank {r} ({type(exc).__name__}: {exc}); {path} {before} "
            f"and {tmp} is left incomplete"
        ) from None

    def commit():  # every rank has finished: rank 0 writes the record and renames into place
        if rank == 0:
            F.commit(path, _record(model, optimizer, placed, extra))

    _everywhere(commit, group, "save_checkpoint")
    return path


def _record(model: DataParallel, optimizer, placed: dict, extra) -> dict:
    """What the commit record says about the run: enough to check a model and optimizer against
    the checkpoint before loading, and to consolidate it without them."""
    from minizero.checkpoint import layout as L

    module = model.module
    names = L.canonical_names(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    keys = [  # the model's state_dict keys in order; a parameter's: its stored (first) name
        [k, "param", names[id(params[k])]] if k in params else [k, "buffer"]
        for k in module.state_dict(keep_vars=True)
    ]
    info = lambda p: {"shape": list(p.shape), "trainable": p.requires_grad,
                      "group": placed.get(names[id(p)])}  # fmt: skip
    return {
        "saved_with": {"world": model.world, "stage": model.stage,
                       "precision": model.precision.name,
                       "param_dtype": str(model.precision.param_dtype).removeprefix("torch."),
                       "torch": torch.__version__},
        "optimizer": _class_name(optimizer),
        "groups": len(optimizer.param_groups),
        "keys": keys,
        "params": {names[id(p)]: info(p) for p in module.parameters()},
        "scaler": model.scaler.state_dict() if model.scaler is not None else None,
        "extra": extra is not None,
        "ready": model.extension.bucket_order(),  # DDP's buckets' order (None: not cut again)
    }  # fmt: skip


# -- loading -------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer):
    """Load a checkpoint into ``model`` and ``optimizer`` (as ``minizero.parallelize`` returned
    them, at any world size, stage and precision); collective. Returns the ``extra`` it was saved
    with. Rank r < the saved world size gets saved rank r's RNG states; other ranks keep theirs.
    Every file and the model, optimizer and groups are checked first: on a bad checkpoint every
    rank raises :class:`CheckpointError` and nothing is loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from minizero.checkpoint import layout as L

    _check_pair(model, optimizer, "load_checkpoint")
    group, rank, world = model.group, model.rank, model.world
    ready = _everywhere(lambda: open_checkpoint(path)[1].get("ready"), group, "load_checkpoint")
    if ready is not None:  # cut DDP's buckets as the saved run had cut them
        model.extension.cut_as(ready)

    def validate():
        where, record = open_checkpoint(path)
        data = sorted(f for f in record["files"] if f != ".metadata")
        F.verify_files(where, record, [".metadata", *data[rank::world]])  # data: shared out
        canon = _match(record, model, optimizer)
        md = FileSystemReader(where).read_metadata()
        targets, ranges = L.load_targets(model, optimizer, md, canon, rank)
        for key, (_numel, start) in ranges.items():
            saved = [(c.offsets[0], c.offsets[0] + c.sizes[0])
                     for c in md.state_dict_metadata[key].chunks]  # fmt: skip
            gap = L.uncovered(saved, (start, start + targets[key].numel()))
            if gap is not None:
                raise CheckpointError(
                    f"checkpoint {where} is damaged: no piece holds {gap} of {key}"
                )
        return where, record, canon, targets, ranges

    where, record, canon, targets, ranges = _everywhere(validate, group, "load_checkpoint")
    try:  # into fresh tensors: the model is untouched until everything has been read
        dcp.load(targets, storage_reader=FileSystemReader(where),
                 planner=L.FlatLoadPlanner(ranges), process_group=group)  # fmt: skip
    except CheckpointException as e:
        r, (exc, _) = sorted(e.failures.items())[0]
        raise CheckpointError(
            f"checkpoint {where} could not be read on rank {r} ({type(exc).__name__}: {exc}); "
            "nothing was loaded"
        ) from None
    extra = L.apply_loaded(model, optimizer, targets, canon, rank)
    if model.scaler is not None and record["scaler"] is not None:
        model.scaler.load_state_dict(record["scaler"])
    return extra


def _match(record: dict, model: DataParallel, optimizer) -> dict[str, str]:
    """Check the checkpoint against this model and optimizer; return {model name: stored name}."""
    from minizero.checkpoint import layout as L

    saved = {k[0]: k for k in record["keys"]}
    params = record["params"]
    own = model.module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in saved]
    if missing:
        raise CheckpointError(
            f"the checkpoint holds another model: it has no {missing[0]!r}, which this model has "
            f"(first missing of {len(missing)})"
        )
    for k, v in own.items():
        if saved[k][1] == "param" and tuple(params[saved[k][2]]["shape"]) != tuple(v.shape):
            raise CheckpointError(
                f"the checkpoint holds another model: {k!r} has shape "
                f"{tuple(params[saved[k][2]]['shape'])} there and {tuple(v.shape)} here"
            )
    unknown = [k for k in saved if k not in own]
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds another model: it has {unknown[0]!r}, which this model "
            f"lacks ({len(unknown)} such entries)"
        )
    if _class_name(optimizer) != record["optimizer"]:
        raise CheckpointError(
            f"the checkpoint was saved with optimizer {record['optimizer']}, this one is "
            f"{_class_name(optimizer)}: build the same optimizer class to resume "
            "(minizero.consolidate gives the weights)"
        )
    if len(optimizer.param_groups) != record["groups"]:
        raise CheckpointError(
            f"the checkpoint's optimizer has {record['groups']} param groups, this one "
            f"{len(optimizer.param_groups)}: build the groups as they were when it was saved"
        )
    canon = {n: saved[n][2] for n in L.canonical_names(model.module).values()}
    groups = {id(t): gi for gi, g in enumerate(optimizer.param_groups) for t in g["params"]}
    for f, t in _frags(model):
        was, now = params[canon[f.name]]["group"], groups.get(id(t))
        if was is not None and now != was:
            raise CheckpointError(
                f"{f.name!r} was in param group {was} when the checkpoint was saved and is in "
                f"{now} now: build the groups as they were"
            )
    return canon


def _frags(model: DataParallel):
    return ((f, f.tensor) for f in model.fragments)


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)  # parallelize's subclass keeps the user's class's name and module
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_pair(model, optimizer, what: str) -> None:
    if not isinstance(model, DataParallel):
        raise TypeError(
            f"{what} takes the model that minizero.parallelize returned, got "
            f"{type(model).__name__} (a plain model saves with torch.save(model.state_dict()))"
        )
    if isinstance(optimizer, torch.optim.Optimizer) and wrapper_of(optimizer) is None:
        model.extension.adopt(optimizer)  # built after wrapping (FSDP2's order), not stepped yet
    if wrapper_of(optimizer) is not model:
        raise TypeError(f"{what} takes the optimizer that minizero.parallelize returned with model")
    if model.params and not model.fragments:
        raise TypeError(f"{what}: {type(model).__name__} has no fragment layout; use parallelize")
    if model.replicate_group is not None:  # HSDP: every node holds the shards
        raise NotImplementedError(
            f"{what} does not take a model parallelized with a mesh (HSDP) yet: save "
            f"model.state_dict() (full, fp32; call it on every rank, save on rank 0) instead"
        )


# -- collectives: every rank succeeds or fails alike ----------------------------------------------
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
            if err[0] == "CheckpointError":
                raise CheckpointError(err[1])
            raise RuntimeError(f"{what}: rank {r}: {err[0]}: {err[1]}")
    return result


# -- consolidation (one process, no ranks) -------------------------------------------------------
def consolidate(path: str | os.PathLike, *, working: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict in a checkpoint, for ``model.load_state_dict(strict=True)`` on a
    plain model: parameters and floating buffers in fp32 (``working=True``: in the run's working
    dtype, the 16-bit copy it computed with), tied names sharing one tensor. Reads only the
    model's part, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from minizero.checkpoint import layout as L

    path, record = open_checkpoint(path)
    F.verify_files(path, record, sorted(record["files"]))
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
    dtype = getattr(torch, record["saved_with"]["param_dtype"]) if working else torch.float32
    out, whole = {}, {}  # whole: stored name -> its tensor, one for all tied names
    for k in record["keys"]:
        if k[1] == "param":
            name = k[2]
            if name not in whole:
                flat = sd.get(f"model16/{name}", sd.get(f"model/{name}"))  # (numel,)
                whole[name] = flat.view(record["params"][name]["shape"]).to(dtype)
            out[k[0]] = whole[name]
        else:
            v = sd[f"buffer/{k[0]}"]
            out[k[0]] = v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
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
