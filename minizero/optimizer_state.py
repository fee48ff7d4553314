"""The optimizer's state dict where a rank holds only its shard (stages 1-3): what
``optimizer.state_dict()`` writes, and the whole one, gathered (so that a training script's own
save and resume, nanoGPT's among them, work at every stage).

At stages 1-3 (and in mixed precision) the optimizer steps this rank's fragments of the fp32
masters (data_parallel.py's ``Fragment``), so its own state dict holds only those. Two forms:

* **This rank's shard** (``optimizer.state_dict()``): numbered as a plain torch optimizer over
  the model's parameters would number them, each state a flat range of its parameter, marked
  ``"minizero_fragment"``. Only the same rank of the same layout loads it back
  (``StageStep.load_state_dict``). Written on rank 0 alone (nanoGPT's save) it is a warning; a
  plain optimizer loaded from it (nanoGPT's resume, before wrapping) is refused when adopted
  (habits/optimizer.py's ``check_loaded_state``), with the same fix.
* **The whole one** (:func:`consolidate`): what a plain optimizer over the model's parameters
  would return, every state of every parameter whole; collective, as
  ``ZeroRedundancyOptimizer.consolidate_state_dict(to=0)``. A plain optimizer loads it, and
  ``parallelize`` (or the adoption at its first step) cuts it to each rank's shard again: the
  resume of torch DDP's nanoGPT, at any stage.

    optimizer.consolidate_state_dict(to=0)   # every rank (collective)
    if rank == 0:
        torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}, path)
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.precision import full_dtype

FIX = (
    "call minizero.consolidate_state_dict(model, optimizer) on every rank before rank 0 saves "
    "(ZeroRedundancyOptimizer's optimizer.consolidate_state_dict(to=0) on every rank; FSDP2's "
    "get_optimizer_state_dict): rank 0's optimizer.state_dict() is then the whole state, as "
    "torch DDP's; or save with minizero.save_checkpoint(path, model, optimizer) on every rank"
)


def plain_params(optimizer) -> list[list[torch.Tensor]] | None:
    """Each group's parameters as the user built the optimizer (None: not recorded)."""
    return optimizer._wrapper.optimizers[optimizer].params


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
        if w.stage > 0:  # one rank's range: a plain optimizer loaded from it is refused.
            # Ints in a tuple: torch's load_state_dict keeps those (it rebuilds a str as text
            # of a generator)
            st["minizero_fragment"] = (f.start, f.end, f.param.numel(), w.rank, w.world, w.stage)
        else:  # stage 0's fragments are whole parameters (flat fp32 masters): their shape
            st = {k: v.view(f.param.shape) if _per_element(v, f.numel) else v
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
            state[i] = {k: v.reshape(t.shape) if _per_element(v, f.numel) else v
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
        state[i] = {k: _cut(v, f) for k, v in st.items()}
    groups_out = [{**g, "params": o["params"]} for g, o in zip(saved, own, strict=True)]
    return {"state": state, "param_groups": groups_out}


def _cut(v: object, f) -> object:
    """A per-parameter state value cut to fragment ``f`` (flat, in the master's dtype)."""
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        return v.detach().reshape(-1)[f.start : f.end].to(f.tensor.dtype).clone()
    return v


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
    receives it; the others get None (``to=None``: every rank receives it).

    Parameter by parameter (the most a rank holds beyond its partition is one parameter's states
    while they move, and on ``to`` the whole result): each rank fills its fragment's range of
    every per-element state into zeros, and an all-reduce sums the disjoint ranges. Which keys and
    scalars (``step``) a parameter has comes from the ranks that hold it (one small all-gather of
    objects)."""
    w, groups = optimizer._wrapper, plain_params(optimizer)
    sd = torch.optim.Optimizer.state_dict(optimizer)  # the groups' settings
    params = [p for g in groups for p in g]
    mine: dict[int, tuple[list[str], dict]] = {}  # plain index -> (per-element keys, scalars)
    held: dict[int, tuple] = {}  # plain index -> (fragment, its state) on this rank
    for i, p in enumerate(params):
        for f in w.fragments_of.get(id(p), []):
            st = optimizer.state.get(f.tensor)
            if st:
                keys = sorted(k for k, v in st.items() if _per_element(v, f.numel))
                mine[i] = (keys, {k: v for k, v in st.items() if k not in keys})
                held[i] = (f, st)
    parts = [mine]
    if w.stage > 0 and w.world > 1:
        parts = [None] * w.world
        dist.all_gather_object(parts, mine, group=w.group)
    info = {i: v for part in parts for i, v in part.items()}
    state = {}
    for i, (keys, scalars) in sorted(info.items()):
        p = params[i]
        # (keys, numel) in the masters' dtype (fp32; fp64): this rank's range of each state
        flat = torch.zeros(len(keys), p.numel(), dtype=full_dtype(w.precision), device=p.device)
        if keys and i in held:
            f, st = held[i]
            for r, k in enumerate(keys):
                flat[r, f.start : f.end] = st[k].reshape(-1)  # (fp32 DDP: the whole p)
        if keys and w.stage > 0 and w.world > 1:  # disjoint ranges: the sum is the whole
            C.all_reduce(flat, group=w.group, tag="consolidate optimizer state, one parameter")
        if to is None or w.rank == to:
            st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}
            st.update({k: flat[r].view(p.shape).clone() for r, k in enumerate(keys)})
            state[i] = st
    if to is not None and w.rank != to:
        return None
    n = 0
    for g, ps in zip(sd["param_groups"], groups, strict=True):
        g["params"] = list(range(n, n + len(ps)))
        n += len(ps)
    return {"state": state, "param_groups": sd["param_groups"]}


def _per_element(v: object, numel: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel
