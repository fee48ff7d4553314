"""Optimizer state moved between layouts, in one place: the fp32 masters and the optimizer's
states (the paper's K bytes per parameter), whole per parameter or cut into this rank's fragments.

Four callers, one mover:

* **Adoption** (:func:`regroup`): an optimizer over whole parameters, perhaps already holding
  state (nanoGPT's resume loads it before wrapping), gets this rank's fragments instead; each
  state its range (:func:`cut`). So does a whole state dict loaded after wrapping
  (:func:`shard_whole_state_dict`), and the checkpoint's load (minizero/checkpoint/layout.py)
  with the ranges it read.
* **The bucket rebuild** (:class:`Rebuild`): the fragments are cut again, and masters and states
  follow them, a parameter at a time (:func:`take`, then :func:`whole`, then :func:`cut`).
* **Consolidation** (:func:`consolidate`): the whole states, as a plain optimizer over the
  parameters returns them (:func:`take`, then :func:`whole`).
* **This rank's shard** (``optimizer.state_dict()``, :func:`shard_state_dict`): numbered as a
  plain torch optimizer over the model's parameters would number them, each state a flat range of
  its parameter, marked ``"minizero_fragment"``. Only the same rank of the same layout loads it
  back (``StageStep.load_state_dict``). Written on rank 0 alone (nanoGPT's save) it is a warning;
  a plain optimizer loaded from it (nanoGPT's resume, before wrapping) is refused when adopted
  (habits/optimizer.py's ``check_loaded_state``), with the same fix.

A state is per element (:func:`per_element`: Adam's moments, one value per element of the
parameter) or a scalar (``step``), copied as it is.

    optimizer.consolidate_state_dict(to=0)   # every rank (collective)
    if rank == 0:
        torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}, path)

The bucket rebuild, torch DDP's buckets from its second iteration on, cut again, once, in the
real ready order:

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

import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from minizero import collectives as C
from minizero.precision import full_dtype

MOVE = "masters and optimizer states, one parameter"
CONSOLIDATE = "consolidate optimizer state, one parameter"


# -- the mover ------------------------------------------------------------------------------------
def per_element(v: object, numel: int) -> bool:
    """A state with one value per element of a tensor of ``numel`` elements (not ``step``)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel


def cut(v: object, f) -> object:
    """A parameter's whole state value for fragment ``f``: a per-element one gives its range (flat,
    in the master's dtype); a scalar (``step``) is copied."""
    if per_element(v, f.param.numel()):
        return v.detach().reshape(-1)[f.start : f.end].to(f.tensor.dtype).clone()
    return v.clone() if isinstance(v, torch.Tensor) else v


def take(optimizer: torch.optim.Optimizer, wrapper, give_back: bool = False) -> dict:
    """This rank's fragments' states by parameter (index in ``wrapper.params``): ``info``, the same
    on every rank (one all-gather of objects): (group, per-element keys, scalars); ``states``:
    {fragment start: state}. ``give_back``: they leave, the groups get the parameters back."""
    frag = {id(f.tensor): f for f in wrapper.fragments}
    index = {id(p): i for i, p in enumerate(wrapper.params)}
    mine, states = {}, {}
    for gi, group in enumerate(optimizer.param_groups):
        for f in [frag[id(t)] for t in group["params"] if id(t) in frag]:
            st = optimizer.state.pop(f.tensor, {}) if give_back else optimizer.state.get(f.tensor)
            if st or give_back:  # (consolidate: a fragment without state has none to give)
                keys = sorted(k for k, v in st.items() if per_element(v, f.numel))
                mine[index[id(f.param)]] = (gi, keys, {k: st[k] for k in st if k not in keys})
                states.setdefault(index[id(f.param)], {})[f.start] = st
        if give_back:
            group["params"] = [t for t in group["params"] if id(t) not in frag]
    parts = [mine]
    if wrapper.sharded.state and wrapper.world > 1:
        parts = [None] * wrapper.world
        dist.all_gather_object(parts, mine, group=wrapper.group)
    info = {i: v for part in parts for i, v in part.items()}
    for i, (gi, _, _) in sorted(info.items()) if give_back else ():
        optimizer.param_groups[gi]["params"].append(wrapper.params[i])
    return {"optimizer": optimizer, "info": info, "states": states}


