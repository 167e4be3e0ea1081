"""OLMo Hybrid: the gated delta rule (model.delta_rule_recurrent, delta_rule_chunked) against
transformers' torch references (olmo_hybrid's torch_recurrent_gated_delta_rule and
torch_chunk_gated_delta_rule) and the two forms against each other, gradients included; then the
whole model against transformers within its own fp32 error, generation with the state cache, the
released shape's count, the checkpoint names of each writer, OLMo-core's hybrid checkpoints, and a
tiny hybrid run. (Logits, loss, both directions of HF conversion, JAX vs torch gradients and
causality for common.VARIANTS' olmo_hybrid: test_hf.py and test_model.py.)"""
import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import convert
import model
from common import olmo_core_round_trip, random_params, tokens, train_tiny_overlay, variant
from configs import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]

hybrid = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")


def inputs(B=2, T=150, K=2, N=4, Hk=16, Hv=24, seed=0, negative=True):
    """q, k (B, T, K, Hk) as projected (the rule L2-normalises them); v (B, T, N, Hv); g <= 0 and
    beta (B, T, N), beta in (0, 2) where negative eigenvalues are allowed (OLMo Hybrid doubles the
    sigmoid), else (0, 1); an initial state (B, N, Hk, Hv). T = 150: two whole chunks of 64 and a
    padded one."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((2, B, T, K, Hk)) * 3).astype(np.float32)
    v = rng.standard_normal((B, T, N, Hv)).astype(np.float32)
    g = (-0.3 * np.exp(0.5 * rng.standard_normal((B, T, N)))).astype(np.float32)
    beta = ((2 if negative else 1) / (1 + np.exp(-rng.standard_normal((B, T, N))))).astype(np.float32)
    state = (0.1 * rng.standard_normal((B, N, Hk, Hv))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("negative, grouped", [(True, True), (False, False)])
def test_both_forms_equal_transformers(negative, grouped):
    q, k, v, g, beta, state = inputs(K=2 if grouped else 4, negative=negative)
    ref, ref_state = hybrid.torch_recurrent_gated_delta_rule(
        *map(torch.from_numpy, (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    scale = np.abs(ref.numpy()).max()
    for form, xp in ((model.delta_rule_recurrent, jnp.asarray),
                     (model.delta_rule_chunked, jnp.asarray),
                     (model.delta_rule_recurrent_torch, torch.from_numpy),
                     (model.delta_rule_chunked_torch, torch.from_numpy)):
        o, s = form(*map(xp, (q, k, v, g, beta)), state=xp(state))
        np.testing.assert_allclose(np.asarray(o), ref.numpy(), rtol=0, atol=1e-5 * scale,
                                   err_msg=form.__name__)
        np.testing.assert_allclose(np.asarray(s), ref_state.numpy(), rtol=0, atol=1e-5,
                                   err_msg=form.__name__)
    # transformers' own chunked form agrees with its recurrent one to the same rounding
    chunked, _ = hybrid.torch_chunk_gated_delta_rule(*map(torch.from_numpy, (q, k, v, g, beta)),
                                                     initial_state=torch.from_numpy(state),
                                                     use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(chunked.numpy(), ref.numpy(), rtol=0, atol=1e-5 * scale)


def test_chunked_gradients_equal_the_recurrent_forms():
    """The chunked form, which training uses, has the recurrent form's gradients (every input,
    the initial state too), and no chunk size changes the output."""
    args = [jnp.asarray(a) for a in inputs(B=1, T=40)]
    r = jnp.asarray(np.random.default_rng(1).standard_normal((1, 40, 4, 24)), jnp.float32)

    def loss(form, *a):
        o, s = form(*a[:5], state=a[5])
        return (o * r).sum() + s.sum()
    # jitted (op by op, each step of the scans would be dispatched on its own: seconds)
    want = jax.jit(jax.grad(partial(loss, model.delta_rule_recurrent), range(6)))(*args)
    chunked = partial(model.delta_rule_chunked, chunk=16)  # chunks of 16, 16 and 8 of 16
    got = jax.jit(jax.grad(partial(loss, chunked), range(6)))(*args)
    for name, a, b in zip("q k v g beta state".split(), want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5, err_msg=name)
    o16 = jax.jit(chunked)(*args[:5], state=args[5])[0]
    o64 = jax.jit(model.delta_rule_chunked)(*args[:5], state=args[5])[0]
    np.testing.assert_allclose(np.asarray(o16), np.asarray(o64), rtol=0, atol=1e-5)


# --- the whole model: against transformers, generation, conversion, training ---

def hf_pair(m, params, tmp_path):
    """transformers' OlmoHybridForCausalLM on our weights (save_hf), in fp32 and in fp64."""
    tf = pytest.importorskip("transformers")
    convert.save_hf(tmp_path, m, params)
    load = tf.AutoModelForCausalLM.from_pretrained
    return load(tmp_path, dtype=torch.float32).eval(), load(tmp_path, dtype=torch.float64).eval()


