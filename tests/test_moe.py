"""The mixture of experts (OLMoE, FlexOlmo): the two ways of computing it against each other and
the torch loop, OLMo-core's router losses against a transcription of its nn/moe/loss.py, the
released shapes' counts, HF's and OLMo-core's MoE settings refused, OLMo-core's MoE checkpoints,
and a tiny MoE run that learns and uses every expert. (8 fake devices with an expert axis train
like one: tests/mesh_check.py, run by test_shard.py.) (Logits against transformers: test_hf.py's
olmoe and flex_olmo variants; the router exercise: test_course.py.)"""
import dataclasses
import json
import re
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


def test_dense_and_grouped_experts_are_equal():
    """One MoE layer (model.moe): experts_grouped (sorted pairs, ragged_dot) gives experts_dense's
    sum (every expert on every token, one-hot weighted), its gradients too, and torch's MoE the
    same output, by its loop (CPUs) and by torch._grouped_mm (GPUs; its forward runs on a CPU). (flex_olmo's experts are the same functions; test_hf.py runs both.)"""
    m = variant("olmoe", n_layers=1)
    params = random_params(m, seed=1)
    p = {k.removeprefix("layers."): jnp.asarray(v[0]) for k, v in params.items()
         if k.startswith("layers.mlp.")}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 16, m.d_model)), jnp.float32)
    r = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape), jnp.float32)

    def loss(p, x, how):
        y, terms = model.moe(p, x, dataclasses.replace(m, moe_compute=how))
        return (y * r).sum() + terms["load balancing loss"] + terms["router Z loss"], y
    (_, dense), g_dense = jax.value_and_grad(loss, (0, 1), has_aux=True)(p, x, "dense")
    (_, grouped), g_grouped = jax.value_and_grad(loss, (0, 1), has_aux=True)(p, x, "grouped")
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=0, atol=2e-5)
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_grouped)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    net = model.torch_model(m, params).layers[0].mlp
    with torch.no_grad():
        t = net(torch.from_numpy(np.array(x)))[0].numpy()
        # the GPU's form (torch._grouped_mm), whose CPU kernel runs forward only
        rows = torch.from_numpy(np.array(x)).reshape(-1, m.d_model)
        _, _, weights, chosen = (a.reshape(rows.shape[0], -1) for a in net.route(rows[None]))
        grouped_torch = net.grouped(rows, weights, chosen).reshape(x.shape).numpy()
    np.testing.assert_allclose(t, np.asarray(dense), rtol=0, atol=2e-5)
    np.testing.assert_allclose(grouped_torch, np.asarray(dense), rtol=0, atol=2e-5)


def test_auto_is_dense_on_a_cpu_and_grouped_on_gpus_and_tpus():
    """moe_compute auto lowers to ragged_dot for CUDA and TPUs, where it has a kernel, and to
    experts_dense for a CPU, where XLA's ragged_dot is a masked dense dot over every expert."""
    m = variant("olmoe", n_layers=1)
    params = {k: jnp.asarray(v) for k, v in random_params(m).items()}
    toks = jnp.asarray(tokens(m, T=8))
    traced = jax.jit(lambda p, t: model.forward(p, t, m)).trace(params, toks)
    for platform, ragged in [("cpu", False), ("cuda", True), ("tpu", True)]:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("ragged_dot" in text) == ragged, platform


