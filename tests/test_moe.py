"""The mixture of experts (OLMoE, FlexOlmo): the two ways of computing it against each other and
the torch loop, OLMo-core's router losses against a transcription of its nn/moe/loss.py, the
released shapes' counts, HF's MoE settings refused, the shard_map form on 8 fake devices, and a
tiny MoE run that learns and uses every expert. (Logits against transformers: test_hf.py's
olmoe and flex_olmo variants; the router exercise: test_course.py.)"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import convert
import model
from common import random_params, tokens, variant
from configs import ConfigError, load_config, run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_dense_and_grouped_experts_are_equal():
    """experts_grouped (sorted pairs, ragged_dot) gives experts_dense's sum (every expert on every
    token, one-hot weighted), forward and gradients, and torch's loop gives the same logits.
    (flex_olmo's experts are the same functions: test_hf.py runs both families.)"""
    m = variant("olmoe", n_layers=1)
    params = {k: jnp.asarray(v) for k, v in random_params(m, seed=1).items()}
    toks = jnp.asarray(tokens(m, T=16))
    dense = dataclasses.replace(m, moe_compute="dense")
    grouped = dataclasses.replace(m, moe_compute="grouped")

    def loss(p, mm):
        x, terms = model.forward(p, toks, mm, head=False)
        return (x ** 2).mean() + sum(v for k, v in terms.items() if k != model.LOAD)
    for a, b in [(model.forward(params, toks, dense), model.forward(params, toks, grouped))]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)
    ga, gb = jax.grad(loss)(params, dense), jax.grad(loss)(params, grouped)
    for k in ga:
        np.testing.assert_allclose(np.asarray(ga[k]), np.asarray(gb[k]), rtol=1e-4, atol=1e-6,
                                   err_msg=k)
    with torch.no_grad():
        t = model.torch_model(m, {k: np.asarray(v) for k, v in params.items()})
        t = t(torch.from_numpy(np.array(toks))).numpy()
    np.testing.assert_allclose(t, np.asarray(model.forward(params, toks, grouped)), rtol=0, atol=2e-5)


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
    chosen experts), written apart from model.py. logits (B, S, E) torch fp32."""
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
    np.testing.assert_allclose(float(terms["load balancing loss"]) / count, 0.01 * lb.item(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(terms["router Z loss"]) / count, 0.001 * z.item(), rtol=1e-5)
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
    """configs/tiny-olmoe.toml stacked on tiny.toml, on the test corpus (conftest's setup), 40
    steps in this process: the loss falls, the router losses and each layer's load imbalance are
    logged under OLMo-core's names, and every expert of every layer takes tokens."""
    import train
    root, _ = setup
    run = tmp_path / "run"
    run_cli(train.cli, [str(ROOT / "configs/tiny.toml"), str(ROOT / "configs/tiny-olmoe.toml"),
                        f"--data.path={root / 'data'}", "--model.vocab_size=384",
                        "--model.eos_token_id=382", "--model.pad_token_id=383",
                        "--data.seq_len=32", "--data.global_batch=8", "--train.steps=40",
                        "--train.log_every=10", "--train.warmup=5", "--train.checkpoint_every=40",
                        "--eval.every=0", f"--train.run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # (the first line averages steps 1-10)
    for key in ("load balancing loss", "router Z loss", "load imbalance",
                "block 00/load imbalance", "block 01/load imbalance"):
        assert key in rows[-1], key
    assert 1.0 <= rows[-1]["load imbalance"] < 4.0  # (4 = E/k: two experts take every token)
    m, params = convert.load_hf(run / "step_40")
    _, terms = model.forward(params, jnp.asarray(tokens(m, B=8, T=64)), m, head=False)
    assert (np.asarray(terms[model.LOAD]) > 0).all(), np.asarray(terms[model.LOAD])


def test_the_sharded_step_equals_one_device():
    """A small OLMoE's loss and gradients on 8 fake CPU devices, the experts computed under
    shard_map by shard.experts, equal one device's: each device on its own tokens with every
    expert (fsdp 4 x tensor 2), and expert parallelism (expert 4 x fsdp 2: each device keeps 2 of
    the 8 experts; pairs travel by all-to-all)."""
    code = r"""
import sys, json
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
import model, shard
from common import variant, random_params, tokens
from configs import MeshConfig
m = variant("olmoe", n_experts=8, experts_per_token=3)
params = {k: jnp.asarray(v) for k, v in random_params(m, seed=4).items()}
toks = jnp.asarray(tokens(m, B=8, T=16, seed=5))
def loss(p, toks, mesh):
    x, terms = model.forward(p, toks, m, head=False,
                             experts_fn=None if mesh is None else shard.experts(mesh, m))
    return (x ** 2).mean() + terms["load balancing loss"] + terms["router Z loss"]
one = jax.value_and_grad(loss)(params, toks, None)
for axes in [dict(fsdp=4, tensor=2), dict(expert=4, fsdp=2)]:
    mesh = shard.make_mesh(MeshConfig(data=1, **axes))
    shardings = shard.state_shardings(mesh, model.param_table(m))[0]
    placed = {k: jax.device_put(v, shardings[k]) for k, v in params.items()}
    rows = jax.device_put(toks, shard.instance_sharding(mesh))
    many = jax.jit(lambda p, t: jax.value_and_grad(loss)(p, t, mesh))(placed, rows)
    diff = max(float(jnp.abs(one[1][k] - many[1][k]).max()) for k in params)
    print(json.dumps({"mesh": axes, "loss": [float(one[0]), float(many[0])], "grad": diff}))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in r.stdout.strip().splitlines()[-2:]:
        out = json.loads(line)
        assert abs(out["loss"][0] - out["loss"][1]) < 1e-5 and out["grad"] < 1e-5, out
