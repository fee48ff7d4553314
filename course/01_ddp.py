# %% [markdown]
# # Lesson 01 — DDP: data parallelism, naive then bucketed
#
# **Data parallelism**: every rank holds a full copy of the model, takes its own 1/N of each
# global batch, and before the optimizer step the ranks **average their gradients** with an
# all-reduce. Then every rank applies the same update and the copies stay identical. This is the
# baseline the ZeRO paper starts from (§1-2; §3 analyses where its memory goes): plain
# synchronous data parallelism. ZeRO keeps this
# exact training algorithm and only removes the redundant copies (lessons 02–04).
#
# You will write:
#
# 1. **naive DDP**: after backward, all-reduce every gradient, one at a time;
# 2. **bucketed DDP**: gradients grouped into buckets whose all-reduce starts *during* backward,
#    from gradient hooks.
#
# Each check trains your version on real ranks next to one process on the whole batch, PyTorch's
# `DistributedDataParallel` and minizero's own `minizero.ddp`, and says where they differ.
#
#     python -m minizero grade my-lessons/01_ddp.ipynb

# %%
from minizero.course.labs.lesson01 import *  # torch, dist, minizero, C, hint, lab, lesson01

NPROCS, INFO = setup()

# %% [markdown]
# ## 1. Why averaging gradients is enough
#
# The loss of a global batch of B rows is the mean over its rows. Split it into N equal slices:
# its gradient is the **mean of the N slices' gradients**. So if rank r computes the gradient of
# its slice and the ranks average, every rank holds the gradient that one process would compute
# on the whole batch. The first cell is what each rank runs: the gradient of minizero's MLP on its
# own rows of the global batch, with no communication.


# %%
# @save
def local_gradients(rows_per_rank: int) -> dict:
    """On every rank: the MLP's gradients on this rank's rows of the global batch, nothing sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MLP()
    x, y = synthetic_batch("mlp", rows_per_rank * world, 0, rank=rank, world=world)  # my rows
    model(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


# %% [markdown]
# The second compares, parameter by parameter, the ranks' gradients with each other (`spread`) and
# their mean with one process that runs the whole batch (`error`). The prediction: the spread is
# the size of a gradient, the error is float rounding.


# %%
# @save
def gradient_mean(nprocs: int, rows_per_rank: int = 4) -> list[dict]:
    """Each rank's gradients (``local_gradients``) against one process on the whole batch."""
    local = minizero.launch(local_gradients, nprocs, rows_per_rank, verbose=False)  # per rank
    torch.manual_seed(0)
    single = MLP()
    single(*synthetic_batch("mlp", rows_per_rank * nprocs, step=0)).backward()  # every row
    rows = []
    for name, p in single.named_parameters():
        spread = max((g[name] - local[0][name]).abs().max().item() for g in local)
        mean = sum(g[name] for g in local) / nprocs
        rows.append(dict(name=name, spread=spread, error=(mean - p.grad).abs().max().item()))
    return rows


lab.show_gradient_mean(gradient_mean(NPROCS, rows_per_rank=4))

# %% [markdown]
# Local gradients differ between ranks, so without communication the copies would drift apart after
# one step; their mean equals one process's gradient up to float rounding.
#
# ## Exercise 1 — naive DDP
#
# Write `allreduce_gradients(model, group=None)`, called on every rank after `loss.backward()`:
# replace every `p.grad` by its average over the ranks of `group`. Use
# `minizero.collectives.all_reduce(tensor, group=group)` (in place, it **sums**), so that the
# `CommLedger` sees each call. Skip parameters whose `p.grad is None`. (The initial weights must
# also be the same everywhere: here every rank seeds its generator alike; DDP broadcasts rank 0's.)


# %%
def allreduce_gradients(model: torch.nn.Module, group=None) -> None:
    """Average every gradient of ``model`` over the ranks of ``group``, in place."""
    # BEGIN SOLUTION
    # TODO: every p.grad becomes the average of that gradient over the group's ranks
    # HINT: all_reduce sums in place; the average is that sum divided by the number of ranks of
    #       `group` (dist.get_world_size(group)), not of the default group: the check also runs on a
    #       subgroup.
    # HINT: A parameter whose p.grad is None got no gradient: skip it. Every other gradient gets one
    #       all_reduce(p.grad, group=group), then the division, in place.
    # HINT: world = dist.get_world_size(group)
    #       for p in model.parameters():
    #           if p.grad is not None:
    #               all_reduce(p.grad, group=group, tag="naive")  # the sum, in place
    #               ...  # the average
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(p.grad, group=group, tag="naive")  # sum over ranks, in place
            p.grad.div_(world)
    # END SOLUTION


# %% check="allreduce_gradients"
# 3 SGD steps of minizero's MLP on max(NPROCS, 3) ranks: your gradients and parameters, step by
# step, against one process on the whole batch, torch DDP and minizero.naive_ddp.NaiveDDP;
# volume 2Ψ.
lesson01.check_allreduce_gradients(allreduce_gradients, NPROCS)

# %% [markdown]
# ## 2. What naive DDP costs
#
# Per step, naive DDP all-reduces Ψ gradient elements, **2Ψ** in the ZeRO paper's accounting (§7.1;
# lesson 00), in **one collective per parameter tensor**, **after backward has finished**: the
# network idles during backward, the compute during communication. minizero's `NaiveDDP` does the
# same as your function. Measured on `TinyGPT`:

# %%
lab.show_naive_volume(lab.naive_volume(NPROCS))  # expected: 2Ψ, every all-reduce after backward

# %% [markdown]
# ## 3. Gradient hooks: the argument is the parameter
#
# To communicate during backward we need to know when each gradient is ready. PyTorch calls
# `p.register_post_accumulate_grad_hook(hook)` **after** the gradient has been accumulated into
# `p.grad`, with **the parameter `p` as the argument**, not the gradient (unlike a tensor's
# `register_hook`). The mix-up is silent: pytorch/pytorch issue #187268 reports a run whose loss
# stalled for thousands of steps because of it. All-reducing the argument averages the *weights*
# (identical everywhere, so nothing changes) and leaves each rank's local gradient in `p.grad`. The
# cell shows what each hook receives:

# %%
lin = torch.nn.Linear(3, 2)
lin.weight.register_post_accumulate_grad_hook(
    lambda arg: print(
        f"post_accumulate_grad_hook: argument is lin.weight? {arg is lin.weight}; "
        f"its .grad has shape {tuple(arg.grad.shape)}"
    )
)
lin.bias.register_hook(
    lambda grad: print(
        f"register_hook: argument is a gradient of shape {tuple(grad.shape)}, "
        f"requires_grad={grad.requires_grad}, is lin.bias? {grad is lin.bias}"
    )
)
lin(torch.randn(4, 3)).sum().backward()

# %% [markdown]
# ## Exercise 2 — bucketed DDP, overlapped with backward
#
# Torch DDP (and minizero's `DDP`) group parameters into **buckets** of about `bucket_cap_mb` MiB,
# in **reverse** registration order (backward produces the last layer's gradients first). Each
# bucket has one flat buffer; when its last gradient has arrived, its all-reduce starts
# **asynchronously**, while backward goes on. At the end of backward we wait for every bucket and
# write the averages back into `p.grad`.
#
# Provided: buckets from `minizero.bucket.make_buckets` (a `Bucket` has `.index`, `.params`,
# `.numel` and `.view(flat, p)`, the slice of a flat buffer that belongs to `p`, shaped like `p`);
# one flat buffer per bucket; a count of gradients still expected per bucket; a hook on every
# parameter; and `_finish()`, queued to run once when backward is over.
#
# * `post_accumulate_grad_hook(param)` (torch's name for such a hook: autograd calls it with the
#   parameter): copy `param.grad` into its slot of its bucket's flat buffer; decrement the bucket's
#   count; at 0, start the bucket's all-reduce with `all_reduce(flat, group=self.group,
#   async_op=True, tag=...)` and keep `(bucket, work)` in `self.works`.
# * `_finish()`: for each `(bucket, work)`: `work.wait()`, divide the flat buffer by the world size,
#   copy each parameter's slice back into its `p.grad`.


