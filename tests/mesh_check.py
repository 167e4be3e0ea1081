"""Run by test_shard.py in a subprocess with 8 fake CPU devices (XLA_FLAGS set before jax starts):
two train steps of the tiny config at T = 512, documents kept apart, the head in chunks, on data, FSDP,
tensor and context-parallel meshes, and the splash kernel (interpreted) per device under shard.attention's
shard_map, with a context axis too (one kernel per shard's offset); then the tiny OLMoE (tiny-olmoe.toml)
at T = 128 on one device and on fsdp 2 x expert 2 x tensor 2 (expert parallelism: each device 4 of the
8 experts, each expert's width split over tensor, pairs sent by all-to-all), and the tiny OLMo Hybrid
(tiny-hybrid.toml) at T = 128 on one device and on data 2 x fsdp 2 x tensor 2 (its Gated DeltaNet heads split
over tensor; documents not kept apart: its G layers do not reset at them); prints losses and whether
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
MOE = load_config(["configs/tiny.toml", "configs/tiny-olmoe.toml"]).model.__dict__
HYBRID = load_config(["configs/tiny.toml", "configs/tiny-hybrid.toml"]).model.__dict__
# (d, f, e, c, t): data, fsdp, expert, context, tensor; tensor parallelism alone is in "mixed" and
# "splash_fsdp_tensor", context parallelism with fsdp in "fsdp_context" and "splash_context" (each
# compile is ~6 s of the test: a mesh that adds no new layout is left out)
MESHES = {"one": (1, 1, 1, 1, 1), "fsdp": (1, 8, 1, 1, 1), "mixed": (2, 2, 1, 1, 2),
          "fsdp_context": (1, 2, 1, 4, 1), "splash_fsdp_tensor": (1, 2, 1, 1, 2),
          "splash_context": (1, 2, 1, 2, 1),
          "moe_one": (1, 1, 1, 1, 1), "moe_expert": (1, 2, 2, 1, 2),
          "hybrid_one": (1, 1, 1, 1, 1), "hybrid_tensor": (2, 2, 1, 1, 2)}
out = {}
rng = np.random.default_rng(0)
tokens = rng.integers(0, 4094, (2, 1, 8, 512)).astype(np.int32)  # (steps, micro-batches, B, T)
tokens[rng.random(tokens.shape) < 1 / 60] = TINY["eos_token_id"]  # documents of ~60 tokens, kept apart
# The same weights and AdamW state on every mesh, drawn once on the host, then placed on each mesh
# (a jitted init per mesh would compile again; the attention choice changes no parameter)
DENSE = {k: v for k, v in TINY.items() if k != "derived"}
EXPERTS = {k: v for k, v in MOE.items() if k != "derived"}
LINEAR = {k: v for k, v in HYBRID.items() if k != "derived"}
MODELS = {"dense": DENSE, "moe": EXPERTS, "hybrid": LINEAR}
drawn, zeros = {}, {}
for kind, m in MODELS.items():
    drawn[kind] = jax.device_get(model.init_params(build({"model": m}).model, jax.random.PRNGKey(0)))
    zeros[kind] = jax.device_get(train.new_optimizer(drawn[kind]))
for name, (d, f, e, c, t) in MESHES.items():
    attention = "splash" if name.startswith("splash") else "xla"
    kind = name.split("_")[0] if name.startswith(("moe", "hybrid")) else "dense"
    T = 512 if kind == "dense" else 128
    cfg = build({"model": {**MODELS[kind], "attention": attention},
                 "data": dict(global_batch=8, seq_len=T, doc_mask=kind != "hybrid"),
                 "mesh": dict(data=d, fsdp=f, expert=e, context=c, tensor=t),
                 "train": dict(lr=1e-2, warmup=0, loss_chunks=4)})  # the head in 4 passes, on every mesh
    devices = jax.devices()[: d * f * e * c * t]
    mesh = shard.make_mesh(cfg.mesh, devices)
    p_sh, o_sh, h_sh = shard.state_shardings(mesh, model.param_table(cfg.model))
    params = jax.device_put(drawn[kind], p_sh)
    opt = jax.device_put(zeros[kind], o_sh)
    history = jax.device_put(train.new_history(), h_sh)
    step = train.make_train_step(cfg, mesh)
    losses = []
    for s in range(2):
        batch = dict(tokens=jax.device_put(tokens[s, ..., :T], shard.batch_sharding(mesh)))
        params, opt, history, metrics = step(params, opt, history, batch, jnp.float32(1e-2))
        losses.append(float(metrics["loss"]))
    kept = all(params[k].sharding.spec == p_sh[k].spec and opt["m"][k].sharding.spec == p_sh[k].spec for k in params)
    fraction = sum(x.addressable_shards[0].data.size for x in params.values()) / sum(x.size for x in params.values())
    out[name] = dict(losses=losses, shardings_kept=kept, param_fraction_per_device=fraction,
                     q_spec=str(p_sh["layers.self_attn.q_proj.weight"].spec),
                     v_spec=str(p_sh.get("layers.linear_attn.v_proj.weight", p_sh["norm.weight"]).spec),
                     router_losses=[float(metrics.get(k, 0)) for k in train.MOE_METRICS])
print(json.dumps(out))
