"""The course's focused tests (docs/exercises.md), in course order, for the exercises the whole
model needs: each checks one exercise's functions, JAX and its PyTorch twin, against something real
nobody here wrote (transformers' RMSNorm, decoder layer, rotary embedding, masks and attention,
MoE router and sparse MoE block, OLMo Hybrid's gated delta rule; OLMo-core's skip-step rule as
reference/olmo-facts.md states it), on tiny shapes, and calls only that exercise and earlier ones,
so the course can be taken in order.
A failure says what differs, where, and which usual mistake gives that pattern (teach.py). The
whole model against transformers is the capstone: test_hf.py::test_hf_to_ours, under exercise 6
for OLMo 1, 2 and 3 and under the router (7) for OLMoE and FlexOlmo.

    .venv/bin/python -m pytest -q tests/test_course.py
    python tests/exercises.py test rope   # in a student copy: one exercise's tests (a skip fails)
"""
import importlib
import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import model
import train
from common import variant
from teach import close, compare, fail, mistake, report, spans

AXES = ("batch", "position", "head", "dim")  # q, k, v and attention outputs: (B, T, N, H)


def hf_net(family):
    """transformers' model of common.VARIANTS[family], every weight random (test_hf.hf_model)."""
    pytest.importorskip("transformers")
    from test_hf import hf_model
    return hf_model(family)


def numpy(t):
    return t.detach().float().numpy()


def hf_cos_sin(net, T, layer_type=None):
    """transformers' rotary embedding at positions 0..T-1: cos, sin (T, H)."""
    pos = torch.arange(T)[None]
    extra = () if layer_type is None else (layer_type,)
    cos, sin = net.model.rotary_emb(torch.zeros(1), pos, *extra)
    return cos[0], sin[0]


# --- 1. rmsnorm: rms_norm and block (torch: RMSNorm.forward, Block.forward) ----------------------

def test_rms_norm_is_transformers():
    """fp32, and bf16 activations with an fp32 weight (our mixed precision) bit for bit, against
    transformers' Olmo2RMSNorm; the torch twin RMSNorm the same."""
    norm = hf_net("olmo2").model.layers[0].post_attention_layernorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    w, eps = numpy(norm.weight), norm.variance_epsilon
    x = 3 * np.random.default_rng(0).standard_normal((2, 8, w.size)).astype(np.float32)
    x[1] *= 1e-3  # batch row 1: mean(x²) ≈ 1e-5, where eps (1e-6) matters
    want = numpy(norm(torch.from_numpy(x)))
    ms = (x.astype(np.float64) ** 2).mean(-1, keepdims=True)
    centred = x - x.mean(-1, keepdims=True)
    mistakes = [
        mistake("subtracting the mean (LayerNorm, OLMo 1's norm)",
                centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps) * w,
                "RMSNorm only divides by the root mean square; it never centres x."),
        mistake("leaving out the weight", x / np.sqrt(ms + eps),
                "multiply by the learned weight (D,) after normalising."),
        mistake("adding eps outside the square root", x / (np.sqrt(ms) + eps) * w,
                "x / sqrt(mean(x²) + eps): eps goes under the root, as HF and OLMo-core do.")]
    hint = "RMSNorm: x / sqrt(mean(x²) + eps) * weight, the mean over the last axis (D), in fp32."
    axes = ("batch", "position", "feature")
    twin = model.RMSNorm(w.size, eps)
    twin.weight.data = torch.from_numpy(w)
    runs = [("model.rms_norm", lambda: model.rms_norm(jnp.asarray(x), jnp.asarray(w), eps)),
            ("model.RMSNorm (torch)", lambda: numpy(twin(torch.from_numpy(x))))]
    for name, run in runs:  # the JAX function first, then its twin
        compare(f"{name}, fp32", run(), want, axes, 1e-6, mistakes, hint)

    xb = torch.from_numpy(x).bfloat16()
    want = numpy(norm(xb))
    llama = LlamaRMSNorm(w.size, eps)  # Llama's order: cast to bf16, then times the weight
    llama.weight.data = torch.from_numpy(w)
    cast_first = numpy(llama(xb).to(torch.bfloat16))
    runs = [("model.rms_norm", lambda: model.rms_norm(jnp.asarray(numpy(xb), jnp.bfloat16),
                                                     jnp.asarray(w), eps)),
            ("model.RMSNorm (torch)", lambda: twin(xb))]
    for name, run in runs:
        got = run()
        if str(got.dtype) not in ("bfloat16", "torch.bfloat16"):
            fail(f"{name} of a bf16 x returns {got.dtype}: cast the result back to x's dtype.")
        got = np.asarray(got.astype(jnp.float32)) if isinstance(got, jax.Array) else numpy(got)
        differ = got != want
        # fp32 sums in another order may move a rare value by one bf16 step: up to 1% may differ
        if differ.mean() > 0.01:
            lines = [f"{name}, bf16 x and an fp32 weight: {differ.sum()} of {differ.size} values "
                     f"differ from transformers' Olmo2RMSNorm (bit for bit, up to 1%); the fp32 "
                     f"test passed, so the maths is right and the casts are not."]
            if np.array_equal(got, cast_first):
                lines.append("That is exactly Llama's order (LlamaRMSNorm): the normalised x cast "
                             "to bf16, then times the weight. OLMo 2/3 multiply by the weight in "
                             "fp32 and cast once, at the end.")
            fail(*lines, hint)


class HFAttentionStandIn(torch.nn.Module):
    """In place of a decoder layer's attention: tanh(h @ A) · 2, no attention at all, so that only
    the block's norms and residual adds are under test (attention is exercises 3 to 5)."""

    def __init__(self, A):
        super().__init__()
        self.A = A

    def forward(self, hidden_states, **kwargs):
        return torch.tanh(hidden_states @ self.A) * 2, None


class AttentionStandIn(HFAttentionStandIn):
    def forward(self, x, *args):  # model.Block calls self_attn(x, cos, sin, mask, cache, pos)
        return super().forward(x)[0]


@pytest.mark.parametrize("family", ["olmo2", "olmo1"])
def test_block_is_transformers_decoder_layer(family):
    """block and the torch Block.forward against transformers' decoder layer (Olmo2DecoderLayer, the
    reordered norm; OlmoDecoderLayer, pre-norm), their attention replaced by the same stand-in."""
    layer = hf_net(family).model.layers[0]
    D = layer.hidden_size
    A = torch.from_numpy(0.3 * np.random.default_rng(1).standard_normal((D, D)).astype(np.float32))
    layer.self_attn = HFAttentionStandIn(A)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 6, D)).astype(np.float32))
    with torch.no_grad():
        want = numpy(layer(x))
    m = variant(family)
    p = {k: jnp.asarray(numpy(v)) for k, v in layer.state_dict().items()}
    twin = model.Block(m)
    twin.self_attn = AttentionStandIn(A)
    twin.load_state_dict(layer.state_dict())
    attn = lambda h: torch.tanh(h @ A) * 2  # noqa: E731
    if family == "olmo1":
        mistakes, hint = [], ("OLMo 1 keeps the pre-norm block: x + attn(layer_norm(x)), then "
                              "+ mlp(layer_norm(x)), with model.layer_norm (no weight).")
    else:
        na, nf, mlp = layer.post_attention_layernorm, layer.post_feedforward_layernorm, layer.mlp
        with torch.no_grad():
            pre = x + attn(na(x))
            pre = pre + mlp(nf(pre))
            after_add = na(x + attn(x))
            after_add = nf(after_add + mlp(after_add))
            swapped = x + nf(attn(x))
            swapped = swapped + na(mlp(swapped))
        mistakes = [
            mistake("the pre-norm block (OLMo 1's and Llama's order)", numpy(pre),
                    "OLMo 2/3 put no norm on the way into a sublayer; they normalise its output."),
            mistake("normalising after the residual add (the 2017 Transformer's post-norm)",
                    numpy(after_add), "normalise the sublayer's output, then add it to x."),
            mistake("swapping the two norms", numpy(swapped),
                    "post_attention_layernorm follows attention, post_feedforward_layernorm the "
                    "MLP.")]
        hint = ("OLMo 2/3 'reordered norm': x = x + rms_norm(attn(x)); x = x + rms_norm(mlp(x)), "
                "each with its own weight (post_attention_layernorm, post_feedforward_layernorm).")
    axes = ("batch", "position", "feature")
    out = model.block(p, jnp.asarray(numpy(x)), lambda h: jnp.tanh(h @ jnp.asarray(A)) * 2, m)
    got = block_x(f"model.block ({family})", out)
    compare(f"model.block ({family})", got, want, axes, 1e-5, mistakes, hint)
    with torch.no_grad():
        got = numpy(block_x(f"model.Block.forward (torch, {family})", twin(x, None, None, None)))
    compare(f"model.Block.forward (torch, {family})", got, want, axes, 1e-5, mistakes, hint)