def whole(w, held: list[dict], old: dict, master: bool, tag: str) -> Iterator[tuple]:
    """Per parameter of ``w`` (in order): (index, parameter, rows, flat), ``flat`` (rows, numel)
    whole, from ``old`` (id(param) -> this rank's fragments: their ranges filled in, an all-reduce
    of the disjoint ranges at stages 1-3). Row 0 is the master if ``master``, then one per
    (held, per-element key) it has. A rank holds one parameter's beyond its partition, not KΨ."""
    for i, p in enumerate(w.params):
        rows = [(h, k) for h in held if i in h["info"] for k in h["info"][i][1]]
        flat = torch.zeros(master + len(rows), p.numel(), dtype=full_dtype(w.precision),
                           device=p.device)  # fmt: skip
        for f in old.get(id(p), []):  # this rank's old fragments filled in
            if master:
                flat[0, f.start : f.end] = f.tensor
            for r, (h, k) in enumerate(rows, start=master):
                if f.start in h["states"].get(i, {}):  # (consolidate: where it holds state)
                    flat[r, f.start : f.end] = h["states"][i][f.start][k].reshape(-1)
        for h in held:
            h["states"].pop(i, None)  # this parameter's old states: freed as it moves
        if len(flat) and w.sharded.state and w.world > 1:  # disjoint ranges: the sum is the whole
            C.all_reduce(flat, group=w.group, tag=tag)
        yield i, p, rows, flat


def state_of(h: dict, i: int, rows: list, flat: torch.Tensor) -> dict:
    """Parameter ``i``'s state in ``h``: its scalars, and a row of ``flat`` per key of ``rows``."""
    st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in h["info"][i][2].items()}
    return st | {k: flat[r].clone() for r, (hh, k) in enumerate(rows) if hh is h}


def regroup(optimizer: torch.optim.Optimizer, wrapper) -> None:
    """Swap each param group's parameters for this rank's fragments of them (the optimizer steps
    fp32 masters); a state already there (a loaded one) gives each fragment its range (``cut``)."""
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
                optimizer.state[f.tensor] = {k: cut(v, f) for k, v in old[f.param].items()}


# -- the bucket rebuild ---------------------------------------------------------------------------
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
        held = held or w.holds_unsynced_grads()  # stages 2-3: no_sync() buffers
        if not forward or (torch.is_grad_enabled() and w.require_sync and not held):
            self.cut(list(seen.values()))

    def order(self) -> list[str] | None:
        """The names the buckets are cut over, in order (None where they are not rebuilt)."""
        w = self.wrapper
        return [w.param_names[id(p)] for b in w.buckets for p in b.params] if self.on else None

    def rebuild_as(self, names: list[str]) -> None:
        """Cut the buckets over a saved run's order (names), where it is another."""
        named = {self.wrapper.param_names[id(p)]: p for p in self.wrapper.params}
        if self.on and names != self.order() and sorted(names) == sorted(named):
            self.cut([named[n] for n in names])

    def cut(self, ready: list[nn.Parameter]) -> None:
        """Cut the buckets again over rank 0's ``ready`` (fp32 DDP: nothing else moves)."""
        w, self.seen = self.wrapper, None
        index = {id(p): i for i, p in enumerate(w.params)}
        order = torch.tensor([index[id(p)] for p in ready], device=w.params[0].device)
        w.broadcast_from_rank0(order, "ready order")  # every rank cuts the same, as torch
        ready = [w.params[i] for i in order.tolist()]
        if not w.separate_masters:  # fp32 DDP: the parameters are the masters
            return w.lay_out(ready)
        self.move_states(ready)

    def move_states(self, ready: list[nn.Parameter]) -> None:
        """Cut, and move the fp32 masters and each optimizer's states, a parameter at a time: a
        rank holds one parameter's beyond its partition, not KΨ (:func:`whole`)."""
        w = self.wrapper
        old = dict(w.fragments_of)  # id(param) -> its fragments here, before the cut
        held = [take(o, w, give_back=True) for o in list(w.optimizers)]  # before the cut
        w.lay_out(ready)
        for h in held:
            regroup(h["optimizer"], w)  # groups of the new fragments; their states follow
        for i, p, rows, flat in whole(w, held, old, master=True, tag=MOVE):
            for f in w.fragments_of.get(id(p), []):
                f.tensor.copy_(flat[0, f.start : f.end])
                for h in [h for h in held if i in h["info"] and any(h["info"][i][1:])]:  # has state
                    h["optimizer"].state[f.tensor] = state_of(h, i, rows, flat[1:, f.start : f.end])


