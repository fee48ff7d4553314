"""A small training script run by test_exit.py under plain torchrun: a tiny model trained a few
steps at ``STAGE`` with nanoGPT's habits (the optimizer built before wrapping, gradient sync off
on the first of two micro-batches, clip_grad_norm_ on p.grad, rank 0 logging), then it either
destroys its process group itself (``EXIT=destroy``, nanoGPT's train.py) or leaves it to the
interpreter's exit (``EXIT=leave``). Rank r writes its final parameters to ``$OUT/r.pt``."""

import os

import torch
import torch.distributed as dist

import minizero

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # nanoGPT's order: before wrapping
model = minizero.parallelize(model, int(os.environ["STAGE"]))
for step in range(3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)[2 * rank : 2 * rank + 2]  # this rank's rows
    for micro in range(2):
        model.require_backward_grad_sync = micro == 1
        (model(x[micro : micro + 1]).pow(2).mean() / 2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.save(minizero.full_state_dict(model), os.path.join(os.environ["OUT"], f"{rank}.pt"))
if os.environ["EXIT"] == "destroy":
    dist.destroy_process_group()
