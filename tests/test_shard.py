"""shard.py: FSDP, tensor and mixed meshes against one device; layouts; bad meshes; the AOT plan."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
import shard
from common import random_params, tokens, variant
from configs import build
from teach import fail

ROOT = Path(__file__).resolve().parents[1]
EIGHT = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")


def test_meshes_train_like_one_device():
    r = subprocess.run([sys.executable, "tests/mesh_check.py"], cwd=ROOT, env=EIGHT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    one = out["one"]["losses"]
    for name in ("fsdp", "mixed", "fsdp_context", "splash_fsdp_tensor",
                 "splash_context"):
        np.testing.assert_allclose(out[name]["losses"], one, rtol=1e-5, err_msg=name)
        assert out[name]["shardings_kept"], name
    # the tiny OLMoE with expert parallelism (each device 4 of the 8 experts, their width split
    # over tensor; pairs by all-to-all) trains like one device, router losses included
    for key in ("losses", "router_losses"):
        np.testing.assert_allclose(out["moe_expert"][key], out["moe_one"][key], rtol=1e-5, err_msg=key)
    assert out["moe_expert"]["shardings_kept"]
    assert out["moe_expert"]["param_fraction_per_device"] < 0.5  # (the experts: 1/8 a device)
    # the tiny OLMo Hybrid, its Gated DeltaNet heads (and their states) split over tensor
    np.testing.assert_allclose(out["hybrid_tensor"]["losses"], out["hybrid_one"]["losses"], rtol=1e-5)
    assert out["hybrid_tensor"]["shardings_kept"]
    assert out["hybrid_tensor"]["v_spec"] == "P(None, 'tensor', 'fsdp')"
    assert out["fsdp"]["q_spec"] == "P(None, None, 'fsdp')" and out["mixed"]["q_spec"] == "P(None, 'tensor', 'fsdp')"
    assert out["fsdp"]["param_fraction_per_device"] < 0.2  # each device keeps about 1/8 of the weights
    assert out["mixed"]["param_fraction_per_device"] < 0.3
    # Context parallelism (4 devices share each instance's 512 positions): weights are split over fsdp only
    # (shard.py says why), so the context ranks of a group hold the same shard.
    assert out["fsdp_context"]["param_fraction_per_device"] < 0.6


def test_layouts_follow_the_rules():
    m = build({"model": dict(d_model=64, n_heads=4, n_kv_heads=2, mlp_hidden=128, vocab_size=512,
                             eos_token_id=0, pad_token_id=1)}).model
    table = model.param_table(m)
    wrong = []
    q, o = "layers.self_attn.q_proj.weight", "layers.self_attn.o_proj.weight"
    down, norm = "layers.mlp.down_proj.weight", "layers.post_attention_layernorm.weight"
    for sizes, want in [
            (dict(data=1, fsdp=4, tensor=2),
             {"embed_tokens.weight": ("tensor", "fsdp"), q: (None, "tensor", "fsdp"),
              o: (None, "fsdp", "tensor"), down: (None, "fsdp", "tensor"), norm: (None, "fsdp")}),
            (dict(data=2, fsdp=1, tensor=2),
             {"embed_tokens.weight": ("tensor", None), q: (None, "tensor", None)})]:
        for name, spec in want.items():
            got = tuple(shard.spec_for(name, table[name], sizes))
            if got != spec:
                p = table[name]
                wrong.append(f"  {name} {p.shape}, axes {p.axes}, mesh {sizes}: yours P{got}, "
                             f"want P{spec}")
    if wrong:
        fail("shard.spec_for:", *wrong,
             "Each dimension's logical axis goes through RULES (embed -> fsdp; heads, kv_heads, "
             "mlp, vocab -> tensor; layers -> not split); a mesh axis of size 1 splits nothing, "
             "so it is left out (None when none is left); one mesh axis is named alone, not as a "
             "1-tuple.")


def test_bad_meshes_fail_before_compiling():
    mesh = lambda **kw: build({"mesh": kw}).mesh  # noqa: E731
    with pytest.raises(ValueError, match=r"needs 6 devices, there are 8"):
        shard.mesh_shape(mesh(data=2, fsdp=3), 8)
    with pytest.raises(ValueError, match="8 devices do not divide by 3"):
        shard.mesh_shape(mesh(data=-1, fsdp=3), 8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        shard.mesh_shape(mesh(data=-1, fsdp=-1), 8)
    shape = shard.mesh_shape(mesh(data=-1, fsdp=2, tensor=2), 8)
    assert dict(zip(shard.AXES, shape)) == dict(data=2, fsdp=2, expert=1, context=1, tensor=2)
    m = build({"model": dict(d_model=96, n_heads=4, vocab_size=1000, eos_token_id=0, pad_token_id=1)}).model
    p = model.param_table(m)["lm_head.weight"]
    want = ("lm_head.weight: dimension 'vocab' of size 1000 does not divide over mesh axis "
            "'tensor' of size 16")
    try:
        got = shard.spec_for("lm_head.weight", p, dict(data=1, fsdp=1, tensor=16))
        refused = None
    except ValueError as e:
        refused = str(e)
    if refused is None:
        fail(f"shard.spec_for splits lm_head.weight's 1000 rows over tensor = 16 as {got}: "
             f"refuse a split that does not divide, with a ValueError saying {want!r}.")
    if want not in refused:
        fail(f"shard.spec_for refuses lm_head.weight (1000 rows) over tensor = 16 with "
             f"{refused!r}; the message must say {want!r} (the parameter, the axis, both sizes).")

    with pytest.raises(ValueError, match=r"data.global_batch=12 does not divide over the 8 data-parallel ranks \(mesh data=2 x fsdp=4\)"):
        shard.check_batch(12, 0, 8, "mesh data=2 x fsdp=4")
    with pytest.raises(ValueError, match="train.micro_batch=3 does not divide the 4 instances each rank gets"):
        shard.check_batch(32, 3, 8, "mesh data=2 x fsdp=4")


def test_remat_policies_compute_the_same_gradients():
    m = variant("olmo3")
    params = {k: jnp.asarray(v) for k, v in random_params(m, std=0.1).items()}
    t = tokens(m, T=24)
    labels = jnp.asarray(model.shift_labels(t))
    grads = {r: jax.grad(model.loss_fn)(params, jnp.asarray(t), labels, m, remat=r) for r in ("none", "block", "mlp", "dots")}
    for r in ("block", "mlp", "dots"):
        for k in params:
            ref = np.asarray(grads["none"][k])
            np.testing.assert_allclose(np.asarray(grads[r][k]), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=k)


def test_plan_compiles_for_a_simulated_mesh():
    r = subprocess.run([sys.executable, "train.py", "plan", "configs/tiny.toml", "--mesh", "data=2,fsdp=2,tensor=2",
                        "--batch", "16", "--seq", "128", "--device", "v5e", "--devices", "8"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(8 x v5e)" in r.stdout and "of 16.0 GiB JAX can use on a v5e (16 GiB): fits" in r.stdout
    assert "optimizer state" in r.stdout