# %%
class BucketedDDP(torch.nn.Module):
    """DDP with gradient buckets whose all-reduce overlaps backward."""

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = 25, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in params:
                C.broadcast(p.detach(), src=0, group=group, tag="initial weights")
        self.buckets = make_buckets(params, bucket_cap_mb)  # bucket 0 holds the LAST parameters
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        # (numel,) flat gradient buffer per bucket; b.view(self.flat[b.index], p) is p's slot
        self.flat = [torch.zeros(b.numel, device=b.params[0].device) for b in self.buckets]
        self.pending = [len(b.params) for b in self.buckets]  # gradients still to arrive
        self.works = []  # (bucket, async work) of the all-reduces in flight
        self._finish_queued = False
        for p in params:
            p.register_post_accumulate_grad_hook(self.post_accumulate_grad_hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def post_accumulate_grad_hook(self, param: torch.nn.Parameter) -> None:
        """Autograd calls this when ``param.grad`` holds this backward's gradient."""
        if not self._finish_queued:  # run self._finish() once, when backward is over
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        # BEGIN SOLUTION
        # TODO: param.grad is in its bucket's buffer; a complete bucket's all-reduce has started
        # HINT: The hook's argument is the parameter, not the gradient: the gradient is param.grad.
        #       self.bucket_of[param] is its bucket b, self.flat[b.index] that bucket's flat buffer,
        #       and b.view(flat, param) param's slot in it, shaped like param.
        # HINT: self.pending[b.index] counts the gradients b still waits for: one fewer now. At 0 b
        #       is complete: start its all-reduce with async_op=True and keep (b, work) in
        #       self.works. Do not wait here: backward goes on while the bucket travels.
        # HINT: b = self.bucket_of[param]
        #       b.view(self.flat[b.index], param).copy_(param.grad)
        #       self.pending[b.index] -= 1
        #       if self.pending[b.index] == 0:
        #           work = all_reduce(self.flat[b.index], group=self.group, async_op=True, tag=...)
        #           self.works.append((b, work))
        b = self.bucket_of[param]
        b.view(self.flat[b.index], param).copy_(param.grad)  # the argument is the PARAMETER
        self.pending[b.index] -= 1
        if self.pending[b.index] == 0:  # b's last gradient: communicate while backward goes on
            tag = f"bucket {b.index}"
            work = all_reduce(self.flat[b.index], group=self.group, async_op=True, tag=tag)
            self.works.append((b, work))
        # END SOLUTION

    def _finish(self) -> None:
        """Runs once at the end of backward: wait, average, write back into p.grad."""
        self._finish_queued = False
        mark("backward end")
        # BEGIN SOLUTION
        # TODO: every p.grad holds the average over the ranks of its gradient, read from its bucket
        # HINT: Each (b, work) in self.works is an all-reduce that may still be running: wait for it
        #       before reading b's buffer. The buffer then holds the sum over the ranks; divide it
        #       by self.world for the average.
        # HINT: for b, work in self.works:
        #           work.wait()
        #           flat = self.flat[b.index].div_(self.world)  # (numel,) the average
        #           for p in b.params:
        #               p.grad.copy_(...)  # p's slot of flat
        for b, work in self.works:
            work.wait()
            flat = self.flat[b.index].div_(self.world)  # (numel,) sum over ranks -> average
            for p in b.params:
                p.grad.copy_(b.view(flat, p))
        # END SOLUTION
        self.works.clear()
        self.pending = [len(b.params) for b in self.buckets]


# %% check="BucketedDDP"
# 3 SGD steps of the MLP with bucket_cap_mb=0.002 (a few buckets): gradients and parameters
# against one process, torch DDP and minizero.ddp.DDP; one all-reduce per bucket, asynchronous,
# some started before backward ended and waited on only after it (in _finish); volume 2Ψ;
# then again on a subgroup (ranks 0 and 1 of the 3, group=...).
lesson01.check_bucketed_ddp(BucketedDDP, NPROCS)

# %% [markdown]
# ## 4. When did each bucket's all-reduce run?
#
# minizero's `DDP` works like your class, except that its gradients *are* views into the buckets
# (torch's `gradient_as_bucket_view=True`), so it holds one copy of the gradients where yours holds
# two.
#
# When did each all-reduce *run*? The ledger sees when it was issued and waited for; the profiler
# sees when the backend ran it
# ([how](../docs/machinery.md#when-a-buckets-all-reduce-ran-the-profiler-and-gloos-threads)).
# `minizero.analysis.timeline.profile_step(step)` runs one step under `torch.profiler` and returns,
# for every all-reduce, when it was issued, started and completed, beside the marks of forward and
# backward. The cell trains `TinyGPT` at three bucket sizes and keeps, for each, the step of median
# overlap.

# %%
CAPS = [0.05, 0.2, 25]  # MiB; 25 is torch DDP's default, larger than all of TinyGPT
TIMELINES = lab.overlap_timelines(NPROCS, CAPS, steps=6)
lab.plot_timelines(TIMELINES)
lab.show_overlap(TIMELINES)

# %% [markdown]
# Each orange bar is an all-reduce running in the backend; the dotted line before it, the time it
# waited after being issued. The printed fractions measure overlap: the share of all-reduce time
# that falls before the last gradient was computed. With one big bucket (25 MiB, torch's default,
# larger than TinyGPT) the all-reduce starts only once the last gradient exists, and the step waits
# for nearly all of it, as in naive DDP. With small buckets the first all-reduces start early and
# most of the communication hides behind backward. Hidden is not free: gloo's threads share the CPU
# cores with backward, and NCCL's kernels take SMs and memory bandwidth from it. Rerun the cell: on
# a shared machine these numbers move.
#
# One bucket size at a time (needs ipywidgets and a live kernel; same data):

# %%
lab.timeline_widget(TIMELINES)  # JupyterLab with ipywidgets; never in a graded run

# %% [markdown]
# ## 5. Naive, bucketed, PyTorch: messages, volume, time
#
# Same model, same data, three implementations of the same averaging. The cell measures per step
# (median of 5 after 2 warm-up steps): the number of all-reduces, the volume in units of Ψ, and
# the wall time of forward + backward + communication. (torch DDP does not go through
# `minizero.collectives`, so the ledger cannot count its messages.)


# %%
lab.show_variants(lab.ddp_variants(NPROCS, bucket_cap_mb=0.1, steps=7))

# %% [markdown]
# What the numbers say:
#
# * **Volume is the same, 2Ψ**: bucketing changes how many messages carry the gradient and when.
# * **Messages**: one per tensor naive, one per bucket bucketed; each pays a latency (lesson 00).
# * **Time** mixes fewer latencies and overlap, which helps only where communication and compute do
#   not compete for the same resources (section 4).
#
# ## 6. The redundancy ZeRO removes
#
# Every rank holds the whole model state. The cell measures, on every rank, the bytes of each after
# one step of DDP with AdamW in fp32 and bf16 (`minizero.analysis.memory.model_state_bytes`), beside
# the paper's formulas: (4 + 4 + 8)Ψ in fp32 (Adam's two moments), (2 + 2 + K)Ψ with K = 12 in mixed
# precision (fp32 master weights, momentum and variance).


# %%
RUNS = [("fp32", 0), ("bf16", 0)]  # (precision, stage): DDP, AdamW; beside the paper's formula
adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)
lab.show_model_states(lab.model_states(NPROCS, RUNS, optimizer=adamw))