def block_x(name, out):
    """x of a block's (x, terms), or a failure that says what a block returns."""
    if not isinstance(out, tuple) or len(out) != 2:
        fail(f"{name} returns {type(out).__name__}, not (x, terms): x after both sublayers, and "
             "beside it the auxiliary loss terms the feed-forward returned with its output "
             "(mlp's: {}).")
    x, terms = out
    if terms != {}:
        fail(f"{name}'s terms are {terms!r}: hand on the feed-forward's own terms, the second "
             "value mlp returns ({} for this dense MLP).")
    return x


# --- 2. rope: rope_cos_sin and rope (torch: rope_cos_sin_torch, rope_torch) ---------------------

ROPE_LAYERS = [("olmo1", 0, None), ("olmo2", 0, None), ("olmo3", 0, "sliding_attention"),
               ("olmo3", 3, "full_attention")]  # olmo3's layer 3: full attention, with YaRN


def test_rope_cos_sin_is_transformers():
    """cos and sin at 80 positions (past YaRN's original 64) against transformers' rotary embedding,
    for plain RoPE and for YaRN's full layers, whose attention factor multiplies both."""
    T = 80
    for family, i, layer_type in ROPE_LAYERS:
        cos, sin = (numpy(a) for a in hf_cos_sin(hf_net(family), T, layer_type))
        _, inv_freq, scale = model.layer_arrays(variant(family))
        f, s = inv_freq[i], float(scale[i])
        angles = np.arange(T, dtype=np.float32)[:, None] * f[None, :]  # (T, H/2)
        both = np.concatenate([angles, angles], -1)
        case = f"{family} layer {i} ({'YaRN, scale %.4g' % s if s != 1 else 'plain RoPE'})"
        runs = [("model.rope_cos_sin",
                 lambda: model.rope_cos_sin(jnp.arange(T), jnp.asarray(f), s)),
                ("model.rope_cos_sin_torch",
                 lambda: model.rope_cos_sin_torch(torch.arange(T), torch.from_numpy(f), s))]
        hint = (f"cos and sin are (T, H): the H/2 angles position · inv_freq, then the same H/2 "
                f"again (HF's cat(freqs, freqs)), both times scale (YaRN's attention factor: "
                f"{s:.4g} on this layer; plain RoPE layers pass 1).")
        for name, run in runs:  # the JAX function first, then its twin
            got = run()
            for part, g, want, fn in [("cos", got[0], cos, np.cos), ("sin", got[1], sin, np.sin)]:
                mistakes = [
                    mistake("putting each angle twice in a row (f0 f0 f1 f1 ..., the interleaved "
                            "layout)", fn(np.repeat(angles, 2, -1)) * s,
                            "HF repeats the whole H/2 block."),
                    mistake("leaving out YaRN's attention factor", fn(both),
                            f"multiply by scale ({s:.4g} here): plain RoPE layers pass 1.")]
                g = g.numpy() if isinstance(g, torch.Tensor) else np.asarray(g)
                compare(f"{name}'s {part}, {case}", g, want, ("position", "dim"), 1e-6,
                        mistakes if s != 1 else mistakes[:1], hint)


