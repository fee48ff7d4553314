"""torch DDP's buckets from its second iteration on: cut again, once, in the real ready order.

torch 2.13's DDP starts with one bucket (``_BucketCapacityConfig.compute_bucket_size_limits`` in
torch/nn/parallel/distributed.py; minizero's first buckets are the size rule over the predicted
order instead, minizero/bucket.py). During the first synchronised backward its reducer notes each
parameter as its gradient becomes ready (``rebuilt_params_``); before the next synchronised
forward it cuts the buckets over that order with the same caps (``Reducer::rebuild_buckets`` in
torch/csrc/distributed/c10d/reducer.cpp), every rank as rank 0 does (``sync_bucket_indices``), and
never again. With ``find_unused_parameters`` (and no ``static_graph``) it keeps its first buckets.

minizero does the same at stages 0-2 (stage 3's buckets are its units). :class:`ReadyOrder` notes
the order, not under ``no_sync()``; the buckets are cut again at the first ``zero_grad()`` after
that backward, where no gradient has to move, or at the next synchronised forward if every
``p.grad`` is None by then (a plain optimizer's ``zero_grad()`` does not reach the wrapper). What
moves is what sits on the buckets: the fp32 masters and each optimizer's param groups and states
(at stages 1-2 a rank owns chunk r of each bucket, so ownership changes: collective). A checkpoint
and an optimizer state dict record the order, and loading one cuts a fresh model's buckets the
same way (:meth:`Rebuild.rebuild_as`), so a resumed run goes on in the saved run's layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.data_parallel import DataParallel
from minizero.optimizer import regroup


class ReadyOrder:
    """The parameters in the order synchronised backwards make their gradients ready (each once,
    the first time), from a post-accumulate-grad hook on each, until :meth:`take`."""

    def __init__(self, params: list[nn.Parameter], synced: Callable[[], bool]):
        self.synced, self.expected = synced, len(params)
        self.seen: dict[int, nn.Parameter] = {}  # id(p) -> p, in ready order (dicts keep it)
        self.handles = [p.register_post_accumulate_grad_hook(self.ready) for p in params]

    def ready(self, p: nn.Parameter) -> None:  # argument: the parameter
        if self.synced():
            self.seen.setdefault(id(p), p)

    def complete(self) -> bool:
        return len(self.seen) == self.expected

    def take(self) -> list[nn.Parameter]:
        for h in self.handles:
            h.remove()
        return list(self.seen.values())


class Rebuild:
    """One wrapper's rebuild: ``recorder`` notes the order until it is done (None: done, or
    never)."""

    def __init__(self, wrapper: DataParallel) -> None:
        self.wrapper = wrapper
        self.on = getattr(type(wrapper), "rebuilds_buckets", False)
        self.on = self.on and not wrapper.find_unused_parameters  # as torch
        params = [p for p in wrapper.module.parameters() if p.requires_grad]
        self.recorder = ReadyOrder(params, lambda: wrapper.require_sync) if self.on else None

    def due(self) -> bool:
        return self.recorder is not None and self.recorder.complete()

    def at_zero_grad(self) -> None:
        if self.due():
            self.rebuild(self.recorder.take())

    def before_forward(self) -> None:
        w = self.wrapper
        if self.due() and torch.is_grad_enabled() and w.require_sync:  # torch's moment, when
            if all(p.grad is None for p in w.params):  # no gradient is held
                self.rebuild(self.recorder.take())

    def order(self) -> list[str] | None:
        """The names the buckets are cut over, in order (None where they are not rebuilt)."""
        w = self.wrapper
        return [w.param_names[id(p)] for b in w.buckets for p in b.params] if self.on else None

    def rebuild_as(self, names: list[str]) -> None:
        """Cut the buckets over a saved run's order (names), where it is another."""
        named = {self.wrapper.param_names[id(p)]: p for p in self.wrapper.params}
        if self.on and names != self.order() and sorted(names) == sorted(named):
            self.rebuild([named[n] for n in names])

    def rebuild(self, ready: list[nn.Parameter]) -> None:
        """Cut the buckets again over rank 0's ``ready``; the working copy moves as it is, the
        fp32 masters and each optimizer's groups and states whole, then cut to the new fragments."""
        w = self.wrapper
        self.recorder = None
        index = {id(p): i for i, p in enumerate(w.params)}
        order = torch.tensor([index[id(p)] for p in ready], device=w.params[0].device)
        w.broadcast_from_rank0(order, "ready order")  # every rank cuts the same, as torch
        moves = any(m is not None for m in w.masters)  # fp32 DDP: the parameters are the masters
        full = w.full_params() if moves else {}  # id(p) -> its whole fp32 master
        alive = {id(o): o for o in (ref() for ref in w.optimizers) if o is not None}
        optimizers = list(alive.values()) if moves else []  # each once
        for o in optimizers:
            unshard(o, w)
        w.lay_out([w.params[i] for i in order.tolist()])
        for f in w.fragments:
            if f.is_master:
                f.tensor.copy_(full[id(f.param)].reshape(-1)[f.start : f.end])
        for o in optimizers:
            regroup(o, w)


def unshard(optimizer: torch.optim.Optimizer, wrapper: DataParallel) -> None:
    """The inverse of :func:`~minizero.optimizer.regroup`: each group holds its parameters again
    and each state is whole, in the parameter's shape, put together from every rank's fragments
    (collective at stages 1-2, where a rank holds only its own; each element is on one rank)."""
    frag = {id(f.tensor): f for f in wrapper.fragments}
    index = {id(p): i for i, p in enumerate(wrapper.params)}
    mine: dict[int, tuple[int, dict]] = {}  # param index -> (group, {key: scalar, or None})
    held = []  # (fragment, its state) on this rank
    for gi, group in enumerate(optimizer.param_groups):
        for t in [t for t in group["params"] if id(t) in frag]:
            f, st = frag[id(t)], optimizer.state.pop(t, {})
            each = {k: v.shape == t.shape for k, v in st.items() if isinstance(v, torch.Tensor)}
            mine[index[id(f.param)]] = (gi, {k: None if each.get(k) else v for k, v in st.items()})
            held.append((f, st))
        group["params"] = [t for t in group["params"] if id(t) not in frag]
    parts = [mine]
    if wrapper.stage > 0:  # a rank knows only the parameters it holds fragments of
        parts = [None] * wrapper.world
        dist.all_gather_object(parts, mine, group=wrapper.group)
    info = {i: v for part in parts for i, v in part.items()}
    at: dict[tuple[int, str], int] = {}  # (param index, key) -> offset in one flat buffer
    n = 0
    for i, (_, keys) in sorted(info.items()):
        for k in [k for k, v in keys.items() if v is None]:
            at[i, k], n = n, n + wrapper.params[i].numel()
    like = next(m for m in wrapper.masters if m is not None)
    flat = torch.zeros(n, dtype=like.dtype, device=like.device)  # (n,) every elementwise state
    for f, st in held:
        for k, v in st.items():
            if (index[id(f.param)], k) in at:
                o = at[index[id(f.param)], k]
                flat[o + f.start : o + f.end] = v
    if wrapper.stage > 0:
        C.all_reduce(flat, group=wrapper.group, tag="optimizer states, whole")
    for i, (gi, keys) in sorted(info.items()):
        p = wrapper.params[i]
        optimizer.param_groups[gi]["params"].append(p)
        if keys:  # in the parameter's shape, which regroup cuts (a 0-d parameter's as (1,))
            optimizer.state[p] = {
                k: v if v is not None else flat[at[i, k] : at[i, k] + p.numel()].view(p.shape or 1)
                for k, v in keys.items()
            }
