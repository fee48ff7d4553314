"""A checkpoint's layout: every parameter by name, each rank's part by element range. Lesson 07.

Each rank of a stage owns, of each parameter ``p`` (flattened), one range ``[start, end)``: the
whole of it at stage 0 (DDP), the part of it that falls in the rank's chunk of its bucket at
stages 1-3 (``DataParallel.fragments``, lesson 02). A checkpoint stores, under the parameter's
name, a 1-D tensor of ``p.numel()`` elements of which each rank writes only its range:

    model/<name>          fp32 master values (the parameter itself in fp32)     (numel,) float32
    model16/<name>        the 16-bit working copy (mixed precision only)        (numel,) bf16/fp16
    optim/<name>/<key>    per-element optimizer state (exp_avg, momentum, ...)  (numel,)
    optim/<name>/<key>    per-parameter scalars (Adam's step): 0-d, one copy     ()
    optim/param_groups    the groups' settings (lr, betas, weight_decay, ...)   pickled, rank 0
    buffer/<key>          buffers (and other state_dict entries), as they are   rank 0
    rng/<rank>/cpu|cuda   each rank's random number generator states            uint8
    extra                 what the caller passed (LR scheduler, data position)  pickled, rank 0

The files say nothing about buckets, ranks or world sizes: a rank that now owns ``[a, b)`` of
``model/<name>`` reads those elements, from whichever saved pieces hold them (:func:`read_plan`).
Frozen parameters are stored whole under ``model/<name>`` by rank 0. Tied parameters are stored
once, under their first name (``named_parameters()`` order). Loading rebuilds the working copy
from the masters, as the end of an optimizer step does; ``model16`` is there for
``consolidate(..., working=True)``: the 16-bit weights the ranks ran with.

The two DCP planners below teach ``torch.distributed.checkpoint`` this layout: a saved piece is a
chunk ``[start, start + n)`` of a 1-D tensor of ``numel`` elements, the same description DCP
keeps for a DTensor or ShardedTensor shard, so DCP's own resharding reads it back at any layout
and its tools (``dcp_to_torch_save``) read the whole tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from minizero.data_parallel import DataParallel
from minizero.optimizer.state import per_element

# key -> (numel of the whole flattened tensor, the element where this rank's piece of it starts);
# the piece's length is the saved tensor's. (A range, elsewhere here, is (start, end).)
Pieces = dict[str, tuple[int, int]]

# 0-d optimizer states that are one number per parameter (not per element), whatever its shape.
SCALAR_STATES = {"step", "eta", "mu", "mu_product"}


# -- what this rank owns -------------------------------------------------------------------------
def owned_ranges(model: DataParallel) -> dict[str, tuple[int, int]]:
    """``{name: (start, end)}``: the elements of each trainable parameter (flattened) this rank
    owns, i.e. steps and saves. Stage 0: ``(0, numel)`` for all; stages 1-3: the part of the
    parameter inside this rank's chunk of its bucket (absent when none is)."""
    return {f.name: (f.start, f.end) for f in model.fragments}


def read_plan(
    saved: list[tuple[int, int]], want: tuple[int, int]
) -> list[tuple[int, int, int, int]]:
    """Which saved pieces give the elements ``want = (start, end)``, and where.

    ``saved``: the ``(start, end)`` of each saved piece of one flat tensor. Returns one
    ``(k, src, dst, n)`` per piece ``k`` that overlaps ``want``: its elements ``[src, src + n)``
    (counted from the piece's start) go to ``[dst, dst + n)`` of the wanted range (counted from
    ``want[0]``). Lesson 07's second exercise; DCP's ``create_read_items_for_chunk_list`` does the
    same in any number of dimensions.
    """
    lo, hi = want
    plan = []
    for k, (s, e) in enumerate(saved):
        a, b = max(s, lo), min(e, hi)
        if a < b:
            plan.append((k, a - s, a - lo, b - a))
    return plan


def uncovered(saved: list[tuple[int, int]], want: tuple[int, int]) -> tuple[int, int] | None:
    """The first sub-range of ``want`` that no saved piece holds, or None."""
    lo, hi = want
    have = sorted((lo + dst, lo + dst + n) for _, _, dst, n in read_plan(saved, want))
    at = lo
    for a, b in have:
        if a > at:
            return (at, a)
        at = max(at, b)
    return (at, hi) if at < hi else None


