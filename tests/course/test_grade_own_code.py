"""Your own code, not the library's: while grading checks an exercise, a part that hands its work
to minizero's implementation of the same name fails, named; a part that calls the library for
anything else does not (issue 31). The checks run in-process here, as in test_checks_reject*."""

from __future__ import annotations

import torch
from cheats import solution

import minizero.tools.train as train
from minizero.bucket import Bucket
from minizero.course.checks import lesson00, lesson02, lesson03, own_code
from minizero.tools.train import estimate_loss as library_estimate_loss
from minizero.zero2 import ZeRO2

ZERO2_PARTS = ["MyZeRO2.post_accumulate_grad_hook", "MyZeRO2.finish_in_flight"]


class _HandsOnGradReady(solution("03_zero2", "MyZeRO2")["MyZeRO2"]):
    """The issue's cheat for one method; the lesson's solution (the student's own) for the other."""

    def post_accumulate_grad_hook(self, p):
        return ZeRO2.post_accumulate_grad_hook(self, p)


def test_a_method_that_calls_minizeros_own_fails_named_and_the_students_own_does_not(capsys):
    with own_code.graded(ZERO2_PARTS, [], {"MyZeRO2": _HandsOnGradReady}) as found:
        lesson03.check_zero2(_HandsOnGradReady, 2)  # the check itself passes: same numbers
    assert "PASS" in capsys.readouterr().out
    assert found == [
        "MyZeRO2.post_accumulate_grad_hook calls minizero's ZeRO2.post_accumulate_grad_hook: "
        "write it yourself"
    ]  # recorded on the ranks (forked), where autograd calls the hook


class _Borrowed(Bucket):
    """super(), an alias and a method left out: three ways of not writing it."""

    def __init__(self, params, index=0, world=1):
        super().__init__(params, index, world)

    def view(self, flat, p):
        return super().view(flat, p)

    chunk = Bucket.chunk  # flatten: not written at all


def test_super_an_alias_and_a_missing_method_each_fail_named():
    parts = ["MyBucket.__init__", "MyBucket.view", "MyBucket.chunk", "MyBucket.flatten"]
    with own_code.graded(parts, [], {"MyBucket": _Borrowed}) as found:
        lesson02.check_bucket(_Borrowed)
    assert found == [
        "MyBucket.chunk is minizero's Bucket.chunk: write it yourself",
        "MyBucket.flatten is not written: the class inherits minizero's Bucket.flatten",
        "MyBucket.__init__ calls minizero's Bucket.__init__: write it yourself",
        "MyBucket.view calls minizero's Bucket.view: write it yourself",
    ]


def test_the_lessons_own_delegation_and_the_checks_own_calls_are_not_flagged():
    init, view = "MyBucket.__init__", "MyBucket.view"
    with own_code.graded([init, view], [init], {"MyBucket": _Borrowed}) as found:
        p = torch.nn.Parameter(torch.zeros(3))
        b = _Borrowed([p])  # super().__init__: the lesson's own way (in the kit's solution)
        Bucket.view(b, torch.zeros(3), p)  # the check probing with the library on your object
        assert found == [] and own_code.TRIPS == []  # neither recorded
        b.view(torch.zeros(3), p)  # yours, handing it on
    assert found == ["MyBucket.view calls minizero's Bucket.view: write it yourself"]


def _calls_the_module(model, batches, group=None):
    return train.estimate_loss(model, batches, group)


def _calls_an_alias(model, batches, group=None):
    return library_estimate_loss(model, batches, group)


def _own_loop(model, batches, group=None):
    return float(torch.stack([model(x) for x in batches]).mean())


def test_a_function_that_calls_minizeros_function_of_the_same_name_fails():
    said = "estimate_loss calls minizero's estimate_loss (minizero.tools.train): write it yourself"
    model = torch.nn.Linear(2, 1)
    for fn in (_calls_the_module, _calls_an_alias, _own_loop):
        with own_code.graded(["estimate_loss"], [], {"estimate_loss": fn}) as found:
            try:
                fn(model, [torch.ones(1, 2)])
            except Exception:  # the library's needs a process group: the call is what counts
                pass
        assert found == ([] if fn is _own_loop else [said]), fn.__name__
    assert train.estimate_loss is library_estimate_loss  # unwired afterwards


def _rebinds_torch_equal_on_its_rank(t, group=None):
    torch.equal = lambda a, b: True
    return t


def test_a_rank_whose_code_rebinds_torch_equal_is_reported():
    own_code.RANK_TAMPERED.clear()
    with own_code.graded(["all_reduce_via_rs_ag"], [], {}) as found:
        try:
            lesson00.check_all_reduce_via_rs_ag(_rebinds_torch_equal_on_its_rank, 2)
        except lesson00.CheckFailed:
            pass
    assert found == [] and "torch.equal" in own_code.RANK_TAMPERED
    assert torch.equal(torch.zeros(1), torch.zeros(1)) and not torch.equal(
        torch.zeros(1), torch.ones(1)
    )  # this process never saw it: ranks are forked


def _rank(cls):
    p = torch.nn.Parameter(torch.zeros(3))
    cls([p], 0, 1).view(torch.zeros(3), p)
    torch.equal = lambda a, b: True
    return "done"


def test_a_rank_started_fresh_gets_the_wires_and_its_own_seal_through_cloudpickle():
    """What a torchrun rank (NCCL) receives: the wires and the student's class, pickled by value
    as a notebook's class is, in one piece; it installs them itself and reports back."""
    import cloudpickle

    class MyBucket(Bucket):  # local: pickled by value, as a notebook's class
        def view(self, flat, p):
            return super().view(flat, p)

    wires, _ = own_code.plan(["MyBucket.view"], [], {"MyBucket": MyBucket})
    wires, fn, cls = cloudpickle.loads(cloudpickle.dumps((wires, _rank, MyBucket)))
    assert wires[0].student is cls  # one pickle: the wire's class is the one the rank runs
    equal = torch.equal
    try:
        report = own_code.in_rank(wires, fn, cls)
    finally:
        torch.equal = equal
    assert report.result == "done" and report.tampered == ["torch.equal"]
    assert report.trips == ["MyBucket.view calls minizero's Bucket.view: write it yourself"]
    assert not hasattr(vars(Bucket)["view"], "__wrapped_by_grader__")  # unwired after the rank
