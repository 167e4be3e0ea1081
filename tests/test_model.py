"""JAX vs PyTorch on the same weights, and the properties the architecture promises."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import model
from common import VARIANTS, random_params, tokens, variant
from configs import ModelConfig
from teach import expect, fail, mistake, number

# Every variant but flex_olmo: OLMo 2's block (olmo2) with OLMoE's experts (olmoe), each checked
# here; its whole model against transformers in test_hf.py, both backends
MODEL_VARIANTS = sorted(set(VARIANTS) - {"flex_olmo"})


def both_logits(m, params, toks, dtype="float32"):
    lj = model.forward(params, jnp.asarray(toks), m, jnp.dtype(dtype))
    with torch.no_grad():
        lt = model.torch_model(m, params)(torch.from_numpy(toks), getattr(torch, dtype))
    return np.asarray(lj.astype(jnp.float32)), lt.float().numpy()


@pytest.mark.parametrize("name", MODEL_VARIANTS)
def test_jax_torch_logits_loss_grads_fp32(name):
    m = variant(name)
    params = random_params(m, std=0.1)
    toks = tokens(m, T=24)
    labels = model.shift_labels(toks)
    labels[0, 3] = model.IGNORE_INDEX  # an ignored label in the middle too

    lj, lt = both_logits(m, params, toks)
    assert np.abs(lj).max() > 1.0  # far from uniform, so a wrong tensor would show
    np.testing.assert_allclose(lj, lt, atol=2e-5 * np.abs(lt).max(), rtol=0)

    # jitted: op by op, JAX would dispatch each op of the layer scan's body on its own (seconds)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, t, y: model.loss_fn(p, t, y, m, z_loss=1e-2)))
    loss_j, grads_j = value_and_grad(params, jnp.asarray(toks), jnp.asarray(labels))
    net = model.torch_model(m, params)
    loss_t = model.cross_entropy_torch(net(torch.from_numpy(toks)), torch.from_numpy(labels), z_loss=1e-2)[0]
    loss_t.backward()
    assert float(loss_j) == pytest.approx(loss_t.item(), rel=1e-5)
    grads_t = model.stack_layers({k: p.grad.numpy() for k, p in net.named_parameters()}, m)
    assert set(grads_t) == set(grads_j)
    for k in grads_j:
        g_j, g_t = np.asarray(grads_j[k]), grads_t[k]
        np.testing.assert_allclose(g_j, g_t, atol=1e-4 * np.abs(g_t).max() + 1e-9, rtol=0, err_msg=k)


@pytest.mark.parametrize("name", MODEL_VARIANTS)
def test_jax_torch_bf16(name):
    m = variant(name)
    params = random_params(m, std=0.1)
    toks = tokens(m)
    lj, lt = both_logits(m, params, toks, "bfloat16")
    f32, _ = both_logits(m, params, toks)
    scale = np.abs(f32).max()
    # bf16 keeps 8 bits of mantissa: both backends land near fp32, and near each other.
    assert np.abs(lj - f32).max() < 0.1 * scale and np.abs(lt - f32).max() < 0.1 * scale
    assert np.abs(lj - lt).max() < 0.1 * scale
    assert np.abs(lj - f32).mean() < 0.01 * scale


def test_bf16_linear_gradients_are_fp32_sums_of_bf16_products():
    """linear in bf16 (low_linear's own backward, bf16 dots: test_accelerators.py): y and dx the
    exact fp32 sums of the bf16 operands' products rounded once to bf16; dw that sum unrounded in
    the fp32 master's dtype (JAX's transpose rounded it to bf16: 2^-9 of each entry)."""
    rng = np.random.default_rng(0)
    bf16, f32 = jnp.bfloat16, jnp.float32
    x = jnp.asarray(rng.standard_normal((3, 40, 64)), bf16)  # (B, T, D)
    w = jnp.asarray(rng.standard_normal((96, 64)), f32)  # (F, D), the fp32 master
    g = jnp.asarray(rng.standard_normal((3, 40, 96)), bf16)  # dL/dy (B, T, F)
    y, vjp = jax.vjp(model.linear, x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (bf16, bf16, f32)
    x32, w32, g32 = (np.asarray(a.astype(f32), np.float64) for a in (x, w.astype(bf16), g))
    want_dw = np.einsum("bto,bti->oi", g32, x32)
    for got, want in ((y, x32 @ w32.T), (dx, g32 @ w32)):  # within bf16's half step
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2.0 ** -8, atol=0)
    np.testing.assert_allclose(dw, want_dw, rtol=0, atol=1e-6 * np.abs(want_dw).max())


def test_loss_against_torch_reference():
    """cross_entropy and cross_entropy_torch (both cross_entropy_of, with xp = jnp and torch): the
    cross-entropy equals torch's own with ignore_index, the z term mean(logsumexp²) over the
    targets."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 7, 11)).astype(np.float32) * 3
    labels = rng.integers(0, 11, (2, 7))
    labels[1, 2:] = model.IGNORE_INDEX
    t = torch.from_numpy(logits)
    flat = torch.from_numpy(labels).view(-1)
    ref_ce = float(torch.nn.functional.cross_entropy(t.view(-1, 11), flat, ignore_index=-100))
    valid = labels != model.IGNORE_INDEX
    lse = torch.logsumexp(t.double(), -1).numpy()
    ref_z, n = (lse[valid] ** 2).mean(), valid.sum()
    every = f"over all {labels.size} positions, the {labels.size - n} ignored ones included"
    ce_mistakes = [
        mistake("the sum over the targets, not divided by n", ref_ce * n,
                "divide by n, the number of targets."),
        mistake(f"dividing by all {labels.size} positions", ref_ce * n / labels.size,
                "n counts only the labels that are not IGNORE_INDEX.")]
    z_mistakes = [
        mistake(f"averaging logsumexp² {every}", (lse ** 2).mean(),
                "ignored positions take no part in z either."),
        mistake(f"summing logsumexp² {every}, over n", (lse ** 2).sum() / n,
                "sum over the targets only (labels != IGNORE_INDEX)."),
        mistake("logsumexp, not squared", lse[valid].mean(), "z is the mean of logsumexp²."),
        mistake("the sum over the targets, not divided by n", (lse[valid] ** 2).sum(),
                "divide by n, as the cross-entropy.")]
    loss_mistakes = [mistake("ce + z, without the multiplier", ref_ce + ref_z,
                             "loss = ce + z_loss · z (z_loss = 1e-4 here)."),
                     mistake("ce alone", ref_ce, "add z_loss · z.")]
    def on_torch():
        try:
            return model.cross_entropy_torch(t, torch.from_numpy(labels), z_loss=1e-4)
        except (TypeError, AttributeError, RuntimeError) as e:
            fail(f"model.cross_entropy_torch, which calls cross_entropy_of with torch tensors and "
                 f"xp = torch, raises {type(e).__name__}: {e}",
                 "Write cross_entropy_of with what jnp and torch share: xp.where, .sum(), * and /, "
                 "and no jnp.* call of your own.")
    runs = [("model.cross_entropy",
             lambda: model.cross_entropy(jnp.asarray(logits), jnp.asarray(labels), z_loss=1e-4)),
            ("model.cross_entropy_torch (xp = torch)", on_torch)]
    for name, run in runs:  # JAX first, then the same function on torch tensors
        loss, ce, z = run()
        expect(number(f"{name}'s ce", ce, ref_ce, 1e-6, ce_mistakes,
                      "ce = −(sum of log p(label) over the targets) / n; label_logps gives "
                      "log p(label) and 0 at ignored positions."),
               number(f"{name}'s z", z, ref_z, 1e-6, z_mistakes,
                      "z = (sum of logsumexp² over the targets) / n."),
               number(f"{name}'s loss", loss, ref_ce + 1e-4 * ref_z, 1e-6, loss_mistakes,
                      "cross_entropy_of returns (loss, ce, z), loss = ce + z_loss · z."))


