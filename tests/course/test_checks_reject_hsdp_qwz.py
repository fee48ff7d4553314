"""Lesson 08's HSDP and qwZ checks fail plausible wrong answers, each with a message naming the
mistake; the solutions pass (issue 15's rule: a check is code under test too)."""

import pytest
import torch
import torch.distributed as dist

from minizero import collectives as C
from minizero.course.checks import CheckFailed, lesson08

pytestmark = pytest.mark.timeout(300)


# -- HSDP's two-step reduction ---------------------------------------------------------------------
def _shard(grad, group):
    n_s = dist.get_world_size(group)
    out = torch.empty(grad.numel() // n_s, dtype=grad.dtype)  # (numel / N_s,)
    C.reduce_scatter(out, grad, group=group)
    return out


def hsdp_right(grad, shard_group, replicate_group):
    out = _shard(grad, shard_group)
    C.all_reduce(out, group=replicate_group)
    return out / (dist.get_world_size(shard_group) * dist.get_world_size(replicate_group))


def hsdp_node_only(grad, shard_group, replicate_group):  # forgot the replicate all-reduce
    return _shard(grad, shard_group) / dist.get_world_size(shard_group)


def hsdp_no_div_nodes(grad, shard_group, replicate_group):  # divided by N_s only
    out = _shard(grad, shard_group)
    C.all_reduce(out, group=replicate_group)
    return out / dist.get_world_size(shard_group)


def hsdp_world_all_reduce(grad, shard_group, replicate_group):  # group= dropped
    out = _shard(grad, shard_group)
    C.all_reduce(out)
    return out / dist.get_world_size()


def hsdp_hard_coded_2(grad, shard_group, replicate_group):  # right on 2 x 2 only
    out = torch.empty(grad.numel() // 2, dtype=grad.dtype)  # N_s = 2
    C.reduce_scatter(out, grad, group=shard_group)
    C.all_reduce(out, group=replicate_group)
    return out / (2 * 2)


def hsdp_world_reduce_scatter(grad, shard_group, replicate_group):  # shard over the world
    out = torch.empty(grad.numel() // dist.get_world_size(), dtype=grad.dtype)
    C.reduce_scatter(out, grad)
    return out / dist.get_world_size()


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_hsdp_reduce_passes_the_solution(capsys):
    lesson08.check_hsdp_reduce(hsdp_right)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (hsdp_node_only, "average over your node only: all-reduce the shard over replicate_group"),
        (hsdp_no_div_nodes, "x the average: divide the sum by every rank's count"),
        (hsdp_world_all_reduce, "the all-reduce ran on the default group"),
        (hsdp_hard_coded_2, "a size hard-coded for 2 x 2 (a 2?)"),
        (hsdp_world_reduce_scatter, "reduce-scatter over shard_group (not the world)"),
    ],
)
def test_hsdp_reduce_rejects_wrong_answers(wrong, says):
    with pytest.raises(CheckFailed) as e:
        lesson08.check_hsdp_reduce(wrong)
    assert says in str(e.value), str(e.value)


# -- qwZ's block quantisation ----------------------------------------------------------------------
def _blocks(x, block):
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = x
    return padded.view(-1, block), n  # (blocks, block)


def quant_right(x, block):
    rows, n = _blocks(x, block)
    scales = rows.abs().amax(1) / 127  # (blocks,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(-1)[:n], scales


def quant_per_tensor(x, block):  # one scale for everything
    scale = x.abs().max() / 127
    return torch.round(x / scale).to(torch.int8), scale.view(1)


def quant_128(x, block):  # absmax / 128: the largest element overflows
    rows, n = _blocks(x, block)
    scales = rows.abs().amax(1) / 128
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp(-128, 127).to(torch.int8)
    return q.view(-1)[:n], scales


def quant_truncate(x, block):  # .to(int8) rounds toward zero
    rows, n = _blocks(x, block)
    scales = rows.abs().amax(1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (rows / safe[:, None]).to(torch.int8).view(-1)[:n], scales


def quant_float(x, block):  # rounded, but kept as float: no bytes saved
    q, s = quant_right(x, block)
    return q.float(), s


@pytest.mark.soak  # the fast tier grades the solution itself (test_lesson_runs.py)
def test_quantize_passes_the_solution(capsys):
    lesson08.check_quantize(quant_right)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, says",
    [
        (quant_per_tensor, "want one per block of 256"),
        (quant_128, "absmax / 127, so that the largest |x| maps to ±127"),
        (quant_truncate, "Round to the nearest level (torch.round)"),
        (quant_float, "make it int8"),
    ],
)
def test_quantize_rejects_wrong_answers(wrong, says):
    with pytest.raises(CheckFailed) as e:
        lesson08.check_quantize(wrong)
    assert says in str(e.value), str(e.value)
