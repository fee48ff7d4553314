"""What a training loop did on a rank, seen from outside it, for lesson 09's check and lab: the
:class:`LoopWatch` (torch's global hooks, the loop unchanged; :mod:`.lesson09` says what is
watched and why) and :func:`state_summary` of the state dict the loop returned."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from minizero.course.checks.common import guard

LOCKSTEP_S = 60.0  # how long a forward waits for the other ranks' before it names the laggards


class OutOfStep(RuntimeError):
    """Raised on every rank when the ranks' forwards differ: one evaluates while another trains."""


def _kind(module) -> str:
    inner = getattr(module, "module", module)
    return "train" if torch.is_grad_enabled() and inner.training else "eval"


class LoopWatch:
    """What a training loop does on this rank, through torch's global hooks (``with LoopWatch():``
    around the loop). ``steps``: per ``opt.step()``, ``{"lr": [per param group], "sq": the
    squared norm of the gradients it steps (this rank's shard at stages 1-3), "backwards":
    [(the gradient reaching the loss, synced?) per backward since the step before]}``;
    ``forwards``: this rank's forwards of the plain model, ``{"train": n, "eval": n}``;
    ``stage``: the stage the model was wrapped at. With ``lockstep`` the wrapped model's forwards
    run in lockstep over ``group`` (see the module's docstring). With ``measure``, the model
    states at the second step (``states``) and each step's time from its first forward
    (``step_s``); ``progress.tick(loss=...)`` after each step, on rank 0."""

    def __init__(self, group=None, *, lockstep: bool = True, norms: bool = False,
                 measure: bool = False, progress=None, lockstep_s: float = LOCKSTEP_S):  # fmt: skip
        self.group, self.norms, self.measure, self.progress = group, norms, measure, progress
        self.lockstep_s = lockstep_s
        self.steps, self.backwards, self.step_s = [], [], []
        self.forwards = {"train": 0, "eval": 0}
        self.stage = self.wrapper = self.t0 = self.states = None
        self.store, self.n, self.handles = None, 0, []
        if lockstep and dist.is_initialized():
            c10d = dist.distributed_c10d
            name = "world" if group is None else c10d._get_process_group_name(group)
            self.me = dist.get_rank()
            self.members = dist.get_process_group_ranks(group or c10d._get_default_group())
            self.store = c10d._get_default_store()
            n = self.store.add(f"minizero/loopwatch/{name}/{self.me}", 1)  # equal on every member
            self.prefix = f"minizero/loopwatch/{name}/{n}"

    def __enter__(self) -> LoopWatch:
        from torch.nn.modules import module as m
        from torch.optim import optimizer as o

        self.handles = [m.register_module_forward_pre_hook(self._pre),
                        m.register_module_forward_hook(self._post),
                        o.register_optimizer_step_pre_hook(self._step_pre),
                        o.register_optimizer_step_post_hook(self._step_post)]  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module, args) -> None:
        from minizero.data_parallel import DataParallel
        from minizero.models import TinyGPT

        if isinstance(module, TinyGPT):
            self.forwards[_kind(module)] += 1
        elif isinstance(module, DataParallel):
            self.wrapper, self.stage = module, module.stage
            kind = _kind(module)
            if kind == "train" and self.t0 is None:
                self.t0 = time.perf_counter()
            self._lockstep(kind)

    def _post(self, module, args, out) -> None:
        from minizero.data_parallel import DataParallel

        if isinstance(module, DataParallel) and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, w=module: self._backward(g, w))

    def _backward(self, g: torch.Tensor, wrapper) -> None:
        self.backwards.append((float(g.detach().float().mean()), bool(wrapper.require_sync)))

    def _step_pre(self, opt, args, kwargs) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        sq = sum(float(g.detach().double().pow(2).sum()) for g in grads) if self.norms else None
        lrs = [float(g["lr"]) for g in opt.param_groups]
        self.steps.append({"lr": lrs, "sq": sq, "backwards": self.backwards})
        self.backwards = []
        if self.measure and len(self.steps) == 2 and self.wrapper is not None:
            from minizero.analysis.memory import model_state_bytes

            self.states = model_state_bytes(self.wrapper, opt)  # Adam's states exist, grads alive

    def _step_post(self, opt, args, kwargs) -> None:
        if self.t0 is not None:
            self.step_s.append(time.perf_counter() - self.t0)
            self.t0 = None
        if self.progress is not None:
            self.progress.tick()

    def _lockstep(self, kind: str) -> None:
        """Forward number ``n`` of the wrapped model: every member posts its kind and waits for
        the others'; all raise :class:`OutOfStep` if they differ or one never comes."""
        if self.store is None:
            return
        key, it = f"{self.prefix}/{self.n}", len(self.steps)
        self.n += 1
        self.store.set(f"{key}/{self.me}", kind)
        if self.store.add(key, 1) == len(self.members):
            self.store.set(key + "/all", "1")
        try:
            self.store.wait([key + "/all"], timedelta(seconds=self.lockstep_s))
        except RuntimeError:  # torch's DistStoreError
            late = [r for r in self.members if not self.store.check([f"{key}/{r}"])]
            raise OutOfStep(
                f"at iteration {it}, rank {self.me} ran a forward ({kind}) that rank(s) {late} "
                f"did not reach in {self.lockstep_s:g} s: every rank must run the same forwards "
                "(an evaluation too), or a collective inside them waits forever."
            ) from None
        kinds = {r: self.store.get(f"{key}/{r}").decode() for r in self.members}
        if len(set(kinds.values())) > 1:
            evals = [r for r, k in kinds.items() if k == "eval"]
            trains = [r for r, k in kinds.items() if k == "train"]
            raise OutOfStep(
                f"at iteration {it}, rank(s) {evals} evaluated (a forward without gradients or in "
                f"eval mode) while rank(s) {trains} trained: every rank evaluates, each on its "
                "share of the eval batches, and the ranks average (all_reduce sums; divide by "
                "the world). At stage 3 each forward all-gathers the parameters from every rank: "
                "rank 0 evaluating alone waits for ranks that never come. Print on rank 0 only."
            )