@pytest.mark.parametrize("overrides", [
    dict(rope_theta=500000.0, linear_neg_eigval=False),  # RoPE; 2 key heads for 4 value heads
    dict(linear_value_heads=2),  # no RoPE; a value head per key head; β in (0, 2)
])
def test_logits_equal_transformers_within_its_own_fp32_error(overrides, tmp_path):
    """150 tokens: two whole chunks of 64 and part of a third. Both backends' logits differ from
    transformers' in float64 by at most 4x as much as transformers' own in float32 do (its chunked
    rule runs in fp32 too); common.VARIANTS' olmo_hybrid runs the rest in test_hf.py."""
    m = variant("olmo_hybrid", **overrides)
    params = random_params(m, seed=4, std=0.15)
    hf32, hf64 = hf_pair(m, params, tmp_path)
    assert (hf32.model.rotary_emb is None) == (m.rope_theta == 0)  # transformers' NoPE too
    toks = torch.from_numpy(tokens(m, T=150))
    with torch.no_grad():
        ref, own = hf64(toks).logits.numpy(), hf32(toks).logits.double().numpy()
        ours_torch = model.torch_model(m, params)(toks).double().numpy()
    ours_jax = np.asarray(model.forward(params, jnp.asarray(toks.numpy()), m), np.float64)
    scale, hf_error = np.abs(ref).max(), np.abs(own - ref).max()
    assert 0 < hf_error < 1e-4 * scale
    for name, ours in (("jax", ours_jax), ("torch", ours_torch)):
        assert np.abs(ours - ref).max() <= 4 * hf_error, (name, np.abs(ours - ref).max(), hf_error)


def test_generation_carries_the_state_not_the_sequence():
    """A 7-token prompt (chunked), then one token a call (the recurrent form, S and the conv
    windows carried), to 40 tokens: the logits of one forward over all 40, in both backends. The
    G layers' cache is the same size for any sequence length; the F layers' grows with it."""
    m = variant("olmo_hybrid", linear_chunk=16)
    params = random_params(m, seed=1)
    toks = tokens(m, T=40, seed=2)
    want = np.asarray(model.forward(params, jnp.asarray(toks), m))
    step = jax.jit(lambda p, t, pos, c: model.forward_step(p, t, pos, c, m))
    net = model.torch_model(m, params)
    cache, kv, got_jax, got_torch = model.new_cache(m, 2, 40), net.new_cache(2, 40, torch.float32), [], []
    for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, 40)]:
        logits, cache = step(params, jnp.asarray(toks[:, start:stop]), start, cache)
        got_jax.append(np.asarray(logits))
        with torch.no_grad():
            got_torch.append(net(torch.from_numpy(toks[:, start:stop]), cache=kv, pos=start).numpy())
    for got in (got_jax, got_torch):
        np.testing.assert_allclose(np.concatenate(got, 1), want, rtol=0, atol=1e-5 * np.abs(want).max())
    sizes = [{k: v.shape for k, v in c.items()} for c in model.new_cache(m, 1, 10)]
    longer = [{k: v.shape for k, v in c.items()} for c in model.new_cache(m, 1, 100_000)]
    assert sizes[0] == longer[0] == dict(q=(1, 3, 48), k=(1, 3, 48), v=(1, 3, 192), S=(1, 4, 24, 48))
    assert sizes[1]["k"] == (1, 10, 2, 16) and longer[1]["k"] == (1, 100_000, 2, 16)