# %% [markdown]
# Every rank holds the same 16Ψ bytes (gradients included once: they live in the buckets), so N
# ranks hold N identical copies of the model states. ZeRO (Rajbhandari et al., Microsoft DeepSpeed,
# arXiv 1910.02054, SC20) is this same synchronous data parallelism with that redundancy removed:
# no parameter server, no asynchrony, nothing specific to Transformers. Lesson 02 partitions the
# optimizer states (stage 1, P_os).

# %% [markdown]
# ## 7. Choosing `bucket_cap_mb`: a model, then a sweep
#
# Buckets trade two costs (the question Stanford CS336's assignment 2 asks about DDP). Take the
# gradient of S bytes in k buckets, a backward of T seconds that produces the bytes at a steady
# rate, and lesson 00's α-β model: one bucket's all-reduce takes c = α · 2(N−1) + 2(N−1)/N ·
# (S/k) / β. Bucket i is ready at i · T/k; its all-reduce starts then, or when the previous one
# ends. What is left after backward ends, the **exposed communication**, is
#
# $$\text{exposed}(k) = c + (k-1)\,\max\!\left(0,\; c - T/k\right)$$
#
# * **large buckets** (small k): the last bucket's all-reduce cannot start before backward ends,
#   and it is big: c grows with S/k;
# * **small buckets** (large k): each pays α · 2(N−1) again; once c > T/k backward no longer
#   hides them, and the latencies add up.
#
# `minizero.analysis.cost.bucket_exposed` computes it for the buckets DDP really makes. The cell
# fits α and β on these ranks (lesson 00's fit, 4 KiB to 64 MiB), then trains DDP with each
# `bucket_cap_mb` below, alternating a step under `no_sync()` (forward and backward timed apart,
# no communication: T) and a normal step (forward + backward + the wait for the last bucket).

# %%
CAPS_MB = [0.005, 0.02, 0.05, 0.1, 0.2, 0.5]  # MiB; TinyGPT's gradient is ~0.4 MiB
s = lab.bucket_sweep(NPROCS, CAPS_MB, steps=5)
link = cost.fit(s.sweep, NPROCS)  # minizero's collectives: a reduce-scatter's bytes on gloo too
exposed = {c: cost.bucket_exposed(s.buckets[c], s.backward_s[c], NPROCS, link) for c in CAPS_MB}
predicted = {c: s.forward_s[c] + s.backward_s[c] + exposed[c] for c in CAPS_MB}  # the model
lab.show_bucket_sweep(s, link, predicted)
lab.plot_bucket_sweep(s, predicted)

# %% [markdown]
# The model's curve has the U shape of the two costs; the measured one follows it where backward and
# communication can run side by side. On gloo they share the CPU cores, so hidden communication is
# partly paid anyway: rerun the cell before trusting a minimum. For a model of billions of
# parameters on NCCL, the same formula with that machine's α and β (`python -m minizero bench
# collectives`) says where its minimum lies.
