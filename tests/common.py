"""Small configs covering every architectural feature, weights far from the trivial init, and
once_per_session for fixtures both test workers read."""
import fcntl
import os
import shutil

import jax
import numpy as np

from configs import ModelConfig
from model import param_table

VARIANTS = {
    # OLMo 1: parameter-free LayerNorm, tied embeddings, clip_qkv small enough to actually clamp.
    "olmo1": dict(family="olmo1", d_model=64, n_layers=2, n_heads=4, mlp_hidden=96, vocab_size=300,
                  tie_embeddings=True, clip_qkv=0.5, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64,
                  init="mitchell", eos_token_id=2, pad_token_id=1),
    # OLMo 2: reordered norm, QK-norm, GQA, head_dim != d_model / n_heads.
    "olmo2": dict(family="olmo2", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, mlp_hidden=96,
                  vocab_size=300, max_seq_len=64, eos_token_id=2, pad_token_id=1),
    # OLMo 3: 3 sliding : 1 full with a window shorter than the sequence, YaRN on the full layer, K=1.
    "olmo3": dict(family="olmo3", d_model=64, n_layers=4, n_heads=4, n_kv_heads=1, head_dim=32, mlp_hidden=96,
                  vocab_size=300, max_seq_len=64, sliding_window=5, layer_pattern="SSSF",
                  yarn_factor=4.0, yarn_original_max_seq_len=64, eos_token_id=2, pad_token_id=1),
    # OLMoE: Llama's pre-norm order, QK-norm, clip_qkv small enough to clamp, GQA; 4 experts, top 2,
    # weights not renormalised.
    "olmoe": dict(family="olmoe", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=32,
                  vocab_size=300, max_seq_len=64, norm_eps=1e-5, clip_qkv=0.8, n_experts=4,
                  experts_per_token=2, eos_token_id=2, pad_token_id=1),
    # FlexOlmo: OLMo 2's block with 5 experts, top 3, renormalised (FlexOlmo's release does not).
    "flex_olmo": dict(family="flex_olmo", d_model=64, n_layers=2, n_heads=4, head_dim=24, mlp_hidden=32,
                      vocab_size=300, max_seq_len=64, n_experts=5, experts_per_token=3,
                      norm_topk_prob=True, eos_token_id=2, pad_token_id=1),
    # OLMo Hybrid as released: Gated DeltaNet (G) and full-attention layers, twice, no RoPE, GQA;
    # the G layers' 2 key heads serve 4 value heads, negative eigenvalues allowed
    "olmo_hybrid": dict(family="olmo_hybrid", d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        mlp_hidden=96, vocab_size=300, max_seq_len=64, layer_pattern="GF",
                        rope_theta=0.0, linear_key_heads=2, linear_value_heads=4,
                        eos_token_id=2, pad_token_id=1),
}


def variant(name, **overrides):
    return ModelConfig(**{**VARIANTS[name], **overrides})


def random_params(m, seed=0, std=0.2):
    """Every weight random (norm weights too, around 1), so a misplaced tensor cannot hide."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in param_table(m).items():
        if callable(p.std):  # OLMo Hybrid's A_log and dt_bias: their own init, decays that keep
            # tokens in the state for a while (a random normal would forget in a token or two)
            out[name] = np.asarray(p.std(jax.random.PRNGKey(seed), p.shape))
        elif p.std is None:
            out[name] = (1 + 0.2 * rng.standard_normal(p.shape)).astype(np.float32)
        else:
            out[name] = (std * rng.standard_normal(p.shape)).astype(np.float32)
    return out


def tokens(m, B=2, T=24, seed=0):
    return np.random.default_rng(seed).integers(0, m.vocab_size, (B, T))


# The real-size configs as shipped, each with the files it stacks on (tests/tables.py plans each on
# its target, test_accelerators.py checks each fits).
SHIPPED = [["olmo1-1b"], ["olmo1-7b"], ["olmo2-1b"], ["olmo2-7b"], ["olmo2-13b"], ["olmo3-7b"],
           ["olmo3-7b-h256"], ["olmo3-32b"],
           ["olmo3-7b", "olmo3-7b-pretrain-2"], ["olmo3-7b", "olmo3-7b-stage2"],
           ["olmo3-32b", "olmo3-32b-stage2"],
           ["olmo3-7b", "olmo3-7b-stage3"], ["olmo3-32b", "olmo3-32b-stage3"],
           ["olmo3-7b", "olmo3-7b-stage3", "olmo3-7b-sft"],
           ["olmo3-7b", "olmo3-7b-stage3", "olmo3-7b-dpo"],
           ["olmo3-7b", "olmo3-7b-stage3", "olmo3-7b-rl"], ["olmoe-1b-7b"], ["flexolmo-7x7b"],
           ["olmo-hybrid-7b"]]


def once_per_session(tmp_path_factory, name, make):
    """A folder that make(folder) fills once for the whole test session, whichever pytest-xdist
    worker asks first; the other waits on a file lock and then reads the same folder. For a module
    fixture that tests on either worker read: each worker would otherwise run it again (an 8-device
    training run: 10-20 s of CI's two cores). The tests must only read the folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is a sibling of the other's
        root = root.parent
    folder = root / f"once-{name}"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / "made").exists():  # (a folder a failed make left is made again)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / "made").touch()
    return folder


def olmo_core_round_trip(m, params, config, sd, tmp_path):
    """An OLMo-core checkpoint of (m, params) (its config.json `config`, state dict `sd`) written
    in tmp_path/core reads as ours, tensor for tensor, and converts to ours, then to a
    release-style HF folder -> (that OLMo-core folder, its Source, transformers' model of the HF
    folder, in eval mode)."""
    import json

    import pytest

    import convert
    import model
    src = tmp_path / "core"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    convert.write_safetensors(src / "model.safetensors", sd)
    s = convert.open_source(src)
    assert s.kind == "olmo_core" and s.m.differences(m, ignore=("max_seq_len",)) == []
    got = {k: t.load() for k, t in s.tensors.items()}
    want = model.unstack_layers(params, m)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)
    convert.convert(src, tmp_path / "ours")
    convert.convert(tmp_path / "ours", tmp_path / "release", to_hf=True)
    tf = pytest.importorskip("transformers")
    return src, s, tf.AutoModelForCausalLM.from_pretrained(tmp_path / "release").eval()


def train_tiny_overlay(overlay, root, run, steps, log_every):
    """configs/tiny.toml with configs/OVERLAY.toml on top, on the test corpus in root (conftest's
    setup: a 384-id BPE), steps of 8 x 32 tokens in this process, into run -> the metrics'
    lines that hold a loss (each the mean since the line before)."""
    import json
    from pathlib import Path

    import train
    from configs import run_cli
    configs = Path(__file__).resolve().parents[1] / "configs"
    run_cli(train.cli, [str(configs / "tiny.toml"), str(configs / f"{overlay}.toml"),
                        f"--data.path={root / 'data'}", "--model.vocab_size=384",
                        "--model.eos_token_id=382", "--model.pad_token_id=383",
                        "--data.seq_len=32", "--data.global_batch=8", f"--train.steps={steps}",
                        f"--train.log_every={log_every}", "--train.warmup=5",
                        f"--train.checkpoint_every={steps}", "--eval.prompt=", "--eval.every=0",
                        f"--train.run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]
