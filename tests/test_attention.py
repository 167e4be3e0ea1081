"""Every attention implementation against one dense reference (outputs and gradients, fp32 and bf16, full and
sliding layers, packed documents), packed documents kept apart in both backends, and the XLA path's work
growing with the window. Splash (the TPU kernel) runs interpreted on this CPU; cuDNN needs a GPU."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import model
import shard
from common import random_params, variant

B, T, N, K, H = 2, 40, 4, 2, 16  # T = 40 crosses the blocks of 16 below and is no multiple of splash's 128


def reference(q, k, v, window, segments):
    """Dense attention written out: scores of every pair in fp32, the mask by its definition, repeat_kv."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    keep = (j <= i) & ((window == 0) | (i - j < window))                    # (T, T)
    keep = keep[None] if segments is None else keep & (segments[:, :, None] == segments[:, None, :])
    k, v = (jnp.repeat(x.astype(jnp.float32), N // K, axis=2) for x in (k, v))  # (B, T, N, H)
    scores = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k) * H ** -0.5
    scores = jnp.where(jnp.asarray(keep)[:, None], scores, -jnp.inf)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v).astype(q.dtype)


def documents(rng):
    """(B, T) ids of random documents: about one in 8 positions starts a new one."""
    return np.cumsum(rng.random((B, T)) < 0.125, axis=1).astype(np.int32)


