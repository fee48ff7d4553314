"""torch DDP's buckets from its second iteration on: cut again, once, in the real ready order.

During its first synchronised backward torch's reducer notes each parameter as its gradient
becomes ready; before the next synchronised forward it cuts the buckets over that order with the
same caps (``Reducer::rebuild_buckets``, reducer.cpp), every rank as rank 0 does, and never again;
with ``find_unused_parameters`` it keeps its first buckets. ``DDP`` (and ZeRO-1/2, which keep its
buckets; stage 3's are its units) does the same: :meth:`Rebuild.note` records the order, and the
buckets are cut again at the first ``zero_grad()`` after that backward (no gradient has to move),
or at the next synchronised forward if every ``p.grad`` is None by then. What moves is what sits
on the buckets: the fp32 masters and each attached optimizer's param groups and states. At
stages 1-2 ownership follows the buckets, so they move between ranks, a parameter at a time: a
rank never holds more than one parameter's master and states beyond its partition. A checkpoint
and an optimizer state dict record the order (:meth:`Rebuild.order`); loading one cuts a fresh
model's buckets the same way (:meth:`Rebuild.rebuild_as`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C


class Rebuild:
    """One DDP's rebuild; ``seen``: the ready order so far (None: done, or never)."""

    def __init__(self, wrapper) -> None:
        self.wrapper = wrapper
        self.on = wrapper.rebuilds_buckets and not wrapper.find_unused_parameters  # as torch
        self.seen: dict[int, nn.Parameter] | None = {} if self.on else None  # id(p) -> p, in order

    def note(self, p: nn.Parameter) -> None:  # each parameter once, synchronised backwards
        if self.seen is not None and self.wrapper.require_sync:
            self.seen.setdefault(id(p), p)

    def when_due(self, forward: bool) -> None:
        """Cut at ``zero_grad()``, or at a synchronised training forward with no gradient held."""
        w, seen = self.wrapper, self.seen
        if seen is None or len(seen) < len(w.params):
            return
        held = any(p.grad is not None for p in w.params)
        held = held or getattr(w, "holds_unsynced_grads", lambda: False)()  # stages 2-3 no_sync
        if not forward or (torch.is_grad_enabled() and w.require_sync and not held):
            self.rebuild(list(seen.values()))

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
        """Cut the buckets again over rank 0's ``ready`` (fp32 DDP: nothing else moves)."""
        w, self.seen = self.wrapper, None
        index = {id(p): i for i, p in enumerate(w.params)}
        order = torch.tensor([index[id(p)] for p in ready], device=w.params[0].device)
        w.broadcast_from_rank0(order, "ready order")  # every rank cuts the same, as torch
        ready = [w.params[i] for i in order.tolist()]
        if all(m is None for m in w.masters):  # fp32 DDP: the parameters are the masters
            return w.lay_out(ready)
        self.move_states(ready)

    def move_states(self, ready: list[nn.Parameter]) -> None:
        """Cut, and move the fp32 masters and each optimizer's states, a parameter at a time."""
        w = self.wrapper
        old = dict(w.fragments_of)  # id(param) -> its fragments here, before the cut
        alive = list(w.optimizers)  # (held weakly: the live ones, in the order attached)
        held = [take_states(o, w) for o in alive]  # before the fragments change
        w.lay_out(ready)
        for o in alive:
            regroup(o, w)  # groups of the new fragments; their states follow, in move()
        move(w, old, list(zip(alive, held, strict=True)))


def regroup(optimizer: torch.optim.Optimizer, wrapper) -> None:
    """Swap each param group's parameters for this rank's fragments of them (the optimizer steps
    fp32 masters); a state already there (Adagrad's sum) gives each fragment its range."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    new: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for f in wrapper.fragments:
        if id(f.param) in group_of:
            new[group_of[id(f.param)]].append(f.tensor)
    for group, params in zip(optimizer.param_groups, new, strict=True):
        group["params"] = params
    if optimizer.state:
        old = dict(optimizer.state)
        optimizer.state.clear()
        for f in wrapper.fragments:
            if f.param in old:
                optimizer.state[f.tensor] = {k: fragment_of(v, f) for k, v in old[f.param].items()}


def fragment_of(value, f) -> object:
    """A per-parameter state value cut to fragment ``f``: tensors of the parameter's shape
    give their range (flat, in the master's dtype); scalars (``step``) are copied."""
    if isinstance(value, torch.Tensor) and value.shape == f.param.shape and value.dim() > 0:
        return value.detach().reshape(-1)[f.start : f.end].to(f.tensor.dtype).clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def take_states(optimizer: torch.optim.Optimizer, wrapper) -> dict:
    """Each param group gets its parameters back, the fragments' states are taken out: per
    parameter index, (group, state keys, scalars) known on every rank, states by fragment start."""
    frag = {id(f.tensor): f for f in wrapper.fragments}
    index = {id(p): i for i, p in enumerate(wrapper.params)}
    mine: dict[int, tuple[int, list, dict]] = {}  # param index -> (group, state keys, scalars)
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


def move(wrapper, old: dict, optimizers: list) -> None:
    """Per parameter, its master and states made whole from the old fragments (an all-reduce at
    stages 1-2) and cut to the new: a rank holds one parameter's beyond its partition, not KΨ."""
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