# -- teaching DCP the layout ----------------------------------------------------------------------
class FlatSavePlanner(DefaultSavePlanner):
    """Writes ``state_dict[key]`` (a 1-D piece) as chunk ``[start, start + n)`` of a 1-D tensor of
    ``numel`` elements, for every ``key`` in ``ranges``; everything else as DCP always does (a
    plain tensor or object; a key several ranks hold is written once: DCP's deduplication)."""

    def __init__(self, ranges: Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ranges = ranges

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self.ranges}
        items = list(create_default_local_save_plan(rest, self.is_coordinator).items)
        for key, (numel, start) in self.ranges.items():
            piece = self.state_dict[key]  # (n,) this rank's elements [start, start + n)
            chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=piece.size())
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size([start])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties.create_from_tensor(piece),
                        size=torch.Size([numel]),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.ranges:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class FlatLoadPlanner(DefaultLoadPlanner):
    """Fills ``state_dict[key]`` (a 1-D tensor of n elements) with elements ``[start, start + n)``
    of the saved 1-D tensor ``key``, for every ``key`` in ``ranges``, from whichever saved chunks
    hold them (DCP's resharding); everything else whole. Objects arrive in ``state_dict``."""

    def __init__(self, ranges: Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ranges = ranges

    def create_local_plan(self) -> LoadPlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self.ranges}
        items = list(create_default_local_load_plan(rest, self.metadata, strict=True).items)
        for key, (_numel, start) in self.ranges.items():
            target = self.state_dict[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size([start]), sizes=target.size())
            saved = self.metadata.state_dict_metadata[key]
            items += create_read_items_for_chunk_list(key, saved, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.ranges:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


class Writer(FileSystemWriter):
    """DCP's file writer (one file per rank), which also leaves ``rank-<r>.done`` once this rank's
    files are on disk, with their sizes and CRC32s."""

    def __init__(self, path: Path, rank: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._rank = rank

    def write_data(self, plan, planner):
        from minizero.checkpoint.files import file_info, write_json

        done = super().write_data(plan, planner)
        files = sorted({r.storage_data.relative_path for r in done.wait()})
        path = Path(self.path)
        marker = {"rank": self._rank, "files": {f: file_info(path / f) for f in files}}
        write_json(path / f"rank-{self._rank}.done", marker)
        return done


# -- this rank's part of the model and optimizer, under the layout's keys ----------------------
def canonical_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (a tied parameter has several)."""
    return {id(p): n for n, p in reversed(list(module.named_parameters()))}


def state_kind(key: str, value, frag: torch.Tensor) -> str:
    """How an optimizer state is stored: "elem" (one value per element), "scalar", "object"."""
    if not isinstance(value, torch.Tensor):
        return "object"
    if value.dim() == 0 and (frag.dim() > 0 or key in SCALAR_STATES):
        return "scalar"
    if value.numel() == frag.numel():
        return "elem"
    raise ValueError(
        f"optimizer state {key!r} has shape {tuple(value.shape)}, neither one value per element "
        f"of its tensor ({tuple(frag.shape)}) nor one number: minizero cannot reshard it"
    )


def save_entries(
    model: DataParallel, optimizer: torch.optim.Optimizer, rank: int, extra=None
) -> tuple[dict, Pieces]:
    """This rank's state dict for DCP and the ranges of its pieces. Rank 0 adds what is
    replicated (frozen parameters, buffers, group settings, ``extra``)."""
    sd: dict = {}
    ranges: Pieces = {}
    mixed = model.precision.master
    for f in model.fragments:
        t = f.tensor  # what the optimizer steps: (numel,) fp32 master view, or the param
        numel = f.param.numel()
        sd[f"model/{f.name}"] = t.detach().reshape(-1)  # (n,) fp32, elements [start, end)
        ranges[f"model/{f.name}"] = (numel, f.start)
        if mixed:
            sd[f"model16/{f.name}"] = model.fragment_values(f)  # (stage 3: its shard between uses)
            ranges[f"model16/{f.name}"] = (numel, f.start)
        for key, v in optimizer.state.get(t, {}).items():
            fqn = f"optim/{f.name}/{key}"
            kind = state_kind(key, v, t)
            if kind == "elem":
                sd[fqn] = v.detach().reshape(-1)
                ranges[fqn] = (numel, f.start)
            else:  # one value for the whole parameter: every owner holds it, DCP writes it once
                sd[fqn] = v.detach() if kind == "scalar" else v
    if rank == 0:
        names = canonical_names(model.module)
        for p in model.module.parameters():
            if not p.requires_grad:  # replicated, whole
                sd[f"model/{names[id(p)]}"] = p.detach().float().reshape(-1)
                ranges[f"model/{names[id(p)]}"] = (p.numel(), 0)
        params = dict(model.module.named_parameters(remove_duplicate=False))
        for k, v in model.module.state_dict(keep_vars=True).items():
            if k not in params:
                sd[f"buffer/{k}"] = v.detach() if isinstance(v, torch.Tensor) else v
        sd["optim/param_groups"] = [
            {k: v for k, v in g.items() if k not in ("params", "param_names")}
            for g in optimizer.param_groups
        ]
        if extra is not None:
            sd["extra"] = extra
    sd[f"rng/{rank}/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng/{rank}/cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return sd, ranges


def load_targets(
    model: DataParallel,
    optimizer: torch.optim.Optimizer,
    md: Metadata,
    canon: dict[str, str],
    rank: int,
) -> tuple[dict, Pieces]:
    """Fresh tensors for everything this rank needs from a checkpoint whose DCP metadata is
    ``md``; ``canon`` maps this model's parameter names to the checkpoint's stored names."""
    sd: dict = {}
    ranges: Pieces = {}
    in_optimizer = {id(t) for g in optimizer.param_groups for t in g["params"]}
    stored = md.state_dict_metadata
    states = optimizer_keys(stored)
    for f in model.fragments:
        t = f.tensor  # what the optimizer steps: (numel,) fp32 master view, or the param
        c = canon[f.name]
        numel = f.param.numel()
        sd[f"model/{c}"] = torch.empty(f.numel, dtype=torch.float32, device=t.device)
        ranges[f"model/{c}"] = (numel, f.start)
        if id(t) not in in_optimizer:
            continue
        for key in states.get(c, []):
            fqn, smd = f"optim/{c}/{key}", stored[f"optim/{c}/{key}"]
            if isinstance(smd, BytesStorageMetadata):
                sd[fqn] = None
            elif len(smd.size) == 0:
                sd[fqn] = torch.empty((), dtype=smd.properties.dtype)
            else:
                sd[fqn] = torch.empty(f.numel, dtype=smd.properties.dtype, device=t.device)
                ranges[fqn] = (numel, f.start)
    names = canonical_names(model.module)
    for p in model.module.parameters():
        if not p.requires_grad:
            c = canon[names[id(p)]]
            sd[f"model/{c}"] = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
            ranges[f"model/{c}"] = (p.numel(), 0)
    for fqn, smd in stored.items():
        if fqn.startswith("buffer/"):
            sd[fqn] = empty_for(smd)
    sd["optim/param_groups"] = None
    if "extra" in stored:
        sd["extra"] = None
    for dev in ("cpu", "cuda"):
        if f"rng/{rank}/{dev}" in stored:
            sd[f"rng/{rank}/{dev}"] = empty_for(stored[f"rng/{rank}/{dev}"])
    return sd, ranges


def empty_for(smd) -> torch.Tensor | None:
    """A CPU tensor to load a whole stored entry into (None for a stored object)."""
    if isinstance(smd, BytesStorageMetadata):
        return None
    return torch.empty(tuple(smd.size), dtype=smd.properties.dtype)


def apply_loaded(
    model: DataParallel,
    optimizer: torch.optim.Optimizer,
    sd: dict,
    canon: dict[str, str],
    rank: int,
):
    """Put what :func:`load_targets` received in place: fp32 masters (and from them, as after an
    optimizer step, the working copy), frozen parameters, buffers, optimizer state and groups,
    RNG states. Returns ``extra``."""
    with torch.no_grad():
        for f in model.fragments:
            t = f.tensor  # what the optimizer steps: (numel,) fp32 master view, or the param
            t.copy_(sd[f"model/{canon[f.name]}"].view(t.shape))
        names = canonical_names(model.module)
        for p in model.module.parameters():
            if not p.requires_grad:
                p.copy_(sd[f"model/{canon[names[id(p)]]}"].view(p.shape))
        own = model.module.state_dict(keep_vars=True)
        params = dict(model.module.named_parameters(remove_duplicate=False))
        for k, v in own.items():
            if k not in params and isinstance(v, torch.Tensor):
                v.copy_(sd[f"buffer/{k}"])
    model.after_step()  # masters -> working copy (and all-gathered at stages 1-2), as a step ends
    model.end_step()
    frag_of = {id(f.tensor): f for f in model.fragments}
    current = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]  # this one's indices
    received = optimizer_keys(sd)
    state, i = {}, 0
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) not in frag_of:  # a frozen parameter in an fp32 DDP optimizer: no state
                i += 1
                continue
            c = canon[frag_of[id(t)].name]
            st = {}
            for key in received.get(c, []):
                v = sd[f"optim/{c}/{key}"]
                st[key] = v.view(t.shape) if per_element(v, t.numel()) else v  # a (n,) piece
            if st:
                state[i] = st
            i += 1
    groups = []  # the saved settings (lr, betas, ...), this optimizer's parameters
    for saved, cur in zip(sd["optim/param_groups"], current, strict=True):
        groups.append({**saved, **{k: cur[k] for k in ("params", "param_names") if k in cur}})
    # numbered as torch numbers this optimizer's fragments: torch's own load (StageStep's would
    # take a dict without minizero's record for a whole one, numbered by parameter)
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": state, "param_groups": groups})
    model.optimizers[optimizer].full = None  # a consolidated state dict is of before
    if f"rng/{rank}/cpu" in sd:
        torch.set_rng_state(sd[f"rng/{rank}/cpu"])
    if f"rng/{rank}/cuda" in sd and torch.cuda.is_available():
        saved = list(sd[f"rng/{rank}/cuda"])
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
    return sd.get("extra")


def optimizer_keys(entries) -> dict[str, list[str]]:
    """Stored name -> its optimizer state keys, from ``optim/<name>/<key>`` entries."""
    out: dict[str, list[str]] = {}
    for fqn in entries:
        if fqn.startswith("optim/") and fqn != "optim/param_groups":
            name, key = fqn[len("optim/") :].rsplit("/", 1)
            out.setdefault(name, []).append(key)
    return out