def rotation_hint(rope, H, torch_layout=False):
    """Which dimensions the learner's rope turns together, from rope(e_d) for each basis vector e_d
    at one position: HF's rotate_half pairs d with d + H/2, and turns e_0 towards +e_{H/2}."""
    a = 0.3 + 0.1 * np.arange(H // 2)
    cos = np.concatenate([np.cos(a), np.cos(a)])[None].astype(np.float32)  # (T=1, H)
    sin = np.concatenate([np.sin(a), np.sin(a)])[None].astype(np.float32)
    eye = np.eye(H, dtype=np.float32)
    if torch_layout:  # (B, N, T, H): head n holds e_n
        out = numpy(rope(torch.from_numpy(eye)[None, :, None], torch.from_numpy(cos),
                         torch.from_numpy(sin)))
    else:  # (B, T, N, H)
        out = np.asarray(rope(jnp.asarray(eye)[None, None], jnp.asarray(cos), jnp.asarray(sin)))
    out = out.reshape(H, H)  # row d: the rotated e_d
    partners = [set(np.flatnonzero(np.abs(out[d]) > 1e-3).tolist()) - {d} for d in range(H)]
    if partners == [{d ^ 1} for d in range(H)]:
        return ("Your rope turns neighbours (2i, 2i + 1) together: the interleaved convention "
                "(GPT-J, Meta's original LLaMA). HF and OLMo turn dimension i with i + H/2 "
                "(rotate_half: cat(-x2, x1) of the two halves), which is why convert.py never "
                "permutes q or k.")
    if partners == [{(d + H // 2) % H} for d in range(H)]:
        if out[0, H // 2] < 0:
            return ("Your rope pairs i with i + H/2, as HF does, but turns the other way: "
                    "rotate_half(x) = cat(-x2, x1), so out[i] = x[i]·cos − x[i + H/2]·sin.")
        return ("Your rope pairs the dimensions as HF does (i with i + H/2); check which cos and "
                "sin entries multiply which half.")
    if not any(partners):
        return ("Your rope mixes no dimensions at all: x·cos + rotate_half(x)·sin, and the "
                "second term is missing.")
    return (f"Your rope mixes dimension 0 with {sorted(partners[0])}; HF's turns dimension i with "
            f"i + H/2 ({H // 2} for 0).")


def test_rope_is_transformers_rotate_half():
    """rope and rope_torch against transformers' apply_rotary_pos_emb (q and k, fp32 inside), on
    transformers' own cos and sin of an OLMo 3 YaRN layer."""
    net = hf_net("olmo3")
    from transformers.models.olmo3.modeling_olmo3 import apply_rotary_pos_emb
    cos, sin = hf_cos_sin(net, 7, "full_attention")
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((2, 4, 7, 32)).astype(np.float32))  # (B, N, T, H)
    k = torch.from_numpy(rng.standard_normal((2, 1, 7, 32)).astype(np.float32))  # (B, K, T, H)
    want_q, want_k = (numpy(a).transpose(0, 2, 1, 3)
                      for a in apply_rotary_pos_emb(q, k, cos[None], sin[None]))
    j = lambda t: jnp.asarray(numpy(t))  # noqa: E731
    for name, fn, torch_layout in [("model.rope", model.rope, False),
                                   ("model.rope_torch", model.rope_torch, True)]:
        for part, x, want in [("q", q, want_q), ("k", k, want_k)]:
            if torch_layout:
                got = numpy(fn(x, cos, sin)).transpose(0, 2, 1, 3)
            else:
                got = np.asarray(fn(j(x).transpose(0, 2, 1, 3), j(cos), j(sin)))
            message = report(f"{name}({part}) with transformers' cos and sin", got, want, AXES,
                             1e-5)
            if message:
                fail(message, rotation_hint(fn, 32, torch_layout))
    got = model.rope(jnp.zeros((1, 7, 4, 32), jnp.bfloat16), j(cos), j(sin))
    if got.dtype != jnp.bfloat16:
        fail(f"model.rope of a bf16 x returns {got.dtype}: rotate in fp32, return x's dtype.")


# --- 3. qk_norm: project_qkv (torch: Attention.project) ------------------------------------------

def each_head_by_transformers(norm, heads):
    """heads (B, T, n, H) each normalised on its own by transformers' RMSNorm (norm's own class, H
    wide, with that head's slice of norm's weight): Qwen 3's and Gemma's per-head QK-norm, the
    mistake to recognise, computed by code the learner does not write."""
    n, H = heads.shape[2], heads.shape[3]
    weights = norm.weight.view(n, H)
    out = []
    for i in range(n):
        one = type(norm)(H, eps=norm.variance_epsilon)
        one.weight.data = weights[i]
        out.append(one(heads[:, :, i]))
    return torch.stack(out, dim=2)


def captured_qkv(net, module, x, cos, sin, monkeypatch):
    """q, k, v (B, T, N|K, H) as transformers' layer-0 attention hands them to its attention
    function: projected, QK-normed or clamped, RoPE applied."""
    seen = {}

    def capture(mod, query, key, value, *args, **kwargs):
        seen.update(q=query, k=key, v=value)
        return original(mod, query, key, value, *args, **kwargs)
    original = module.eager_attention_forward
    monkeypatch.setattr(module, "eager_attention_forward", capture)
    net.config._attn_implementation = "eager"
    with torch.no_grad():
        net.model.layers[0].self_attn(hidden_states=x, position_embeddings=(cos[None], sin[None]),
                                      attention_mask=None)
    return [numpy(seen[n]).transpose(0, 2, 1, 3) for n in "qkv"]


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "olmo1"])
def test_project_qkv_is_transformers_attention(family, monkeypatch):
    """project_qkv and the torch Attention.project against the q, k and v transformers' attention
    layer computes: OLMo 2/3 with QK-norm (and GQA, and head_dim != D / N), OLMo 1.7 clip_qkv."""
    net = hf_net(family)
    hf_name = {"olmo1": "olmo"}.get(family, family)
    module = importlib.import_module(f"transformers.models.{hf_name}.modeling_{hf_name}")
    m = variant(family)
    cos, sin = hf_cos_sin(net, 9, "sliding_attention" if family == "olmo3" else None)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 9, m.d_model))
                         .astype(np.float32))
    want = captured_qkv(net, module, x, cos, sin, monkeypatch)
    attn = net.model.layers[0].self_attn
    p = {f"self_attn.{k}": jnp.asarray(numpy(v)) for k, v in attn.state_dict().items()}
    twin = model.Attention(m)
    twin.load_state_dict(attn.state_dict())

    def run_torch():
        with torch.no_grad():
            return [numpy(a).transpose(0, 2, 1, 3) for a in twin.project(x, cos, sin)]
    B, T = x.shape[:2]

    def rope(a):  # (B, T, n, H) -> the same, RoPE applied as transformers does
        a = a.transpose(1, 2)
        return module.apply_rotary_pos_emb(a, a, cos[None], sin[None])[0].transpose(1, 2)
    alts = {"q": [], "k": [], "v": []}
    with torch.no_grad():
        for n, heads in (("q", m.n_heads), ("k", m.n_kv_heads)):
            proj = getattr(attn, f"{n}_proj")(x)  # (B, T, n·H)
            if family == "olmo1":
                heads_first = rope(proj.view(B, T, heads, -1))
                alts[n] = [mistake("not clamping to ±clip_qkv", numpy(heads_first),
                                   "OLMo 1.7 clamps q, k and v right after the projections."),
                           mistake("clamping after RoPE",
                                   numpy(heads_first.clamp(-m.clip_qkv, m.clip_qkv)),
                                   "clamp first, then RoPE.")]
                continue
            norm = getattr(attn, f"{n}_norm")
            per_head = each_head_by_transformers(norm, proj.view(B, T, heads, -1))
            after = rope(proj.view(B, T, heads, -1)).reshape(B, T, -1)
            alts[n] = [mistake("normalising per head (Qwen 3's and Gemma's QK-norm)",
                               numpy(rope(per_head)),
                               "OLMo 2/3 normalise over the whole projected width, before the "
                               "split into heads."),
                       mistake("normalising after RoPE", numpy(norm(after).view(B, T, heads, -1)),
                               "normalise, then split into heads, then RoPE."),
                       mistake("leaving out the QK-norm", numpy(rope(proj.view(B, T, heads, -1))),
                               f"OLMo 2/3 RMS-normalise q and k (self_attn.{n}_norm.weight).")]
    hint = ("OLMo 1.7: q, k, v = the projections clamped to ±clip_qkv; then heads, then RoPE."
            if family == "olmo1" else
            "OLMo 2/3: q = rms_norm(x @ Wq.T) over all N·H (k: K·H), then split into heads, "
            "then RoPE; v has no norm.")
    axes = {"q": AXES, "k": ("batch", "position", "kv head", "dim"),
            "v": ("batch", "position", "kv head", "dim")}
    runs = [("model.project_qkv", lambda: model.project_qkv(
        p, jnp.asarray(numpy(x)), jnp.asarray(numpy(cos)), jnp.asarray(numpy(sin)), m)),
            ("model.Attention.project (torch)", run_torch)]
    for name, run in runs:  # the JAX function first, then its twin
        for n, g, w in zip("qkv", run(), want):
            compare(f"{name}'s {n} ({family})", np.asarray(g), w, axes[n], 1e-5, alts[n], hint)


# --- 4. sliding_window: attention_mask (one function for jnp and torch) ---------------------------

MASK_CASES = [
    (0, range(12), range(12), "a full layer, 12 positions"),
    (5, range(12), range(12), "a sliding layer, W = 5, 12 positions"),
    (1, range(6), range(6), "W = 1: each query sees only its own key"),
    (4, range(8, 12), range(5, 12),
     "queries 8-11 against keys 5-11 (one of attend_in_blocks' blocks)"),
    (4, [20, 21], [18, 19, 16, 17, 20, 21], "two new tokens against a ring of cached keys "
     "(cached_attention: the keys in slot order, not position order)")]


def visible_keys(mask, k_pos, row):
    return sorted(int(k_pos[j]) for j in np.flatnonzero(mask[row]))


def mask_message(name, got, want, window, q_pos, k_pos, what):
    """None when the masks agree; else the first queries that differ, and what the pattern means."""
    if got.shape != want.shape:
        return f"{name}, {what}: shape {got.shape}, want {want.shape} (queries, keys)"
    rows = np.flatnonzero((got != want).any(1))
    if not len(rows):
        return None
    lines = [f"{name}, {what} (window {window}): queries at positions "
             f"{spans(q_pos[r] for r in rows)} see other keys than transformers' mask lets them:"]
    for r in rows[:3]:
        lines.append(f"  the query at {q_pos[r]} sees keys {visible_keys(got, k_pos, r)}; "
                     f"transformers: {visible_keys(want, k_pos, r)}")
    extra = (got & ~want).sum(1)[rows]
    gone = (want & ~got).sum(1)[rows]
    future = (got & (k_pos[None, :] > q_pos[:, None])).any()
    if future:
        lines.append("Some query sees a key after its own position: the mask must be causal "
                     "(key position <= query position).")
    elif window and (extra == 1).all() and not gone.any():
        lines.append("One key too many, the oldest: the window holds W keys, the query's own "
                     "included (HF: key > query - W, i.e. query - key < W, not <= W).")
    elif window and (gone == 1).all() and not extra.any():
        lines.append("One key too few: the window holds W keys including the query's own key "
                     "(query - key < W).")
    elif not window:
        lines.append("window 0 means a full layer: causal, no window.")
    else:
        lines.append("Compare positions (q_pos, k_pos), not row and column indices: the keys of a "
                     "block or of a cache ring do not start at 0 nor come in order.")
    return "\n".join(lines)