# (olmo_hybrid's causality: test_hybrid.py's generation test, each position's logits from the
# tokens before it alone equal to the whole sequence's)
@pytest.mark.parametrize("name", [v for v in MODEL_VARIANTS if v != "olmo_hybrid"])
def test_causal(name):
    m = variant(name)
    params = random_params(m)
    a = tokens(m, T=20)
    b = a.copy()
    b[:, 12:] = (b[:, 12:] + 7) % m.vocab_size
    for la, lb in zip(both_logits(m, params, a), both_logits(m, params, b)):
        if m.n_experts:
            # Equal to rounding: an expert's rows are the batch's tokens routed to it, so later
            # tokens change how many rows its matmul blocks over and its sums' order (transformers'
            # too); a later token leaking in would move the logits by far more than 1e-5
            np.testing.assert_allclose(la[:, :12], lb[:, :12], rtol=0, atol=1e-5)
        else:
            np.testing.assert_array_equal(la[:, :12], lb[:, :12])
        assert np.abs(la[:, 12:] - lb[:, 12:]).max() > 1e-3


def test_sliding_window_sees_exactly_w_keys():
    W, T, q = 6, 16, 13
    m = variant("olmo3", n_layers=1, layer_pattern="S", sliding_window=W, yarn_factor=0.0)
    params = random_params(m)
    base = tokens(m, B=1, T=T)
    ref = both_logits(m, params, base)
    for back, seen in [(W, False), (W - 1, True)]:
        changed = base.copy()
        changed[0, q - back] = (changed[0, q - back] + 1) % m.vocab_size
        for r, c in zip(ref, both_logits(m, params, changed)):
            moved = np.abs(r[0, q] - c[0, q]).max()
            assert (moved > 1e-4) == seen, (back, moved)
    # A full layer sees the same far-back key.
    full = variant("olmo3", n_layers=1, layer_pattern="F", sliding_window=0, yarn_factor=0.0)
    changed = base.copy()
    changed[0, q - W] = (changed[0, q - W] + 1) % m.vocab_size
    assert np.abs(both_logits(full, params, base)[0][0, q] - both_logits(full, params, changed)[0][0, q]).max() > 1e-4


