"""A checkpoint on disk: the directory, its commit record, completion markers, integrity. Lesson 07.

    <path>.incomplete/          while saving; renamed to <path> once every rank has finished
        saving.json             written first by rank 0: {"format", "world"}
        __<r>_0.distcp          rank r's data (DCP, one file per rank)
        rank-<r>.done           rank r's marker, once its file is on disk: {"files": {name: size,
                                CRC32}}
        .metadata               DCP's metadata (which chunk of which tensor is where), rank 0
        minizero.json           the commit record, written last by rank 0 (see checkpoint.py)

A directory without ``minizero.json`` is never loaded: a save that died is named, with the ranks
that never finished. Each file's size and CRC32 are checked before anything is read into a model.
All writes of small files are write-to-temporary, fsync, rename.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

FORMAT = "minizero checkpoint"
VERSION = 1
RECORD = "minizero.json"  # the commit record, written last
STARTED = "saving.json"  # written first into <path>.incomplete: the world size of the save


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, damaged, or of something else."""


def incomplete_path(path: Path) -> Path:
    """Where a save into ``path`` writes until it commits."""
    return path.with_name(path.name + ".incomplete")


def start(path: Path, world: int) -> Path:
    """Rank 0, before any rank writes: a fresh ``<path>.incomplete`` (an earlier save that died
    there is removed). Refuses to replace a ``path`` that is not a checkpoint."""
    if path.exists() and not (path / RECORD).is_file():
        raise CheckpointError(
            f"{path} exists and is not a minizero checkpoint: save_checkpoint replaces only a "
            "checkpoint; choose another path"
        )
    tmp = incomplete_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_json(tmp / STARTED, {"format": FORMAT, "world": world})
    return tmp


def commit(path: Path, record: dict) -> None:
    """Rank 0, once every rank has finished: add every file's size and CRC32 to ``record``, write
    it, and rename ``<path>.incomplete`` to ``path`` (an earlier checkpoint there goes to
    ``<path>.old`` for the moment between the two renames, then is removed)."""
    tmp = incomplete_path(path)
    world = json.loads((tmp / STARTED).read_text())["world"]
    files = {}
    for r in range(world):
        files.update(json.loads((tmp / f"rank-{r}.done").read_text())["files"])
    files[".metadata"] = file_info(tmp / ".metadata")
    write_json(tmp / RECORD, {"format": FORMAT, "version": VERSION, **record, "files": files})
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory and its record; :class:`CheckpointError` if there is none."""
    path = Path(path)
    if not (path / RECORD).is_file():
        partial = path if (path / STARTED).is_file() else incomplete_path(path)
        if (partial / STARTED).is_file():
            raise CheckpointError(_incomplete_message(partial))
        old = path.with_name(path.name + ".old")
        if not path.exists():
            died = (old / RECORD).is_file()
            hint = f" (a save replacing it died between two renames: it is {old})" if died else ""
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
    """``{"bytes": size, "crc32": checksum}`` of a file."""
    crc = 0
    with open(f, "rb") as fh:
        while block := fh.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return {"bytes": f.stat().st_size, "crc32": crc}


def write_json(f: Path, data: dict) -> None:
    """Write ``data`` to ``f`` whole or not at all: a temporary file, fsync, rename."""
    tmp = f.with_name(f.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(f)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_bytes(path: str | os.PathLike) -> list[dict[str, int]]:
    """Per saving rank: ``files`` (bytes of its files), ``shards`` (bytes of the elementwise data of
    trainable parameters it wrote: working copy, fp32 masters, optimizer states) and ``elements``
    (how many parameter elements those cover)."""
    from torch.distributed.checkpoint import FileSystemReader

    path, record = open_checkpoint(path)
    md = FileSystemReader(path).read_metadata()
    out = [{"files": 0, "shards": 0, "elements": 0} for _ in range(record["saved_with"]["world"])]
    for name, info in record["files"].items():
        if name.startswith("__"):  # DCP's __<rank>_<n>.distcp
            out[int(name[2:].split("_")[0])]["files"] += info["bytes"]
    trainable = {n for n, p in record["params"].items() if p["trainable"]}
    for index, where in md.storage_data.items():
        kind, _, rest = index.fqn.partition("/")
        name = rest.rsplit("/", 1)[0] if kind == "optim" else rest
        stored = md.state_dict_metadata[index.fqn]
        if kind not in ("model", "model16", "optim") or name not in trainable or not stored.size:
            continue  # not elementwise data of a trainable parameter (scalars: 0-d)
        rank = int(where.relative_path[2:].split("_")[0])
        chunk = next(c for c in stored.chunks if tuple(c.offsets) == tuple(index.offset))
        out[rank]["shards"] += chunk.sizes[0] * stored.properties.dtype.itemsize
        if kind == "model":
            out[rank]["elements"] += chunk.sizes[0]
    return out