def test_attention_mask_is_transformers_sliding_window():
    """attention_mask, on jnp and on torch, against transformers' causal and sliding-window mask
    functions (masking_utils), on positions: a whole sequence, a block, a ring of cached keys."""
    pytest.importorskip("transformers")
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    for window, q_pos, k_pos, what in MASK_CASES:
        q_pos, k_pos = np.array(q_pos), np.array(k_pos)
        fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
        i, j = torch.from_numpy(q_pos)[:, None], torch.from_numpy(k_pos)[None, :]
        want = fn(0, 0, i, j).numpy()
        runs = [("model.attention_mask on jnp", lambda: np.asarray(model.attention_mask(
                    jnp.asarray(q_pos)[:, None], jnp.asarray(k_pos)[None, :], window))),
                ("model.attention_mask on torch",
                 lambda: model.attention_mask(i, j, window).numpy())]
        for name, run in runs:  # both backends call the one function
            message = mask_message(name, run(), want, window, q_pos, k_pos, what)
            if message:
                fail(message)


# --- 5. gqa: attend, attend_in_blocks (torch: SDPA's and flex's own enable_gqa) ------------------

GQA_CASES = [(4, 2, 0, False, "a full layer, N = 4 query heads over K = 2 kv heads"),
             (4, 2, 5, True, "a sliding layer, W = 5, over two documents in a row (segments)")]


