"""The models and the synthetic data every lesson uses (minizero/models.py, minizero/data.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minizero.models import MLP, EncoderLM, GPTConfig, TinyGPT, count_params, synthetic_batch


def tiny_gpt(seed: int = 0, **overrides) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig.tiny(**overrides))


def gpt_params(c: GPTConfig) -> int:
    """Ψ by hand: embeddings, 12C^2 + 13C per block (with biases), final LayerNorm; lm_head tied."""
    C = c.n_embd
    return c.vocab_size * C + c.block_size * C + c.n_layer * (12 * C * C + 13 * C) + 2 * C


def test_gpt_forward_backward_shapes_and_convention():
    model = tiny_gpt()
    idx, targets = synthetic_batch("gpt", 4, step=0, seq_len=16)
    logits = model(idx)
    assert logits.shape == (4, 16, 101)
    loss = model(idx, targets)
    assert loss.shape == ()
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(64, 101), targets.reshape(64)))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_gpt_param_counts():
    for cfg in (GPTConfig.tiny(), GPTConfig.small()):
        assert count_params(TinyGPT(cfg)) == gpt_params(cfg)
    assert count_params(TinyGPT(GPTConfig.tiny())) == 108_608
    assert count_params(TinyGPT(GPTConfig.small())) == 3_716_608


def test_gpt_init_is_deterministic_given_the_seed():
    a, b, c = tiny_gpt(0), tiny_gpt(0), tiny_gpt(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_gpt_lm_head_is_tied_to_the_token_embedding():
    model = tiny_gpt()
    assert model.lm_head.weight is model.wte.weight
    assert sum(1 for _ in model.parameters()) == len(model.state_dict()) - 1  # one name too many
    idx, targets = synthetic_batch("gpt", 2, step=0, seq_len=8)
    model(idx, targets).backward()
    tied_grad = model.wte.weight.grad.clone()

    # Untie: the tied gradient is the sum of the embedding's and the head's.
    untied = tiny_gpt()
    untied.lm_head.weight = torch.nn.Parameter(untied.wte.weight.detach().clone())
    untied(idx, targets).backward()
    torch.testing.assert_close(tied_grad, untied.wte.weight.grad + untied.lm_head.weight.grad)


def test_gpt_attention_is_causal():
    model = tiny_gpt().eval()
    idx, _ = synthetic_batch("gpt", 2, step=0, seq_len=12)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 101
    torch.testing.assert_close(model(idx)[:, :7], model(changed)[:, :7])
    assert not torch.allclose(model(idx)[:, 7:], model(changed)[:, 7:])


def test_gpt_config_validates_itself():
    with pytest.raises(
        ValueError, match=r"GPTConfig.n_embd \(30\) must be divisible by n_head \(4\)"
    ):
        GPTConfig.tiny(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="GPTConfig.n_layer must be a positive int, got 0"):
        GPTConfig.tiny(n_layer=0)
    with pytest.raises(ValueError, match=r"GPTConfig.dropout must be in \[0, 1\), got 1.0"):
        GPTConfig.tiny(dropout=1.0)
    with pytest.raises(TypeError):
        GPTConfig(101, 32, 2, 2, 64)  # keyword-only
    with pytest.raises(ValueError, match="sequence length 33 exceeds block_size 32"):
        tiny_gpt()(torch.zeros(1, 33, dtype=torch.long))


def test_gpt_builds_and_runs_on_the_meta_device():
    cfg = GPTConfig(vocab_size=50_304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = TinyGPT(cfg)  # ~1.3B parameters, no memory
        idx = torch.zeros(2, 64, dtype=torch.long)
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == gpt_params(cfg)
    loss = model(idx, idx)
    loss.backward()
    assert loss.is_meta and model.wte.weight.grad.shape == (50_304, 2048)


def test_gpt_runs_in_bf16():
    model = tiny_gpt().to(torch.bfloat16)
    idx, targets = synthetic_batch("gpt", 2, step=0, seq_len=8)
    loss = model(idx, targets)
    assert loss.dtype == torch.bfloat16
    loss.backward()


def test_encoder_lm_is_torchs_encoder_with_a_tied_head_and_the_gpt_convention():
    cfg = GPTConfig.tiny(n_embd=32, block_size=8)
    torch.manual_seed(0)
    model = EncoderLM(cfg)
    assert model.lm_head.weight is model.tok_emb.weight  # one Parameter, counted once
    assert all(isinstance(b, nn.TransformerEncoderLayer) for b in model.blocks)
    assert model.blocks is model.encoder.layers and len(model.blocks) == cfg.n_layer
    idx, targets = synthetic_batch("gpt", 3, step=0, seq_len=8)
    logits = model(idx)  # (B, T, V)
    assert logits.shape == (3, 8, cfg.vocab_size)
    loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    cut = model(idx[:, :5])  # causal: a prefix's logits do not see the tokens after it
    torch.testing.assert_close(cut, logits[:, :5], atol=1e-5, rtol=0)
    with torch.device("meta"):
        big = EncoderLM(GPTConfig.small())
    assert count_params(big) == gpt_params(GPTConfig.small())  # 12C^2 + 13C per layer, as GPT
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_mlp_sizes_need_padding():
    model = MLP()
    numels = [p.numel() for p in model.parameters()]
    assert all(n % 2 and n % 3 for n in numels)
    assert count_params(model) == sum(numels) == 1837
    assert all(1837 % world for world in (2, 3, 4))


def test_mlp_forward_loss_backward():
    torch.manual_seed(0)
    model = MLP()
    x, y = synthetic_batch("mlp", 5, step=0)
    out = model(x)
    assert out.shape == (5, 7)
    loss = model(x, y)
    torch.testing.assert_close(loss, F.mse_loss(out, y))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_mlp_frozen_first():
    model = MLP(frozen_first=True)
    assert not model.layers[0].weight.requires_grad
    assert count_params(model) == 1837 - 13 * 37
    x, y = synthetic_batch("mlp", 5, step=0)
    model(x, y).backward()
    assert model.layers[0].weight.grad is None and model.layers[0].bias.grad is not None


def test_mlp_tied_weight_is_one_parameter():
    model = MLP(tied=True)
    assert model.tie_a.weight is model.tie_b.weight
    assert count_params(model) == 1837 + 37 * 37 + 2 * 37
    x, y = synthetic_batch("mlp", 5, step=0)
    model(x, y).backward()
    assert model.tie_a.weight.grad is model.tie_b.weight.grad
    with torch.device("meta"):
        assert count_params(MLP(tied=True, bias=False)) == 13 * 37 + 37 * 37 + 37 * 29 + 29 * 7 + 7


def test_mlp_rejects_bad_sizes():
    with pytest.raises(
        ValueError, match=r"MLP sizes must be at least two positive ints, got \(3,\)"
    ):
        MLP(sizes=(3,))


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_concatenate_to_the_global_batch(kind, world):
    full = synthetic_batch(kind, 12, step=5, seed=3)
    parts = [synthetic_batch(kind, 12, step=5, seed=3, rank=r, world=world) for r in range(world)]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts]), full[i])
        assert all(p[i].shape[0] == 12 // world for p in parts)


def test_batches_are_deterministic_and_differ_by_step_and_seed():
    a, b = synthetic_batch("gpt", 4, step=1), synthetic_batch("gpt", 4, step=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], synthetic_batch("gpt", 4, step=2)[0])
    assert not torch.equal(a[0], synthetic_batch("gpt", 4, step=1, seed=1)[0])
    idx, targets = a
    assert idx.dtype == torch.long and torch.equal(idx[:, 1:], targets[:, :-1])  # shifted by one
    assert int(idx.max()) < 101


def test_batch_shapes_follow_the_model_shapes():
    idx, targets = synthetic_batch("gpt", 2, step=0, vocab_size=2048, seq_len=128)
    assert idx.shape == targets.shape == (2, 128)
    x, y = synthetic_batch("mlp", 3, step=0, in_features=5, out_features=11)
    assert x.shape == (3, 5) and y.shape == (3, 11) and x.dtype == torch.float32


def test_batch_errors():
    msg = r"global_batch \(7\) must be a positive multiple of world \(2\).*pick e.g. 6"
    with pytest.raises(ValueError, match=msg):
        synthetic_batch("mlp", 7, step=0, rank=0, world=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world\); got rank=2, world=2"):
        synthetic_batch("mlp", 4, step=0, rank=2, world=2)
    with pytest.raises(ValueError, match="synthetic_batch kind must be 'gpt' or 'mlp', got 'cnn'"):
        synthetic_batch("cnn", 4, step=0)


def test_the_data_is_learnable():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(60):
        loss = model(*synthetic_batch("mlp", 32, step=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