# -- the optimizer's state dict -------------------------------------------------------------------
FIX = (
    "call minizero.consolidate_state_dict(model, optimizer) on every rank before rank 0 saves "
    "(ZeroRedundancyOptimizer's optimizer.consolidate_state_dict(to=0) on every rank; FSDP2's "
    "get_optimizer_state_dict): rank 0's optimizer.state_dict() is then the whole state, as "
    "torch DDP's; or save with minizero.save_checkpoint(path, model, optimizer) on every rank"
)


def plain_params(optimizer) -> list[list[torch.Tensor]] | None:
    """Each group's parameters as the user built the optimizer (None: not recorded)."""
    return optimizer._wrapper.optimizers[optimizer].params  # (optimizer.Adopted)


def shard_state_dict(optimizer, sd: dict) -> dict:
    """torch's state dict of the fragments ``sd`` renumbered as a plain optimizer over the
    parameters numbers them: a parameter's index, its fragment's flat states, and where they sit
    (``"minizero_fragment"``: start, end, numel, rank, world, stage). Each rank holds at most one
    fragment of a parameter (its chunk of a bucket is contiguous): the numbering is one to one."""
    w, groups = optimizer._wrapper, plain_params(optimizer)
    plain = {id(p): i for i, p in enumerate(p for g in groups for p in g)}
    frag = {id(f.tensor): f for f in w.fragments}
    tensors = [t for g in optimizer.param_groups for t in g["params"]]  # torch's numbering
    state = {}
    for i, t in enumerate(tensors):
        f = frag.get(id(t))
        if f is None or i not in sd["state"]:
            continue
        st = dict(sd["state"][i])
        if w.sharded.state:  # one rank's range: a plain optimizer loaded from it is refused.
            # Ints in a tuple: torch's load_state_dict keeps those (it rebuilds a str as text
            # of a generator)
            st["minizero_fragment"] = (f.start, f.end, f.param.numel(), w.rank, w.world, w.stage)
        else:  # stage 0's fragments are whole parameters (flat fp32 masters): their shape
            st = {k: v.view(f.param.shape) if per_element(v, f.numel) else v
                  for k, v in st.items()}  # fmt: skip
        state[plain[id(f.param)]] = st
    for g, params in zip(sd["param_groups"], groups, strict=True):
        g["params"] = [plain[id(p)] for p in params]
    sd["state"] = state
    sd["minizero_shard"]["numbering"] = "parameters"
    return sd


def unshard_state_dict(optimizer, sd: dict) -> dict:
    """The inverse of :func:`shard_state_dict`, on the rank and layout that wrote it: torch's
    numbering of this optimizer's fragments."""
    w, groups = optimizer._wrapper, plain_params(optimizer)
    plain = {id(p): i for i, p in enumerate(p for g in groups for p in g)}
    frag = {id(f.tensor): f for f in w.fragments}
    tensors = [t for g in optimizer.param_groups for t in g["params"]]
    own = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]  # fragments' indices
    state = {}
    for i, t in enumerate(tensors):
        f = frag.get(id(t))
        st = None if f is None else sd["state"].get(plain[id(f.param)])
        if st is not None:  # (stage 0: each state back to the flat master's shape)
            state[i] = {k: v.reshape(t.shape) if per_element(v, f.numel) else v
                        for k, v in st.items() if k != "minizero_fragment"}  # fmt: skip
    saved = [{**g, "params": o["params"]} for g, o in zip(sd["param_groups"], own, strict=True)]
    return {"state": state, "param_groups": saved}