def test_attend_is_transformers_attention(monkeypatch):
    """attend and attend_in_blocks (one block, and blocks of 8 queries) against transformers' own
    attention of a layer (eager_attention_forward, repeat_kv, with its masking_utils mask), outputs
    and gradients."""
    pytest.importorskip("transformers")
    from transformers import masking_utils as mu
    from transformers.models.olmo3.modeling_olmo3 import eager_attention_forward
    B, T, H = 2, 20, 8
    rng = np.random.default_rng(4)
    for N, K, window, documents, what in GQA_CASES:
        q, k, v = (torch.from_numpy(rng.standard_normal((B, n, T, H)).astype(np.float32))
                   .requires_grad_() for n in (N, K, K))
        segments = np.repeat([[0] * 7 + [1] * 13], B, 0).astype(np.int32) if documents else None
        docs = [mu.packed_sequence_mask_function(torch.from_numpy(segments))] if documents else []
        causal = mu.and_masks(mu.causal_mask_function, *docs)
        fn = causal if not window else mu.and_masks(
            mu.sliding_window_causal_mask_function(window), *docs)

        def hf(q, k, v, groups=N // K, scale=H ** -0.5, mask_fn=fn):
            mask = None if mask_fn is None else mu.eager_mask(B, T, T, mask_function=mask_fn)
            module = types.SimpleNamespace(num_key_value_groups=groups, training=False)
            return eager_attention_forward(module, q, k, v, mask, scaling=scale)[0]  # (B, T, N, H)
        want = hf(q, k, v)
        g = torch.from_numpy(rng.standard_normal(want.shape).astype(np.float32))
        grads = [numpy(t) for t in torch.autograd.grad((want * g).sum(), (q, k, v))]
        with torch.no_grad():
            tiled = hf(q, k.repeat(1, N // K, 1, 1), v.repeat(1, N // K, 1, 1), groups=1)
            mistakes = [
                mistake("query head n reading kv head n % K (tiling the kv heads)", numpy(tiled),
                        "n // (N/K): HF's repeat_kv repeats each kv head N/K times in a row."),
                mistake("leaving the scores unscaled", numpy(hf(q, k, v, scale=1.0)),
                        "multiply q·k by scale (head_dim ** -0.5) before the softmax."),
                mistake("leaving out the mask", numpy(hf(q, k, v, mask_fn=None)),
                        "a query reads only the keys attention_mask lets it (causal, window).")]
            if window:
                mistakes.append(mistake("ignoring the window", numpy(hf(q, k, v, mask_fn=causal)),
                                        "pass `window` on to attention_mask."))
        j = [jnp.asarray(numpy(t).transpose(0, 2, 1, 3)) for t in (q, k, v)]
        seg = None if segments is None else jnp.asarray(segments)
        hint = ("GQA: query head n reads kv head n // (N/K); scores q·k · scale, masked, softmax "
                "in fp32 over the keys.")
        got = model.attend(*j, None if seg is None else (seg, seg), H ** -0.5, 0, 0, window)
        compare(f"model.attend, {what}", got, numpy(want), AXES, 1e-5, mistakes, hint)
        got = model.attend_in_blocks(*j, window, H ** -0.5, seg)
        compare(f"model.attend_in_blocks (one block), {what}", got, numpy(want), AXES, 1e-5,
                mistakes, hint)
        monkeypatch.setattr(model, "Q_BLOCK", 8)

        @jax.jit
        def blocked(q, k, v, g):  # the output and the gradient of sum(output · g) by q, k, v
            out, vjp = jax.vjp(lambda *a: model.attend_in_blocks(*a, window, H ** -0.5, seg),
                               q, k, v)
            return out, vjp(g)
        step = min(8, window // 2 or 8)
        hint_blocks = (f"attend is right; the blocks are not. With Q_BLOCK = 8 the queries go in "
                       f"blocks of {step} (positions 0-{step - 1}, {step}-{2 * step - 1}, ...): "
                       f"each block calls attend with its first query position and the first "
                       f"key position lo it reads (on a sliding layer lo = first - W + 1, "
                       f"clipped), "
                       f"so that attention_mask compares positions, not indices.")
        out, ours = blocked(*j, jnp.asarray(numpy(g)))
        compare(f"model.attend_in_blocks (blocks), {what}", out, numpy(want), AXES, 1e-5,
                hint=hint_blocks)
        for name, a, w in zip("qkv", ours, grads):
            axes = AXES if name == "q" else ("batch", "position", "kv head", "dim")
            compare(f"the gradient of model.attend_in_blocks (blocks) by {name}, {what}", a,
                    w.transpose(0, 2, 1, 3), axes, 1e-5, hint=hint_blocks)
        monkeypatch.undo()


# --- 7. router: route (torch: MoE.route); moe and the experts are given -------------------------

MOE_FAMILIES = ["olmoe", "flex_olmo"]  # norm_topk_prob false (OLMoE), true (common.VARIANTS')
EXPERT_AXES = ("batch", "position", "expert")  # logits, probs (B, T, E)
CHOICE_AXES = ("batch", "position", "choice")  # weights, experts (B, T, k)


def hf_sparse_moe(family, seed=0):
    """transformers' mixture-of-experts block for common.VARIANTS[family] (OlmoeSparseMoeBlock,
    FlexOlmoSparseMoeBlock: its router `gate` and its fused experts), from transformers' own
    config class, every weight random; and our config of the variant."""
    pytest.importorskip("transformers")
    m = variant(family)
    if family == "olmoe":
        from transformers import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
    else:
        from transformers import FlexOlmoConfig as Config
        from transformers.models.flex_olmo.modeling_flex_olmo import \
            FlexOlmoSparseMoeBlock as Block
    block = Block(Config(hidden_size=m.d_model, intermediate_size=m.mlp_hidden,
                         num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                         norm_topk_prob=m.norm_topk_prob, experts_implementation="eager"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # logits of std ~1 on x ~ N(0, 1): no near ties among experts
            p.copy_(0.15 * torch.randn_like(p))
    return block.eval(), m


def moe_weights(block, m):
    """transformers' block's weights under our names: JAX's one-layer p and the torch MoE's state
    dict. Its experts.gate_up_proj (E, 2F, D) holds gate_proj then up_proj along dim 1 (its
    forward chunks the product in two, gate first); down_proj (E, D, F) is ours as it is."""
    F = m.mlp_hidden
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    stacked = dict(gate_proj=gate_up[:, :F], up_proj=gate_up[:, F:], down_proj=down)
    p = {"mlp.gate.weight": jnp.asarray(numpy(block.gate.weight))}
    p.update({f"mlp.experts.{n}.weight": jnp.asarray(numpy(w)) for n, w in stacked.items()})
    state = {"gate.weight": block.gate.weight.detach().clone()}
    state.update({f"experts.{e}.{n}.weight": w[e].clone() for n, w in stacked.items()
                  for e in range(m.n_experts)})
    return p, state


def host(a):
    """A jax array or a torch tensor as numpy: floats as fp32 (bf16 too), integers as they are."""
    if isinstance(a, torch.Tensor):
        return a.detach().float().numpy() if a.is_floating_point() else a.numpy()
    return np.asarray(a, np.float32) if jnp.issubdtype(a.dtype, jnp.floating) else np.asarray(a)


def route_arrays(name, out):
    """route's four outputs as numpy arrays, with their dtypes' names; or a failure that says
    what route returns."""
    if not isinstance(out, tuple) or len(out) != 4:
        fail(f"{name} returns {type(out).__name__}, not the 4-tuple (logits, probs, weights, "
             "experts): the router's logits and their softmax (B, T, E), then each token's k "
             "weights and experts (B, T, k).")
    dtypes = [str(a.dtype).replace("torch.", "") for a in out]
    return [host(a) for a in out], dtypes


def by_expert(weights, experts):
    """Each token's k (weight, expert) pairs in the order of the expert's index: the mixture's
    sum does not depend on the order of the k choices, so neither does the test."""
    order = np.argsort(experts, -1, kind="stable")
    return np.take_along_axis(weights, order, -1), np.take_along_axis(experts, order, -1)


def chosen_message(name, got, want, probs, logits, k):
    """None when every token goes to the k experts transformers' router sends it to (in any
    order); else which tokens do not, and the usual mistake that picks the experts yours did."""
    if got.shape != want.shape:
        return (f"{name}'s experts: shape {got.shape}, transformers' {want.shape} (batch, "
                f"position, choice): each token's k = {k} experts, the last axis.")
    if not np.issubdtype(got.dtype, np.integer):
        return (f"{name}'s experts are {got.dtype}: they are indices 0..E-1 (int32 from "
                "jax.lax.top_k, int64 from torch.topk).")
    mine, theirs = np.sort(got, -1), np.sort(want, -1)
    bad = (mine != theirs).any(-1)  # (B, T)
    if not bad.any():
        return None
    lines = [f"{name}: {bad.sum()} of {bad.size} tokens go to other experts than transformers' "
             "router sends them to:"]
    for b, t in list(zip(*np.nonzero(bad)))[:3]:
        lines.append(f"  batch {b}, position {t}: yours {mine[b, t].tolist()}, transformers' "
                     f"{theirs[b, t].tolist()} (the probabilities: {np.round(probs[b, t], 3)})")
    least = np.sort(np.argsort(probs, -1, kind="stable")[..., :k], -1)
    over_positions = torch.softmax(torch.tensor(logits), 1).topk(k).indices.numpy()
    if np.array_equal(mine, least):
        lines.append("Yours are the k LEAST probable experts: take the k largest (jax.lax.top_k "
                     "and torch.topk give the largest first).")
    elif np.array_equal(mine, np.sort(over_positions, -1)):
        lines.append("Yours are what a softmax over the positions (axis 1) picks: the softmax "
                     "runs over the E experts, the last axis.")
    else:
        lines.append("Each token goes to its k most probable experts (the k largest logits too: "
                     "the softmax keeps their order).")
    return "\n".join(lines)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_route_is_transformers_router(family):
    """route and the torch MoE.route against transformers' router (OlmoeTopKRouter with
    norm_topk_prob false, FlexOlmoTopKRouter with it true) on random weights and inputs: the
    logits, the softmax over all E experts, the k experts each token goes to and their weights,
    with the usual mistakes named (top-k before the softmax, renormalising or not, sigmoid)."""
    block, m = hf_sparse_moe(family)
    router, k, norm = block.gate, m.experts_per_token, m.norm_topk_prob
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((2, 9, m.d_model))
                         .astype(np.float32))
    B, T = x.shape[:2]
    with torch.no_grad():
        logits, weights, experts = (t.reshape(B, T, -1) for t in router(x))
        probs = torch.softmax(logits, -1, dtype=torch.float)  # transformers' router's own line
        top = probs.topk(k).values  # the k largest, in the order of transformers' experts
    want_w = by_expert(numpy(weights), experts.numpy())[0]
    # The wrong weights, for the same experts as transformers' (each ranks the experts as the
    # probabilities do), in its order; then by expert as the learner's are
    renorm = lambda w: w / w.sum(-1, keepdim=True)  # noqa: E731
    maybe = renorm if norm else (lambda w: w)
    wrong = [("taking the k largest logits as the weights (no softmax)",
              maybe(logits.topk(k).values),
              "the weights are probabilities: the softmax of the logits over all E experts, then "
              "the k largest."),
             ("a sigmoid of the logits in place of the softmax (DeepSeek-V3's router)",
              maybe(torch.sigmoid(logits.topk(k).values)),
              "OLMoE and FlexOlmo take the softmax of the logits over the E experts.")]
    if norm:
        wrong.insert(0, ("leaving the k probabilities as they are (norm_topk_prob is true here)",
                         top, "when m.norm_topk_prob, divide each token's k weights by their "
                         "sum, so that they add up to 1."))
    else:
        # the two usual mistakes give the same weights here: with norm_topk_prob false, a
        # softmax over the k largest logits is the k largest probabilities renormalised
        wrong.insert(0, ("top-k before the softmax (a softmax over the k largest logits), or "
                         "renormalising the k weights where norm_topk_prob is false,",
                         renorm(top), "both make each token's weights sum to 1. OLMoE's "
                         "norm_topk_prob is false: the softmax over all E experts first, then "
                         "the k largest probabilities as they are (they sum to less than 1)."))
    mistakes = [mistake(what, by_expert(numpy(w), experts.numpy())[0], fix)
                for what, w, fix in wrong]
    sums = numpy(weights).sum(-1)
    how = ("divided by their sum (norm_topk_prob)" if norm else
           "kept as they are (norm_topk_prob false)")
    twin = model.MoE(m)
    twin.gate.weight.data = router.weight.detach().clone()
    runs = [("model.route", lambda: model.route({"mlp.gate.weight": jnp.asarray(numpy(
                router.weight))}, jnp.asarray(numpy(x)), m)),
            ("model.MoE.route (torch)", lambda: twin.route(x))]
    for name, run in runs:  # the JAX function first, then its twin
        with torch.no_grad():
            (got_l, got_p, got_w, got_e), _ = route_arrays(name, run())
        what = f"{name} ({family}, E = {m.n_experts}, k = {k})"
        compare(f"{what}: logits", got_l, numpy(logits), EXPERT_AXES, 1e-5,
                hint="the logits: x @ mlp.gate.weight.T (E, D), no bias, as fp32.")
        compare(f"{what}: probs", got_p, numpy(probs), EXPERT_AXES, 1e-5,
                [mistake("a softmax over the positions (axis 1)",
                         numpy(torch.softmax(logits, 1)), "the softmax runs over the E "
                         "experts, the last axis.")],
                "probs (B, T, E): the softmax of the logits over all E experts, in fp32 "
                "(router_losses reads it).")
        message = chosen_message(f"{what}: experts", got_e, experts.numpy(), numpy(probs),
                                 numpy(logits), k)
        if message:
            fail(message)
        if got_w.shape != want_w.shape:
            fail(f"{what}: weights of shape {got_w.shape}, experts of shape {got_e.shape}: one "
                 f"weight for each of a token's k choices, (B, T, k) = {want_w.shape}.")
        mine = by_expert(got_w, got_e)[0]
        compare(f"{what}: weights", mine, want_w, CHOICE_AXES, 1e-5, mistakes,
                f"The weights are the k largest of the softmax over all E experts (fp32), {how}: "
                f"transformers' sum to {sums.min():.3f}-{sums.max():.3f} a token, yours to "
                f"{mine.sum(-1).min():.3f}-{mine.sum(-1).max():.3f}.")


def test_route_keeps_the_softmax_in_fp32():
    """route and MoE.route on bf16 activations, training's compute dtype, against transformers'
    bf16 router: the logits are the bf16 product (to bf16 rounding), and the softmax and the
    weights are fp32, as transformers' softmax(dtype=torch.float) (a bf16 softmax is named)."""
    block, m = hf_sparse_moe("olmoe")
    router, k = block.gate.to(torch.bfloat16), m.experts_per_token
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((2, 9, m.d_model))
                         .astype(np.float32)).bfloat16()
    B, T = x.shape[:2]
    with torch.no_grad():
        logits, _, experts = (t.reshape(B, T, -1) for t in router(x))
    w = router.weight.detach().float()  # bf16 values, held in fp32 as our parameters are
    twin = model.MoE(m)
    twin.gate.weight.data = w.clone()
    runs = [("model.route", lambda: model.route({"mlp.gate.weight": jnp.asarray(numpy(w))},
                                                jnp.asarray(numpy(x), jnp.bfloat16), m)),
            ("model.MoE.route (torch)", lambda: twin.route(x))]
    for name, run in runs:  # the JAX function first, then its twin
        with torch.no_grad():
            (got_l, got_p, got_w, got_e), dtypes = route_arrays(name, run())
        what = f"{name} of a bf16 x (olmoe)"
        for part, dtype in zip(("logits", "probs", "weights"), dtypes):
            if dtype != "float32":
                fail(f"{what} returns its {part} in {dtype}: the router works in fp32. Cast the "
                     "logits (the bf16 product) to fp32 before the softmax, as transformers' "
                     "router does (softmax(dtype=torch.float)); the top-k and the weights follow "
                     "in fp32.")
        compare(f"{what}: logits", got_l, numpy(logits), EXPERT_AXES, 1e-2,
                hint="the logits: the bf16 product x @ W.T (W cast to x's dtype, as linear and "
                     "Linear do), then cast to fp32.")
        own = numpy(torch.softmax(torch.tensor(got_l), -1))  # fp32, of the learner's logits
        message = report(f"{what}: probs, against the fp32 softmax of your own logits", got_p,
                         own, EXPERT_AXES, 1e-6,
                         [mistake("a softmax over the positions (axis 1)",
                                  numpy(torch.softmax(torch.tensor(got_l), 1)),
                                  "the softmax runs over the E experts, the last axis.")])
        if message:
            as_bf16 = numpy(torch.tensor(got_p).bfloat16())
            fail(message, "Every one of your probabilities is a bf16 number: the softmax ran in "
                 "bf16 and was cast up after it. Cast the logits to fp32 first."
                 if np.array_equal(got_p, as_bf16) else "", "probs: the softmax of the "
                 "logits over the E experts in fp32.")
        message = chosen_message(f"{what}: experts", got_e, experts.numpy(), own, got_l, k)
        if message:
            fail(message)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_is_transformers_sparse_moe_block(family):
    """moe (experts_dense and experts_grouped) and the torch MoE.forward, on route's weights and
    experts, against transformers' sparse MoE block (OlmoeSparseMoeBlock, FlexOlmoSparseMoeBlock)
    with the same weights; and the expert load each counts from route's experts."""
    block, m = hf_sparse_moe(family, seed=1)
    k, E, norm = m.experts_per_token, m.n_experts, m.norm_topk_prob
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((2, 9, m.d_model))
                         .astype(np.float32))
    B, T, D = x.shape
    with torch.no_grad():
        want = numpy(block(x))
        logits, _, experts = block.gate(x)  # logits (B·T, E), experts (B·T, k)
        top = torch.softmax(logits, -1, dtype=torch.float).topk(k).values

        def combined(w):  # transformers' experts, summed with other weights than its router's
            return numpy(block.experts(x.reshape(-1, D), experts, w).reshape(B, T, D))
        if norm:
            weighting = mistake("leaving the k probabilities as they are (norm_topk_prob is true "
                                "here)", combined(top), "when m.norm_topk_prob, route divides "
                                "each token's k weights by their sum.")
        else:
            weighting = mistake("top-k before the softmax, or renormalising the k weights "
                                "where norm_topk_prob is false,",
                                combined(top / top.sum(-1, keepdim=True)),
                                "route keeps the k largest probabilities of the softmax over all "
                                "E experts as they are.")
        mistakes = [weighting,
                    mistake("adding the chosen experts' outputs unweighted",
                            combined(torch.ones_like(top)),
                            "each expert's output is multiplied by route's weight for it.")]
    load = np.bincount(experts.numpy().reshape(-1), minlength=E)
    p, state = moe_weights(block, m)
    twin = model.MoE(m)
    twin.load_state_dict(state)
    hint = ("moe: each token leaves with the sum over its k chosen experts of weight · "
            "SwiGLU_e(x) (experts_dense: every expert on every token times the token's share "
            "of it, 0 for the experts route did not choose). moe, the experts and the loop are "
            "given: route's weights and experts are what this checks; "
            "test_route_is_transformers_router places a difference more closely.")
    # jitted, as the training step runs it (and one compile is faster than op by op)
    runs = [(f"model.moe (moe_compute {c})",
             lambda c=c: jax.jit(partial(model.moe, m=variant(family, moe_compute=c)))(
                 p, jnp.asarray(numpy(x))))
            for c in ("dense", "grouped")]
    runs.append(("model.MoE.forward (torch)", lambda: twin(x)))
    for name, run in runs:  # the JAX function first, then its twin
        with torch.no_grad():
            y, terms = run()
        what = f"{name} ({family}, E = {E}, k = {k})"
        compare(what, host(y), want, ("batch", "position", "feature"), 1e-5, mistakes, hint)
        counted = host(terms[model.LOAD])
        if not np.array_equal(counted, load):
            fail(f"{what}: the expert load (terms[model.LOAD]) is {counted.tolist()}; "
                 f"transformers' router sends {load.tolist()} (token, expert) pairs to experts "
                 f"0..{E - 1}. moe counts route's experts: each token's k different indices, "
                 "0 <= e < E.")


# --- 8. delta_rule: delta_rule_recurrent (torch: delta_rule_recurrent_torch) ---------------------
# delta_rule_chunked (the same rule in matmuls) and gated_deltanet (the layer) are given

RULE_AXES = ("batch", "position", "value head", "dim")  # the rule's output o (B, T, N, Hv)
STATE_AXES = ("batch", "value head", "key dim", "value dim")  # its state S (B, N, Hk, Hv)
RULE = ("The gated delta rule, per token and value head: S ← S·exp(g_t) (the decay first); S ← S "
        "+ k_t (β_t (v_t - Sᵀk_t))ᵀ; o_t = Sᵀq_t, the updated S; q and k L2-normalised over Hk "
        "(eps 1e-6, fp32), key head n // (N / K) for value head n, q times Hk**-0.5; in fp32.")


def rule_inputs(B=2, T=12, K=2, N=4, Hk=8, Hv=6, seed=9):
    """q, k (B, T, K, Hk) as projected (no unit vectors: the rule L2-normalises them); v (B, T,
    N, Hv); g <= 0 and beta in (0, 2) (B, T, N), OLMo Hybrid's doubled sigmoid; a state (B, N,
    Hk, Hv) to start from. fp32 numpy; K = 2 key heads for N = 4 value heads, Hk != Hv."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, K, Hk)).astype(np.float32)
    v = rng.standard_normal((B, T, N, Hv)).astype(np.float32)
    g = (-0.3 * np.exp(0.5 * rng.standard_normal((B, T, N)))).astype(np.float32)
    beta = (2 / (1 + np.exp(-rng.standard_normal((B, T, N))))).astype(np.float32)
    state = rng.standard_normal((B, N, Hk, Hv)).astype(np.float32)
    return q, k, v, g, beta, state


def delta_rule_as(q, k, v, g, beta, state=None, wrong=None):
    """The rule token by token in float64 numpy, right or with one usual mistake (`wrong`, a key
    of RULE_MISTAKES): (o (B, T, N, Hv), the final state (B, N, Hk, Hv))."""
    B, T, N, Hv = v.shape
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    S = np.zeros((B, N, k.shape[-1], Hv)) if state is None else np.asarray(state, np.float64)
    if wrong != "no_l2":
        q, k = (a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6) for a in (q, k))
    group = N // k.shape[2]
    if wrong == "tiled":
        q, k = (np.tile(a, (1, 1, group, 1)) for a in (q, k))
    else:
        q, k = (np.repeat(a, group, axis=2) for a in (q, k))
    if wrong != "no_scale":
        q = q * q.shape[-1] ** -0.5
    o = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # (B, N, Hk), (B, N, Hk), (B, N, Hv)
        decay, b = np.exp(g[:, t])[..., None, None], beta[:, t, :, None]
        before = S
        if wrong != "decay_after":
            S = S * decay
        decayed = S
        predicted = np.einsum("bnkv,bnk->bnv", before if wrong == "undecayed" else S, k_t)
        error = b * v_t - predicted if wrong == "beta_on_v" else b * (v_t - predicted)
        S = S + np.einsum("bnk,bnv->bnkv", k_t, error)
        if wrong == "decay_after":
            S = S * decay
        read = dict(read_decayed=decayed, read_before=before).get(wrong, S)
        o.append(np.einsum("bnkv,bnk->bnv", read, q_t))
    return np.stack(o, 1), S


RULE_MISTAKES = {  # wrong: (what it is, the fix); `delta_rule_as` writes each out
    "decay_after": (
        "decaying the state after the correction, S ← (S + k_t (β_t (v_t - Sᵀk_t))ᵀ)·exp(g_t),",
        "decay first: S ← S·exp(g_t), then predict k_t's value from the decayed S and correct "
        "it (transformers' and FLA's order; the chunked form assumes it)."),
    "no_l2": (
        "leaving q and k as projected (no L2 norm)",
        "the rule L2-normalises q and k itself, over the head dim Hk, in fp32 with eps 1e-6 under "
        "the root (model.l2_normalize). With ||k_t|| = 1, β_t alone sets the step; unnormalised, "
        "I - β_t k_t k_tᵀ scales k_t's direction by 1 - β_t ||k_t||², far below -1 for a long "
        "k_t, and S grows without bound."),
    "tiled": (
        "tiling the key heads (value head n reads key head n % K)",
        "value head n reads key head n // (N / K): each key head serves N / K consecutive value "
        "heads (model.value_heads: jnp.repeat or torch's repeat_interleave along the heads, not "
        "jnp.tile or torch's repeat)."),
    "no_scale": (
        "leaving out q's scale Hk**-0.5",
        "after the L2 norm, multiply q by Hk**-0.5, Hk the key head dim (o_t = S_tᵀq_t / "
        "sqrt(Hk))."),
    "read_decayed": (
        "reading o_t from the state before this token's correction (decayed, not yet corrected)",
        "o_t reads the updated state: decay, correct, then o_t = S_tᵀq_t."),
    "read_before": (
        "reading o_t from the state before this token (S_{t-1}, neither decayed nor corrected)",
        "o_t reads the updated state: decay, correct, then o_t = S_tᵀq_t."),
    "undecayed": (
        "predicting k_t's value from the state before its decay",
        "predict from the decayed state, (S_{t-1}·exp(g_t))ᵀk_t: the correction fixes the state "
        "it is added to."),
    "beta_on_v": (
        "applying β_t to v_t alone, S ← S + k_t (β_t v_t - Sᵀk_t)ᵀ,",
        "β_t scales the whole error, v_t - Sᵀk_t: it is the learning rate of one step on "
        "||Sᵀk_t - v_t||²."),
}


def rule_arrays(name, out):
    """delta_rule_recurrent's (o, state) as numpy; or a failure that says what the function
    returns."""
    if not isinstance(out, tuple) or len(out) != 2 or any(a is None for a in out):
        what = type(out).__name__ if not isinstance(out, tuple) else \
            f"({', '.join(type(a).__name__ for a in out)})"
        fail(f"{name} returns {what}, not the pair (o, state): the output (B, T, N, Hv) and the "
             "state after the last token (B, N, Hk, Hv), zeros before the first when none is "
             "given.")
    dtypes = [str(a.dtype).replace("torch.", "") for a in out]
    if dtypes != ["float32", "float32"]:
        fail(f"{name} returns o in {dtypes[0]} and the state in {dtypes[1]}: the rule runs in "
             "fp32 whatever dtype q, k and v come in (transformers' too); both come out fp32.")
    return [host(a) for a in out]


def rule_mistakes(inputs, state=None):
    """(mistakes for o, mistakes for the final state) on these inputs: each usual mistake with the
    output it gives; for the state only those that change it, and returning the state given."""
    on_o, on_state = [], []
    right = delta_rule_as(*inputs, state=state)[1]
    for wrong, (what, fix) in RULE_MISTAKES.items():
        o, S = delta_rule_as(*inputs, state=state, wrong=wrong)
        on_o.append(mistake(what, o, fix))
        if not close(S, right, 1e-5):
            on_state.append(mistake(what, S, fix))
    if state is not None:
        on_state.append(mistake("returning the state you were given", state, "return S after the "
                                "last token's update: the state the next call starts from."))
    return on_o, on_state


def test_delta_rule_is_transformers():
    """delta_rule_recurrent and the torch delta_rule_recurrent_torch against transformers'
    torch_recurrent_gated_delta_rule (OLMo Hybrid's, use_qk_l2norm_in_kernel=True) on random
    inputs: 2 key heads for 4 value heads, Hk != Hv, β in (0, 2), a state to start from; the
    output and the final state, with the usual mistakes named."""
    hybrid = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    q, k, v, g, beta, state = rule_inputs()
    want_o, want_s = hybrid.torch_recurrent_gated_delta_rule(
        *map(torch.from_numpy, (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    on_o, on_state = rule_mistakes((q, k, v, g, beta), state)
    # jitted, as generation steps it (forward_step), and one compile is faster than op by op
    runs = [("model.delta_rule_recurrent", lambda: jax.jit(model.delta_rule_recurrent)(
                *map(jnp.asarray, (q, k, v, g, beta)), state=jnp.asarray(state))),
            ("model.delta_rule_recurrent_torch", lambda: model.delta_rule_recurrent_torch(
                *map(torch.from_numpy, (q, k, v, g, beta)), state=torch.from_numpy(state.copy())))]
    for name, run in runs:  # the JAX function first, then its twin
        o, S = rule_arrays(name, run())
        what = f"{name} (B = 2, T = 12, K = 2 key heads, N = 4 value heads, Hk = 8, Hv = 6)"
        compare(f"{what}: o", o, numpy(want_o), RULE_AXES, 1e-5, on_o, RULE)
        compare(f"{what}: the final state", S, numpy(want_s), STATE_AXES, 1e-5, on_state,
                "o matches, so the steps are right: return the state after the last token's "
                "update, (B, N, Hk, Hv), key dim before value dim.")


def test_delta_rule_recurrent_equals_chunked():
    """delta_rule_recurrent against the chunked form (model.delta_rule_chunked, given: the same
    rule in matmuls, C tokens at a time, as training runs it), T = 40 over chunks of 16 (two whole
    and a padded one), no state given (zeros), q, k and v in bf16 as a bf16 forward hands them
    over; the torch twin against delta_rule_chunked_torch the same."""
    q, k, v, g, beta, _ = rule_inputs(T=40, seed=10)
    q, k, v = (numpy(torch.from_numpy(a).bfloat16()) for a in (q, k, v))  # bf16 values
    jax_in = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(g), jnp.asarray(beta)]
    torch_in = [torch.from_numpy(a).bfloat16() for a in (q, k, v)] + [torch.from_numpy(g),
                                                                       torch.from_numpy(beta)]
    on_o, on_state = rule_mistakes((q, k, v, g, beta))
    hint = ("delta_rule_chunked computes the same rule in chunks of C tokens (and is right: "
            "tests/test_hybrid.py checks it against transformers); test_delta_rule_is_transformers "
            "places a difference more closely. " + RULE)
    runs = [("model.delta_rule_recurrent", lambda: jax.jit(model.delta_rule_recurrent)(*jax_in),
             lambda: jax.jit(partial(model.delta_rule_chunked, chunk=16))(*jax_in)),
            ("model.delta_rule_recurrent_torch", lambda: model.delta_rule_recurrent_torch(
                *torch_in), lambda: model.delta_rule_chunked_torch(*torch_in, chunk=16))]
    for name, run, chunked in runs:  # the JAX function first, then its twin
        what = f"{name} of bf16 q, k, v (T = 40, no state given)"
        o, S = rule_arrays(what, run())
        want_o, want_s = rule_arrays("the chunked form", chunked())
        compare(f"{what}: o, against the chunked form", o, want_o, RULE_AXES, 1e-5, on_o, hint)
        compare(f"{what}: the final state, against the chunked form's", S, want_s, STATE_AXES,
                1e-5, on_state, "o matches, so the steps are right: with no state given, start "
                "from zeros (B, N, Hk, Hv) and return the state after the last token.")


# --- 11. skip_step: is_outlier --------------------------------------------------------------------

def skip_cases():
    """(what, n, losses, grad norms, loss, grad_norm, hint): histories laid out as push_history
    leaves them (step s in slot s % 128; slots never written hold new_history's zeros)."""
    rng = np.random.default_rng(5)

    def values(n, mean=2.0, std=0.05):
        v = mean + std * rng.standard_normal(min(n, 128))
        return np.concatenate([v, np.zeros(128 - len(v))]).astype(np.float32)
    flat = values(100)
    ok = values(100, 1.0, 0.1)
    mu, sd = flat[:100].mean(), flat[:100].std(ddof=1)
    return [
        ("a loss 8σ above 100 steps", 100, flat, ok, mu + 8 * sd, 1.0,
         "the mean and std of the last min(n, 128) values only: the slots never written hold "
         "new_history's zeros."),
        ("a loss 4σ above 100 steps", 100, flat, ok, mu + 4 * sd, 1.0,
         "6σ is the threshold: 4σ is ordinary noise."),
        ("a grad norm 8σ above, an ordinary loss", 100, flat, ok, mu,
         1.0 + 8 * ok[:100].std(ddof=1),
         "the gradient norm alone can make an outlier (loss OR grad norm)."),
        ("a loss 8σ below the mean", 100, flat, ok, mu - 8 * sd, 1.0,
         "one-sided: only a rise is an outlier (x - mean > 6σ, no absolute value)."),
        ("62 values of history, a loss 100σ above", 62, values(62), values(62, 1.0, 0.1),
         2.0 + 100 * 0.05, 1.0, "with the step itself under 64 values (SKIP_MIN) never skip."),
        ("63 values of history, a loss 8σ above", 63, values(63), values(63, 1.0, 0.1), 2.4, 1.0,
         "OLMo-core's window counts the step itself: 63 values before it and this one make "
         "64 (SKIP_MIN), so the 64th step can be skipped (n + 1 >= SKIP_MIN)."),
        ("300 steps pushed (the ring wrapped), a loss 8σ above", 300, values(300),
         values(300, 1.0, 0.1), 2.4, 1.0,
         "n counts every push; the ring holds the last min(n, 128): divide by that, not by n."),
    ]


def olmo_core_skips(n, losses, grads, loss, grad_norm):
    """OLMo-core's SkipStepOptimizer.get_step_factor (olmo_core/optim/skip_step_optimizer.py):
    its window holds this step's value too (set before step()), at most 128 + 1; no skip while
    it holds fewer than max(2, 128 // 2) = 64; else loss - mean > 6·std or grad_norm - mean >
    6·std over the values before this one (torch.std_mean: std with n - 1)."""
    held = min(n, 128)
    if held + 1 < max(2, 128 // 2):
        return False
    pairs = ((loss, losses.astype(np.float64)), (grad_norm, grads.astype(np.float64)))
    return any(x - h[:held].mean() > 6 * h[:held].std(ddof=1) for x, h in pairs)


def test_is_outlier_is_olmo_cores_rule():
    """train.is_outlier, jitted as the train step runs it, against OLMo-core's SkipStepAdamW
    rule."""
    step = jax.jit(train.is_outlier)
    wrong = []
    for what, n, losses, grads, loss, grad_norm, hint in skip_cases():
        history = dict(loss=jnp.asarray(losses), grad_norm=jnp.asarray(grads),
                       n=jnp.asarray(n, jnp.int32))
        try:
            got = step(history, jnp.float32(loss), jnp.float32(grad_norm))
        except jax.errors.ConcretizationTypeError as e:
            fail("train.is_outlier runs inside the jitted train step: its inputs are tracers, so "
                 "a Python `if` (or bool(), int()) on a value cannot work; write the decision "
                 "with jnp.where, & and |.", str(e).splitlines()[0])
        if np.shape(got) != () or np.asarray(got).dtype != np.bool_:
            fail(f"train.is_outlier returns {np.asarray(got).dtype} of shape {np.shape(got)}: "
                 "it returns one bool (a jnp scalar).")
        want = olmo_core_skips(n, losses, grads, loss, grad_norm)
        held = min(n, 128)
        z = [(x - h[:held].mean()) / h[:held].std(ddof=1)
             for x, h in ((loss, losses), (grad_norm, grads))]
        if bool(got) != want:
            wrong.append(f"  {what} (n = {n}; of the last {held}, the loss is {z[0]:+.1f}σ from "
                         f"the mean, the grad norm {z[1]:+.1f}σ): OLMo-core "
                         f"{'skips' if want else 'does not skip'}, yours "
                         f"{'does' if got else 'does not'}: {hint}")
    if wrong:
        fail("train.is_outlier disagrees with OLMo-core's SkipStepAdamW rule (skip when loss - "
             "mean > 6·std or grad_norm - mean > 6·std over the last min(n, 128) values, once "
             "n + 1 >= 64, the step itself counted; std with n - 1, as torch.std):", *wrong)
