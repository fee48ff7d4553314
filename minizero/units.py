"""ZeRO-3 units: which modules' parameters are gathered together, and the guard on the rest.

Taught in lesson 04 (04_zero3). A **unit** is a module whose whole subtree's parameters (minus
those of units nested inside it) live in one flat buffer that stage 3 all-gathers before the
module's forward and frees after it, as FSDP2's ``fully_shard(module)`` does. The root module is
always a unit: it holds whatever no other unit holds.

``select_units(model, units)`` picks them: module classes, a predicate ``module -> bool``, or
``None``, the default: the *repeated blocks*, i.e. the children of every ``nn.ModuleList`` and the
children of an ``nn.Sequential`` whose class appears there more than once (searched from the root
down; the search does not enter a block it picked). So ``nn.TransformerEncoderLayer``, a nanoGPT
``Block``, a torchvision ``BasicBlock`` or a Hugging Face ``GPT2Block`` is one unit each, and
``nn.MultiheadAttention``, which reads ``out_proj.weight`` without calling ``out_proj``, sits whole
inside one unit.

Between uses a sharded parameter keeps its shape but its storage has 0 bytes. Reading it then
would crash the process, so its class is switched to a guarded subclass whose
``__torch_function__`` lets metadata through (shape, dtype, ``.grad``, hooks, ``detach()``) and
raises :class:`ShardedParameterError` on anything that reads values. The switch costs a class
assignment per parameter when a unit is gathered or freed, and nothing on the ops of forward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from minizero import collectives as C

Units = type | tuple[type, ...] | Callable[[nn.Module], bool] | None


def _has_trainable(m: nn.Module) -> bool:
    return any(p.requires_grad for p in m.parameters())


def _repeated_blocks(root: nn.Module) -> set[nn.Module]:
    picked: set[nn.Module] = set()

    def visit(m: nn.Module) -> None:
        kids = list(m.children())
        if isinstance(m, nn.ModuleList):
            chosen = {c for c in kids if _has_trainable(c)}
        elif isinstance(m, nn.Sequential):
            count = Counter(type(c) for c in kids)
            chosen = {c for c in kids if count[type(c)] > 1 and _has_trainable(c)}
        else:
            chosen = set()
        for c in kids:
            if c in chosen:
                picked.add(c)
            else:
                visit(c)

    visit(root)
    return picked


def select_units(root: nn.Module, units: Units = None, min_params: int = 0) -> list[nn.Module]:
    """The unit modules of ``root``: the root first, then the picked ones in ``modules()`` order.

    ``units``: a module class or a tuple of them (every module of those classes is a unit), a
    function ``module -> bool``, or None for the repeated blocks (see the module docstring).
    ``min_params``: a picked module with fewer own trainable parameters (not in a unit inside it)
    is no unit; they join the unit around it. A unit costs three collectives whatever its size:
    small ones cost their latency (FSDP1's ``min_num_params``, DeepSpeed's persistence threshold).
    """
    if not isinstance(min_params, int) or isinstance(min_params, bool) or min_params < 0:
        raise ValueError(f"min_params must be an int >= 0 (parameters a unit), got {min_params!r}")
    if units is None:
        picked = _repeated_blocks(root)
    elif isinstance(units, type) or (
        isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)
    ):
        picked = {m for m in root.modules() if isinstance(m, units)}
    elif callable(units):
        picked = {m for m in root.modules() if units(m)}
    else:
        raise TypeError(
            "units must be a module class, a tuple of module classes, a function "
            f"module -> bool, or None (the repeated blocks), got {units!r}"
        )
    if min_params:
        picked = _at_least(root, picked, min_params)
    return [root] + [m for m in root.modules() if m in picked and m is not root]


def _at_least(root: nn.Module, picked: set[nn.Module], min_params: int) -> set[nn.Module]:
    """``picked`` less the units of under ``min_params`` own parameters, innermost first."""
    kept = set(picked)
    for m in [m for m in reversed(list(root.modules())) if m in kept]:  # innermost first
        inner = {id(p) for k in m.modules() if k is not m and k in kept for p in k.parameters()}
        own = {id(p): p.numel() for p in m.parameters() if p.requires_grad and id(p) not in inner}
        if sum(own.values()) < min_params:
            kept.discard(m)  # its parameters go to the unit around it
    return kept


def assign_params(
    root: nn.Module, unit_modules: list[nn.Module]
) -> tuple[list[list[nn.Parameter]], list[nn.Module], dict[nn.Module, list[int]]]:
    """Share the trainable parameters out among the units.

    A parameter belongs to the nearest unit above the first module (in ``modules()`` order) that
    registers it; a parameter registered again elsewhere (tied weights) stays there, and the unit
    of that other module *uses* it too. Returns the parameter groups (one per unit that owns any),
    the unit module of each group, and for each unit module the sorted group indices it needs.
    """
    is_unit = set(unit_modules)
    enclosing: dict[nn.Module, nn.Module] = {}

    def walk(m: nn.Module, unit: nn.Module) -> None:
        if m in enclosing:  # a module registered twice: its first place counts
            return
        enclosing[m] = m if m in is_unit else unit
        for c in m.children():
            walk(c, enclosing[m])

    walk(root, root)
    owner: dict[int, nn.Module] = {}  # id(param) -> its unit module
    own: dict[nn.Module, list[nn.Parameter]] = {u: [] for u in unit_modules}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad and id(p) not in owner:
                owner[id(p)] = enclosing[m]
                own[enclosing[m]].append(p)
    owning = [u for u in unit_modules if own[u]]
    index = {u: i for i, u in enumerate(owning)}
    uses: dict[nn.Module, set[int]] = {u: set() for u in unit_modules}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                uses[enclosing[m]].add(index[owner[id(p)]])
    needs = {u: sorted(uses[u]) for u in unit_modules if uses[u] or u is root}
    return [own[u] for u in owning], owning, needs


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a module's output: tensors, lists, tuples, dicts and dataclasses."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [t for o in out for t in output_tensors(o)]
    if isinstance(out, dict):  # OrderedDict and Hugging Face's ModelOutput included
        return [t for o in out.values() for t in output_tensors(o)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in output_tensors(getattr(out, f.name))]
    return []


class Accumulators:
    """The AccumulateGrad nodes of ``params`` (kept alive: the ones autograd runs), to tell from a
    hook inside backward what kind of pass it is. A deepcopy of the model gets none."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]

    def __deepcopy__(self, memo) -> Accumulators:
        return Accumulators([])

    def will_run(self) -> bool:
        """Whether this pass accumulates into some ``p.grad`` (``loss.backward()``) or computes
        other gradients only (``torch.autograd.grad(loss, inputs)``). Refuses a pass that builds
        a graph of the gradients (``create_graph=True``): it keeps parameters stage 3 frees."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "minizero ZeRO-3: backward with create_graph=True (a gradient penalty, double "
                "backward) is not supported at stage 3: the graph of the gradients holds unit "
                "parameters that stage 3 frees after use. Use stage 2 (parameters stay whole); "
                "torch.autograd.grad(loss, inputs) without create_graph works at every stage."
            )
        try:
            return any(map(torch._C._will_engine_execute_node, self.nodes))
        except RuntimeError:  # "... currently running autograd.grad()": nothing accumulates
            return False


# The usual cause, as nanoGPT's own train.py meets it at stage 3: it evaluates on rank 0 alone,
# while the others go on to the next training step. The fix lesson 09 teaches: every rank
# evaluates, rank 0 prints.
ONE_RANK_FORWARD = (
    " A forward run on some ranks only is the usual cause, e.g. an evaluation on rank 0 alone: "
    "`if master_process: losses = estimate_loss()` (nanoGPT's train.py). At stage 3 every rank "
    "evaluates and rank 0 prints: `losses = estimate_loss()` on every rank, then "
    "`if master_process: print(...)` (and save: model.state_dict() is collective too)."
)


class SameModule:
    """Stage 3's check that the ranks run the same unit modules, in two halves: each rank starts
    the all-gather of its ``code`` (2 * the module's index in ``names`` + 1 if backward starts from
    it) here, so that it can be in flight with the unit's own all-gather; :meth:`verify` waits
    for it and, where the codes differ, raises a ``RuntimeError`` naming what each rank ran.
    Verify before anything reads what was gathered after it: ranks that ran different modules
    may have paired their gathers of units of the same size."""

    def __init__(self, code: int, names: list[str], group, device: torch.device) -> None:
        self.names = names
        mine = torch.tensor([code], dtype=torch.int64, device=device)
        self.every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        gather = lambda a: dist.all_gather(self.every, mine, group=group, async_op=a)
        if dist.get_backend(group) == "gloo":  # temporaries: freed here, not on gloo's thread
            self.work = C.released(gather, (mine, *self.every), async_op=True)  # (no ledger)
        else:
            self.work = gather(True)

    def verify(self) -> None:
        self.work.wait()
        codes = [int(t) for t in self.every]
        if len(set(codes)) > 1:
            names = self.names
            what = lambda c: ("backward, from " if c % 2 else "forward of ") + repr(names[c // 2])
            ran = "; ".join(f"rank {r}: {what(c)}" for r, c in enumerate(codes))
            raise RuntimeError(
                f"minizero ZeRO-3: the ranks ran different modules at the same point ({ran}). "
                "Stage 3 all-gathers each unit's parameters with a collective, so every rank "
                "must run the same modules with parameters in the same order: make the branch "
                "the same on every rank (e.g. run both and select the output)." + ONE_RANK_FORWARD
            )


# -- the guard on sharded parameters -----------------------------------------------------------
class ShardedParameterError(RuntimeError):
    """A sharded ZeRO-3 parameter was read where only this rank's chunk of it exists."""