def test_layer_arrays_olmo3_7b():
    from configs import load_config
    m = load_config(["configs/olmo3-7b.toml", "configs/olmo3-7b-stage3.toml"]).model
    window, inv_freq, scale = model.layer_arrays(m)
    assert [i for i in range(32) if window[i] == 0] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert set(window[window > 0]) == {4096}
    assert np.all(scale[window > 0] == 1.0) and np.allclose(scale[window == 0], 0.1 * math.log(8) + 1)
    # YaRN only on full layers: sliding layers keep plain RoPE.
    np.testing.assert_allclose(inv_freq[0], 500000.0 ** -(np.arange(0, 128, 2) / 128), rtol=1e-6)
    assert not np.allclose(inv_freq[3], inv_freq[0])


def test_init_from_table():
    m = ModelConfig(d_model=128, n_layers=3, n_heads=4, vocab_size=4096, eos_token_id=0, pad_token_id=1)
    params = model.init_params(m, jax.random.PRNGKey(0))
    q = np.asarray(params["layers.self_attn.q_proj.weight"])
    # Truncated at ±3σ: std shrinks by a known factor (0.9866 for ±3σ).
    assert np.abs(q).max() <= 0.06 + 1e-7
    assert q.std() == pytest.approx(0.02 * 0.98658, rel=0.02)
    assert np.all(np.asarray(params["norm.weight"]) == 1.0)
    net = model.torch_model(m)
    assert net.layers[1].mlp.up_proj.weight.std().item() == pytest.approx(0.02 * 0.98658, rel=0.03)
    assert net.layers[0].post_attention_layernorm.weight.min().item() == 1.0


def test_mitchell_init_per_layer():
    m = ModelConfig(family="olmo1", d_model=256, n_layers=4, n_heads=4, mlp_hidden=512, vocab_size=1024,
                    norm_eps=1e-5, init="mitchell", eos_token_id=0, pad_token_id=1)
    params = model.init_params(m, jax.random.PRNGKey(1))
    o = np.asarray(params["layers.self_attn.o_proj.weight"])
    down = np.asarray(params["layers.mlp.down_proj.weight"])
    for i in range(4):
        depth = math.sqrt(2 * (i + 1))
        assert o[i].std() == pytest.approx(0.98658 / math.sqrt(256) / depth, rel=0.03)
        assert down[i].std() == pytest.approx(0.98658 / math.sqrt(512) / depth, rel=0.03)
    assert np.asarray(params["embed_tokens.weight"]).std() == pytest.approx(0.98658 / 16, rel=0.03)
    assert "lm_head.weight" in params and "norm.weight" not in params


def test_flops_per_token_by_hand():
    m = variant("olmo3")  # D 64, L 4 (3 sliding W=5 + 1 full), N 4, H 32, V 300, untied
    T = 64
    matmul = model.count_params(m) - 300 * 64
    assert model.flops_per_token(m, T) == 6 * matmul + 12 * 4 * 32 * (3 * 5 + 64)
    tied = variant("olmo1")
    assert model.flops_per_token(tied, T) == 6 * model.count_params(tied) + 12 * 4 * 16 * 2 * 64


def test_stack_unstack_round_trip():
    m = variant("olmo2")
    params = random_params(m)
    flat = model.unstack_layers(params, m)
    assert "layers.1.self_attn.q_norm.weight" in flat and "layers.self_attn.q_norm.weight" not in flat
    back = model.stack_layers(flat, m)
    assert all(np.array_equal(back[k], params[k]) for k in params)
    assert set(model.torch_model(m).state_dict()) == set(flat)


def test_token_checks():
    m = variant("olmo2")
    with pytest.raises(ValueError, match="token id 300 is out of range for vocab_size=300"):
        model.check_tokens(np.array([[1, 300]]), m)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        model.check_tokens(np.array([[-1, 3]]), m)
    with pytest.raises(ValueError, match=r"expected integer token ids of shape \(B, T\)"):
        model.check_tokens(np.array([1.0, 2.0]), m)


