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
(at stages 1-2 a rank owns chunk r of each bucket, so ownership changes: collective). They move
a parameter at a time, so that beyond its partition a rank holds at most one parameter's master
and states while they move, never the model's KΨ that stages 1-2 partition. A checkpoint
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
        """Cut the buckets again over rank 0's ``ready``. The working copy moves as it is; the
        fp32 masters and each optimizer's states move a parameter at a time (:func:`move`)."""
        w = self.wrapper
        self.recorder = None
        index = {id(p): i for i, p in enumerate(w.params)}
        order = torch.tensor([index[id(p)] for p in ready], device=w.params[0].device)
        w.broadcast_from_rank0(order, "ready order")  # every rank cuts the same, as torch
        if all(m is None for m in w.masters):  # fp32 DDP: the parameters are the masters
            w.lay_out([w.params[i] for i in order.tolist()])
            return
        old = dict(w.fragments_of)  # id(param) -> its fragments here, before the cut
        alive = {id(o): o for o in (ref() for ref in w.optimizers) if o is not None}
        held = {id(o): take_states(o, w) for o in alive.values()}  # before the fragments change
        w.lay_out([w.params[i] for i in order.tolist()])
        for o in alive.values():
            regroup(o, w)  # groups of the new fragments; their states follow, in move()
        move(w, old, [(o, held[id(o)]) for o in alive.values()])


def take_states(optimizer: torch.optim.Optimizer, wrapper: DataParallel) -> dict:
    """Give each param group its parameters back in place of this rank's fragments, and take
    the fragments' states out: ``{param index: (group, states by fragment start)}`` for the
    parameters this rank holds a fragment of, known on every rank (small: an all-gather of
    objects at stages 1-2, where a rank holds only its own fragments)."""
    frag = {id(f.tensor): f for f in wrapper.fragments}
    index = {id(p): i for i, p in enumerate(wrapper.params)}
    mine: dict[int, tuple[int, list]] = {}  # param index -> (group, state keys and scalars)
    states: dict[int, dict[int, dict]] = {}  # param index -> {fragment start: its state}
    for gi, group in enumerate(optimizer.param_groups):
        for t in [t for t in group["params"] if id(t) in frag]:
            f, st = frag[id(t)], optimizer.state.pop(t, {})
            i = index[id(f.param)]
            scalars = {k: v for k, v in st.items() if not _elementwise(v, f)}
            mine[i] = (gi, sorted(k for k in st if k not in scalars), scalars)
            states.setdefault(i, {})[f.start] = st
        group["params"] = [t for t in group["params"] if id(t) not in frag]
    parts = [mine]
    if wrapper.stage > 0:
        parts = [None] * wrapper.world
        dist.all_gather_object(parts, mine, group=wrapper.group)
    info = {i: v for part in parts for i, v in part.items()}
    for i, (gi, _, _) in sorted(info.items()):
        optimizer.param_groups[gi]["params"].append(wrapper.params[i])
    return {"info": info, "states": states}


def _elementwise(v: object, f) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == f.numel


def move(wrapper: DataParallel, old: dict, optimizers: list) -> None:
    """For each parameter in turn: its fp32 master and its elementwise states, put together
    whole from the old fragments (an all-reduce at stages 1-2, where each element is on one rank),
    then cut to the new fragments. One parameter at a time: the most a rank holds beyond its
    partition is one parameter's master and states, never the whole model's KΨ."""
    w = wrapper
    like = next(m for m in w.masters if m is not None)  # the masters' dtype and device
    for i, p in enumerate(w.params):
        # rows of flat: 0 the master, then one per (optimizer, state key) this parameter has
        rows = [(o, h, k) for o, h in optimizers if i in h["info"] for k in h["info"][i][1]]
        flat = torch.zeros(1 + len(rows), p.numel(), dtype=like.dtype, device=like.device)
        for f in old.get(id(p), []):  # (1 + rows, numel), this rank's old fragments filled in
            flat[0, f.start : f.end] = f.tensor
            for r, (_, h, k) in enumerate(rows, start=1):
                flat[r, f.start : f.end] = h["states"][i][f.start][k]
        for _, h in optimizers:
            h["states"].pop(i, None)  # this parameter's old states: freed as it moves
        if w.stage > 0:
            C.all_reduce(flat, group=w.group, tag="masters and optimizer states, one parameter")
        for f in w.fragments_of.get(id(p), []):
            f.tensor.copy_(flat[0, f.start : f.end])
            for o, h in optimizers:
                _, names, scalars = h["info"].get(i, (None, [], {}))
                if names or scalars:
                    st = {k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in scalars.items()}  # fmt: skip
                    for r, (oo, _, k) in enumerate(rows, start=1):
                        if oo is o:
                            st[k] = flat[r, f.start : f.end].clone()
                    o.state[f.tensor] = st
