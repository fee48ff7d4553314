"""Memory meters and the paper's formulas (minizero/analysis/memory.py), on CPU."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from minizero.analysis.memory import (
    PAPER_TABLE1,
    TABLE1_DP,
    TABLE1_PSI,
    MemoryMeter,
    format_bytes,
    model_state_bytes,
    model_state_report,
    paper_model_state_bytes,
    table1_gb,
)
from minizero.models import MLP, GPTConfig, TinyGPT, count_params, synthetic_batch


def one_step(model, opt, batch):
    opt.zero_grad(set_to_none=True)
    model(*batch).backward()
    opt.step()


# --- paper formulas ----------------------------------------------------------------------------


def test_paper_formula_mixed_precision_adam():
    psi, n = 1000, 4
    total = lambda stage: sum(paper_model_state_bytes(psi, n, stage).values())
    assert total(0) == (2 + 2 + 12) * psi
    assert total(1) == 2 * psi + 2 * psi + 12 * psi / n
    assert total(2) == 2 * psi + (2 + 12) * psi / n
    assert total(3) == (2 + 2 + 12) * psi / n
    assert paper_model_state_bytes(psi, n, 2) == {"params": 2000, "grads": 500, "optimizer": 3000}


def test_paper_formula_fp32_and_k_override():
    assert paper_model_state_bytes(10, 1, 0, "fp32") == {"params": 40, "grads": 40, "optimizer": 80}
    assert paper_model_state_bytes(10, 2, 1, "fp16", k=8)["optimizer"] == 40  # SGD momentum, mixed
    assert paper_model_state_bytes(10, 2, 3, "fp32", k=4) == {
        "params": 20,
        "grads": 20,
        "optimizer": 20,
    }


def test_paper_formula_errors():
    with pytest.raises(ValueError, match="precision must be one of"):
        paper_model_state_bytes(10, 1, 0, "fp8")
    with pytest.raises(ValueError, match="stage must be 0 \\(DDP\\), 1, 2 or 3, got 4"):
        paper_model_state_bytes(10, 1, 4)
    with pytest.raises(ValueError, match="world must be >= 1, got 0"):
        paper_model_state_bytes(10, 0, 1)


def printed_as(value: float, printed: float) -> bool:
    """Whether ``value`` shows as ``printed`` when rounded or truncated to the digits printed."""
    decimals = len(repr(float(printed)).split(".")[1].rstrip("0"))
    scale = 10**decimals
    half_up = math.floor(value * scale + 0.5) / scale
    truncated = math.floor(value * scale + 1e-9) / scale
    return math.isclose(half_up, printed) or math.isclose(truncated, printed)


def test_formula_reproduces_the_papers_table_1():
    assert set(PAPER_TABLE1) == set(TABLE1_PSI)
    for name, rows in PAPER_TABLE1.items():
        assert tuple(rows) == TABLE1_DP
        for n, printed in rows.items():
            for stage, cell in zip((1, 2, 3), printed, strict=True):
                got = table1_gb(TABLE1_PSI[name], n, stage)
                assert printed_as(got, cell), (name, n, stage, got, cell)
        # Stage 0 (DDP) is the N_d = 1 row at every N_d.
        assert all(table1_gb(TABLE1_PSI[name], n, 0) == rows[1][0] for n in TABLE1_DP)
    assert not printed_as(41.4, 41.3) and not printed_as(41.2, 41.3)  # the check can fail


# --- model_state_bytes -------------------------------------------------------------------------


def test_plain_model_and_adam_fp32_is_4_4_8_psi():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.tiny())  # lm_head tied: counted once
    opt = torch.optim.Adam(model.parameters())
    psi = count_params(model)
    assert model_state_bytes(model, opt) == {"params": 4 * psi, "grads": 0, "optimizer": 0}
    one_step(model, opt, synthetic_batch("gpt", 2, step=0, seq_len=8))
    assert model_state_bytes(model, opt) == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 8 * psi,
    }
    assert model_state_bytes(model, opt) == paper_model_state_bytes(psi, 1, 0, "fp32")


def test_frozen_params_count_as_params_without_grads_or_states():
    model = MLP(frozen_first=True)
    opt = torch.optim.Adam(model.parameters())  # Adam keeps no state for a param with no grad
    one_step(model, opt, synthetic_batch("mlp", 4, step=0))
    psi = count_params(model)
    assert psi == 1837 - 13 * 37
    assert model_state_bytes(model, opt) == {
        "params": 4 * 1837,
        "grads": 4 * psi,
        "optimizer": 8 * psi,
    }


def test_tied_weights_count_once():
    model = MLP(tied=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one_step(model, opt, synthetic_batch("mlp", 4, step=0))
    psi = count_params(model)
    assert model_state_bytes(model, opt) == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 4 * psi,
    }


class Flat:
    """A stand-in for a wrapper: grads are views into one flat buffer, also listed as comm."""

    def __init__(self, n_params: int = 10, pad: int = 2):
        self.params = [torch.zeros(n_params)]
        self.flat = torch.zeros(n_params + pad)  # (n + pad,) padded
        self.grads = [self.flat[:4], self.flat[4:n_params]]  # views, one storage

    def _minizero_state_tensors(self):
        return {"params": self.params, "grads": self.grads, "comm": [self.flat]}


def test_each_storage_counted_once_across_categories():
    f = Flat()
    got = model_state_bytes(f, include_comm=True)
    assert got == {"params": 40, "grads": 48, "optimizer": 0, "comm": 0}
    assert model_state_bytes(f) == {"params": 40, "grads": 48, "optimizer": 0}


def test_storage_resized_to_zero_counts_zero():
    f = Flat()
    f.params[0].untyped_storage().resize_(0)  # ZeRO-3 frees a gathered parameter like this
    assert model_state_bytes(f)["params"] == 0


def test_meta_tensors_at_scale():
    cfg = GPTConfig(vocab_size=50_304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = TinyGPT(cfg).to(torch.bfloat16)
        for p in model.parameters():
            p.grad = torch.empty_like(p)  # bf16 grads
        opt = torch.optim.Adam(model.parameters())
        for p in model.parameters():  # fp32 master, momentum, variance
            opt.state[p] = {k: torch.empty_like(p, dtype=torch.float32) for k in ("m", "v", "w")}
    psi = count_params(model)
    assert psi > 1_000_000_000
    assert model_state_bytes(model, opt) == paper_model_state_bytes(psi, 1, 0, "bf16")


def test_fake_tensors_through_a_real_adam_step():
    with FakeTensorMode():
        model = TinyGPT(GPTConfig.tiny())
        opt = torch.optim.Adam(model.parameters())
        one_step(model, opt, (torch.zeros(2, 8, dtype=torch.long),) * 2)
        got = model_state_bytes(model, opt)
    assert got == paper_model_state_bytes(count_params(model), 1, 0, "fp32")


def test_bad_owner_and_bad_category():
    with pytest.raises(TypeError, match="expected an nn.Module or a torch.optim.Optimizer"):
        model_state_bytes(object())

    class Bad:
        def _minizero_state_tensors(self):
            return {"buffers": []}

    with pytest.raises(ValueError, match="_minizero_state_tensors key 'buffers' not in"):
        model_state_bytes(Bad())


def test_format_bytes_and_report(capsys):
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(120e9, "GB") == "120.00 GB"
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    one_step(model, opt, synthetic_batch("mlp", 4, step=0))
    report = model_state_report(model, opt, stage=0)
    assert "1.000" in report and report in capsys.readouterr().out


# --- MemoryMeter on CPU ------------------------------------------------------------------------


def test_meter_sees_activations_rise_in_forward_and_fall_after_backward():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.tiny())
    opt = torch.optim.Adam(model.parameters())
    psi = count_params(model)
    batch = synthetic_batch("gpt", 8, step=0)
    with MemoryMeter(model, opt) as m:
        start = m.mark("start")
        loss = model(*batch)
        fwd = m.mark("after forward")
        loss.backward()
        bwd = m.mark("after backward")
        opt.step()
        stp = m.mark("after step")
    assert [r["label"] for r in m.marks] == [
        "start",
        "after forward",
        "after backward",
        "after step",
    ]
    assert (
        fwd["activations"] > 10 * bwd["activations"] and fwd["activations"] > start["activations"]
    )
    assert (start["grads"], fwd["grads"], bwd["grads"]) == (0, 0, 4 * psi)
    assert bwd["optimizer"] == 0 and stp["optimizer"] >= 8 * psi  # + Adam's 0-d step counters
    assert all(r["params"] == 4 * psi for r in m.marks)
    for r in m.marks:
        parts = r["params"] + r["grads"] + r["optimizer"] + r["comm"] + r["activations"]
        assert parts == r["total"] <= r["peak"]
        assert r["at_peak"]["total"] == r["peak"]
    peaks = [r["peak"] for r in m.marks]
    assert peaks == sorted(peaks) and peaks[-1] > fwd["total"]  # backward peaks above forward
    assert m.marks[-1]["at_peak"]["activations"] > 0


def test_meter_sees_a_storage_resized_to_zero_disappear():
    model = MLP()
    with MemoryMeter(model) as m:
        t = torch.ones(1000)
        before = m.mark("allocated")
        t.untyped_storage().resize_(0)
        after = m.mark("resized")
        del t
        gone = m.mark("deleted")
    assert before["total"] - after["total"] == 4000
    assert after["total"] == gone["total"] == 4 * 1837 and after["peak"] == before["peak"]


def test_meter_counts_comm_and_reset_peak():
    f = Flat()
    with MemoryMeter(f) as m:
        big = torch.zeros(10_000)
        del big
        first = m.mark("after a big temporary")
        m.reset_peak()
        second = m.mark("after reset")
    assert first["peak"] >= 40_000 + 88 and second["peak"] == second["total"] == 88
    assert (second["params"], second["grads"], second["comm"]) == (40, 48, 0)
    assert m.table().splitlines()[0].split()[:3] == ["mark", "params", "grads"]


def test_meter_mark_outside_with_is_an_error():
    with pytest.raises(RuntimeError, match=r"call mark\(\) inside `with MemoryMeter"):
        MemoryMeter(MLP()).mark("x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_meter_on_cuda_reads_the_allocator():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.tiny()).cuda()
    opt = torch.optim.Adam(model.parameters())
    psi = count_params(model)
    batch = [t.cuda() for t in synthetic_batch("gpt", 8, step=0)]
    with MemoryMeter(model, opt) as m:
        loss = model(*batch)
        fwd = m.mark("after forward")
        loss.backward()
        bwd = m.mark("after backward")
    assert m.device.type == "cuda" and bwd["grads"] == 4 * psi and bwd["params"] == 4 * psi
    assert fwd["activations"] > bwd["activations"]
    for r in m.marks:
        assert (
            r["total"] == r["params"] + r["grads"] + r["optimizer"] + r["comm"] + r["activations"]
        )
        assert r["total"] <= r["peak"] <= r["reserved"]
