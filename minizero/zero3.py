"""ZeRO-DP stage 3: optimizer states, gradients and parameters partitioned. Taught in lesson 04.

Rajbhandari et al., arXiv 1910.02054, §5.3. What this file adds to zero2.py: parameters too live
sharded between uses; each unit's are all-gathered just before its forward and again before its
backward, and freed right after. Which modules are units: minizero/units.py.

The moments it overrides, and what each does differently from ZeRO2:

    cut_buckets(ready)  one bucket per unit (a module's own parameters), not cut by size
    take_optim_params, cast_working, load_param, params_written: ``param_shards`` are the params
    forward             module hooks: gather a unit before its forward, free it after
    post_accumulate_grad_hook(p)  only count: autograd's gradients stay until the unit's last one
    reduce_bucket(b)    copy the unit's gradients into a buffer then, reduce-scatter, free it
    backward_end()      ZeRO2's, then free every unit still gathered
    after_step()        optim_params -> param_shards, no all-gather (the next forward gathers)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from minizero import collectives as C
from minizero import units as U
from minizero.bucket import Bucket
from minizero.precision import Precision
from minizero.seams import Sharded
from minizero.units import WHERE, Accumulators, UncopiedHook, Units, set_guard
from minizero.zero2 import ZeRO2


class ZeRO3(ZeRO2):
    """P_os+g+p: each rank keeps only its shard of every model state.

    Model states per rank: (2 + 2 + K)Ψ/N in mixed precision ((4 + 4 + K)Ψ/N in fp32).
    Communication per step: all-gather Ψ in forward + all-gather Ψ in backward + reduce-scatter Ψ
    of the gradients = 3Ψ, 1.5x DDP (§7.2.2).

    Units (``units=``, see minizero/units.py): the root module and, by default, the repeated blocks
    (children of ``nn.ModuleList``s, ...); or the modules of the given classes, or those a predicate
    picks; ``min_unit_params`` folds a unit with fewer parameters into the one around it
    (per-collective latency, not bytes, is what a small unit costs). Each unit's parameters, minus
    those of units nested in it, are one bucket: gathered before the unit's forward, freed after it,
    gathered again when backward reaches the unit's output, freed once the unit's gradients are
    reduce-scattered. A tied parameter belongs to the first unit that registers it; every unit that
    registers it too gathers that unit, and keeps it gathered while any module using it is still in
    its forward (from the second step on, until the last module that uses it in the recorded order).
    Between uses a unit's flat buffer has its storage resized to 0 bytes: only ``param_shards``
    (rank r's chunk) stays, and its parameters are guarded: reading them raises an error that points
    to ``summon_full_params``.

    Prefetch: the first step records the order in which units start their forward and end it; with
    ``prefetch=1`` the next unit's all-gather is issued (asynchronously) as soon as the current
    one's is done, in forward, and in backward (which meets the units in the reverse order of their
    forward's end) the previous one's. A unit first used later, or units run in another order, are
    gathered on demand: prefetch may miss, results are the same. Units replace buckets, so there is
    no ``bucket_cap_mb``. ``reshard_root=False`` keeps the root's units gathered from the end of
    forward to the end of backward, as FSDP2 does for its root (one all-gather fewer, 3Ψ - Ψ_root
    per step).

    ZeRO++ (hpZ ``reshard_after_forward``, qwZ ``quantize_weights``, qgZ
    ``quantize_gradients``) is a subclass of this one, minizero/zeropp.py: it overrides the
    moments ``subclass_moments`` names and reads, beside the face, ``subclass_reads`` (below).

    ``check_modules``: before each unit's forward and at the start of backward the ranks
    all-gather one int64 naming the module, so that ranks that run different modules get a
    ``RuntimeError`` naming them instead of a mismatched collective (a gloo abort or a hang). It
    costs one small synchronous collective per unit per forward; it is not in the CommLedger.

    What lesson 04 asks you to write (each rank makes the same calls in the same order):
    ``gather(i, wait=True)``: unit i's ``flat_params[i]`` full; if not ``gathered[i]``: storage
    back to ``buckets[i].padded`` elements, an async all-gather of ``param_shards[i]`` into it kept
    in ``gather_works[i]``, ``gathered[i] = True``; with ``wait``, wait for ``gather_works[i]`` (one
    a prefetch started too) and forget it. ``free(i)``: wait for ``gather_works[i]`` if any (never
    drop memory a collective writes into), storage to 0 bytes, ``gathered[i] = False``.
    ``pre_forward(m, args)``, before a unit module's forward: gather (and wait for) ``units_of[m]``,
    then start, without waiting, the gathers of ``neighbour(m, +prefetch)``. ``pre_backward(m)``,
    when backward reaches m's output: ``queue_backward_end()``, gather ``units_of[m]``, prefetch
    ``neighbour(m, -prefetch)`` except units already reduce-scattered (``started[i]``).
    """

    stage = 3
    sharded = Sharded(state=True, grads=True, params=True)
    # A subclass outside the stage files (ZeRO++, zeropp.py) may override these moments and read
    # these fields, beside the face (docs/design.md, "Two ways to extend a stage"; test_layout)
    subclass_moments = ("start_gather", "release", "pre_forward", "reduce_scatter", "after_step",
                        "held_tensors")  # fmt: skip
    subclass_reads = ("param_shards", "flat_params", "gather")

    def __init__(
        self,
        module: nn.Module,
        *,
        units: Units = None,
        min_unit_params: int = 0,
        precision: str | Precision = "fp32",
        process_group: dist.ProcessGroup | None = None,
        prefetch: int = 1,
        reshard_root: bool = True,
        check_modules: bool = True,
        **options,  # broadcast_buffers, find_unused_parameters: see DataParallel
    ):
        if "bucket_cap_mb" in options:
            raise TypeError(
                "ZeRO3 has no bucket_cap_mb: its buckets are the units (units=, see "
                "minizero/units.py), one all-gather and one reduce-scatter per unit"
            )
        self.param_shards: list[torch.Tensor] = []  # (shard,) per unit; filled by super().__init__
        self._units_arg = units, min_unit_params  # select_units' arguments
        super().__init__(module, precision=precision, process_group=process_group, **options)
        self.prefetch = prefetch
        self.reshard_root = reshard_root
        n = len(self.buckets)
        self.gather_works: list = [None] * n  # in-flight all-gather per unit
        self.gathered = [True] * n  # flat_params[i] holds the full unit
        self._active = [0] * n  # modules using unit i whose forward is running
        self.max_gathered = 0  # most units gathered at once (a structure check)
        self.order: list[nn.Module] = []  # unit modules, in the order the first forward began them
        self.ends: list[nn.Module] = []  # ... and ended them
        self.recording = True
        self._pos: dict[nn.Module, int] = {}  # module -> place in order (after recording)
        self._last_use: dict[int, int] = {}  # unit -> place in order of its last user
        # this backward pass: None before its first hook, True when it accumulates into .grad,
        # False for torch.autograd.grad(loss, inputs) (input gradients only: nothing to reduce)
        self._accumulating: bool | None = None
        self._module_names = [self._module_name[m] for m in self.units_of]
        self._module_index = {m: k for k, m in enumerate(self.units_of)}
        dev = self.param_shards[0].device if self.param_shards else torch.device("cpu")
        self.check_modules = check_modules and self.world > 1 and dev.type != "meta"
        self._check_device = dev
        for b in self.buckets:  # for the guard's message: which parameter, which unit, 1/N
            for p in b.params:
                WHERE[p] = (self.param_names[id(p)], self._unit_names[b.index], self.world)
        for m in self.units_of:
            # first of m's pre-hooks (as FSDP2's): one of the user's may read the parameters
            # (torch.nn.utils.prune, weight_norm compute the weight from them). Under
            # torch.compile(model) both hooks run eagerly (graph breaks): tracing them would
            # read sharded parameters, and the gathers and frees must really happen
            eager = torch._dynamo.disable
            m.register_forward_pre_hook(UncopiedHook(eager(self._forward_pre_hook)), prepend=True)
            m.register_forward_hook(UncopiedHook(eager(self._post_forward)))
        self._accumulators = Accumulators(self.params)
        for i in range(n):
            self.release(i)

    # -- layout: one unit per selected module, the root holding the rest --------------------------
    rebuilds_buckets = False  # units are modules, not buckets cut in ready order

    def cut_buckets(self, ready: list[nn.Parameter]) -> list[Bucket]:  # (ready: not used)
        unit_modules = U.select_units(self.module, *self._units_arg)
        # self.units_of: unit module -> the units its forward needs (its own, tied ones)
        groups, owners, self.units_of = U.assign_params(self.module, unit_modules)
        names = {m: name or "(root)" for name, m in self.module.named_modules()}
        self._module_name = names  # module -> its name, for messages
        self._unit_names = [names[m] for m in owners]  # unit index -> its module's name
        return self.flatten([Bucket(g, i, self.world) for i, g in enumerate(groups)])

    def take_optim_params(self, b: Bucket) -> torch.Tensor:
        # (shard,) the only copy of these parameters this rank keeps between uses
        shard = b.chunk(self.flat_params[b.index], self.rank).clone()
        self.param_shards.append(shard)
        return shard.float().clone() if self.precision.master else shard

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()  # only the shards between uses, and the gathered units
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        gathered = [f for f, g in zip(self.flat_params, self.gathered, strict=True) if g]
        return {**held, "params": self.param_shards + frozen, "comm": held["comm"] + gathered}

    def fragment_values(self, f) -> torch.Tensor:
        return self.param_shards[f.bucket][f.offset : f.offset + f.numel]  # between uses

    def cast_working(self) -> None:
        super().cast_working()
        dtype = self.precision.param_dtype
        self.param_shards = [s.to(dtype) for s in self.param_shards]  # (shard,) working dtype

    def load_param(self, p: nn.Parameter, full: torch.Tensor) -> None:
        if id(p) not in self.param_bucket:  # frozen: replicated in full, in the working dtype
            p.data.copy_(full)
            return
        flat = full.reshape(-1).to(self.param_shards[0].device)  # only this rank's ranges
        for f in self.fragments_of.get(id(p), []):
            self.param_shards[f.bucket][f.offset : f.offset + f.numel].copy_(flat[f.start : f.end])
            f.tensor.copy_(flat[f.start : f.end])
        b = self.bucket_of(p)
        if self.gathered[b.index]:  # refresh the full copy too, should it be in use
            b.view(self.flat_params[b.index], p).copy_(full)

    def params_written(self) -> None:
        with torch.no_grad():
            for shard, m in zip(self.param_shards, self.optim_params, strict=True):
                if m is not shard:  # only elements edited: a read-only summon must not round
                    changed = shard != m.to(shard.dtype)  # (shard,) bool
                    m[changed] = shard[changed].float()

    # -- gather and free ---------------------------------------------------------------------
    def gather(self, i: int, wait: bool = True) -> None:
        if not self.gathered[i]:
            flat = self.flat_params[i]  # (padded,) storage back to full size, then filled
            flat.untyped_storage().resize_(self.buckets[i].padded * flat.element_size())
            self.gather_works[i] = self.start_gather(i, flat)
            self.gathered[i] = True
            self.max_gathered = max(self.max_gathered, sum(self.gathered))
        if wait and self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None

    def start_gather(self, i: int, flat: torch.Tensor):
        """Start the all-gather of unit i's shards into its ``flat`` (padded,)."""
        shard, tag = self.param_shards[i], f"zero3 params {i}"
        return C.all_gather(flat, shard, group=self.group, async_op=True, tag=tag)

    def free(self, i: int) -> None:
        if self.gather_works[i] is not None:
            self.gather_works[i].wait()
            self.gather_works[i] = None
        self.flat_params[i].untyped_storage().resize_(0)  # p.data views stay, with 0 bytes
        self.gathered[i] = False

    def release(self, i: int, after_forward: bool = False) -> None:
        """Free unit i and guard its parameters (their storage is empty now). ``after_forward``:
        after a forward that backward will follow (ZeRO++'s hpZ keeps a part there)."""
        self.free(i)
        set_guard(self.buckets[i].params, True)

    def neighbour(self, m: nn.Module, step: int) -> list[int]:
        """The units of the module ``step`` places after ``m`` in forward (``step < 0``: in
        backward) in the recorded order, skipping modules without units; [] while recording."""
        seq = self.order if step > 0 else self.ends[::-1]
        if self.recording or m not in seq:
            return []
        left = abs(step)
        for other in seq[seq.index(m) + 1 :]:
            if self.units_of.get(other):
                left -= 1
                if left == 0:
                    return self.units_of[other]
        return []

    # -- hooks -------------------------------------------------------------------------------
    def _forward_pre_hook(self, m: nn.Module, args) -> None:
        if m is self.module:  # a new forward: nothing of an earlier one (an exception) is running
            self._active = [0] * len(self.buckets)
        if self.check_modules:  # in flight with m's own gathers; verified before m runs
            check = self._module_check(m, backward=False)
            for i in self.units_of[m]:
                self.gather(i, wait=False)
            check.verify()
        self.pre_forward(m, args)
        for i in self.units_of[m]:
            self._active[i] += 1
            set_guard(self.buckets[i].params, False)

    def pre_forward(self, m: nn.Module, args) -> None:
        if self.recording and m not in self.order:
            self.order.append(m)
        for i in self.units_of[m]:
            self.gather(i)
        for i in self.neighbour(m, +self.prefetch):
            self.gather(i, wait=False)

    def _post_forward(self, m: nn.Module, args, out):
        if self.recording and m not in self.ends:
            self.ends.append(m)
        for i in self.units_of[m]:
            self._active[i] -= 1
        grad = torch.is_grad_enabled()
        if m is self.module:  # forward is over: free every unit (the root's too, unless kept)
            keep = set() if self.reshard_root or not grad else set(self.units_of[m])
            for i, gathered in enumerate(self.gathered):
                if gathered and i not in keep:
                    self.release(i, after_forward=grad)
        else:  # free the units no running module uses and no later module needs
            pos = self._pos.get(m)
            for i in self.units_of[m]:
                if self._active[i] == 0 and (pos is None or self._last_use.get(i, -1) <= pos):
                    self.release(i, after_forward=grad)
        if grad:
            for t in U.output_tensors(out):
                if t.requires_grad:
                    t.register_hook(UncopiedHook(lambda g, m=m: self._backward_hook(m)))

    def _backward_hook(self, m: nn.Module) -> None:
        if self._accumulating is None:  # once, as a backward pass starts
            self._accumulating = self._accumulators.will_run()
            if self.check_modules:
                self._module_check(m, backward=True).verify()
            if not self._accumulating:
                Variable._execution_engine.queue_callback(self._input_grads_end)
        if self._accumulating:
            self.pre_backward(m)
        else:  # the unit's parameters are needed for its input's gradient, nothing else
            for i in self.units_of[m]:
                self.gather(i)
        for i in self.units_of[m]:
            set_guard(self.buckets[i].params, False)

    def _input_grads_end(self) -> None:
        """After a pass that accumulated no parameter gradient: free the units it gathered."""
        self._accumulating = None
        for i, gathered in enumerate(self.gathered):
            if gathered:
                self.release(i)

    def pre_backward(self, m: nn.Module) -> None:
        self.queue_backward_end()
        for i in self.units_of[m]:
            self.gather(i)
        for i in self.neighbour(m, -self.prefetch):
            if not self.started[i]:  # not a unit whose backward is already over
                self.gather(i, wait=False)

    # -- gradients: kept as autograd made them until the unit's last one, as FSDP2 does ----------
    def post_accumulate_grad_hook(self, p: nn.Parameter) -> None:  # argument: the parameter
        b = self.bucket_of(p)
        self.queue_backward_end()
        if not self.require_sync:  # no_sync(): into the unit's full (padded,) buffer, kept
            buf = self.filling[b.index]  # until a synchronised backward reduces the sum
            if buf is None:  # (ZeRO2's no_sync(), at FSDP2's cost: the unsharded gradient)
                buf = self.new_bucket_buffer(b)
            b.view(buf, p).add_(p.grad)
            p.grad = None
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:
            self.reduce_bucket(b)

    def reduce_bucket(self, b: Bucket) -> None:
        """Every gradient of unit b is in (or backward is over): copy them into one (padded,)
        buffer, reduce-scatter it, and drop the full parameters again. Stage 2 fills its buffer
        from the first gradient on; here it is allocated only now, when the unit's activations
        are gone, which keeps the peak at the start of a unit's backward as low as FSDP2's."""
        if not self.require_sync:  # no_sync(): nothing to reduce; the parameters are freed
            self.started[b.index] = True  # (not prefetched again in this backward)
            return self.release(b.index)
        self.finish_in_flight()  # the previous buffer is freed before this one exists
        buf = self.filling[b.index]  # None, or the no_sync() backwards' sum
        if buf is None:
            buf = self.new_bucket_buffer(b)
        for q in b.params:
            if q.grad is not None:  # this backward's gradient; None: q was not used
                b.view(buf, q).add_(q.grad)
                q.grad = None
        super().reduce_bucket(b)  # reduce-scatter
        self.release(b.index)

    def backward_end(self) -> None:
        super().backward_end()
        if not self.require_sync:  # no_sync(): DDP's backward_end reduced nothing; count again
            self.pending = [len(b.params) for b in self.buckets]
            self.started = [False] * len(self.buckets)
        for i in range(len(self.buckets)):
            if self.gathered[i]:
                self.release(i)
        self._accumulating = None
        if self.recording:  # the forward order is known now: where each unit is last used
            self.recording = False
            self._pos = {m: j for j, m in enumerate(self.order)}
            self._last_use = {i: j for j, m in enumerate(self.order) for i in self.units_of[m]}

    # -- ranks must run the same modules ---------------------------------------------------------
    def _module_check(self, m: nn.Module, backward: bool) -> U.SameModule:
        code = 2 * self._module_index[m] + backward
        group = self.group if self.replicate_group is None else None  # HSDP: every rank
        return U.SameModule(code, self._module_names, group, self._check_device)

    # -- full parameters outside forward ----------------------------------------------------------
    def summon_full_params(self, writeback: bool = True):
        """``with model.summon_full_params(): ...``: every parameter full on this rank, to read
        or change in place (collective; see :func:`minizero.units.summon_full_params`)."""
        return U.summon_full_params(self, writeback)

    # -- the optimizer's side: no all-gather after the step; the next forward gathers --------
    def after_step(self) -> None:
        if self.precision.master:
            with torch.no_grad():
                for shard, m in zip(self.param_shards, self.optim_params):
                    shard.copy_(m)