def olmo_core_losses(logits, top_k, loss_div_factor):
    """A transcription of OLMo-core's src/olmo_core/nn/moe/loss.py (load_balancing_loss with its
    default local_batch granularity, router_z_loss; no TP or CP mesh) and of MoERouter.forward's
    inputs to them (router.py: scores = logits.softmax, top-k of the scores, the histogram of the
    chosen experts), written apart from model.py. logits (B, S, E) torch fp32. Unweighted: the
    router multiplies each by its weight, which MoEBase divided by n_layers."""
    B, S, E = logits.shape
    scores = logits.softmax(dim=-1)
    _, expert_indices = torch.topk(scores, top_k, dim=-1)
    batch_size_per_expert = torch.stack([(expert_indices == e).sum() for e in range(E)])
    # load_balancing_loss, local_batch
    expert_scores = scores.view(-1, E).mean(dim=0)
    lb = torch.dot(batch_size_per_expert.type_as(expert_scores), expert_scores) / loss_div_factor
    lb = (E / top_k) * lb
    # router_z_loss
    z = torch.logsumexp(logits, dim=-1).square().sum() / loss_div_factor
    return lb, z


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_router_losses_are_olmo_cores(backend):
    """Each layer's two router losses, as train.step_loss adds them (the term over the step's
    target count, times the weight), equal OLMo-core's with loss_div_factor = that count; the
    logged load is each expert's pairs."""
    m = variant("olmoe", lb_loss=0.01, router_z_loss=0.001)
    L = m.n_layers  # MoEBase: lb_loss_weight / n_layers (scale_loss_by_num_layers, its default)
    p = {k.removeprefix("layers."): np.asarray(v)[0] for k, v in random_params(m, seed=2).items()
         if k.startswith("layers.")}
    x = np.random.default_rng(0).standard_normal((3, 10, m.d_model)).astype(np.float32)
    count = 27  # the step's target tokens (some positions are not targets: OLMo-core's too)
    if backend == "jax":
        _, terms = model.moe({k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), m)
        logits = np.asarray(x @ p["mlp.gate.weight"].T)
    else:
        net = model.torch_model(m, random_params(m, seed=2)).layers[0].mlp
        with torch.no_grad():
            _, terms = net(torch.from_numpy(x))
            logits = net.gate(torch.from_numpy(x)).numpy()
    lb, z = olmo_core_losses(torch.from_numpy(logits).double(), m.experts_per_token, count)
    np.testing.assert_allclose(float(terms["load balancing loss"]) / count, 0.01 / L * lb.item(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(terms["router Z loss"]) / count, 0.001 / L * z.item(),
                               rtol=1e-5)
    chosen = np.argsort(-logits, -1)[..., :m.experts_per_token]
    want = np.bincount(chosen.reshape(-1), minlength=m.n_experts)
    assert np.array_equal(np.asarray(terms[model.LOAD]), want)


def test_released_shapes_count_exactly():
    """`python model.py` on the two shipped MoE configs: transformers' counts of OlmoeConfig (the
    release's intermediate_size 1024) and FlexOlmoConfig (its defaults), and the active count."""
    olmoe = load_config([str(ROOT / "configs/olmoe-1b-7b.toml")]).model
    flex = load_config([str(ROOT / "configs/flexolmo-7x7b.toml")]).model
    assert model.count_params(olmoe) == 6_919_161_856
    assert model.count_params(flex) == 33_270_665_216
    # a token passes 8 of 64 experts: all but 56 experts' 3·F·D per layer
    assert model.active_params(olmoe) == 6_919_161_856 - 16 * 56 * 3 * 1024 * 2048
    assert model.flops_per_token(olmoe) < model.flops_per_token(
        dataclasses.replace(olmoe, experts_per_token=64))


@pytest.mark.parametrize("key,value,match", [
    ("router_bias", True, "router_bias=True is not supported"),
    ("num_shared_experts", 2, "num_shared_experts=2 is not supported"),
    ("num_experts_per_tok", 9, "experts_per_token=9: must be in 1..n_experts=4"),
])
def test_hf_moe_settings_we_do_not_implement_are_refused(key, value, match):
    m = variant("olmoe")
    hf = dict(convert.config_to_hf(m), **{key: value})
    with pytest.raises(ConfigError, match=match):
        convert.config_from_hf(hf)


def test_dense_family_with_experts_is_refused():
    with pytest.raises(ConfigError, match="family 'olmo2' has no experts"):
        variant("olmo2", n_experts=4, experts_per_token=2)
    with pytest.raises(ConfigError, match="OLMoE needs head_dim"):
        variant("olmoe", head_dim=24)


def test_tiny_moe_trains_and_uses_every_expert(setup, tmp_path):
    """configs/tiny-olmoe.toml stacked on tiny.toml, on the test corpus (conftest's setup), 30
    steps in this process: the loss falls, the router losses and each layer's load imbalance are
    logged under OLMo-core's names, and every expert of every layer takes tokens."""
    root, _ = setup
    run = tmp_path / "run"
    rows = train_tiny_overlay("tiny-olmoe", root, run, steps=30, log_every=10)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # (the first line averages steps 1-10)
    for key in ("load balancing loss", "router Z loss", "load imbalance",
                "block 00/load imbalance", "block 01/load imbalance"):
        assert key in rows[-1], key
    assert 1.0 <= rows[-1]["load imbalance"] < 4.0  # (4 = E/k: two experts take every token)
    m, params = convert.load_hf(run / "step_30")
    _, terms = model.forward(params, jnp.asarray(tokens(m, B=8, T=64)), m, head=False)
    assert (np.asarray(terms[model.LOAD]) > 0).all(), np.asarray(terms[model.LOAD])


def olmo_core_moe(m, params):
    """An OLMo-core MoE checkpoint of (m, params) as its trainer writes one (config.json with
    model.block.feed_forward_moe; model.safetensors under OLMo-core's names: the router flat, each
    layer's experts as w1, w3 (E·F, D) and w2 (E·F, D), the down projections transposed)."""
    ln = {"name": "rms", "eps": m.norm_eps, "bias": False}
    attn = {"name": "default", "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "bias": False,
            "qk_norm": ln, "rope": {"name": "default", "theta": int(m.rope_theta)}}
    router = {"top_k": m.experts_per_token, "normalize_expert_weights": 1.0 if m.norm_topk_prob else None}
    moe = {"name": "dropless", "num_experts": m.n_experts, "hidden_size": m.mlp_hidden, "router": router,
           "lb_loss_weight": m.lb_loss, "z_loss_weight": m.router_z_loss}
    block = {"name": "moe" if m.family == "olmoe" else "moe_reordered_norm", "attention": attn,
             "layer_norm": ln, "feed_forward_moe": moe}
    t = {"name": "moe", "d_model": m.d_model, "vocab_size": m.vocab_size, "n_layers": m.n_layers,
         "block": block, "init_std": m.init_std, "lm_head": {"name": "default", "layer_norm": ln, "bias": False}}
    tok = {"eos_token_id": m.eos_token_id, "pad_token_id": m.pad_token_id, "identifier": "test"}
    config = {"model": t, "dataset": {"sequence_length": m.max_seq_len, "tokenizer": tok}}
    norms = ({"input_layernorm": "attention_norm", "post_attention_layernorm": "feed_forward_norm"}
             if m.family == "olmoe" else
             {"post_attention_layernorm": "attention_norm", "post_feedforward_layernorm": "feed_forward_norm"})
    sd = {"embeddings.weight": params["embed_tokens.weight"], "lm_head.norm.weight": params["norm.weight"],
          "lm_head.w_out.weight": params["lm_head.weight"]}
    for i in range(m.n_layers):
        b = f"blocks.{i}."
        for x in "qkv":
            sd[f"{b}attention.w_{x}.weight"] = params[f"layers.self_attn.{x}_proj.weight"][i]
            if x != "v":
                sd[f"{b}attention.{x}_norm.weight"] = params[f"layers.self_attn.{x}_norm.weight"][i]
        sd[f"{b}attention.w_out.weight"] = params["layers.self_attn.o_proj.weight"][i]
        for ours, theirs in norms.items():
            sd[f"{b}{theirs}.weight"] = params[f"layers.{ours}.weight"][i]
        sd[f"{b}feed_forward_moe.router.weight"] = params["layers.mlp.gate.weight"][i].reshape(-1)
        e = "layers.mlp.experts."
        sd[f"{b}feed_forward_moe.experts.mlp.w1"] = params[e + "gate_proj.weight"][i].reshape(-1, m.d_model)
        sd[f"{b}feed_forward_moe.experts.mlp.w3"] = params[e + "up_proj.weight"][i].reshape(-1, m.d_model)
        sd[f"{b}feed_forward_moe.experts.mlp.w2"] = np.swapaxes(params[e + "down_proj.weight"][i], 1, 2).reshape(
            -1, m.d_model)
    return config, {k: np.ascontiguousarray(v) for k, v in sd.items()}


@pytest.mark.parametrize("name", ["olmoe", "flex_olmo"])
def test_olmo_core_moe_checkpoints_convert(name, tmp_path):
    """OLMo-core's MoE checkpoints (its "moe" block: OLMoE's; "moe_reordered_norm": FlexOlmo's)
    read as ours, tensor for tensor, and convert to a directory transformers loads as the right
    class; a router setting we do not implement is refused by name."""
    m = variant(name, clip_qkv=0.0)  # (OLMo-core clamps before the QK-norm, HF's OLMoE after)
    params = random_params(m, seed=6)
    config, sd = olmo_core_moe(m, params)
    src, s, net = olmo_core_round_trip(m, params, config, sd, tmp_path)
    assert type(net).__name__ == convert.HF_CLASS[name][1]
    toks = tokens(m, T=16)
    with torch.no_grad():
        ref = net(torch.from_numpy(toks)).logits.numpy()
    ours = np.asarray(model.forward(params, jnp.asarray(toks), s.m))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    bad = json.loads(json.dumps(config))
    bad["model"]["block"]["feed_forward_moe"]["router"]["bias_gamma"] = 1e-4
    (src / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="bias_gamma=0.0001 is not supported"):
        convert.open_source(src)


@pytest.mark.parametrize("key,want", [rule[:2] for rule in convert.OLMO_CORE_MOE_FLAGS])
def test_olmo_core_moe_settings_refused_in_one_line(key, want):
    """Each OLMo-core MoE setting we do not implement, set otherwise in an OLMo-core MoE config."""
    m = variant("olmoe", clip_qkv=0.0)
    config, _ = olmo_core_moe(m, random_params(m))
    assert convert.config_from_olmo_core(config).differences(m, ignore=("max_seq_len",)) == []
    bad = {"dropless": "default", "softmax": "sigmoid", "default": "other", "moe": "default",
           "local_batch": "instance"}
    wants = want if isinstance(want, tuple) else (want,)
    value = (False if wants[0] is True else 0.5 if wants[0] is None or wants[0] is False
             else bad.get(wants[0], "other"))
    node = config["model"]
    *path, last = key.removeprefix("model.").split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r} is not supported (")):
        convert.config_from_olmo_core(config, "config.json")