# -- in the ranks ----------------------------------------------------------------------------------


def state_summary(sd, cfg) -> dict | None:
    """What the returned state dict is: keys and shapes against a plain model's, whether it loads
    with strict=True, and the val loss of the plain model it loads into (one process, the
    whole eval batches)."""
    from minizero.models import TinyGPT
    from minizero.tools import shakespeare
    from minizero.tools.train import eval_batches

    if sd is None:
        return None
    if not isinstance(sd, Mapping):
        return {"error": f"it is a {type(sd).__name__}, not a state dict (a dict of tensors)"}
    data = shakespeare.load()
    plain = TinyGPT(cfg.gpt(data.vocab_size))
    want = plain.state_dict()
    out = {"missing": [k for k in want if k not in sd]}
    out["unexpected"] = [k for k in sd if k not in want]
    out["shapes"] = [(k, tuple(getattr(sd[k], "shape", ())), tuple(v.shape))
                     for k, v in want.items() if k in sd
                     and tuple(getattr(sd[k], "shape", ())) != tuple(v.shape)]  # fmt: skip
    if out["missing"] or out["unexpected"] or out["shapes"]:
        return out
    values = {}
    for k, v in sd.items():  # stage 3's parameters between uses: only this rank's shard
        values[k], err = guard(lambda v=v: v.detach().cpu().clone())
        if err is not None:
            return out | {"unreadable": (k, err.split(" (at line")[0])}
    _, err = guard(plain.load_state_dict, values)
    if err is not None:
        return out | {"error": f"a plain model's load_state_dict(strict=True) raised {err}"}
    whole = eval_batches(data, cfg, "val", 0, 1, torch.device("cpu"))
    with torch.no_grad():
        out["val"] = sum(float(plain.eval()(x, y)) for x, y in whole) / len(whole)
    return out


def as_floats(xs) -> list:
    return [[float(v) for v in x] if isinstance(x, list | tuple) else float(x) for x in xs]