def shard_whole_state_dict(optimizer, sd: dict) -> dict:
    """A whole optimizer state dict (a plain optimizer's over the model's parameters, torch
    DDP's, :func:`consolidate`'s) loaded into this rank's optimizer after wrapping: each fragment
    gets its range of every per-element state, in torch's numbering of the fragments. Refused,
    saying which, where the groups or the states' shapes are not this model's."""
    w, groups = optimizer._wrapper, plain_params(optimizer)
    saved = sd["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g) for g in groups]:
        raise ValueError(
            f"this optimizer state dict has param groups of {[len(g['params']) for g in saved]} "
            f"parameters, the optimizer {[len(g) for g in groups]}: it is not a state dict of "
            f"this model's optimizer (at ZeRO stages 1-3 a rank's own optimizer.state_dict() "
            f"holds its shard only; to write a whole one, {FIX})"
        )
    index = {id(p): pi for g, sg in zip(groups, saved, strict=True)
             for p, pi in zip(g, sg["params"], strict=True)}  # fmt: skip
    frag = {id(f.tensor): f for f in w.fragments}
    tensors = [t for g in optimizer.param_groups for t in g["params"]]  # torch's numbering
    own = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]
    state = {}
    for i, t in enumerate(tensors):
        f = frag.get(id(t))
        st = None if f is None else sd["state"].get(index[id(f.param)])
        if not st:
            continue
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != f.param.shape:
                raise ValueError(
                    f"the optimizer state {k!r} of parameter {f.name!r} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(f.param.shape)}: not a whole "
                    f"state dict of this model (to write one at stages 1-3, {FIX})"
                )
        state[i] = {k: cut(v, f) for k, v in st.items()}
    groups_out = [{**g, "params": o["params"]} for g, o in zip(saved, own, strict=True)]
    return {"state": state, "param_groups": groups_out}


def warn_shard(optimizer, sd: dict) -> None:
    """``optimizer.state_dict()`` returned one rank's shard: say so when it is written."""
    w = optimizer._wrapper
    params = sum(len(g) for g in plain_params(optimizer) or [])
    warnings.warn(
        f"optimizer.state_dict() at ZeRO stage {w.stage} holds rank {w.rank}'s shard only: "
        f"{len(sd['state'])} flat fragments of the states of {params} parameters, the elements "
        f"this rank owns ({w.world} ranks hold one each). A checkpoint written from it cannot "
        f"resume (loading it is refused). To write the whole optimizer state, {FIX}",
        UserWarning,
        stacklevel=3,
    )


def consolidate(optimizer, to: int | None = 0) -> dict | None:
    """The whole optimizer state dict, as a plain torch optimizer over the model's parameters
    (in the groups and order the user built it with) would return it; collective over the
    wrapper's group (the ranks of one replica under HSDP). ``to``: the rank (of that group) that
    receives it; the others get None (``to=None``: every rank receives it). Parameter by
    parameter, as the rebuild moves them (:func:`take`, :func:`whole`)."""
    w, groups = optimizer._wrapper, plain_params(optimizer)
    sd = torch.optim.Optimizer.state_dict(optimizer)  # the groups' settings
    plain = {id(p): n for n, p in enumerate(p for g in groups for p in g)}
    held = take(optimizer, w)
    state = {}
    for i, p, rows, flat in whole(w, [held], w.fragments_of, master=False, tag=CONSOLIDATE):
        if i in held["info"] and (to is None or w.rank == to):
            state[plain[id(p)]] = state_of(held, i, rows, flat.view(len(flat), *p.shape))
    if to is not None and w.rank != to:
        return None
    n = 0
    for g, ps in zip(sd["param_groups"], groups, strict=True):
        g["params"] = list(range(n, n + len(ps)))
        n += len(ps)
    return {"state": dict(sorted(state.items())), "param_groups": sd["param_groups"]}