def test_released_shape_counts_exactly():
    """configs/olmo-hybrid-7b.toml has as many parameters as transformers' OlmoHybridConfig()
    (its defaults are the release's shape), each tensor the shape transformers makes it."""
    tf = pytest.importorskip("transformers")
    m = load_config([str(ROOT / "configs/olmo-hybrid-7b.toml")]).model
    assert model.count_params(m) == 7_430_870_688
    with torch.device("meta"):
        net = tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig())
    theirs = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    ours = convert.expected_tensors(m)
    fused = theirs.pop("model.layers.0.linear_attn.conv1d.weight")  # (q; k; v) in memory only
    assert fused == (2 * 2880 + 5760, 1, 4)
    assert ours["layers.0.linear_attn.v_conv1d.weight"] == (5760, 1, 4)
    renamed = {"attention_layer_norm": "input_layernorm",
               "feedforward_layer_norm": "post_attention_layernorm"}
    for name, shape in ours.items():
        hf = convert.hf_name(name)
        for a, b in renamed.items():
            hf = hf.replace(a, b)
        if "conv1d" not in name:
            assert theirs[hf] == shape, name


def test_every_writers_names_read_the_same(tmp_path):
    """The same weights under each writer's names read as ours: the Hub's (save_hf), transformers'
    save_pretrained (the conv weights cut in equal thirds, an attention layer's post-attention
    norm named feedforward_layer_norm), OLMo-core's HF converter (out_proj, norm, input_layernorm,
    post_attention_layernorm on G layers) and a transformers state_dict (the fused conv1d)."""
    m = variant("olmo_hybrid")
    params = random_params(m, seed=5)
    convert.save_hf(tmp_path / "hub", m, params)
    hub = dict(convert.read_safetensors(tmp_path / "hub/model.safetensors")[0])
    core = {}
    for k, v in hub.items():
        k = k.replace("linear_attn.o_proj", "linear_attn.out_proj")
        k = k.replace("linear_attn.o_norm", "linear_attn.norm")
        if ".self_attn." not in k and "layers.1." not in k and "layers.3." not in k:
            k = k.replace("attention_layer_norm", "input_layernorm")
            k = k.replace("feedforward_layer_norm", "post_attention_layernorm")
        core[k] = np.asarray(v)
    fused = {k: np.asarray(v) for k, v in hub.items() if "conv1d" not in k}
    for i in (0, 2):  # the G layers
        a = f"model.layers.{i}.linear_attn."
        fused[a + "conv1d.weight"] = np.concatenate([hub[f"{a}{x}_conv1d.weight"] for x in "qkv"])
    for name, tensors in (("core", core), ("fused", fused)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "hub/config.json").read_text())
        convert.write_safetensors(tmp_path / name / "model.safetensors", tensors, {"format": "pt"})
        m2, params2 = convert.load_hf(tmp_path / name)
        assert m2 == dataclasses.replace(m, init="normal"), name
        assert all(np.array_equal(params2[k], params[k]) for k in params), name


def test_settings_we_do_not_implement_are_refused():
    hf = convert.config_to_hf(variant("olmo_hybrid"))
    assert hf["rope_parameters"]["rope_theta"] is None and convert.config_from_hf(hf).rope_theta == 0
    bad = dict(hf, layer_types=["linear_attention", "sliding_attention"] * 2)
    with pytest.raises(ConfigError, match=r"layer_types \['sliding_attention'\] are not supported"):
        convert.config_from_hf(bad)
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        convert.config_from_hf(dict(hf, attention_bias=True))
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16}
    with pytest.raises(ConfigError, match="YaRN need family 'olmo3'"):
        convert.config_from_hf(dict(hf, rope_parameters=yarn))
    m = variant("olmo_hybrid")
    params = {k: jnp.asarray(v) for k, v in random_params(m).items()}
    segments = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="data.doc_mask: OLMo Hybrid's Gated DeltaNet layers"):
        model.forward(params, jnp.zeros((1, 8), jnp.int32), m, segments=segments)


