"""Run by test_shard.py in a subprocess with 8 fake CPU devices (XLA_FLAGS set before jax starts):
two train steps of the tiny config at T = 512, documents kept apart, the head in chunks, on data, FSDP,
tensor and context-parallel meshes, and the splash kernel (interpreted) per device under shard.attention's
shard_map, with a context axis too (one kernel per shard's offset); prints losses and whether
shardings held."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import model  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402
from configs import build, load_config  # noqa: E402

TINY = load_config(["configs/tiny.toml", "--model.max_seq_len=512"]).model.__dict__
# (d, f, c, t); tensor parallelism alone is in "mixed" and "splash_fsdp_tensor", context
# parallelism with fsdp in "fsdp_context" and "splash_context" (each compile is ~6 s of the test:
# a mesh that adds no new layout is left out)
MESHES = {"one": (1, 1, 1, 1), "fsdp": (1, 8, 1, 1), "mixed": (2, 2, 1, 2),
          "fsdp_context": (1, 2, 4, 1), "splash_fsdp_tensor": (1, 2, 1, 2),
          "splash_context": (1, 2, 2, 1)}
out = {}
rng = np.random.default_rng(0)
tokens = rng.integers(0, 4094, (2, 1, 8, 512)).astype(np.int32)  # (steps, micro-batches, B, T)
tokens[rng.random(tokens.shape) < 1 / 60] = TINY["eos_token_id"]  # documents of ~60 tokens, kept apart
# The same weights and AdamW state on every mesh, drawn once on the host, then placed on each mesh
# (a jitted init per mesh would compile again; the attention choice changes no parameter)
MODEL = {k: v for k, v in TINY.items() if k != "derived"}
drawn = jax.device_get(model.init_params(build({"model": MODEL}).model, jax.random.PRNGKey(0)))
zeros = jax.device_get(train.new_optimizer(drawn))
for name, (d, f, c, t) in MESHES.items():
    attention = "splash" if name.startswith("splash") else "xla"
    cfg = build({"model": {**MODEL, "attention": attention},
                 "data": dict(global_batch=8, seq_len=512, doc_mask=True),
                 "mesh": dict(data=d, fsdp=f, context=c, tensor=t),
                 "train": dict(lr=1e-2, warmup=0, loss_chunks=4)})  # the head in 4 passes, on every mesh
    devices = jax.devices()[: d * f * c * t]
    mesh = shard.make_mesh(cfg.mesh, devices)
    p_sh, o_sh, h_sh = shard.state_shardings(mesh, model.param_table(cfg.model))
    params = jax.device_put(drawn, p_sh)
    opt = jax.device_put(zeros, o_sh)
    history = jax.device_put(train.new_history(), h_sh)
    step = train.make_train_step(cfg, mesh)
    losses = []
    for s in range(2):
        batch = dict(tokens=jax.device_put(tokens[s], shard.batch_sharding(mesh)))
        params, opt, history, metrics = step(params, opt, history, batch, jnp.float32(1e-2))
        losses.append(float(metrics["loss"]))
    kept = all(params[k].sharding.spec == p_sh[k].spec and opt["m"][k].sharding.spec == p_sh[k].spec for k in params)
    fraction = sum(x.addressable_shards[0].data.size for x in params.values()) / sum(x.size for x in params.values())
    out[name] = dict(losses=losses, shardings_kept=kept, param_fraction_per_device=fraction,
                     q_spec=str(p_sh["layers.self_attn.q_proj.weight"].spec))
print(json.dumps(out))
