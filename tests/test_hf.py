"""Ours against Hugging Face transformers' OlmoForCausalLM / Olmo2ForCausalLM / Olmo3ForCausalLM,
in both directions, through the bridge in convert.py; and eval.py's logits command."""
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import convert
import model
import shard
from common import VARIANTS, random_params, tokens, variant
from configs import ConfigError, run_cli
from teach import compare, expect, number

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def hf_model(name):
    """A randomly initialised HF model with the same architecture as VARIANTS[name], built from HF's
    own config class (not from our writer), with every weight random and large."""
    v = VARIANTS[name]
    common = dict(vocab_size=v["vocab_size"], hidden_size=v["d_model"], intermediate_size=v["mlp_hidden"],
                  num_hidden_layers=v["n_layers"], num_attention_heads=v["n_heads"],
                  num_key_value_heads=v.get("n_kv_heads", v["n_heads"]), max_position_embeddings=v["max_seq_len"],
                  pad_token_id=1, eos_token_id=2)
    if name == "olmo1":
        cfg = tf.OlmoConfig(**common, clip_qkv=v["clip_qkv"], tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": v["rope_theta"]})
        net = tf.OlmoForCausalLM(cfg)
    elif name == "olmo2":
        net = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common, head_dim=v["head_dim"], rms_norm_eps=1e-6,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    elif name == "olmo_hybrid":
        types = ["linear_attention" if k == "G" else "full_attention"
                 for k in v["layer_pattern"] * (v["n_layers"] // len(v["layer_pattern"]))]
        net = tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(
            **common, layer_types=types, linear_num_key_heads=v["linear_key_heads"],
            linear_num_value_heads=v["linear_value_heads"], rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": None}))
    elif name in ("olmoe", "flex_olmo"):
        experts = dict(num_experts=v["n_experts"], num_experts_per_tok=v["experts_per_token"],
                       norm_topk_prob=v.get("norm_topk_prob", False),
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        if name == "olmoe":
            net = tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, **experts, clip_qkv=v["clip_qkv"], rms_norm_eps=1e-5))
        else:
            net = tf.FlexOlmoForCausalLM(tf.FlexOlmoConfig(**common, **experts, head_dim=v["head_dim"],
                                                           rms_norm_eps=1e-6))
    else:
        # Legacy (transformers 4.x) RoPE keys, as in the older hub files: our reader must handle them.
        net = tf.Olmo3ForCausalLM(tf.Olmo3Config(
            **common, head_dim=v["head_dim"], rms_norm_eps=1e-6, sliding_window=v["sliding_window"],
            rope_theta=500000.0,
            rope_scaling={"rope_type": "yarn", "factor": v["yarn_factor"], "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": v["yarn_original_max_seq_len"]}))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
            if n.endswith(("A_log", "dt_bias")):  # decays that keep a token a while: g ≈ -0.1
                p.copy_(-2.5 + 0.3 * torch.randn_like(p))
    return net.eval()


def hf_logits(net, toks):
    with torch.no_grad():
        return net(torch.from_numpy(toks)).logits.float().numpy()


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


LOGITS = ("batch", "position", "vocab id")
CAPSTONE = ("The whole model against transformers, the course's capstone: each model exercise's "
            "own test (python tests/exercises.py list) places a difference more closely. From "
            "position 5 on: olmo3's window (W = 5); from 1 on: RoPE; everywhere: a norm or a "
            "projection.")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hf_to_ours(name, tmp_path):
    net = hf_model(name)
    net.save_pretrained(tmp_path)
    m, params = convert.load_hf(tmp_path)
    assert m == variant(name, init_std=0.02, init="normal")  # the bridge read every field back
    toks = tokens(m, T=40)  # longer than the sliding window and than YaRN's original context
    ref = hf_logits(net, toks)
    assert np.abs(ref).max() > 2.0
    ours_jax = np.asarray(model.forward(params, jnp.asarray(toks), m))
    with torch.no_grad():
        ours_torch = model.torch_model(m, params)(torch.from_numpy(toks)).numpy()
    compare(f"model.forward's logits ({name})", ours_jax, ref, LOGITS, 1e-5, hint=CAPSTONE)
    compare(f"model.torch_model's logits ({name})", ours_torch, ref, LOGITS, 1e-5, hint=CAPSTONE)
    # Every other attention implementation this machine runs (splash interpreted, flex eager), to the same 1e-5
    # (not olmo_hybrid's: its attention layers are olmo2's, whose kernels this runs)
    if name != "olmo_hybrid":
        splash, flex = attention_implementations(m, params, toks)
        compare(f"model.forward's logits with splash attention ({name})", splash, ref, LOGITS, 1e-5)
        compare(f"model.torch_model's logits with flex attention ({name})", flex, ref, LOGITS, 1e-5,
                hint="flex attention's masks come from model.attention_mask (exercise sliding_window).")
    # And the loss: HF shifts labels inside; we pass them shifted.
    with torch.no_grad():
        hf_loss = net(torch.from_numpy(toks), labels=torch.from_numpy(toks)).loss.item()
    ours = model.cross_entropy(jnp.asarray(ours_jax), jnp.asarray(model.shift_labels(toks)))[1]
    expect(number(f"model.cross_entropy of our logits ({name})", ours, hf_loss, 1e-5,
                  hint="the logits match, so the loss's own maths differs (exercise z_loss)."))


def attention_implementations(m, params, toks):
    """The logits of model.forward with splash attention (interpreted) and of the torch model with
    flex attention (eager)."""
    splash = np.asarray(model.forward(params, jnp.asarray(toks), m, attend_fn=shard.splash_attend))
    with torch.no_grad():
        flex = model.torch_model(dataclasses.replace(m, attention="flex"), params)
        flex = flex(torch.from_numpy(toks)).numpy()
    return splash, flex


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ours_to_hf(name, tmp_path):
    m = variant(name)
    params = random_params(m, seed=3, std=0.15)
    convert.save_hf(tmp_path, m, params)
    net = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(net).__name__ == convert.HF_CLASS[m.family][1]
    toks = tokens(m, T=40)
    ours = np.asarray(model.forward(params, jnp.asarray(toks), m))
    assert rel(ours, hf_logits(net, toks)) < 1e-5
    # And back: the directory we wrote reads back to the same config and bits.
    m2, params2 = convert.load_hf(tmp_path)
    assert m2 == dataclasses.replace(m, init="normal")  # HF files do not say how a model was initialised
    assert all(np.array_equal(params[k], params2[k]) for k in params)


def test_sharded_checkpoint(tmp_path):
    net = hf_model("olmo2")
    net.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    m, params = convert.load_hf(tmp_path)
    toks = tokens(m)
    assert rel(np.asarray(model.forward(params, jnp.asarray(toks), m)), hf_logits(net, toks)) < 1e-5


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path):
    # Some tied files carry a copy of the head; the tied model must use embed_tokens regardless.
    m = variant("olmo1")
    params = random_params(m)
    convert.save_hf(tmp_path, m, params)
    tensors = dict(convert.read_safetensors(tmp_path / "model.safetensors")[0])
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = np.asarray(tensors["model.embed_tokens.weight"])
    convert.write_safetensors(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    m2, params2 = convert.load_hf(tmp_path)
    assert m2.tie_embeddings and set(params2) == set(params)


def test_yarn_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from configs import load_config
    m = load_config([str(ROOT / "configs/olmo3-7b.toml"), str(ROOT / "configs/olmo3-7b-stage3.toml")]).model
    hf_cfg = tf.Olmo3Config(**{k: v for k, v in convert.config_to_hf(m).items() if k not in ("architectures", "model_type")})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, layer_type="full_attention")
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding
    plain, _ = Olmo3RotaryEmbedding.compute_default_rope_parameters(hf_cfg, layer_type="sliding_attention")
    _, ours, scale = model.layer_arrays(m)
    np.testing.assert_array_equal(ours[3], inv.numpy())  # bit-identical, as HF and OLMo-core are
    np.testing.assert_array_equal(ours[0], plain.numpy())
    assert scale[3] == pytest.approx(factor)
    assert hf_cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + hf_cfg.layer_types[4:]
    assert hf_cfg.layer_types.count("full_attention") == 8


def test_eval_logits_cli_backends_agree(tmp_path, capsys, monkeypatch):
    """`eval.py logits` in each backend and dtype, run as its command line runs it (run_cli(main),
    in this process: four more interpreters would spend half the test importing jax and torch)."""
    import eval as evaluate
    monkeypatch.delenv("NANOLMO_TRACEBACK", raising=False)  # (with it, run_cli raises instead)
    m = variant("olmo3")
    convert.save_hf(tmp_path / "ckpt", m, random_params(m, std=0.15))
    np.save(tmp_path / "in.npy", tokens(m, T=30).astype(np.int32))
    outs = {}
    for backend in ("jax", "torch"):
        for dtype in ("float32", "bfloat16"):
            out = tmp_path / f"{backend}-{dtype}.npy"
            run_cli(evaluate.main, ["logits", str(tmp_path / "ckpt"), "--tokens", str(tmp_path / "in.npy"),
                                    "--out", str(out), "--backend", backend, "--dtype", dtype])
            outs[backend, dtype] = np.load(out)
            assert outs[backend, dtype].dtype == np.float32 and outs[backend, dtype].shape == (2, 30, m.vocab_size)
    assert rel(outs["jax", "float32"], outs["torch", "float32"]) < 1e-5
    assert rel(outs["jax", "bfloat16"], outs["torch", "bfloat16"]) < 0.1
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([[1, m.vocab_size]]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_cli(evaluate.main, ["logits", str(tmp_path / "ckpt"), "--tokens", str(bad), "--out",
                                str(tmp_path / "x.npy")])
    assert exited.value.code == 1
    assert "token id 300 is out of range for vocab_size=300" in capsys.readouterr().err


def test_bad_checkpoints(tmp_path):
    m = variant("olmo2")
    convert.save_hf(tmp_path, m, random_params(m))
    st = tmp_path / "model.safetensors"
    whole = st.read_bytes()
    st.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .* the file is truncated or corrupt"):
        convert.load_hf(tmp_path)
    st.write_bytes(whole[:4])
    with pytest.raises(ValueError, match="too short to be a safetensors file"):
        convert.load_hf(tmp_path)
    st.write_bytes((10**9).to_bytes(8, "little") + whole[8:])
    with pytest.raises(ValueError, match="header claims 1000000000 bytes"):
        convert.load_hf(tmp_path)
    st.write_bytes(whole)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"tensors do not match config.json: missing \[\], unexpected \['layers.1"):
        convert.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "head_dim": 16}))
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(96, 64\), config.json implies \(64, 64\)"):
        convert.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 3}))
    with pytest.raises(ConfigError, match="config.json: model.n_kv_heads=3: n_heads=4 must be a multiple"):
        convert.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama' is not supported"):
        convert.load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    st.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin are pickles, which we never load"):
        convert.load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        convert.load_hf(tmp_path / "nowhere")


def test_ambiguous_legacy_rope_theta_is_refused():
    # transformers 4 applies a top-level rope_theta to every Olmo3 layer; transformers 5 only to full
    # layers (sliding ones keep 500000). With any other theta the file means two different models.
    hf = convert.config_to_hf(variant("olmo3"))
    del hf["rope_parameters"]
    assert convert.config_from_hf({**hf, "rope_theta": 500000.0}).rope_theta == 500000.0
    with pytest.raises(ConfigError, match="transformers 4 and 5 read .* differently"):
        convert.config_from_hf({**hf, "rope_theta": 10000.0})