def olmo_core_hybrid(m, params, gdn_block="default"):
    """An OLMo-core OLMo Hybrid checkpoint of (m, params) as its trainer writes one: config.json
    with model.block {"gdn": ..., "attn": ...} and block_pattern, the attention block OLMo 2's
    ("reordered_norm") without RoPE (rope unset: OLMo-core's long-context stage and after); its
    state dict under OLMo-core's names (blocks.I.attention.w_q, ...; convert.LINEAR_NAMES)."""
    ln = {"_CLASS_": "olmo_core.nn.layer_norm.LayerNormConfig", "name": "rms", "eps": m.norm_eps,
          "bias": False}
    ff = {"hidden_size": m.mlp_hidden, "name": "default", "bias": False}
    attn = {"name": "default", "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "bias": False,
            "qk_norm": ln, "rope": None}
    gdn = {"_CLASS_": "olmo_core.nn.attention.recurrent.GatedDeltaNetConfig",
           "n_heads": m.linear_key_heads, "n_v_heads": m.linear_value_heads,
           "head_dim": m.linear_key_head_dim, "allow_neg_eigval": m.linear_neg_eigval}
    blocks = {"gdn": {"name": gdn_block, "sequence_mixer": gdn, "layer_norm": ln, "feed_forward": ff},
              "attn": {"name": "reordered_norm", "sequence_mixer": attn, "layer_norm": ln,
                       "feed_forward": ff}}
    t = {"d_model": m.d_model, "vocab_size": m.vocab_size, "n_layers": m.n_layers, "block": blocks,
         "block_pattern": ["gdn" if k == "G" else "attn" for k in m.layer_pattern],
         "lm_head": {"name": "default", "layer_norm": ln, "bias": False}}
    tok = {"eos_token_id": m.eos_token_id, "pad_token_id": m.pad_token_id, "identifier": "test"}
    config = {"model": t, "dataset": {"sequence_length": m.max_seq_len, "tokenizer": tok}}
    names = {ours: core for ours, _, core in convert.LAYER_NAMES if core}
    names = {f"{ours}.weight": f"{core}.weight" for ours, core in names.items()}
    names |= {ours: core for ours, core in convert.LINEAR_NAMES}
    top = {"embed_tokens.weight": "embeddings.weight", "norm.weight": "lm_head.norm.weight",
           "lm_head.weight": "lm_head.w_out.weight"}
    sd = {}
    for k, v in model.unstack_layers(params, m).items():
        if k in top:
            sd[top[k]] = v
        else:
            _, i, rest = k.split(".", 2)
            sd[f"blocks.{i}.{names[rest]}"] = v
    return config, {k: np.ascontiguousarray(v) for k, v in sd.items()}


def test_olmo_core_hybrid_checkpoints_convert(tmp_path):
    """OLMo-core's hybrid checkpoints read as ours, tensor for tensor, and convert to a directory
    transformers loads as OlmoHybridForCausalLM with the same logits; a post-norm Gated DeltaNet
    block (OLMo-core's scripts at HEAD; not the released model) is refused by name."""
    m = variant("olmo_hybrid")
    params = random_params(m, seed=6)
    src, s, net = olmo_core_round_trip(m, params, *olmo_core_hybrid(m, params), tmp_path)
    assert type(net).__name__ == "OlmoHybridForCausalLM"
    toks = tokens(m, T=16)
    with torch.no_grad():
        ref = net(torch.from_numpy(toks)).logits.numpy()
    ours = np.asarray(model.forward(params, jnp.asarray(toks), s.m))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    config, _ = olmo_core_hybrid(m, params, gdn_block="reordered_norm")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model.block.gdn.name='reordered_norm' is not supported \(OLMo Hybrid: 'default'"):
        convert.open_source(src)


def test_tiny_hybrid_trains(setup, tmp_path):
    """configs/tiny-hybrid.toml stacked on tiny.toml, on the test corpus (conftest's setup), 20
    steps in this process: the loss falls and the checkpoint reads back as the same model."""
    root, _ = setup
    run = tmp_path / "run"
    rows = train_tiny_overlay("tiny-hybrid", root, run, steps=20, log_every=5)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # (the first line averages steps 1-5)
    m, _ = convert.load_hf(run / "step_20")
    assert m.family == "olmo_hybrid" and m.layer_types() == "GF"