def test_query_blocks_give_the_same_attention(monkeypatch):
    m = variant("olmo3")
    params = {k: jnp.asarray(v) for k, v in random_params(m, std=0.1).items()}
    t = jnp.asarray(tokens(m, T=32))
    labels = jnp.asarray(model.shift_labels(np.asarray(t)))
    both = lambda: jax.jit(lambda p: (model.forward(p, t, m), jax.grad(model.loss_fn)(p, t, labels, m)))(params)
    whole = both()  # (jit: op by op, the blocks' scans take half a minute)
    monkeypatch.setattr(model, "Q_BLOCK", 8)  # 4 blocks of 8 queries, window 5 crossing block edges
    blocks = both()
    np.testing.assert_allclose(np.asarray(blocks[0]), np.asarray(whole[0]), rtol=0, atol=1e-5)
    for k in params:
        ref = np.asarray(whole[1][k])
        np.testing.assert_allclose(np.asarray(blocks[1][k]), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=k)


def test_unrolled_layers_equal_the_scan():
    """train.scan_layers=false: the loop over the repeats of layer_pattern unrolled, the same logits and gradients."""
    m = variant("olmo3", n_layers=2 * len(variant("olmo3").layer_pattern))  # two repeats: a loop of 2
    params = jax.tree.map(jnp.asarray, random_params(m, std=0.1))
    t = jnp.asarray(tokens(m, T=16))

    def run(scan):
        loss = lambda p: jnp.sum(model.forward(p, t, m, scan_layers=scan) ** 2) / t.size  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)
    (a, ga), (b, gb) = run(True), run(False)
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    for k in ga:
        np.testing.assert_allclose(gb[k], ga[k], rtol=1e-5, atol=1e-6 * float(np.abs(ga[k]).max()), err_msg=k)


@pytest.mark.parametrize("chunks", [5, 3])  # T = 24: 5 chunks with one padded position, or 3 of 8
def test_head_in_chunks_equals_the_whole_head(chunks):
    """token_logps in chunks (strided positions, each recomputed in the backward pass) gives the whole head's
    log p(label) and logsumexp, and the cross-entropy + z-loss built from them the same gradients."""
    m = variant("olmo3")
    params = jax.tree.map(jnp.asarray, random_params(m, std=0.1))
    toks = jnp.asarray(tokens(m, T=24))
    labels = jnp.asarray(model.shift_labels(np.asarray(toks))).at[0, 3].set(model.IGNORE_INDEX)

    def stats(p, c):
        x, terms = model.forward(p, toks, m, head=False)
        assert terms == {}  # a dense MLP adds no auxiliary loss terms
        return model.token_logps(p, x, labels, m, c)

    logits = model.forward(params, toks, m)
    whole = model.label_logps(logits, labels)
    for got, want in zip(stats(params, chunks), whole):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    loss = lambda p, c: -stats(p, c)[0].sum() + 1e-2 * (stats(p, c)[1] ** 2).sum()  # noqa: E731
    got, want = jax.grad(loss)(params, chunks), jax.grad(loss)(params, 1)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6 * float(np.abs(want[k]).max()), err_msg=k)


def olmo_core_get_labels(input_ids, label_mask=None, instance_mask=None):
    """OLMo-core data/utils.py get_labels, in numpy: label_mask and instance_mask set -100, then
    the shift; no rule for PAD ids."""
    labels = input_ids.copy()
    if label_mask is not None:
        labels[~label_mask] = model.IGNORE_INDEX
    if instance_mask is not None:
        labels[~instance_mask] = model.IGNORE_INDEX
    return np.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=model.IGNORE_INDEX)


def test_labels_are_olmo_cores_but_at_a_pad_id_inside_the_text():
    """shift_labels equals OLMo-core's get_labels on its own data: a padded instance carries a
    label mask False on the padding (NumpyPaddedFSLDataset), a filtered one an instance mask.
    They differ only at a PAD id inside the text, which OLMo-core trains on and we do not
    (docs/training.md: labels)."""
    pad = 7
    padded = np.array([[3, 4, 5, pad, pad, pad]])
    label_mask = np.array([[True, True, True, False, False, False]])
    assert np.array_equal(model.shift_labels(padded, pad, label_mask),
                          olmo_core_get_labels(padded, label_mask))
    both = np.array([[3, 4, 5, 6, 2, 1], [1, 2, 3, 4, 5, 6]])
    instance = np.array([True, False])
    assert np.array_equal(model.shift_labels(both, pad, np.broadcast_to(instance[:, None], (2, 6))),
                          olmo_core_get_labels(both, instance_mask=instance))
    text = np.array([[3, pad, 5, 6]])  # a PAD id in a document, no mask
    ours, theirs = model.shift_labels(text, pad), olmo_core_get_labels(text)
    assert theirs[0, 0] == pad and ours[0, 0] == model.IGNORE_INDEX
    assert np.array_equal(ours[:, 1:], theirs[:, 1:])