# What never reads a parameter's values: properties, metadata methods, hooks. ``detach`` and
# ``data`` give a tensor on the same (empty) storage, guarded too (``state_dict()`` uses detach).
_GET = {"shape", "dtype", "device", "grad", "_grad", "requires_grad", "is_leaf", "grad_fn",
        "layout", "ndim", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
        "is_mkldnn", "is_nested", "retains_grad", "output_nr", "_version", "itemsize", "nbytes",
        "_backward_hooks", "_post_accumulate_grad_hooks", "name"}  # fmt: skip
_SET = {"grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"}
_METHODS = {"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
            "is_contiguous", "stride", "storage_offset", "__len__", "requires_grad_",
            "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
            "untyped_storage", "data_ptr", "get_device", "is_shared", "is_pinned", "is_inference",
            "_is_view"}  # fmt: skip
_VIEWS = {"detach", "data"}


def _op_name(func) -> tuple[str, str]:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property: func is the descriptor's bound __get__
        return name, getattr(getattr(func, "__self__", None), "__name__", "?")
    return "call", name


# guarded tensor -> (name, unit, world) for the message; minizero's table, weakly keyed by the
# tensor's identity: nothing is written on the user's parameter
WHERE: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Guarded:
    """Mixin of the guarded classes; :data:`WHERE` says which parameter and unit each one is."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kind, name = _op_name(func)
        allowed = (
            (kind == "__get__" and name in _GET | _VIEWS)
            or (kind == "__set__" and name in _SET)
            or (kind == "call" and name in _METHODS | _VIEWS)
        )
        if not allowed:
            _raise(name, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if name in _VIEWS and kind != "__set__":
            out.__class__ = GuardedTensor  # same 0-byte storage: reading it must fail the same way
            WHERE[out] = WHERE.get(args[0])
        return out


def _raise(op: str, args, kwargs) -> None:
    stack, guarded = [args, kwargs], None
    while stack and guarded is None:  # the first guarded tensor among the arguments
        a = stack.pop(0)
        if isinstance(a, _Guarded):
            guarded = a
        elif isinstance(a, list | tuple):
            stack += list(a)
        elif isinstance(a, dict):
            stack += list(a.values())
    name, unit, world = WHERE.get(guarded) or ("a parameter", "?", "N")
    raise ShardedParameterError(
        f"minizero ZeRO-3: {op}() on {name}, which is sharded: between uses this rank holds only "
        f"its 1/{world} chunk, and the full tensor exists only while its unit ({unit}) runs "
        "forward or backward. To read or change it, wrap the code in `with "
        "model.summon_full_params():` on every rank (minizero.full_state_dict(model) gives a "
        "full copy); if a module reads it without calling its unit, pass units=... so that one "
        "unit contains both; an update written by hand cannot step shards: use a torch.optim "
        "optimizer (minizero adopts one built over model.parameters() at its first step)."
    )


class GuardedTensor(_Guarded, torch.Tensor):
    """``detach()`` or ``.data`` of a sharded parameter: the same empty storage, guarded."""

    __slots__ = ()


_guarded_classes: dict[type, type] = {}


def guarded_class(cls: type) -> type:
    """The guarded subclass of a parameter class (``nn.Parameter`` or the user's own)."""
    if cls not in _guarded_classes:
        _guarded_classes[cls] = type(f"Sharded{cls.__name__}", (_Guarded, cls), {"__slots__": ()})
    return _guarded_classes[cls]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a stage-3 parameter between uses (guarded: only its shard is here)."""
    return isinstance(t, _Guarded)


def set_guard(params: list[nn.Parameter], on: bool) -> None:
    """Switch ``params`` to their guarded class (``on``) or back to their own class."""
    for p in params:
        guarded = isinstance(p, _Guarded)
        if on and not guarded:
            p.__class__ = guarded_class(type(p))
        elif not on and guarded:
            p.__class__ = type(p).__mro__[2]  # (Sharded<cls>, _Guarded, <cls>, ...)


# -- full parameters outside forward -----------------------------------------------------------
@contextmanager
def summon_full_params(wrapper, writeback: bool = True):
    """``with model.summon_full_params(): ...`` (a ZeRO3 ``wrapper``): every parameter full on this
    rank, to read or change in place (``p.copy_``, ``load_state_dict`` on ``model.module``,
    ``print``).

    Collective: every rank enters it. The full tensors are new buffers (a copy kept from
    inside stays valid after), in the working dtype. On leaving, with ``writeback``, this
    rank's chunk of each parameter is copied back into its shard (so the edits must be the
    same on every rank to stay consistent) and the optimizer's masters are refreshed.
    """
    if any(wrapper._active) or wrapper.backward_end_queued:
        raise RuntimeError("summon_full_params() inside forward or backward: call it between steps")
    bufs, views = [], {}  # views: id(param) -> its view of flat_params, to put back
    for b, shard in zip(wrapper.buckets, wrapper.param_shards, strict=True):
        buf = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)  # (padded,)
        C.all_gather(buf, shard, group=wrapper.group, tag=f"summon params {b.index}")
        set_guard(b.params, False)
        for p in b.params:
            views[id(p)] = p.data
            p.data = b.view(buf, p)
        bufs.append(buf)
    moved = []
    try:
        yield
    except BaseException:
        writeback = False
        raise
    finally:
        for b, buf in zip(wrapper.buckets, bufs, strict=True):
            for p in b.params:
                if p.data_ptr() != b.view(buf, p).data_ptr():
                    moved.append(wrapper.param_names[id(p)])
                p.data = views[id(p)]
            set_guard(b.params, not wrapper.gathered[b.index])
    if moved:
        raise RuntimeError(
            f"inside summon_full_params() {moved[0]} was given a new tensor (p.data = ...), "
            "which the shards cannot see: change parameters in place (p.copy_(...))"
        )
    if writeback:
        with torch.no_grad():
            for b, buf, shard in zip(wrapper.buckets, bufs, wrapper.param_shards, strict=True):
                shard.copy_(b.chunk(buf, wrapper.rank))
        wrapper.params_written()


class UncopiedHook:
    """A hook that ``copy.deepcopy`` of the user's model makes a no-op (not a wrapper's copy)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo) -> Callable:
        return _no_op


def _no_op(*args) -> None:
    return None
