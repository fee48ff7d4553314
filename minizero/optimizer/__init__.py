"""The optimizer that ``parallelize`` returns: the user's own, with the stage around its step.

Taught in lesson 02 (02_zero1). The user builds a normal torch optimizer over the model's own
parameters, with any param groups and per-group settings (nanoGPT's weight decay on 2-D weights
only, say). :func:`regroup` keeps that very object, its class, defaults and every group's settings,
and swaps each group's parameters for the tensors this rank updates: the parameter's fragments in
this rank's fp32 master shard (``DataParallel.fragments``), or the parameters themselves for fp32
DDP. So ``param_groups``, LR schedulers (even one built before) and ``state_dict()`` work as usual.
A small class is put in front of the optimizer's own, so that ``step()`` and ``zero_grad()`` also do
the stage's part:

    before_step()  reduce / unscale / hand gradients to the fragments  (False: skip, fp16 inf)
    <the user's optimizer step on this rank's fragments; a fragment without gradient is skipped>
    after_step()   copy masters back to the working parameters, all-gather them (ZeRO)

An optimizer built *after* wrapping (FSDP2's order) is adopted at its first ``step()`` by the
habit machinery (minizero/habits/optimizer.py's ``adopt``), through the same ``attach``.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import torch

from minizero.optimizer import state as S
from minizero.optimizer.state import regroup
from minizero.seams import Face as Wrapper  # what the optimizer reads of a stage

__all__ = ["ADOPTED", "Adopted", "StageStep", "attach", "regroup", "shard_record", "wrapper_of"]


@dataclass(kw_only=True)
class Adopted:
    """What minizero knows of an optimizer it steps. Kept here, in :data:`ADOPTED` (weakly keyed
    by the optimizer), and in ``wrapper.optimizers``: nothing of it is written on the optimizer."""

    wrapper: Wrapper | None = None  # set by attach()
    trains: set[int] | None = None  # id(param) of the parameters it trains (None: every one)
    params: list[list[torch.Tensor]] | None = None  # each group's parameters, as the user built it
    closure_through: bool = False  # fp32 DDP: step(closure) is the class's own (LBFGS)
    full: dict | None = None  # consolidate_state_dict's whole state dict, until the next step


ADOPTED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Adopted] = weakref.WeakKeyDictionary()


def wrapper_of(optimizer: object) -> Wrapper | None:
    """The wrapper ``optimizer`` was attached to (None: none)."""
    record = ADOPTED.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    return None if record is None else record.wrapper


class StageStep:
    """Mixin placed before the user's optimizer class; ``ADOPTED[self]`` is what it steps with."""

    minizero_wraps_step = True  # runs the user's class's own step (habits/optimizer.py)

    @property
    def _wrapper(self) -> Wrapper:
        return ADOPTED[self].wrapper

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's GradScaler asks this in its ``step``, and only there. Where this rank holds
        only shards (stages 1-3, fp32 masters) its inf check would be this rank's alone, so ranks
        could disagree on skipping a step (FSDP has a ShardedGradScaler for this): refused here,
        by name. fp32 DDP: False, GradScaler works as with torch DDP."""
        if not ADOPTED[self].closure_through:
            raise RuntimeError(
                "torch's GradScaler cannot see whole gradients here (each rank holds a shard, "
                "so its inf check is not global): drop GradScaler and fp16 autocast and pass "
                "precision='fp16' to minizero.parallelize, which scales the loss and checks "
                "every rank's shards; or use bf16 autocast, which needs no scaler"
            )
        return False

    def step(self, closure=None):
        if closure is not None:
            return self._minizero_step_with_closure(closure)
        record = ADOPTED[self]
        record.full = None  # a consolidated state dict is of the states before
        if record.wrapper.before_step():
            super().step()
        record.wrapper.after_step()
        record.wrapper.end_step()

    def _minizero_step_with_closure(self, closure):
        """fp32 DDP: the optimizer holds the parameters themselves, so a closure (LBFGS calls it
        many times) runs forward and backward, whose hooks all-reduce, as with torch DDP. Else
        (elementwise optimizers call it once, first): the closure, then the stage's step."""
        if ADOPTED[self].closure_through:
            return super().step(closure)
        with torch.enable_grad():
            loss = closure()
        StageStep.step(self)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: the gradients of this optimizer's parameters (the others keep theirs)."""
        w, trains = ADOPTED[self].wrapper, ADOPTED[self].trains  # id(param) of the groups' params
        if trains is not None and any(id(p) not in trains for p in w.params):
            return w.extension.zero_grad_of(trains, set_to_none)  # some: the others keep theirs
        w.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group`` (a parameter that starts training later, with its own
        settings): its parameters are swapped for this rank's fragments of them, as ``regroup``
        does for the groups the optimizer was built with."""
        record = ADOPTED.get(self)  # (None: torch's constructor calls it, before attach)
        wrapper = None if record is None else record.wrapper
        if wrapper is not None:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            if record.trains is not None:
                record.trains |= {id(p) for p in params}
            if record.params is not None:
                record.params.append(list(params))  # as built (optimizer/state.py)
            if wrapper.separate_masters:
                frags = wrapper.fragments_of  # id(param) -> its fragments on this rank
                mine = [f.tensor for p in params for f in frags.get(id(p), [])]
                frozen = [p for p in params if not p.requires_grad]  # no fragments: as they are
                param_group = {**param_group, "params": mine + frozen}
        super().add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm is at most ``max_norm``; return the norm."""
        return self._wrapper.extension.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict:
        """torch's state dict, plus which shard it holds (``"minizero_shard"``): at stages 1-3
        (and in mixed precision) it holds only this rank's fragments, so only the same rank of the
        same layout may load it back (see ``load_state_dict``); at stages 1-3 a warning says so,
        and how to write the whole one. After ``consolidate_state_dict(to=r)`` on every rank, and
        until the next step, rank r's is the whole one (minizero/optimizer/state.py)."""
        full = ADOPTED[self].full
        if full is not None:
            return full
        sd = super().state_dict()
        sd["minizero_shard"] = shard_record(self._wrapper)
        if ADOPTED[self].params is not None and self._wrapper.separate_masters:
            # numbered as a plain optimizer over the parameters: nanoGPT's resume can tell
            sd = S.shard_state_dict(self, sd)
        if sd["minizero_shard"]["sharded"]:
            S.warn_shard(self, sd)
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """ZeroRedundancyOptimizer's call, collective: afterwards, and until the next step, rank
        ``to``'s ``state_dict()`` is the whole optimizer state, as a plain optimizer over the
        model's parameters returns it (torch DDP's; a plain optimizer loads it, and parallelize
        cuts it to each rank's shard again)."""
        ADOPTED[self].full = S.consolidate(self, to)

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuse an optimizer state dict saved by another rank or another layout: its states
        belong to other elements (torch would load it without a word when the counts match)."""
        saved = state_dict.get("minizero_shard")
        numbering = (saved or {}).get("numbering")  # "parameters": optimizer/state.py's form
        saved = None if saved is None else {k: v for k, v in saved.items() if k != "numbering"}
        here = shard_record(self._wrapper)
        if None not in ((saved or {}).get("ready"), here["ready"]):  # DDP's buckets, both
            self._wrapper.extension.cut_as(saved["ready"])  # cut here as there
            here = shard_record(self._wrapper)
        if saved is not None and saved != here and (saved["sharded"] or here["sharded"]):
            other = "" if saved["layout"] == here["layout"] else " with another layout"
            raise RuntimeError(
                f"this optimizer state dict was saved by rank {saved['rank']} of {saved['world']} "
                f"at stage {saved['stage']} and holds only that rank's shard of the optimizer "
                f"states; here is rank {here['rank']} of {here['world']} at stage "
                f"{here['stage']}{other}. Save and resume with minizero.save_checkpoint(path, "
                "model, optimizer) and minizero.load_checkpoint (every rank calls them; any "
                "world size and stage), not with rank 0's optimizer.state_dict(); or, to write "
                f"the whole state with torch.save, {S.FIX.split(' or save with')[0]}"
            )
        ADOPTED[self].full = None
        if numbering == "parameters":  # this rank's shard, as state_dict() wrote it
            state_dict = S.unshard_state_dict(self, state_dict)
        elif (
            saved is None and S.plain_params(self) is not None and self._wrapper.separate_masters
        ):  # a whole one (torch DDP's, a plain optimizer's, consolidated): cut to this rank's
            state_dict = S.shard_whole_state_dict(self, state_dict)
        state_dict = {k: v for k, v in state_dict.items() if k != "minizero_shard"}
        super().load_state_dict(state_dict)

    def _minizero_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = [p for g in self.param_groups for p in g["params"]]  # fragments (or params)
        for st in self.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return {"optimizer": tensors}


def attach(optimizer: torch.optim.Optimizer, wrapper: Wrapper) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` and ``zero_grad()`` run ``wrapper``'s part too; return it."""
    cls = type(optimizer)
    if not issubclass(cls, StageStep):
        optimizer.__class__ = type(cls.__name__, (StageStep, cls), {"__module__": cls.__module__})
    record = wrapper.optimizers[optimizer] = ADOPTED.setdefault(optimizer, Adopted())
    record.wrapper = wrapper  # (a rebuild of the buckets moves the states of wrapper.optimizers)
    record.closure_through = not wrapper.separate_masters
    return optimizer


def shard_record(wrapper) -> dict:
    """What an optimizer state dict needs to say to be loaded only where it belongs: the rank, the
    world, the stage, and a fingerprint of the fragments (name, start, end) it steps."""
    frags = [(f.name, f.start, f.end) for f in wrapper.fragments]
    return {
        "rank": wrapper.rank, "world": wrapper.world, "stage": wrapper.stage,
        "ready": wrapper.extension.bucket_order(),  # DDP's buckets' order (None: not cut again)
        "sharded": wrapper.sharded.state,  # stage 0: every rank holds the same, whole states
        "layout": hashlib.sha1(repr(frags).encode()).hexdigest(),
    }  # fmt: skip