@pytest.mark.parametrize("impl, dtype", [("xla", "float32"), ("xla", "bfloat16"), ("splash", "float32")])
@pytest.mark.parametrize("window", [0, 5])
def test_implementations_equal_the_reference(monkeypatch, impl, dtype, window):
    monkeypatch.setattr(model, "Q_BLOCK", 16)  # the XLA path in 3 query blocks, the window crossing their edges
    rng = np.random.default_rng(window)
    q, k, v, dy = (jnp.asarray(rng.standard_normal((B, T, n, H)), dtype) for n in (N, K, K, N))
    tol = dict(float32=2e-5, bfloat16=5e-2)[dtype]  # bf16: ours keeps bf16 operands, the reference fp32
    for segments in (None, documents(rng)):
        seg = None if segments is None else jnp.asarray(segments)
        ours, ours_vjp = jax.vjp(lambda *x: shard.ATTEND[impl](*x, window, H ** -0.5, seg), q, k, v)
        ref, ref_vjp = jax.vjp(lambda *x: reference(*x, window, segments), q, k, v)
        assert ours.dtype == q.dtype
        for a, b in zip((ours, *ours_vjp(dy)), (ref, *ref_vjp(dy))):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def packed():
    """Three documents packed into one instance: two end in EOS, the third runs to the end (padding would too)."""
    m = variant("olmo3", max_seq_len=64)  # SSSF, window 5, YaRN on the full layer
    rng = np.random.default_rng(0)
    lengths = [11, 17, 12]
    toks = rng.integers(3, m.vocab_size, (1, sum(lengths)))
    ends = np.cumsum(lengths)
    toks[0, ends[:2] - 1] = m.eos_token_id
    return m, toks, np.concatenate([[0], ends])


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_packed_documents_equal_each_document_alone(monkeypatch, impl):
    """With segment ids, each document's logits are those of the document run alone at the same RoPE positions
    (Olmo 3 never restarted them): nothing leaks across an EOS, in either direction."""
    monkeypatch.setattr(model, "Q_BLOCK", 16)
    m, toks, starts = packed()
    forward = functools.partial(model.forward, m=m, attend_fn=shard.ATTEND[impl])
    params = {k: jnp.asarray(v) for k, v in random_params(m, std=0.1).items()}
    segments = model.segment_ids(toks, m.eos_token_id)
    assert segments.tolist() == [[0] * 11 + [1] * 17 + [2] * 12]
    together = np.asarray(forward(params, jnp.asarray(toks), segments=jnp.asarray(segments)))
    plain = np.asarray(forward(params, jnp.asarray(toks)))
    for a, b in zip(starts[:-1], starts[1:]):
        alone = np.asarray(forward(params, jnp.asarray(toks[:, a:b]), positions=jnp.arange(a, b)))
        np.testing.assert_allclose(together[:, a:b], alone, rtol=0, atol=2e-5 * np.abs(alone).max())
        if a:  # without the segment ids the later documents do see the earlier ones
            assert np.abs(plain[:, a:b] - alone).max() > 1e-2


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_torch_keeps_documents_apart_as_jax_does(impl):
    m, toks, _ = packed()
    params = random_params(m, std=0.1)
    segments = model.segment_ids(toks, m.eos_token_id)
    ref = np.asarray(model.forward({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(toks), m,
                                   segments=jnp.asarray(segments)))
    net = model.torch_model(dataclasses.replace(m, attention=impl), params)
    with torch.no_grad():
        ours = net(torch.from_numpy(toks), segments=torch.from_numpy(segments)).numpy()
        plain = net(torch.from_numpy(toks)).numpy()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert np.abs(plain - ref).max() > 1e-2


def test_flex_traces_whole_and_builds_window_masks_once(monkeypatch):
    """A flex sliding layer is one graph to torch.compile (a catch_warnings block around the call
    cost 3 graph breaks); a second forward reuses the first's BlockMask object (made once per T,
    window and device, not each step); and flex's logits are SDPA's."""
    m = dataclasses.replace(variant("olmo3"), attention="flex")  # SSSF, window 5
    params = random_params(m, std=0.1)
    net = model.torch_model(m, params)
    x = torch.randn(B, T, m.d_model)
    cos, sin = model.rope_cos_sin_torch(torch.arange(T), net.inv_freq[0], net.rope_scale[0])
    mask = model.attention_masks_torch(m, net.windows, T, None, x.device)[net.windows[0]]
    with torch.no_grad():  # (traced on a CPU, flex_attention has no backward)
        explained = torch._dynamo.explain(net.layers[0])(x, cos, sin, mask)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    seen, flex = [], model.flex_attention
    monkeypatch.setattr(model, "flex_attention", lambda *a: seen.append(a[3]) or flex(*a))
    toks = torch.from_numpy(np.random.default_rng(0).integers(0, m.vocab_size, (B, T)))
    with torch.no_grad():
        ours = [net(toks) for _ in range(2)]
        sdpa = model.torch_model(dataclasses.replace(m, attention="sdpa"), params)(toks).numpy()
    assert len(seen) == 6 and all(s is mask for s in seen)  # 3 sliding layers, 2 forwards
    for y in ours:
        np.testing.assert_allclose(y.numpy(), sdpa, rtol=0, atol=1e-5 * np.abs(sdpa).max())


def test_wrong_backend_implementations_are_refused():
    m = variant("olmo3")
    with pytest.raises(ValueError, match="model.attention='flex' is a torch implementation"):
        shard.pick_attention(dataclasses.replace(m, attention="flex"), jnp.float32)
    with pytest.raises(ValueError, match="model.attention='splash' is a JAX implementation"):
        model.torch_model(dataclasses.replace(m, attention="splash"))(torch.zeros((1, 8), dtype=torch.long))


def test_xla_work_grows_with_the_window():
    """The compiled XLA attention's FLOPs per query block (XLA's cost analysis counts the lax.map body once): full
    layers score all T keys per block of 512 queries, sliding ones 1.5W - 1 keys per block of W/2, as
    model.flops_per_token counts (T 2048, W 256)."""
    shape = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.float32)

    def flops(window, block):
        f = jax.jit(lambda q, k, v: model.attend_in_blocks(q, k, v, window, 0.125))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "Q_BLOCK", block)
            return f.lower(shape, shape, shape).compile().cost_analysis()["flops"]
    dense, full, sliding = flops(0, 2048), flops(0, 512), flops(256, 512)
    assert full / dense == pytest.approx(512 / 2048, rel=0.05)
    assert sliding / dense == pytest.approx(128 * 383 / 2048 ** 2, rel=0.05)
