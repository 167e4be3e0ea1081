"""Run by test_accelerators.py in a subprocess with 8 fake CPU devices: the real train step of
shipped configs (4 layers, B 8), and eval.py's forward and KV-cache step, lowered from this CPU for
CUDA and for TPU (`.trace(...).lower(lowering_platforms=...)`), with `auto` attention as shipped.
The device check that picks the attention is stubbed (shard.accelerator: an H100's platform and
compute capability, or an A100's, or a TPU's), and so are cuDNN's own version and capability
checks, as JAX's tests stub them (jax._src.cudnn.fused_attention_stablehlo). Prints one JSON line:
per case, the custom calls in the lowered step, whether every fp32 matmul asks for full
precision, and the operand types of its matmuls.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/lower_check.py
"""
import json
import re
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: E402

import eval as evaluate  # noqa: E402
import model  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402
from configs import load_config  # noqa: E402

ACCELERATORS = {"h100": ("gpu", (9, 0)), "a100": ("gpu", (8, 0)), "tpu": ("tpu", None)}
# kernels run per device under shard_map: instances and heads split
TP = ["--mesh.fsdp=4", "--mesh.tensor=2"]
CASES = {  # name: (config files, flags): shipped configs at 4 layers, on 8 devices
    "olmo2-1b": (["olmo2-1b"], TP),
    "olmo3-7b": (["olmo3-7b"], TP),
    "olmo3-7b-h256": (["olmo3-7b-h256"], TP),
    # (documents, context)
    "olmo3-7b-stage3": (["olmo3-7b", "olmo3-7b-stage3"],
                        ["--mesh.fsdp=4", "--mesh.context=2", "--data.seq_len=16384"]),
    "olmo2-1b-fp32": (["olmo2-1b"], TP + ["--train.compute_dtype=float32"]),
    # a mixture of experts, expert parallel: grouped experts, pairs sent by all-to-all
    "olmoe-1b-7b": (["olmoe-1b-7b"], ["--mesh.fsdp=2", "--mesh.expert=4"]),
    # OLMo Hybrid (its first 4 layers: GGGF), heads split over tensor: the chunked delta rule
    # beside the attention layer's kernel (its train step only: eval's paths as olmo3-7b's)
    "olmo-hybrid-7b": (["olmo-hybrid-7b"], TP),
}


def lowered_text(fn, args, platform):
    platforms = ("cuda" if platform == "gpu" else "tpu",)
    return fn.trace(*args).lower(lowering_platforms=platforms).as_text()


def operand_types(dot):
    """A dot_general line's operand element types, "bf16xf32": the types in its signature, and
    where an algorithm names other ones, as the hardware takes them: jax.nn.dot_product_attention
    asks BF16_BF16_F32 of its fp32 scores' cotangent, which XLA rounds to bf16 (kBF16AsF32,
    cuBLAS's CUBLAS_COMPUTE_32F_FAST_16BF): "f32 as bf16"."""
    signature = dot.rsplit(" : (", 1)[1].split(") -> ")[0]
    types = re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", signature)
    algorithm = re.search(r"lhs_precision_type = (\w+), rhs_precision_type = (\w+)", dot)
    if algorithm:
        types = [t if t == a else f"{t} as {a}" for t, a in zip(types, algorithm.groups())]
    return "x".join(types)


def summary(text):
    """What a lowered program calls (cuDNN's attention, a Mosaic kernel) and its matmuls'
    precision and operand types ({"bf16xbf16": count, ...})."""
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    return dict(cudnn_forward=text.count("@__cudnn$fmhaSoftmax("),
                cudnn_backward=text.count("fmhaSoftmaxBackward"),
                mosaic=text.count("tpu_custom_call"), dots=len(dots),
                ragged_dot=text.count("ragged_dot"), all_to_all=text.count("all_to_all"),
                triangular_solve=text.count("triangular_solve"),
                highest=sum("precision = [HIGHEST, HIGHEST]" in d for d in dots),
                types=dict(Counter(map(operand_types, dots))))


def train_step(files, flags, platform):
    base = ["--model.n_layers=4", "--data.global_batch=8", "--train.micro_batch=0", "--mesh.data=1"]
    cfg = load_config([f"configs/{f}.toml" for f in files] + base + flags)
    mesh = shard.make_mesh(cfg.mesh, jax.devices()[:8])
    p_sh, o_sh, h_sh = shard.state_shardings(mesh, model.param_table(cfg.model))
    abstract = lambda shape, dtype, sh: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=sh)
    params = {k: abstract(p.shape, jnp.float32, p_sh[k])
              for k, p in model.param_table(cfg.model).items()}
    opt = dict(m=params, v=params, count=abstract((), jnp.int32, o_sh["count"]))
    hist = jax.tree.map(lambda x: abstract(x.shape, x.dtype, h_sh),
                        jax.eval_shape(train.new_history))
    tokens = abstract((1, 8, cfg.data.seq_len), jnp.int32, shard.batch_sharding(mesh))
    step = train.make_train_step(cfg, mesh)
    args = (params, opt, hist, dict(tokens=tokens), jnp.float32(1e-4))
    return lowered_text(step, args, platform), cfg


def eval_paths(cfg, platform):
    """eval.py's two: the whole forward (scores, bits per byte, logits) and the KV-cache step
    (generate)."""
    m, dtype = cfg.model, jnp.dtype(cfg.train.compute_dtype)
    params = {k: jax.ShapeDtypeStruct(p.shape, jnp.float32)
              for k, p in model.param_table(m).items()}
    tokens = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    # eval._backend's own function (its logits as they are), caught as it is handed to jax.jit:
    # it picks the device's attention kernel (shard.pick_attention), which model.forward does not
    handed = []
    with mock.patch.object(jax, "jit", lambda f: handed.append(f) or f):
        evaluate._backend(m, "jax", dtype, lambda xp, logits, t: logits)
    forward = jax.jit(handed[0])
    cache = jax.eval_shape(lambda: model.new_cache(m, 2, 1024, dtype))
    one = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    step = jax.jit(lambda p, t, c: model.forward_step(p, t, 7, c, m, dtype))
    return (lowered_text(forward, (params, tokens), platform),
            lowered_text(step, (params, one, cache), platform))


def main():
    out = {}
    for accel, (platform, capability) in ACCELERATORS.items():
        stub = lambda device=None, p=platform, c=capability: (p, c)  # noqa: E731
        with mock.patch.object(shard, "accelerator", stub), \
             mock.patch.object(cudnn, "check_cudnn_version", lambda: 91000), \
             mock.patch.object(cudnn, "check_compute_capability",
                               lambda cc, c=capability: c >= (9, 0)):
            for name, (files, flags) in CASES.items():
                if accel == "a100" and name not in ("olmo3-7b", "olmo3-7b-h256"):
                    continue
                text, cfg = train_step(files, flags, platform)
                case = dict(step=summary(text), attention=shard.pick_attention(
                    cfg.model, cfg.train.compute_dtype, cfg.data.doc_mask, None, cfg.mesh.context))
                if "stage3" not in name and "hybrid" not in name:
                    forward, cached = eval_paths(cfg, platform)
                    case.update(forward=summary(forward), generate=summary(cached))
                out[f"{name} {accel}"] = case
    print(json.dumps(out))


if __name__ == "__main__":
    main()
