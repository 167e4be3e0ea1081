"""The OLMo architecture (OLMo 1, 2 and 3; the mixtures of experts OLMoE and FlexOlmo; OLMo Hybrid)
twice, in the same order and names: JAX (pure functions over a flat params dict), then PyTorch
(nn.Module).
The parameter table, init, counts and losses (xp: jnp or torch) serve both. The device attention
kernels (splash, cuDNN) and the choice between them live in shard.py, where the device is known;
so does the experts' placement on a mesh (shard.experts).

    python model.py configs/olmo2-7b.toml    # parameter table, FLOPs/token, total_params=...

Notation, in names and shape comments alike (`# (B, T, N, H)` where a shape changes): B batch,
T sequence (queries), S keys, D d_model, F MLP width (each SwiGLU branch; an expert's, in a
mixture), V vocabulary, L layers, N query heads, K kv heads, H head dim, E experts, k of them
a token. The families (HF names):
    OLMo 1:   x = x + o_proj(attn(LN(x)))
              x = x + down(silu(gate(LN(x))) * up(LN(x)))
    OLMo 2/3: x = x + post_attention_layernorm(o_proj(attn(x)))
              x = x + post_feedforward_layernorm(mlp(x))
    OLMoE:    x = x + o_proj(attn(input_layernorm(x)))
              x = x + moe(post_attention_layernorm(x))
    FlexOlmo: OLMo 2's block, moe for mlp
    OLMo Hybrid, its G layers (Gated DeltaNet):
              x = x + gated_deltanet(attention_layer_norm(x))
              x = x + mlp(feedforward_layer_norm(x))
              and its F layers OLMo 2's block (RoPE or none), 3 G : 1 F
LN: LayerNorm with no weight or bias; the others: RMSNorm with a weight, QK-norm over the
projected width. OLMo 3 adds sliding-window layers (3 sliding : 1 full) and YaRN on full layers.
moe: a router picks k of E SwiGLU experts for each token and sums their outputs, each weighted
by its probability. gated_deltanet: linear attention, a fixed-size state per head that each token
decays and corrects by the delta rule ("the gated delta rule" below: its own K, N, Hk, Hv). Every
family: RoPE in the half-split convention, SwiGLU, no biases, GQA where K < N, and H independent
of D / N. `family` decides the block, and sliding windows and YaRN need olmo3, clip_qkv olmo1 or
olmoe, experts olmoe or flex_olmo, G layers and no RoPE olmo_hybrid: every config we accept has an
HF class computing the same function, which the parity tests compare with.

Params are fp32 (an AdamW update is often smaller than one bf16 step of its weight, and would round
away) and `dtype` is the compute dtype: each matmul casts its fp32 weight to it where it is used.
Norms, RoPE, softmax and the loss run in fp32 whatever `dtype` is: each sums many terms or turns
large angles and logits into small differences, which the 8-bit mantissa of bf16 would lose.
"""

import math
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from configs import ModelConfig, describe, parse_config_args, run_cli

IGNORE_INDEX = -100  # labels that add nothing to the loss
Q_BLOCK = 256  # attend_in_blocks' query blocks


# --- the parameter table and per-layer arrays (both backends) ---

@dataclass(frozen=True)
class Param:
    shape: tuple
    axes: tuple         # logical axis per dim (shard.RULES: mesh axes)
    # a truncated-normal std, a tuple of them (one per layer), a function (key, shape) -> array
    # (OLMo Hybrid's A_log and dt_bias), or None: ones
    std: object = None
    decay: bool = True  # AdamW weight decay
    # The HF layer numbers a stacked param's leading L holds, in order; None: every layer. OLMo
    # Hybrid stacks each kind of layer's own weights on their own L (its 24 Gated DeltaNet
    # layers' linear_attn.*, its 8 attention layers' self_attn.*): row 3 of
    # layers.linear_attn.q_proj is HF's layers.4.linear_attn.q_proj (hf_indices)
    layers: tuple = None


def param_table(m: ModelConfig):
    """name -> Param in HF order and names, without "model." and without the layer index: per-layer
    weights are stacked on a leading L (forward scans them a layer_pattern at a time). Linear
    weights are (out, in) as in PyTorch, so HF conversion is a rename plus stack/unstack, never a
    transpose or a RoPE permutation. This table is the only declaration: init, counts, the logical
    axes for sharding, the weight-decay flag, the checkpoint's tensor names and `python model.py`'s
    printed table all come from it.

    Init: OLMo 2/3 draw every weight from a normal with std init_std truncated at ±3σ and set the
    norms to 1; OLMo 1 uses the "mitchell" init below."""
    D, L, N, K, H = m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim
    hidden, V = m.mlp_hidden, m.vocab_size  # F in shape comments
    # OLMo Hybrid: attention's weights on the F layers only (the G layers' are further down)
    kinds = m.layer_types()
    full = tuple(i for i, kind in enumerate(kinds) if kind != "G") if "G" in kinds else None
    La = len(full) if full else L  # the layers with attention
    if m.init == "mitchell":
        # 1/sqrt(fan_in), the residual stream's writers also / sqrt(2·(layer+1))
        s_in, s_f = 1 / math.sqrt(D), 1 / math.sqrt(hidden)
        depth = [math.sqrt(2 * (i + 1)) for i in range(L)]
        std = dict(embed=s_in, qkv=s_in, out=tuple(s_in / d for d in depth), up=s_in,
                   down=tuple(s_f / d for d in depth), head=s_in)
    else:
        std = dict.fromkeys(["embed", "qkv", "out", "up", "down", "head"], m.init_std)
    t = {"embed_tokens.weight": Param((V, D), ("vocab", "embed"), std["embed"], decay=False)}
    a = "layers.self_attn."
    t[a + "q_proj.weight"] = Param((La, N * H, D), ("layers", "heads", "embed"), std["qkv"],
                                   layers=full)
    t[a + "k_proj.weight"] = Param((La, K * H, D), ("layers", "kv_heads", "embed"), std["qkv"],
                                   layers=full)
    t[a + "v_proj.weight"] = Param((La, K * H, D), ("layers", "kv_heads", "embed"), std["qkv"],
                                   layers=full)
    t[a + "o_proj.weight"] = Param((La, D, N * H), ("layers", "embed", "heads"), std["out"],
                                   layers=full)
    if m.family != "olmo1":
        t[a + "q_norm.weight"] = Param((La, N * H), ("layers", "heads"), layers=full)
        t[a + "k_norm.weight"] = Param((La, K * H), ("layers", "kv_heads"), layers=full)
    if full:
        t.update(linear_attention_table(m, std["qkv"], std["out"]))
    if m.n_experts:  # OLMoE, FlexOlmo: the router, then E experts stacked on an experts axis
        E = m.n_experts
        # the router's (E, D): small, every device keeps all of its rows (shard.RULES)
        t["layers.mlp.gate.weight"] = Param((L, E, D), ("layers", "router", "embed"), std["up"])
        e = "layers.mlp.experts."
        t[e + "gate_proj.weight"] = Param((L, E, hidden, D), ("layers", "experts", "mlp", "embed"),
                                          std["up"])
        t[e + "up_proj.weight"] = Param((L, E, hidden, D), ("layers", "experts", "mlp", "embed"),
                                        std["up"])
        t[e + "down_proj.weight"] = Param((L, E, D, hidden), ("layers", "experts", "embed", "mlp"),
                                          std["down"])
    else:
        t["layers.mlp.gate_proj.weight"] = Param((L, hidden, D), ("layers", "mlp", "embed"),
                                                 std["up"])
        t["layers.mlp.up_proj.weight"] = Param((L, hidden, D), ("layers", "mlp", "embed"),
                                               std["up"])
        t["layers.mlp.down_proj.weight"] = Param((L, D, hidden), ("layers", "embed", "mlp"),
                                                 std["down"])
    if m.family == "olmoe":  # Llama's names: each sublayer's input norm
        t["layers.input_layernorm.weight"] = Param((L, D), ("layers", "embed"))
        t["layers.post_attention_layernorm.weight"] = Param((L, D), ("layers", "embed"))
        t["norm.weight"] = Param((D,), ("embed",))
    elif m.family != "olmo1":  # OLMo 1's LayerNorms have no parameters
        t["layers.post_attention_layernorm.weight"] = Param((La, D), ("layers", "embed"),
                                                            layers=full)
        t["layers.post_feedforward_layernorm.weight"] = Param((La, D), ("layers", "embed"),
                                                              layers=full)
        t["norm.weight"] = Param((D,), ("embed",))
    if not m.tie_embeddings:
        t["lm_head.weight"] = Param((V, D), ("vocab", "embed"), std["head"])
    return t


# OLMo Hybrid's init of A_log and dt_bias (HF's _init_weights for OlmoHybridGatedDeltaNet, from
# Mamba 2): a value head's decay rate A = exp(A_log) uniform in A_RANGE, its step dt log-uniform
# in DT_RANGE (at least DT_FLOOR), stored as dt_bias = softplus⁻¹(dt), so that at a = 0 the decay
# g = -A·softplus(dt_bias) = -A·dt. Init only: a loaded checkpoint brings its own
A_RANGE = (0.0, 16.0)
DT_RANGE = (0.001, 0.1)
DT_FLOOR = 1e-4


def a_log_init(key, shape):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, *A_RANGE))


def dt_bias_init(key, shape):
    low, high = math.log(DT_RANGE[0]), math.log(DT_RANGE[1])
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, low, high)), DT_FLOOR)
    return dt + jnp.log(-jnp.expm1(-dt))  # softplus⁻¹(dt) = log(exp(dt) - 1), without overflow


def linear_attention_table(m, std_in, std_out):
    """OLMo Hybrid's Gated DeltaNet weights (HF's linear_attn.*, as its checkpoints store them),
    stacked over the G layers, with the norms of those layers: pre-norm, as OLMoE, under the
    names attention_layer_norm and feedforward_layer_norm. K and N here: the linear layers' key
    and value heads, Hk and Hv their dims, W the conv's width."""
    D, kinds = m.d_model, m.layer_types()
    numbers = tuple(i for i, kind in enumerate(kinds) if kind == "G")
    Lg = len(numbers)
    K, N = m.linear_key_heads, m.linear_value_heads
    Hk, Hv = m.linear_key_head_dim, m.linear_value_head_dim
    W = m.linear_conv_kernel

    def one(shape, axes, std=None, decay=True):
        return Param((Lg, *shape), ("layers", *axes), std, decay, numbers)
    g = "layers.linear_attn."
    t = {g + "q_proj.weight": one((K * Hk, D), ("key_heads", "embed"), std_in),
         g + "k_proj.weight": one((K * Hk, D), ("key_heads", "embed"), std_in),
         g + "v_proj.weight": one((N * Hv, D), ("value_heads", "embed"), std_in),
         # β's and the decay's projections: one number per value head
         g + "a_proj.weight": one((N, D), ("value_heads", "embed"), std_in),
         g + "b_proj.weight": one((N, D), ("value_heads", "embed"), std_in),
         g + "g_proj.weight": one((N * Hv, D), ("value_heads", "embed"), std_in),  # the gate
         g + "o_proj.weight": one((D, N * Hv), ("embed", "value_heads"), std_out),
         # depthwise: channel c's W taps, PyTorch's Conv1d layout (C, 1, W) as HF stores it
         g + "q_conv1d.weight": one((K * Hk, 1, W), ("key_heads", "conv", "conv"), std_in),
         g + "k_conv1d.weight": one((K * Hk, 1, W), ("key_heads", "conv", "conv"), std_in),
         g + "v_conv1d.weight": one((N * Hv, 1, W), ("value_heads", "conv", "conv"), std_in),
         # per value head; no weight decay (Mamba's and FLA's _no_weight_decay)
         g + "A_log": one((N,), ("value_heads",), a_log_init, decay=False),
         g + "dt_bias": one((N,), ("value_heads",), dt_bias_init, decay=False),
         g + "o_norm.weight": one((Hv,), ("head_dim",)),  # one weight shared by every head
         "layers.attention_layer_norm.weight": one((D,), ("embed",)),
         "layers.feedforward_layer_norm.weight": one((D,), ("embed",))}
    return t


def count_params(m):
    return sum(math.prod(p.shape) for p in param_table(m).values())


def active_params(m):
    """The parameters one token is computed with: all but the experts the router did not choose
    (E - k of them per layer, each 3·F·D); count_params for a dense model."""
    unchosen = m.n_experts - m.experts_per_token if m.n_experts else 0
    return count_params(m) - m.n_layers * unchosen * 3 * m.mlp_hidden * m.d_model


def flops_per_token(m, T=None):
    """Training FLOPs per token at length T, OLMo-core's count: 6 per matmul weight a token
    passes (2 forward, 4 backward: the active parameters, the router's k experts of E) plus
    12·N·H per attended key per layer, T keys on a full layer (the causal mask not discounted)
    and min(W, T) on a sliding one. An OLMo Hybrid G layer has no keys: its delta rule's matmuls
    (delta_rule_chunked, per value head and token, forward) are C·Hk for each of q·kᵀ and β·k·kᵀ
    in its chunk of C, C·Hv for (q·kᵀ)·new, C·(Hk + Hv) for the triangular solves, and Hk·Hv
    for each of w·S, q·S and S's update, each 2 FLOPs, times 3 with the backward."""
    T = T or m.max_seq_len
    # all but the embedding lookup (a tied head still does its V·D matmul)
    matmul = active_params(m) - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    kinds = m.layer_types()
    keys = sum(min(m.sliding_window, T) if kind == "S" else T for kind in kinds if kind != "G")
    C, Hk, Hv = m.linear_chunk, m.linear_key_head_dim, m.linear_value_head_dim
    rule = 6 * m.linear_value_heads * (C * (3 * Hk + 2 * Hv) + 3 * Hk * Hv) * kinds.count("G")
    return 6 * matmul + 12 * m.n_heads * m.head_dim * keys + rule


def init_params(m, key, names=None):
    """fp32, truncated normal at ±3σ, norms 1; `names`: just those, with the same values as in a
    whole draw (the torch backend draws one tensor at a time)."""
    params = {}
    for k, (name, p) in zip(jax.random.split(key, len(param_table(m))), param_table(m).items()):
        if names is not None and name not in names:
            continue
        if p.std is None:
            params[name] = jnp.ones(p.shape, jnp.float32)
        elif callable(p.std):
            params[name] = p.std(k, p.shape)
        else:  # a per-layer std broadcasts along L
            std = jnp.asarray(p.std, jnp.float32).reshape((-1,) + (1,) * (len(p.shape) - 1))
            params[name] = jax.random.truncated_normal(k, -3.0, 3.0, p.shape, jnp.float32) * std
    return params


# Stacked axes: a stacked name ("layers.mlp.up_proj.weight") holds HF's tensors for every index
# of its leading axes, one leading axis per component of the name found in STACKED_AXES, in the
# name's order; HF's name puts each index right after that component. The dense model stacks one
# axis, its layers; an OLMoE's experts a second: "layers.mlp.experts.up_proj.weight" (L, E, F, D)
# <-> "layers.3.mlp.experts.5.up_proj.weight", the names its checkpoints store (transformers
# fuses them in memory only, as gate_up_proj (E, 2F, D), and saves them one by one again).
STACKED_AXES = ("layers", "experts")


def stacked_axes(name):
    """The stacked axes of a param_table name, in order: "layers.mlp.up_proj.weight" ->
    ["layers"]; "norm.weight" -> []."""
    return [part for part in name.split(".") if part in STACKED_AXES]


def layer_name(name, *index):
    """A stacked name and one index per stacked axis -> HF's name (without "model."):
    "layers.mlp.up_proj.weight", 3 -> "layers.3.mlp.up_proj.weight"."""
    for axis, i in zip(stacked_axes(name), index):
        name = name.replace(f"{axis}.", f"{axis}.{i}.", 1)
    return name


def hf_indices(name, p):
    """HF's index (layer number[, expert]) of each tensor stacked in param p, in the row-major
    order of its stacked axes: (0,), (1,), ... or, for an OLMo Hybrid kind's own weights, its
    layers' numbers (Param.layers); [()] for a name outside the layers."""
    lead = p.shape[:len(stacked_axes(name))]
    return [(p.layers[i[0]] if p.layers else i[0], *i[1:]) if i else () for i in np.ndindex(*lead)]


def stacked_tensor(state, name, p):
    """state's HF tensors of stacked param p as one numpy array of p's shape."""
    parts = [np.asarray(state[layer_name(name, *i)]) for i in hf_indices(name, p)]
    return np.stack(parts).reshape(p.shape)


def unstacked_tensors(name, value, p):
    """{HF name: numpy array} of stacked param p's value (any array type), one per HF index."""
    value = np.asarray(value)
    flat = value.reshape(-1, *value.shape[len(stacked_axes(name)):])  # the stacked axes as one
    return {layer_name(name, *i): part for i, part in zip(hf_indices(name, p), flat)}


def stack_layers(state, m):
    """Per-layer state dict (HF names, numpy or torch) -> stacked numpy params, as param_table."""
    return {name: stacked_tensor(state, name, p) for name, p in param_table(m).items()}


def unstack_layers(params, m):
    """Stacked params -> numpy arrays under HF's per-layer names, in the order of params."""
    table, out = param_table(m), {}
    for name, value in params.items():
        out.update(unstacked_tensors(name, value, table[name]))
    return out


def layer_arrays(m):
    """window (L,) int32, 0 = full; inv_freq (L, H/2) fp32; rope_scale (L,) fp32: what sliding
    and full layers differ by, as data. They are read per layer, not scanned: forward's scan step
    is one repeat of layer_pattern (OLMo 3: SSSF), so each layer in it gets its window as a Python
    int and attention builds only the blocks that window can see; forward_step and the PyTorch
    model loop over all L layers, indexing these."""
    H = m.head_dim
    # theta^(2i/H) by torch's fp32 pow, as HF (numpy's is off: 1e-2 rad at 65536)
    pos_freqs = m.rope_theta ** (torch.arange(0, H, 2, dtype=torch.float32, device="cpu") / H)
    plain = (1.0 / pos_freqs).numpy()
    if not m.rope_theta:  # no RoPE (OLMo Hybrid): every angle 0, so cos 1 and sin 0 rotate
        plain = np.zeros(H // 2, np.float32)  # nothing, exactly (x·1 + y·0 = x)
    full, full_scale = plain, 1.0
    if m.yarn_factor:
        full, full_scale = yarn_inv_freq(m, pos_freqs), m.yarn_attention_factor
    sliding = [kind == "S" for kind in m.layer_types()]  # else "F" or "G": full (G: unused)
    window = np.array([m.sliding_window if s else 0 for s in sliding], np.int32)
    inv_freq = np.stack([plain if s else full for s in sliding]).astype(np.float32)
    rope_scale = np.array([1.0 if s else full_scale for s in sliding], np.float32)
    return window, inv_freq, rope_scale


def yarn_inv_freq(m, pos_freqs):
    """YaRN's inv_freq (H/2,): HF's _compute_yarn_parameters (OLMo-core's YaRNRoPEScalingConfig),
    HF's fp32 operations in HF's order, so bit for bit. Dimensions turning more than beta_fast
    times over the original context keep their frequency, those turning fewer than beta_slow times
    are divided by factor, with a linear ramp between; the attention factor multiplies cos and sin
    (rope_cos_sin)."""
    H, theta, ctx = m.head_dim, m.rope_theta, m.yarn_original_max_seq_len

    def dim_for(rotations):  # the dimension turning `rotations` times over ctx
        return H * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(dim_for(m.yarn_beta_fast)), 0)
    high = min(math.ceil(dim_for(m.yarn_beta_slow)), H - 1)
    if low == high:
        high += 0.001  # HF's guard against 0 / 0
    dims = torch.arange(H // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: frequency unchanged, 0: divided by factor
    inv = (1.0 / (m.yarn_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv.numpy()


# === JAX ===

# --- matmuls, the embedding, norms and RoPE ---

def matmul_precision(dtype):
    """Exact fp32 matmuls; bf16: the default. JAX's default precision rounds fp32 operands on GPUs
    (TF32) and TPUs (bf16 passes), where torch's fp32 matmul is exact: the parity tests' 1e-5
    tolerance needs "highest"."""
    return jax.default_matmul_precision("highest" if jnp.dtype(dtype) == jnp.float32 else None)


def linear(x, w):
    """x (..., in) @ w (out, in).T -> (..., out) in x's dtype. The fp32 weight is cast to x's
    dtype where it is used, and the products are summed in fp32 before the cast back, as TPU and
    GPU matmul units do (on CPUs: the fast bf16 path, AMX). Its output is named "linear":
    remat="dots" keeps exactly these (forward's REMAT_DOTS)."""
    if w.dtype == jnp.uint16:  # bf16 held as its bits (CPU decode)
        return bits_linear(x, w)
    if x.dtype != jnp.float32:  # bf16 compute: the backward's dots in bf16 too
        return checkpoint_name(low_linear(x, w), "linear")
    with matmul_precision(x.dtype):
        y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return checkpoint_name(y.astype(x.dtype), "linear")


def sum_f32(spec, a, b):
    """einsum of a and b in their own dtype (bf16), summed and returned in fp32."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


# JAX's own transpose of an fp32-output dot casts its bf16 operands up: every backward matmul
# fp32 (TF32 on a GPU, half bf16's rate). Here each backward dot takes bf16 operands too.
@jax.custom_vjp
def low_linear(x, w):
    """linear for x in bf16 (or fp16): bf16 operands, fp32 sums, one rounding to x's dtype."""
    return sum_f32("...i,oi->...o", x, w.astype(x.dtype)).astype(x.dtype)


def low_linear_fwd(x, w):
    # w itself kept (the fp32 parameter, alive anyway), not a bf16 copy of it per layer
    return low_linear(x, w), (x, w)


def low_linear_bwd(saved, g):
    """g (..., out) in x's dtype -> (dx in x's dtype, dw in w's dtype: fp32 sums over all rows,
    never rounded to bf16 before the cross-device sum and the accumulation)."""
    x, w = saved
    dx = sum_f32("...o,oi->...i", g, w.astype(x.dtype)).astype(x.dtype)
    return dx, sum_f32("...o,...i->oi", g, x).astype(w.dtype)


low_linear.defvjp(low_linear_fwd, low_linear_bwd)


# bf16 weights as bits on a CPU: the CPU decode path (eval.cpu_bits) holds each bf16 matrix as its
# bits (uint16). XLA's CPU backend computes bf16 in fp32 and converts a bf16 weight whole before
# use: an fp32 copy of every matrix per token. Widened a few hundred rows at a time in a loop
# (bits_linear), each weight is read once a token, at memory speed, and never held in fp32; the
# embedding widens only the rows it reads.

def widen(bits):
    """bf16 bits (uint16) -> the same numbers in fp32 (its top half)."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


def bits_linear(x, w):
    """linear for w (out, in) held as bf16 bits: the same products, fp32 sums."""
    rows = math.gcd(w.shape[0], 512)  # a block of rows dividing `out`
    x32 = x.astype(jnp.float32)

    def block(i, y):  # rows i*rows.. of w, widened
        wi = widen(jax.lax.dynamic_slice_in_dim(w, i * rows, rows, 0))  # (rows, in)
        yi = jnp.einsum("...i,oi->...o", x32, wi, precision="highest")  # (..., rows)
        return jax.lax.dynamic_update_slice_in_dim(y, yi, i * rows, y.ndim - 1)
    y0 = jnp.zeros((*x.shape[:-1], w.shape[0]), jnp.float32)
    y = jax.lax.fori_loop(0, w.shape[0] // rows, block, y0)
    return y.astype(x.dtype)


def embed(w, tokens, dtype):
    """tokens (B, T) -> embedding rows (B, T, D) in dtype (bf16 bits: only these widened)."""
    x = w[tokens]
    return (widen(x) if x.dtype == jnp.uint16 else x).astype(dtype)


# exercise: rmsnorm
def rms_norm(x, w, eps):
    # HF Olmo2RMSNorm: weight times the normalised x in fp32, then cast (Llama casts first)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(x.dtype)


def layer_norm(x, eps):
    # OLMo 1: LayerNorm with no weight or bias, in fp32
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


# exercise: rope
def rope_cos_sin(positions, inv_freq, scale):
    """positions (T,) -> cos, sin (T, H) fp32; YaRN's attention factor multiplies both."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (T, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (T, H)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


# exercise: rope
def rope(x, cos, sin):
    """Half-split ("NeoX") rotation, as HF rotate_half; done in fp32. x (B, T, N, H)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


# --- attention: the masks, then softmax attention in query blocks (XLA, any device) ---
# One mask predicate, attention_mask: the XLA blocks, the KV cache, the torch bool masks and
# flex_attention's mask_mod all call it on positions that broadcast, so the off-by-one of the
# sliding window is written once for both backends.

def pad_t(x, n, **how):
    """x with n more positions at the end of axis 1 (T); how: jnp.pad's keyword arguments."""
    return jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2), **how)


# exercise: sliding_window
def attention_mask(i, j, window):
    """True where the query at position i may read the key at position j (arrays that broadcast,
    jnp or torch: (rows, 1) and (1, cols) give the mask): causal, and on sliding layers (window
    W > 0) only the last W keys, the query's own included."""
    return (j <= i) & ((window == 0) | (i - j < window))


@lru_cache(maxsize=None)
def keys_before(window):
    """How many keys before its own a query on a sliding layer of `window` reads. The KV cache and
    the device kernels (shard.py) take a span of keys where the XLA maths takes a mask, so the span
    is counted from attention_mask above: a window has one definition."""
    query = window  # far enough from the first position that only the window limits its keys
    keys = np.arange(query + 1)  # every key up to the query's own
    return int(attention_mask(query, keys, window).sum()) - 1


def segment_ids(tokens, eos):
    """tokens (B, T) -> (B, T) int32 document ids, each EOS ending (in) one (OLMo-core's
    doc_lens); a trailing run without an EOS is one more document; numpy for numpy. RoPE's
    positions are not restarted per document (Olmo 3 never did)."""
    xp = np if isinstance(tokens, np.ndarray) else jnp
    ends = (tokens == eos).astype(np.int32)
    return xp.cumsum(ends, axis=-1, dtype=np.int32) - ends


# exercise: gqa
def attend(q, k, v, seg, scale, first, lo, window):
    """Queries at positions first.. against keys at lo..: q (B, Tq, N, H), k and v (B, S, K, H) ->
    (B, Tq, N, H)."""
    q_pos, k_pos = first + jnp.arange(q.shape[1]), lo + jnp.arange(k.shape[1])
    mask = attention_mask(q_pos[:, None], k_pos[None, :], window)[None, None]  # (1, 1, Tq, S)
    if seg is not None:
        mask = mask & (seg[0][:, None, :, None] == seg[1][:, None, None, :])  # (B, 1, Tq, S)
    with matmul_precision(q.dtype):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)


# exercise: gqa
def attend_in_blocks(q, k, v, window, scale, segments=None, offset=0):
    """Softmax attention on XLA (any device): q (B, Tq, N, H), k and v (B, S, K, H) ->
    (B, Tq, N, H); query head n reads kv head n // (N/K). window: a Python int, 0 = full causal;
    segments (B, S): document ids or None; offset: q's first position among the keys (traced for a
    context-parallel shard). Past Q_BLOCK queries go in blocks under lax.map, each recomputed in the
    backward and reading only the keys it can see: no (N, Tq, S) scores kept (docs/backends.md)."""
    Tq, S = q.shape[1], k.shape[1]
    t_slice = partial(jax.lax.dynamic_slice_in_dim, axis=1)  # (x, start, size) on T
    if Tq <= Q_BLOCK and isinstance(offset, int):  # one block, of the keys it can see
        lo = max(0, offset - window + 1) if window else 0
        end = offset + Tq
        seg = None if segments is None else (segments[:, offset:end], segments[:, lo:end])
        return attend(q, k[:, lo:end], v[:, lo:end], seg, scale, offset, lo, window)
    step = min(Tq, Q_BLOCK, window // 2 or Q_BLOCK)
    n = -(-Tq // step) * step  # queries padded to whole blocks (cut at the end)
    q = pad_t(q, n - Tq)
    qseg = None if segments is None else pad_t(t_slice(segments, offset, Tq), n - Tq, mode="edge")
    size = min(S, step + window - 1) if window else S

    def one(first):
        lo = jnp.clip(offset + first - window + 1, 0, S - size) if window else 0
        cut = partial(t_slice, start_index=lo, slice_size=size)
        seg = None if segments is None else (t_slice(qseg, first, step), cut(segments))
        q_block = t_slice(q, first, step)
        return attend(q_block, cut(k), cut(v), seg, scale, offset + first, lo, window)

    out = jax.lax.map(jax.checkpoint(one), jnp.arange(0, n, step))  # (n / step, B, step, N, H)
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)[:, :Tq]


# --- the layer: QKV projection, attention sublayer, MLP, block ---

# exercise: qk_norm
def project_qkv(p, x, cos, sin, m):
    """x (B, T, D) -> q (B, T, N, H), k and v (B, T, K, H), RoPE applied."""
    B, T, _ = x.shape
    q = linear(x, p["self_attn.q_proj.weight"])  # (B, T, N*H)
    k = linear(x, p["self_attn.k_proj.weight"])  # (B, T, K*H)
    v = linear(x, p["self_attn.v_proj.weight"])  # (B, T, K*H)
    if "self_attn.q_norm.weight" in p:  # OLMo 2/3 QK-norm: over the whole width, before the split
        q = rms_norm(q, p["self_attn.q_norm.weight"], m.norm_eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], m.norm_eps)
    if m.clip_qkv:  # OLMo 1.7 and OLMoE: clamped after the QK-norm (OLMo 1 has none), before RoPE
        q, k, v = (jnp.clip(t, -m.clip_qkv, m.clip_qkv) for t in (q, k, v))
    q = rope(q.reshape(B, T, m.n_heads, m.head_dim), cos, sin)  # (B, T, N, H)
    k = rope(k.reshape(B, T, m.n_kv_heads, m.head_dim), cos, sin)  # (B, T, K, H)
    v = v.reshape(B, T, m.n_kv_heads, m.head_dim)  # (B, T, K, H)
    return q, k, v


def attention(p, x, cos, sin, window, m, segments=None, attend_fn=None):
    """Attention over the sequence itself: x (B, T, D) -> (B, T, D)."""
    B, T, _ = x.shape
    q, k, v = project_qkv(p, x, cos, sin, m)
    if attend_fn is None:
        # The plain XLA maths, on any device. The device kernels (splash, cuDNN) are picked in
        # shard.py, where the device is known: shard.attention on a mesh, shard.ATTEND and
        # shard.pick_attention for one device (eval.py)
        attend_fn = attend_in_blocks
    documents = () if segments is None else (segments,)
    y = attend_fn(q, k, v, window, m.head_dim ** -0.5, *documents)  # (B, T, N, H)
    return linear(y.reshape(B, T, m.n_heads * m.head_dim), p["self_attn.o_proj.weight"])


# The feed-forward, ffn(p, x) -> (y (B, T, D), terms): terms is a dict {name: scalar} of auxiliary
# loss terms. forward sums each over the layers (add_terms) and the training step adds it to the
# loss (train.step_loss), divided by the step's global count as the loss's own sums are. The dense
# MLP has none: its {} adds no operation. A mixture of experts (moe, below) returns the two
# losses of its router, each times its weight and summed over the batch's positions, and the load
# of its experts (the one term kept per layer, not summed: LOAD).
def mlp(p, x):
    """SwiGLU: x (B, T, D) -> (down(silu(gate(x)) · up(x)) (B, T, D), no auxiliary loss terms)."""
    gate = linear(x, p["mlp.gate_proj.weight"])  # (B, T, F)
    up = linear(x, p["mlp.up_proj.weight"])  # (B, T, F)
    return linear(jax.nn.silu(gate) * up, p["mlp.down_proj.weight"]), {}  # (B, T, D)


# --- the mixture of experts (OLMoE, FlexOlmo): a router and E SwiGLU experts for the MLP ---
# Each token goes to the k experts its router likes best and leaves with their outputs' sum, each
# weighted by the router's probability for it: E experts' parameters, k experts' work a token.

LOAD = "expert load"  # (E,) per layer: the (token, expert) pairs each expert took in the batch


# exercise: router
def route(p, x, m):
    """The router (HF's mlp.gate, OLMo-core's MoELinearRouter): x (B, T, D) -> (logits and their
    softmax probs (B, T, E), weights (B, T, k), experts (B, T, k) int32), fp32. The softmax
    runs over all E experts first, in fp32, and the k most probable are taken after it (a
    softmax over the k largest logits alone would make every token's weights sum to 1); they
    are renormalised to sum 1 only if norm_topk_prob, so OLMoE's and FlexOlmo's weights sum to
    less than 1."""
    logits = linear(x, p["mlp.gate.weight"]).astype(jnp.float32)  # (B, T, E)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, m.experts_per_token)  # (B, T, k) each
    if m.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return logits, probs, weights, experts


def experts_dense(p, x, weights, experts, m):
    """Every expert on every token, each output times the token's weight for that expert, 0 where
    the router did not choose it: x (B, T, D) -> (B, T, D). The sum in its plainest form, at E/k
    times the work of the chosen experts alone: the reference experts_grouped is checked against
    (moe_compute = "dense")."""
    E, f32 = m.n_experts, jnp.float32
    # each token's weight per expert, 0 for the E - k it was not sent to
    share = (jax.nn.one_hot(experts, E, dtype=f32) * weights[..., None]).sum(-2)  # (B, T, E)

    def w(name):  # (E, out, in), cast to the compute dtype where it is used (as linear)
        return p[f"mlp.experts.{name}.weight"].astype(x.dtype)
    with matmul_precision(x.dtype):
        gate = jnp.einsum("btd,efd->btef", x, w("gate_proj"), preferred_element_type=f32)
        up = jnp.einsum("btd,efd->btef", x, w("up_proj"), preferred_element_type=f32)
        h = jax.nn.silu(gate.astype(x.dtype)) * up.astype(x.dtype)  # (B, T, E, F)
        y = jnp.einsum("btef,edf,bte->btd", h, w("down_proj"), share.astype(x.dtype),
                       preferred_element_type=f32)  # (B, T, D)
    return y.astype(x.dtype)


# ragged_dot_general's layout for rows (M, in) in groups and weights (E, out, in), our (out, in)
# layout: rows' dim 1 meets the weights' dim 2, rows are ragged on dim 0, the group is dim 0
GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def grouped_linear(x, w, sizes):
    """linear per group: rows x (M, in) in consecutive groups of sizes (E,) rows, group e through
    w[e] (out, in) -> (M, out) in x's dtype, fp32 sums. One call for all E experts: the matmul
    unit sees E problems of uneven sizes at once (XLA's grouped GEMM on GPUs, the MXU on TPUs),
    not E small ones."""
    with matmul_precision(x.dtype):
        y = jax.lax.ragged_dot_general(x, w.astype(x.dtype), sizes, GROUPED,
                                       preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def grouped_swiglu(p, rows, sizes):
    """Each expert's SwiGLU on its own rows: rows (M, D) sorted into consecutive groups, sizes
    (E,) rows for each expert in turn -> (M, D). Rows past sum(sizes) belong to no expert (the
    padding of shard.dispatch_to_experts); nothing reads their outputs."""
    gate = grouped_linear(rows, p["mlp.experts.gate_proj.weight"], sizes)  # (M, F)
    up = grouped_linear(rows, p["mlp.experts.up_proj.weight"], sizes)  # (M, F)
    return grouped_linear(jax.nn.silu(gate) * up, p["mlp.experts.down_proj.weight"], sizes)


def experts_grouped(p, x, weights, experts, m):
    """The chosen experts only: the B·T·k (token, expert) pairs sorted by expert, so that each
    expert's rows sit together, one grouped_linear per projection, then each row times its
    weight and added back to its token: x (B, T, D) -> (B, T, D), k experts' work a token."""
    (B, T, D), k = x.shape, m.experts_per_token
    chosen = experts.reshape(-1)  # (B·T·k,): pair i is token i // k's (i % k)-th choice
    order = jnp.argsort(chosen, stable=True)  # the pairs, expert 0's first
    token = order // k  # (B·T·k,): the token of each sorted pair
    rows = x.reshape(B * T, D)[token]  # (B·T·k, D)
    sizes = jnp.bincount(chosen, length=m.n_experts).astype(jnp.int32)  # (E,) rows per expert
    out = grouped_swiglu(p, rows, sizes)  # (B·T·k, D)
    out = out * weights.reshape(-1)[order, None].astype(out.dtype)
    return jnp.zeros((B * T, D), out.dtype).at[token].add(out).reshape(B, T, D)


def experts_function(m):
    """The experts_fn moe_compute names. auto: grouped where ragged_dot has a kernel of its own
    (GPUs, TPUs), dense on a CPU, where XLA runs a ragged_dot as one dense dot of every pair
    against all E experts' weights, masked: k times experts_dense's work (`python tests/bench.py
    moe`). platform_dependent picks when the step is lowered, for the platform it is lowered for."""
    if m.moe_compute != "auto":
        return experts_dense if m.moe_compute == "dense" else experts_grouped

    def auto(p, x, weights, experts, m):
        return jax.lax.platform_dependent(p, x, weights, experts, cpu=partial(experts_dense, m=m),
                                          default=partial(experts_grouped, m=m))
    return auto


def router_losses(probs, lse, load, m):
    """OLMo-core's two router losses of one layer (nn/moe/loss.py, local_batch granularity),
    each times its weight / L (MoEConfig's scale_loss_by_num_layers: summed over the layers, the
    weight times the mean layer's loss), as a sum over positions that train.step_loss divides by
    the step's target count (OLMo-core's loss_div_factor); and LOAD. probs (B·T, E) fp32, lse
    (B·T,) the logits' logsumexp, load (E,) the pairs each expert took; jnp or torch.
    - load balancing: E/k · Σ_e load_e · mean over positions of p_e. Least (1 · positions) when
      tokens and probabilities spread evenly; its gradient flows through p only (the load is a
      count), lowering the probability of the experts that took the most tokens;
    - router z-loss: Σ over positions of logsumexp(logits)², which keeps the logits small."""
    E, k, L = m.n_experts, m.experts_per_token, m.n_layers
    terms = {LOAD: load}
    if m.lb_loss:
        terms["load balancing loss"] = m.lb_loss / L * E / k * (load * probs.mean(0)).sum()
    if m.router_z_loss:
        terms["router Z loss"] = m.router_z_loss / L * (lse ** 2).sum()
    return terms


def moe(p, x, m, experts_fn=None):
    """The mixture of experts, the MLP of olmoe and flex_olmo: x (B, T, D) -> (Σ over the token's
    k chosen experts e of weight_e · SwiGLU_e(x) (B, T, D), router_losses' terms). experts_fn(p,
    x, weights, experts, m): how the chosen experts are computed, the function shard.experts
    returns on a mesh (each device's own tokens under shard_map); default: the function that
    experts_function picks."""
    logits, probs, weights, experts = route(p, x, m)
    experts_fn = experts_fn or experts_function(m)
    E = m.n_experts
    load = jnp.bincount(experts.reshape(-1), length=E)  # (E,)
    terms = router_losses(probs.reshape(-1, E), jax.nn.logsumexp(logits, -1).reshape(-1), load, m)
    mine = {k: w for k, w in p.items() if k.startswith("mlp.experts.")}  # (E, ...) each
    return experts_fn(mine, x, weights, experts, m), terms


def feed_forward(m, experts_fn=None):
    """The layer's feed-forward ffn(p, x) -> (y, terms): the MLP, or the mixture of experts."""
    return partial(moe, m=m, experts_fn=experts_fn) if m.n_experts else mlp


def add_terms(total, terms):
    """Two dicts of auxiliary loss terms summed name by name (jnp or torch); a name not yet in
    total is taken as it is, so nothing is added to a zero. LOAD is not summed: total holds a
    list of the layers' loads, in order, which forward stacks to (L, E)."""
    out = dict(total)
    for name, value in terms.items():
        if name == LOAD:
            out[name] = out.get(name, []) + [value]
        else:
            out[name] = out[name] + value if name in out else value
    return out


# exercise: rmsnorm
def block(p, x, attn, m, ffn=None):
    """One layer: x (B, T, D) -> (x (B, T, D), the feed-forward's auxiliary loss terms). attn(h) ->
    (B, T, D) is the sequence mixer: attention over the sequence itself in training, over a KV
    cache in generation (forward_step); on OLMo Hybrid's G layers the gated delta rule. ffn(p, h)
    -> ((B, T, D), terms) is the feed-forward (default: the one feed_forward picks)."""
    ffn = ffn or feed_forward(m)
    if "attention_layer_norm.weight" in p:  # OLMo Hybrid's G layers: pre-norm, OLMoE's order
        x = x + attn(rms_norm(x, p["attention_layer_norm.weight"], m.norm_eps))
        y, terms = ffn(p, rms_norm(x, p["feedforward_layer_norm.weight"], m.norm_eps))
        return x + y, terms
    if m.family == "olmo1":  # pre-norm
        x = x + attn(layer_norm(x, m.norm_eps))
        y, terms = ffn(p, layer_norm(x, m.norm_eps))
        return x + y, terms
    if m.family == "olmoe":  # pre-norm, Llama's order: RMSNorm on each sublayer's input
        x = x + attn(rms_norm(x, p["input_layernorm.weight"], m.norm_eps))
        y, terms = ffn(p, rms_norm(x, p["post_attention_layernorm.weight"], m.norm_eps))
        return x + y, terms
    # OLMo 2/3 (and OLMo Hybrid's attention layers): RMSNorm on each sublayer's output, before
    # the add (none on its input)
    x = x + rms_norm(attn(x), p["post_attention_layernorm.weight"], m.norm_eps)
    y, terms = ffn(p, x)
    return x + rms_norm(y, p["post_feedforward_layernorm.weight"], m.norm_eps), terms


# --- the gated delta rule: OLMo Hybrid's linear attention (the G layers) ---
# A linear-attention layer keeps, per value head, a state S (Hk, Hv): a map from keys to values
# that each token first decays, by exp(g_t) (g_t <= 0), then corrects where it mispredicts the
# token's value (the delta rule, a step of learning rate β_t on ||S^T k_t - v_t||²):
#     S_t = S_{t-1} exp(g_t) + β_t k_t (v_t - S_{t-1}^T k_t exp(g_t))^T
#     o_t = S_t^T q_t / sqrt(Hk)
# (Hk: key head dim, Hv: value head dim; q and k L2-normalised first). With ||k_t|| = 1 the update
# is S ← (I - β_t k_t k_tᵀ) S exp(g_t) + β_t k_t v_tᵀ, and I - β k kᵀ scales the direction k by
# 1 - β: β in (0, 1) shrinks it, β in (1, 2) (linear_neg_eigval) flips its sign too. Written twice:
# token by token (the definition, which generation steps) and in chunks of tokens (matmuls, for
# training), equal to rounding (tests/test_hybrid.py, against transformers' torch references).


def l2_normalize(x, eps=1e-6):
    """x / sqrt(Σ x² + eps) over the last axis, in fp32 (FLA's l2norm, which HF copies)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def value_heads(x, n):
    """(B, T, heads, ...) -> (B, T, n, ...): each key head serves n // heads consecutive value
    heads (grouped value heads, as GQA's kv heads serve query heads)."""
    return jnp.repeat(x, n // x.shape[2], axis=2)


# exercise: delta_rule
def delta_rule_recurrent(q, k, v, g, beta, state=None):
    """The definition, one token at a time: q, k (B, T, K, Hk) as projected (L2-normalised here,
    as FLA's kernel does with use_qk_l2norm_in_kernel), v (B, T, N, Hv), g and beta (B, T, N) ->
    (o (B, T, N, Hv), the final state (B, N, Hk, Hv)), fp32; N value heads, K key heads (N a
    multiple of K). state: the state before the first token (default zeros)."""
    B, T, N, Hv = v.shape
    q, k = l2_normalize(q), l2_normalize(k)
    q, k = value_heads(q, N), value_heads(k, N)  # (B, T, N, Hk)
    q = q * q.shape[-1] ** -0.5
    f32 = [a.astype(jnp.float32) for a in (q, k, v, g, beta)]
    state = jnp.zeros((B, N, k.shape[-1], Hv), jnp.float32) if state is None else state

    def step(S, t):  # S (B, N, Hk, Hv); t: this token's q, k (B, N, Hk), v (B, N, Hv), g, beta
        q_t, k_t, v_t, g_t, b_t = t
        S = S * jnp.exp(g_t)[..., None, None]  # decay first
        predicted = jnp.einsum("bnkv,bnk->bnv", S, k_t)  # what S says k_t's value is
        S = S + jnp.einsum("bnk,bnv->bnkv", k_t, b_t[..., None] * (v_t - predicted))
        return S, jnp.einsum("bnkv,bnk->bnv", S, q_t)
    tokens = [jnp.moveaxis(a, 1, 0) for a in f32]  # time first, for the scan
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state  # (B, T, N, Hv)


@jax.custom_vjp
def unit_lower_inverse(A):
    """(I + A)⁻¹ for A (..., C, C) strictly lower triangular, by forward substitution: row i of
    the inverse is e_i - Σ_{j<i} A_ij (row j of it), the rows after i still zero. Not
    jax.scipy.linalg.solve_triangular: in its backward XLA's CPU runtime deadlocks when several
    programs run at once (8 fake devices, or a busy test worker: the whole process then waits
    forever). FLA's kernels, and transformers' export path, invert the same way."""
    C = A.shape[-1]
    eye = jnp.eye(C, dtype=A.dtype)

    def row(i, inverse):
        r = eye[i] - jnp.einsum("...j,...jc->...c", A[..., i, :], inverse)
        return inverse.at[..., i, :].set(r)
    return jax.lax.fori_loop(0, C, row, jnp.zeros_like(A))


def unit_lower_inverse_fwd(A):
    inverse = unit_lower_inverse(A)
    return inverse, inverse


def unit_lower_inverse_bwd(inverse, grad):
    """d(M⁻¹) = -M⁻¹ dM M⁻¹, so A's gradient is -M⁻ᵀ grad M⁻ᵀ on its strictly lower part (a
    backward through the loop would keep all C of its steps' rows)."""
    t = jnp.swapaxes(inverse, -1, -2)
    return (jnp.tril(-(t @ grad @ t), -1),)


unit_lower_inverse.defvjp(unit_lower_inverse_fwd, unit_lower_inverse_bwd)


def delta_rule_chunked(q, k, v, g, beta, chunk=64, state=None):
    """delta_rule_recurrent's output and final state, C = chunk tokens at a time: within a chunk
    the C corrections depend on each other only through a unit lower-triangular system (the "UT
    transform" of DeltaNet), solved once; between chunks the state is carried as in the
    recurrent form. Work linear in T, in (C, C) and (C, Hk) matmuls."""
    B, T, N, Hv = v.shape
    q, k = l2_normalize(q), l2_normalize(k)
    q, k = value_heads(q, N), value_heads(k, N)
    Hk = k.shape[-1]
    q = q * Hk ** -0.5
    pad = -T % chunk  # (padded tokens: g = 0, beta = 0, no update; their outputs cut)

    def chunks(a):  # (B, T, N, ...) -> (T/C, B, N, C, ...), fp32
        a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(B, -1, chunk, *a.shape[2:])  # (B, T/C, C, N, ...)
        return jnp.moveaxis(jnp.moveaxis(a, 3, 2), 1, 0)
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))  # (T/C, B, N, C[, H])
    decay = jnp.cumsum(g, -1)  # (T/C, B, N, C): log of the decay from the chunk's start to i
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    # exp(decay_i - decay_j): the decay between positions j <= i of a chunk, 0 above the diagonal;
    # the exponent there is set to 0 before the exp: positive, it could overflow to inf (and inf
    # times 0 is NaN, in the gradient too)
    gap = jnp.where(causal, decay[..., :, None] - decay[..., None, :], 0.0)
    between = jnp.where(causal, jnp.exp(gap), 0.0)  # (T/C, B, N, C, C)
    kb, vb = k * beta[..., None], v * beta[..., None]
    # Unit lower-triangular A: A_ij = β_i k_i·k_j exp(decay_i - decay_j) below the diagonal; the
    # corrections u (and the decayed keys w) solve (I + A) u = β v, (I + A) w = β k exp(decay)
    A = jnp.einsum("...ik,...jk->...ij", kb, k) * between * ~jnp.eye(chunk, dtype=bool)
    inverse = unit_lower_inverse(A)  # (T/C, B, N, C, C)
    u = inverse @ vb  # (T/C, B, N, C, Hv)
    w = inverse @ (kb * jnp.exp(decay)[..., None])  # (T/C, B, N, C, Hk)
    within = jnp.einsum("...ik,...jk->...ij", q, k) * between  # (T/C, B, N, C, C)
    state = jnp.zeros((B, N, Hk, Hv), jnp.float32) if state is None else state

    def step(S, c):  # S (B, N, Hk, Hv) before the chunk
        q, k, u, w, within, decay = c
        new = u - w @ S  # the chunk's corrections, the old state's predictions removed
        o = (q * jnp.exp(decay)[..., None]) @ S + within @ new  # (B, N, C, Hv)
        last = decay[..., -1:]  # (B, N, 1): the whole chunk's decay
        S = S * jnp.exp(last)[..., None] + jnp.einsum(
            "bnck,bncv->bnkv", k * jnp.exp(last - decay)[..., None], new)
        return S, o
    state, o = jax.lax.scan(step, state, (q, k, u, w, within, decay))  # o (T/C, B, N, C, Hv)
    o = jnp.moveaxis(o, 0, 1).swapaxes(2, 3).reshape(B, -1, N, Hv)  # (B, T + pad, N, Hv)
    return o[:, :T], state


# The layer around the rule (HF's OlmoHybridGatedDeltaNet, OLMo-core's GatedDeltaNet): from x,
# q, k and v by projections, each through a short causal convolution and SiLU (a few tokens of
# local context before the rule mixes the rest); β and the decay g per token and value head from
# two more projections; the rule (which L2-normalises q and k, so that β alone sets the size of
# the update); its output RMS-normed per head, gated by SiLU(g_proj(x)) and projected back to D.
O_NORM_EPS = 1e-5  # the output norm's eps: FLA's FusedRMSNormGated default, which HF keeps


def causal_conv(x, w, before=None):
    """The depthwise causal convolution and SiLU: x (B, T, C), w (C, 1, W) -> (y (B, T, C), the
    last W - 1 inputs (B, W - 1, C): generation's window). y_t mixes each channel's own
    x_{t-W+1..t}, tap j taking x_{t-W+1+j}; before: the W - 1 inputs before x (default zeros:
    the sequence starts here). In fp32, as HF (its conv runs in the fp32 weight's dtype)."""
    (B, T, C), W = x.shape, w.shape[-1]
    before = jnp.zeros((B, W - 1, C), x.dtype) if before is None else before.astype(x.dtype)
    seen = jnp.concatenate([before, x], axis=1)  # (B, W - 1 + T, C)
    taps = w[:, 0, :].astype(jnp.float32)  # (C, W)
    y = sum(seen[:, j:j + T].astype(jnp.float32) * taps[:, j] for j in range(W))
    return jax.nn.silu(y).astype(x.dtype), seen[:, T:]


def gated_deltanet(p, x, m, state=None):
    """A G layer's sequence mixer: x (B, T, D) -> (y (B, T, D), its state after x: the conv
    windows q, k, v (B, W - 1, channels) and the rule's S (B, N, Hk, Hv)). state: the same from
    before x (generation), None at a sequence's start. Here K and N are the linear layers' key
    and value heads, Hk and Hv their dims. T = 1 (a generated token) steps the recurrent form,
    longer x the chunked one."""
    B, T, _ = x.shape
    K, N = m.linear_key_heads, m.linear_value_heads
    Hk, Hv = m.linear_key_head_dim, m.linear_value_head_dim
    state = state or {}
    new, qkv = {}, []
    for n in "qkv":
        h = linear(x, p[f"linear_attn.{n}_proj.weight"])  # (B, T, K·Hk) or (B, T, N·Hv)
        h, new[n] = causal_conv(h, p[f"linear_attn.{n}_conv1d.weight"], state.get(n))
        qkv.append(h)
    q, k = qkv[0].reshape(B, T, K, Hk), qkv[1].reshape(B, T, K, Hk)  # (B, T, K, Hk)
    v = qkv[2].reshape(B, T, N, Hv)  # (B, T, N, Hv)
    b = linear(x, p["linear_attn.b_proj.weight"]).astype(jnp.float32)  # (B, T, N)
    beta = jax.nn.sigmoid(b)
    if m.linear_neg_eigval:
        beta = 2 * beta
    # g = -A·dt <= 0: A = exp(A_log) the head's decay rate, dt = softplus(a + dt_bias) > 0 the
    # token's step (Mamba 2's discretisation), so exp(g) in (0, 1] decays S
    dt = jax.nn.softplus(linear(x, p["linear_attn.a_proj.weight"]).astype(jnp.float32)
                         + p["linear_attn.dt_bias"])
    g = -jnp.exp(p["linear_attn.A_log"].astype(jnp.float32)) * dt  # (B, T, N)
    with matmul_precision(jnp.float32):  # the rule in fp32 whatever dtype is (HF's too)
        if T == 1 and state:
            o, new["S"] = delta_rule_recurrent(q, k, v, g, beta, state["S"])
        else:
            o, new["S"] = delta_rule_chunked(q, k, v, g, beta, m.linear_chunk, state.get("S"))
    gate = linear(x, p["linear_attn.g_proj.weight"]).reshape(B, T, N, Hv)
    o = rms_norm(o, p["linear_attn.o_norm.weight"], O_NORM_EPS)  # (B, T, N, Hv) fp32, per head
    o = (o * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
    return linear(o.reshape(B, T, N * Hv), p["linear_attn.o_proj.weight"]), new


def linear_state_shapes(m, B):
    """The shapes of a G layer's state for B sequences: gated_deltanet's conv windows q, k, v
    (B, W - 1, channels) and S (B, N, Hk, Hv); none grows with the sequence."""
    W, K, N = m.linear_conv_kernel, m.linear_key_heads, m.linear_value_heads
    Hk, Hv = m.linear_key_head_dim, m.linear_value_head_dim
    return dict(q=(B, W - 1, K * Hk), k=(B, W - 1, K * Hk), v=(B, W - 1, N * Hv),
                S=(B, N, Hk, Hv))


def new_linear_state(m, B, dtype=jnp.float32):
    """A G layer's state at a sequence's start: zeros, the conv windows in dtype, S in fp32."""
    return {n: jnp.zeros(shape, jnp.float32 if n == "S" else dtype)
            for n, shape in linear_state_shapes(m, B).items()}


# --- forward, head and losses ---

def pattern_slots(m):
    """{stacked name: the layer_pattern positions whose layers have it}: every position, or those
    of its kind (OLMo Hybrid's "GGGF": linear_attn.* at [0, 1, 2], self_attn.* at [3])."""
    P = len(m.layer_pattern)
    return {name: list(range(P)) if p.layers is None else sorted({i % P for i in p.layers})
            for name, p in param_table(m).items() if name.startswith("layers.")}


def one_layer(params, m, i):
    """Layer i's weights (names without "layers."): row i of the stacked params every layer has,
    and of its kind's own (Param.layers), its row there."""
    table, out = param_table(m), {}
    for name, w in params.items():
        p = table[name]
        if name.startswith("layers.") and (p.layers is None or i in p.layers):
            out[name[len("layers."):]] = w[i if p.layers is None else p.layers.index(i)]
    return out


# remat="dots": MaxText's "minimal" (dots_with_no_batch_dims_saveable), by name: linear's bf16
# matmul is a custom_vjp, which that policy does not see as a dot (it would keep nothing)
REMAT_DOTS = jax.checkpoint_policies.save_only_these_names("linear")


def forward(params, tokens, m, dtype=jnp.float32, remat="none", constrain=lambda x: x,
            segments=None, positions=None, attend_fn=None, head=True, scan_layers=True,
            experts_fn=None):
    """tokens (B, T) int, each < V (else clamped: check_tokens) -> logits (B, T, V) in dtype. If
    not head, the training step's form: (the last layer's output (B, T, D), the feed-forward's
    auxiliary loss terms summed over the layers), the head left to token_logps, in chunks.
    constrain pins each layer's output; segments (B, T): document ids; positions (T,): RoPE's
    positions (default 0..T-1); attend_fn: the function shard.attention returns, which runs a
    kernel on each device's own instances and heads or gathers keys for context parallelism
    (default: the one attention picks); the maths here does not change with it, nor with
    experts_fn (the experts function of moe, from shard.experts on a mesh). remat: what the
    backward keeps of each layer: "none" all, "block" its input only (the backward reruns the
    layer), "mlp" all but the insides of the MLP (rerun), "dots" the projections (REMAT_DOTS)."""
    x = constrain(embed(params["embed_tokens.weight"], tokens, dtype))  # (B, T, D)
    positions = jnp.arange(tokens.shape[1]) if positions is None else positions
    if segments is not None and "G" in m.layer_pattern:
        raise ValueError("data.doc_mask: OLMo Hybrid's Gated DeltaNet layers would carry their "
                         "state S across documents (resetting it at each document's start is not "
                         "implemented here): train with data.doc_mask=false")
    # A scan step is one layer_pattern, so windows are Python ints (as data: every block computed)
    P = len(m.layer_pattern)
    window, inv_freq, rope_scale = layer_arrays(m)
    ropes = [rope_cos_sin(positions, inv_freq[i], rope_scale[i]) for i in range(P)]
    slots, groups = pattern_slots(m), {}
    for name, w in params.items():  # (L, ...) -> (L/P, the pattern's layers that have it, ...)
        if name.startswith("layers."):
            groups[name[len("layers."):]] = w.reshape(-1, len(slots[name]), *w.shape[1:])

    ffn = feed_forward(m, experts_fn)
    ffn = jax.checkpoint(ffn) if remat == "mlp" else ffn

    def layer(p, x, cos, sin, segments, w, kind):  # -> (x, terms), as block
        def mixer(h):
            if kind == "G":
                return gated_deltanet(p, h, m)[0]
            return attention(p, h, cos, sin, w, m, segments, attend_fn)
        return block(p, x, mixer, m, ffn)
    if remat == "block":  # keeps each layer's input only: the backward reruns its forward
        layer = jax.checkpoint(layer, static_argnums=(5, 6))
    if remat == "dots":  # keeps the projections' outputs: reruns norms, RoPE, SwiGLU, attention
        layer = jax.checkpoint(layer, static_argnums=(5, 6), policy=REMAT_DOTS)

    def step(x, group):  # compile time grows with P, not L
        terms = {}  # the P layers' auxiliary loss terms, summed (their LOADs: a list of P)
        for i, kind in enumerate(m.layer_pattern):
            p = {name: w[slots["layers." + name].index(i)] for name, w in group.items()
                 if i in slots["layers." + name]}
            x, layer_terms = layer(p, x, *ropes[i], segments, int(window[i]), kind)
            x = constrain(x)
            terms = add_terms(terms, layer_terms)
        return x, terms

    x, stacked = jax.lax.scan(step, x, groups, unroll=not scan_layers)  # each term (L/P,)
    terms = {name: t.sum(0) for name, t in stacked.items() if name != LOAD}
    if LOAD in stacked:  # P of (L/P, E): layer g·P + i's load at [i][g]
        terms[LOAD] = jnp.stack(stacked[LOAD], 1).reshape(m.n_layers, m.n_experts)  # (L, E)
    if not head:
        return x, terms
    return unembed(params, x, m)


def unembed(params, x, m):
    """The final norm and the head: x (B, T, D) -> (B, T, V)."""
    olmo1 = m.family == "olmo1"
    x = layer_norm(x, m.norm_eps) if olmo1 else rms_norm(x, params["norm.weight"], m.norm_eps)
    return linear(x, params["embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"])


def label_logps(logits, labels, temperature=1.0):
    """logits (B, T, V), labels (B, T) -> (log p(label), logsumexp), (B, T) fp32 each; log p 0 at
    IGNORE_INDEX. Every loss is written on these two: the losses sum log p(label) and z-loss
    squares the logsumexp, so the (B, T, V) logits need not outlive the head (token_logps), and
    the torch backend takes the same two from its logits (label_logps_torch). temperature: GRPO's
    sampling temperature, which divides the logits so that p is the policy its rollouts came from
    (open-instruct, TRL)."""
    logits = logits.astype(jnp.float32) / temperature
    lse, valid = jax.nn.logsumexp(logits, axis=-1), labels != IGNORE_INDEX
    target = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, target - lse, 0.0), lse


# exercise: z_loss
def cross_entropy_of(logp, lse, labels, n, z_loss=0.0, xp=jnp):
    """(loss, ce, z) from label_logps' logp and lse (B, T): ce = -sum(logp) / n and
    z = sum(lse²) / n over the targets (labels != IGNORE_INDEX), loss = ce + z_loss * z; n: the
    batch's target count or the global batch's (train.step_loss); xp: jnp or torch.
    z keeps the softmax's normaliser near 1."""
    ce = -logp.sum() / n
    z = xp.where(labels != IGNORE_INDEX, lse * lse, 0.0).sum() / n
    return ce + z_loss * z, ce, z


def cross_entropy(logits, labels, z_loss=0.0, logps=label_logps, xp=jnp):
    """cross_entropy_of over this batch's (shifted) targets: (loss, ce, z)."""
    n = (labels != IGNORE_INDEX).sum().clip(min=1)
    return cross_entropy_of(*logps(logits, labels), labels, n, z_loss, xp)


def token_logps(params, x, labels, m, chunks=1, temperature=1.0):
    """label_logps (B, T) of the last layer's output x (B, T, D), the head in `chunks` passes
    recomputed in the backward (no whole (B, T, V) logits); chunk j: positions j (mod n). At
    V = 100352 and T = 8192 the whole logits were most of a step's memory (`train.py plan`), and
    on a CPU a chunk that stays in cache is faster too (tests/bench.py train)."""
    def one(x, labels):
        return label_logps(unembed(params, x, m), labels, temperature)
    (B, T, D), n = x.shape, min(chunks, x.shape[1])
    if n == 1:
        return one(x, labels)
    pad = -T % n  # (no targets; cut below)
    x = pad_t(x, pad).reshape(B, -1, n, D)  # (B, T/n, n, D)
    labels = pad_t(labels, pad, constant_values=IGNORE_INDEX).reshape(B, -1, n)  # (B, T/n, n)
    parts = (jnp.moveaxis(x, 2, 0), jnp.moveaxis(labels, 2, 0))  # (n, B, T/n, ...)
    out = jax.lax.map(jax.checkpoint(lambda a: one(*a)), parts)
    return tuple(jnp.moveaxis(a, 0, 2).reshape(B, -1)[:, :T] for a in out)  # (B, T) each


# exercise: dpo
def dpo_loss(scores, ref, beta, xp=jnp):
    """scores, ref (2P,): the policy's and the reference's log-probs of rows chosen_0, rejected_0,
    chosen_1, ... -> (losses, margins), each (P,): margin = β·((π_c - ref_c) - (π_r - ref_r)),
    loss = -log σ(margin) (open-instruct's dpo_loss, TRL's "sigmoid"): the margin is the implicit
    reward of the chosen answer minus that of the rejected one. xp: jnp or torch, which both have
    logaddexp, so the two backends share this maths."""
    ratio = scores - ref  # (2P,) log π/π_ref of each row
    margin = beta * (ratio[0::2] - ratio[1::2])  # (P,)
    return xp.logaddexp(xp.zeros_like(margin), -margin), margin


def grpo_loss(logps, old_logps, advantages, clip=0.2, xp=jnp):
    """Per-token GRPO loss (B, T): -min(ρ·A, clip(ρ, 1 - ε, 1 + ε)·A), ρ = π/π_old,
    A (B, 1) each row's group-normalised advantage (open-instruct grpo_fast, which clips at
    ε = 0.2 on both sides). With one update per batch of rollouts (ours) π_old is π itself under a
    stop-gradient: ρ = 1, the clip never binds and the gradient is -A·∇log π; the clip matters
    once a batch is reused."""
    ratio = xp.exp(logps - old_logps)
    return -xp.minimum(ratio * advantages, xp.clip(ratio, 1 - clip, 1 + clip) * advantages)


def dpo_of(scores, ref, n, tc, xp):
    """dpo_loss of each row's score (2P,): its answer's log-probs summed over the answer's tokens,
    or for dpo_norm (Olmo 2/3) their per-token mean, the sums divided by the lengths n (2P,)."""
    if tc.loss == "dpo_norm":
        scores, ref = scores / n, ref / n
    return dpo_loss(scores, ref, tc.dpo_beta, xp)


def loss_fn(params, tokens, labels, m, dtype=jnp.float32, z_loss=0.0, remat="none", attend_fn=None):
    """cross_entropy's loss of forward's whole logits: the plain form the tests and benchmarks take
    gradients of (the step's own loss: train.step_loss, on token_logps)."""
    logits = forward(params, tokens, m, dtype, remat, attend_fn=attend_fn)
    return cross_entropy(logits, labels, z_loss)[0]


def shift_labels(tokens, pad=None, mask=None):
    """tokens (B, T) -> next-token labels (B, T) (OLMo-core get_labels): IGNORE_INDEX at the end,
    at PAD and where mask (B, T) is False (label_mask); numpy for numpy. PAD only fills packed
    instances, so it is never a target; the mask (OLMo-core's label_mask) keeps chat's assistant
    tokens as the only targets in SFT."""
    xp = np if isinstance(tokens, np.ndarray) else jnp
    labels = xp.concatenate([tokens[..., 1:], xp.full_like(tokens[..., :1], IGNORE_INDEX)], axis=-1)
    if pad is not None:
        labels = xp.where(labels == pad, IGNORE_INDEX, labels)
    if mask is not None:
        targets = xp.concatenate([mask[..., 1:], xp.zeros_like(mask[..., :1])], axis=-1)
        labels = xp.where(targets, labels, IGNORE_INDEX)
    return labels


def check_tokens(tokens, m, source="tokens"):
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{source}: expected integer token ids of shape (B, T), got "
                         f"{tokens.dtype} {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= m.vocab_size):
        bad = tokens.max() if tokens.max() >= m.vocab_size else tokens.min()
        raise ValueError(f"{source}: token id {bad} is out of range for vocab_size={m.vocab_size}")
    if tokens.shape[1] > m.max_seq_len:
        print(f"warning: {source} has {tokens.shape[1]} positions > max_seq_len={m.max_seq_len}",
              file=sys.stderr)
    return tokens


# --- generation: the same layers over a KV cache ---
# A layer's keys and values (RoPE applied) sit in a ring of C slots, position p in slot p % C: a
# full layer's ring holds the longest sequence asked for (S), a sliding layer's only its window,
# the keys it can still see. The sizes differ by layer, so no scan.

def new_cache(m, B, S, dtype=jnp.float32):
    """Empty caches for B sequences of up to S positions: per layer k, v (B, C, K, H), C = S on
    a full layer, min(W, S) on a sliding one; an OLMo Hybrid G layer's state instead
    (new_linear_state: its size independent of S)."""
    sizes = [min(int(w), S) if w else S for w in layer_arrays(m)[0]]
    caches = []
    for C, kind in zip(sizes, m.layer_types()):
        if kind == "G":
            caches.append(new_linear_state(m, B, dtype))
        else:
            caches.append({n: jnp.zeros((B, C, m.n_kv_heads, m.head_dim), dtype) for n in "kv"})
    return caches


# exercise: kv_cache
def cached_attention(p, x, cos, sin, cache, pos, window, m):
    """x (B, T, D) at positions pos..pos+T-1 attends to the cache and to itself -> (y (B, T, D),
    the new cache)."""
    (B, T, _), C = x.shape, cache["k"].shape[1]
    q, k, v = project_qkv(p, x, cos, sin, m)  # (B, T, N, H), (B, T, K, H) x2
    held = (pos - 1) - ((pos - 1 - jnp.arange(C)) % C)  # the position in each slot (< 0: empty)
    key_pos = jnp.concatenate([held, pos + jnp.arange(T)])  # (C + T,)
    q_pos = pos + jnp.arange(T)
    mask = attention_mask(q_pos[:, None], key_pos[None, :], window) & (key_pos >= 0)  # (T, C + T)
    keys = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)  # (B, C + T, K, H)
    values = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    with matmul_precision(q.dtype):
        y = jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None],
                                         scale=m.head_dim ** -0.5)  # (B, T, N, H)
    first = max(0, T - C)  # only the last C new keys fit
    slots = (pos + jnp.arange(first, T)) % C
    cache = dict(k=cache["k"].at[:, slots].set(k[:, first:].astype(cache["k"].dtype)),
                 v=cache["v"].at[:, slots].set(v[:, first:].astype(cache["v"].dtype)))
    return linear(y.reshape(B, T, m.n_heads * m.head_dim), p["self_attn.o_proj.weight"]), cache


def forward_step(params, tokens, pos, cache, m, dtype=jnp.float32):
    """tokens (B, T) at positions pos.. -> (logits (B, T, V), new cache): the prompt (pos = 0), then
    a token a call."""
    x = embed(params["embed_tokens.weight"], tokens, dtype)  # (B, T, D)
    window, inv_freq, rope_scale = layer_arrays(m)
    positions = pos + jnp.arange(tokens.shape[1])
    new = []
    for i, kind in enumerate(m.layer_types()):
        p = one_layer(params, m, i)
        cos, sin = rope_cos_sin(positions, inv_freq[i], rope_scale[i])

        def attn(h):  # block calls it once
            if kind == "G":  # the conv windows and S: the same size whatever the position
                y, c = gated_deltanet(p, h, m, cache[i])
            else:
                y, c = cached_attention(p, h, cos, sin, cache[i], pos, int(window[i]), m)
            new.append(c)
            return y

        x, _ = block(p, x, attn, m)  # (generation trains nothing: no auxiliary loss terms)
    return unembed(params, x, m), new


# === PyTorch ===
# Same maths, names and order; state_dict() keys: HF's without "model."

class Linear(nn.Linear):
    """No bias; the fp32 weight cast to x's dtype at use (JAX's `linear`)."""

    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    # exercise: rmsnorm
    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


def layer_norm_torch(x, eps):
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


# exercise: rope
def rope_cos_sin_torch(positions, inv_freq, scale):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, H/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, H)
    return emb.cos() * scale, emb.sin() * scale


# exercise: rope
def rope_torch(x, cos, sin):
    """x (B, N, T, H)."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, m, window=0):
        super().__init__()
        D, N, K, H = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
        self.m = m
        self.window = window  # 0: full attention; W: a sliding layer sees the last W keys
        self.q_proj = Linear(D, N * H)
        self.k_proj = Linear(D, K * H)
        self.v_proj = Linear(D, K * H)
        self.o_proj = Linear(N * H, D)
        if m.family != "olmo1":
            self.q_norm, self.k_norm = RMSNorm(N * H, m.norm_eps), RMSNorm(K * H, m.norm_eps)

    # exercise: qk_norm
    def project(self, x, cos, sin):
        """x (B, T, D) -> q (B, N, T, H), k and v (B, K, T, H), RoPE applied."""
        m, (B, T, _) = self.m, x.shape
        q = self.q_proj(x)  # (B, T, N*H)
        k = self.k_proj(x)  # (B, T, K*H)
        v = self.v_proj(x)  # (B, T, K*H)
        if m.family != "olmo1":
            q, k = self.q_norm(q), self.k_norm(k)
        if m.clip_qkv:  # after the QK-norm (OLMoE; OLMo 1 has none)
            q, k, v = (t.clamp(-m.clip_qkv, m.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, m.n_heads, m.head_dim).transpose(1, 2)  # (B, N, T, H)
        k = k.view(B, T, m.n_kv_heads, m.head_dim).transpose(1, 2)  # (B, K, T, H)
        v = v.view(B, T, m.n_kv_heads, m.head_dim).transpose(1, 2)  # (B, K, T, H)
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin), v

    def forward(self, x, cos, sin, mask, cache=None, pos=0):
        """x (B, T, D) -> (B, T, D); mask: one of attention_masks_torch's masks; cache: this
        layer's keys and values (B, K, S, H), filled at pos..pos+T-1."""
        m, (B, T, _) = self.m, x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            cache["k"][:, :, pos:pos + T], cache["v"][:, :, pos:pos + T] = k, v
            # Only the keys some query can see: a sliding layer reads its last W keys, not the
            # whole cache under a mask. Besides the work saved, that is the sum transformers'
            # window-sized cache computes: over masked keys, SDPA's fp32 sums run in another
            # order (vector width decides it: AVX2 vs AVX-512), and a bf16 near tie can flip.
            first = first_key(pos, self.window)
            k, v = cache["k"][:, :, first:pos + T], cache["v"][:, :, first:pos + T]  # (B, K, S, H)
        scale = m.head_dim ** -0.5
        if isinstance(mask, torch.Tensor) or mask is None:
            # no mask: causal at pos 0 (SDPA's flash kernel); later, every cached key is visible
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               is_causal=mask is None and pos == 0,
                                               scale=scale, enable_gqa=True)
        else:
            y = flex_attention(q, k, v, mask, scale)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, m.n_heads * m.head_dim))  # (B, T, D)


def first_key(pos, window):
    """The first position a query at `pos` can see: keys_before(window) before it on a sliding
    layer, else 0 (every earlier key)."""
    return max(0, pos - keys_before(window)) if window else 0


def attention_masks_torch(m, windows, T, segments, device, pos=0):
    """{window: mask}: None (at pos 0 SDPA's causal path; later, one query that sees all the keys
    Attention reads), a flex BlockMask (auto on GPUs), or a bool (B|1, 1, T, S) mask over the
    keys first_key(pos, window)..pos+T-1 (SDPA's is_causal would align it top-left)."""
    if m.attention not in ("auto", "sdpa", "flex"):
        raise ValueError(f"model.attention={m.attention!r} is a JAX implementation: "
                         "torch takes auto, sdpa, flex")
    flex = m.attention == "flex" or (m.attention == "auto" and device.type == "cuda")
    out = {}
    for w in set(windows):
        causal = not pos and w == 0  # SDPA's is_causal path
        one_query = pos and T == 1  # one new token sees every key Attention reads
        if segments is None and (causal or one_query):
            out[w] = None
        elif not pos and flex:
            out[w] = (window_block_mask(T, w, device) if segments is None
                      else document_block_mask(segments, w, device))
        else:
            i = torch.arange(pos, pos + T, device=device)[:, None]  # queries
            j = torch.arange(first_key(pos, w), pos + T, device=device)[None, :]  # keys
            mask = attention_mask(i, j, w)[None, None]  # (1, 1, T, S)
            if segments is not None:  # (B, 1, T, T): and the same document
                mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
            out[w] = mask
    return out


@lru_cache(maxsize=16)
def window_block_mask(T, w, device):
    """Window w's BlockMask, made once: the same object each step (compiled guards want it), and
    built eagerly it takes seconds at T = 8192."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, i, j):
        return attention_mask(i, j, w)
    return create_block_mask(visible, None, None, T, T, device=device)


def document_block_mask(segments, w, device):
    """Window w's BlockMask within documents (B, T); compiled on GPUs only: a cold compile of
    create_block_mask takes half a minute on a CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, i, j):  # and the same document
        return attention_mask(i, j, w) & (segments[b, i] == segments[b, j])
    build = compiled(create_block_mask) if device.type == "cuda" else create_block_mask
    B, T = segments.shape
    return build(visible, B, None, T, T, device=device)


@lru_cache(maxsize=None)
def compiled(fn):
    """torch.compile(fn), made once (a new wrapper would start from an empty cache)."""
    return torch.compile(fn)


# Eager flex (the tests') warns it is unfused: filtered here (catch_warnings breaks graphs)
warnings.filterwarnings("ignore", "flex_attention called without torch.compile")


def flex_attention(q, k, v, block_mask, scale):
    """torch's flex_attention: compiled on GPUs (fused), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    run = compiled(flex) if q.is_cuda and not torch.compiler.is_compiling() else flex
    return run(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, m):
        super().__init__()
        D, hidden = m.d_model, m.mlp_hidden
        self.gate_proj = Linear(D, hidden)
        self.up_proj = Linear(D, hidden)
        self.down_proj = Linear(hidden, D)

    def forward(self, x):
        """mlp: x (B, T, D) -> ((B, T, D), no auxiliary loss terms: {})."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), {}


class MoE(nn.Module):
    """moe: the router (gate) and E experts, each an MLP, under HF's names
    (mlp.experts.5.up_proj.weight). The chosen experts only: a loop over the experts on a CPU,
    each on the rows sent to it (as transformers computes it); torch._grouped_mm on a GPU with
    moe_compute auto or grouped, one grouped matmul for all (its CPU kernel has no backward)."""

    def __init__(self, m):
        super().__init__()
        self.m = m
        self.gate = Linear(m.d_model, m.n_experts)
        self.experts = nn.ModuleList(MLP(m) for _ in range(m.n_experts))

    # exercise: router
    def route(self, x):
        """route: x (B, T, D) -> (logits, probs (B, T, E), weights, experts (B, T, k)), fp32."""
        logits = self.gate(x).float()  # (B, T, E)
        probs = logits.softmax(-1)
        weights, experts = probs.topk(self.m.experts_per_token, dim=-1)  # (B, T, k) each
        if self.m.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights, experts

    def forward(self, x):
        """x (B, T, D) -> ((B, T, D), router_losses' terms)."""
        m, (B, T, D) = self.m, x.shape
        logits, probs, weights, experts = (t.reshape(B * T, -1) for t in self.route(x))
        rows = x.reshape(B * T, D)  # logits, probs (B·T, E); weights, experts (B·T, k)
        if x.is_cuda and m.moe_compute != "dense":
            y = self.grouped(rows, weights, experts)
        else:
            y = self.loop(rows, weights, experts)
        load = torch.bincount(experts.reshape(-1), minlength=m.n_experts)  # (E,)
        terms = router_losses(probs, torch.logsumexp(logits, -1), load, m)
        return y.reshape(B, T, D), terms

    def loop(self, rows, weights, experts):
        """Each expert on its own rows: (B·T, D) -> (B·T, D). moe_compute "dense" runs this
        form too: it gives experts_dense's sum, without the work of the unchosen experts."""
        y = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(experts == e)  # the rows sent to e, and which choice
            out = expert(rows[token])[0] * weights[token, slot, None].to(rows.dtype)
            y = y.index_add(0, token, out)
        return y

    def grouped(self, rows, weights, experts):
        """experts_grouped with torch._grouped_mm (CUDA): the pairs sorted by expert, each
        group's rows through its expert's weights, transposed to (E, in, out) views."""
        k = self.m.experts_per_token
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        token = order // k
        ends = torch.cumsum(torch.bincount(chosen, minlength=self.m.n_experts), 0).to(torch.int32)

        def stacked(name):  # (E, in, out) in the compute dtype
            w = torch.stack([getattr(e, name).weight for e in self.experts])
            return w.to(rows.dtype).transpose(1, 2)
        r = rows[token]  # (B·T·k, D)
        gate = torch._grouped_mm(r, stacked("gate_proj"), offs=ends)
        up = torch._grouped_mm(r, stacked("up_proj"), offs=ends)
        out = torch._grouped_mm(F.silu(gate) * up, stacked("down_proj"), offs=ends)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(rows).index_add(0, token, out)


def l2_normalize_torch(x, eps=1e-6):
    """l2_normalize."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# exercise: delta_rule
def delta_rule_recurrent_torch(q, k, v, g, beta, state=None):
    """delta_rule_recurrent: the same shapes and maths, fp32, a loop over the tokens."""
    B, T, N, Hv = v.shape
    q, k = l2_normalize_torch(q), l2_normalize_torch(k)
    q, k = (a.repeat_interleave(N // a.shape[2], dim=2) for a in (q, k))  # (B, T, N, Hk)
    q = q * q.shape[-1] ** -0.5
    v = v.float()
    S = q.new_zeros(B, N, k.shape[-1], Hv) if state is None else state
    out = []
    for t in range(T):
        S = S * g[:, t].float().exp()[..., None, None]  # decay first
        predicted = torch.einsum("bnkv,bnk->bnv", S, k[:, t])
        step = beta[:, t, :, None].float() * (v[:, t] - predicted)  # (B, N, Hv)
        S = S + torch.einsum("bnk,bnv->bnkv", k[:, t], step)
        out.append(torch.einsum("bnkv,bnk->bnv", S, q[:, t]))
    return torch.stack(out, 1), S  # (B, T, N, Hv)


def delta_rule_chunked_torch(q, k, v, g, beta, chunk=64, state=None):
    """delta_rule_chunked: the same steps (the UT transform's system within a chunk, a loop over
    the chunks), fp32; the system by torch.linalg.solve_triangular, whose backward has none of
    XLA's CPU deadlock (unit_lower_inverse)."""
    B, T, N, Hv = v.shape
    q, k = l2_normalize_torch(q), l2_normalize_torch(k)
    q, k = (a.repeat_interleave(N // a.shape[2], dim=2) for a in (q, k))
    Hk = k.shape[-1]
    q = q * Hk ** -0.5
    pad = -T % chunk

    def chunks(a):  # (B, T, N, ...) -> (B, N, T/C, C, ...), fp32
        a = F.pad(a.float(), (0, 0) * (a.ndim - 3) + (0, 0, 0, pad))
        return a.reshape(B, -1, chunk, *a.shape[2:]).movedim(3, 1)
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))  # (B, N, T/C, C[, H])
    decay = g.cumsum(-1)  # (B, N, T/C, C)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gap = torch.where(causal, decay[..., :, None] - decay[..., None, :], 0.0)
    between = torch.where(causal, gap.exp(), 0.0)  # (B, N, T/C, C, C)
    kb, vb = k * beta[..., None], v * beta[..., None]
    eye = torch.eye(chunk, dtype=torch.bool, device=q.device)
    A = (kb @ k.transpose(-1, -2)) * between * ~eye  # strictly lower
    I_A = A + eye  # (I + A): unit lower triangular
    u = torch.linalg.solve_triangular(I_A, vb, upper=False, unitriangular=True)  # (.., C, Hv)
    w = torch.linalg.solve_triangular(I_A, kb * decay.exp()[..., None], upper=False,
                                      unitriangular=True)  # (..., C, Hk)
    within = (q @ k.transpose(-1, -2)) * between
    S = q.new_zeros(B, N, Hk, Hv) if state is None else state.float()
    out = []
    for c in range(q.shape[2]):
        new = u[:, :, c] - w[:, :, c] @ S
        out.append((q[:, :, c] * decay[:, :, c, :, None].exp()) @ S + within[:, :, c] @ new)
        last = decay[:, :, c, -1:]  # (B, N, 1)
        S = S * last.exp()[..., None] + (
            k[:, :, c] * (last - decay[:, :, c]).exp()[..., None]).transpose(-1, -2) @ new
    o = torch.stack(out, 2).reshape(B, N, -1, Hv).transpose(1, 2)  # (B, T + pad, N, Hv)
    return o[:, :T], S


def causal_conv_torch(x, w, before=None):
    """causal_conv: x (B, T, C), w (C, 1, W) -> (silu(conv) (B, T, C), the last W - 1 inputs)."""
    (B, T, C), W = x.shape, w.shape[-1]
    before = x.new_zeros(B, W - 1, C) if before is None else before.to(x.dtype)
    seen = torch.cat([before, x], 1)  # (B, W - 1 + T, C)
    y = F.conv1d(seen.transpose(1, 2).float(), w.float(), groups=C).transpose(1, 2)  # (B, T, C)
    return F.silu(y).to(x.dtype), seen[:, T:]


class GatedDeltaNet(nn.Module):
    """gated_deltanet, HF's names (linear_attn.*)."""

    def __init__(self, m):
        super().__init__()
        self.m = m
        D, W = m.d_model, m.linear_conv_kernel
        K, N = m.linear_key_heads, m.linear_value_heads
        Hk, Hv = m.linear_key_head_dim, m.linear_value_head_dim
        self.q_proj, self.k_proj = Linear(D, K * Hk), Linear(D, K * Hk)
        self.v_proj = Linear(D, N * Hv)
        self.a_proj, self.b_proj = Linear(D, N), Linear(D, N)
        self.g_proj = Linear(D, N * Hv)
        self.o_proj = Linear(N * Hv, D)
        # (for their weights (C, 1, W): causal_conv_torch pads and calls F.conv1d itself)
        self.q_conv1d = nn.Conv1d(K * Hk, K * Hk, W, groups=K * Hk, bias=False)
        self.k_conv1d = nn.Conv1d(K * Hk, K * Hk, W, groups=K * Hk, bias=False)
        self.v_conv1d = nn.Conv1d(N * Hv, N * Hv, W, groups=N * Hv, bias=False)
        self.A_log = nn.Parameter(torch.empty(N))
        self.dt_bias = nn.Parameter(torch.empty(N))
        self.o_norm = RMSNorm(Hv, O_NORM_EPS)

    def forward(self, x, state=None):
        """x (B, T, D) -> (B, T, D); state (generation: OLMo.new_cache's dict for this layer) is
        read and updated in place."""
        m, (B, T, _) = self.m, x.shape
        K, N = m.linear_key_heads, m.linear_value_heads
        Hk, Hv = m.linear_key_head_dim, m.linear_value_head_dim
        qkv, new = [], {}
        for n in "qkv":
            h = getattr(self, f"{n}_proj")(x)
            before = state[n] if state else None
            h, new[n] = causal_conv_torch(h, getattr(self, f"{n}_conv1d").weight, before)
            qkv.append(h)
        q, k = qkv[0].view(B, T, K, Hk), qkv[1].view(B, T, K, Hk)
        v = qkv[2].view(B, T, N, Hv)
        beta = self.b_proj(x).float().sigmoid() * (2 if m.linear_neg_eigval else 1)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        S = state["S"] if state else None
        if T == 1 and state:
            o, new["S"] = delta_rule_recurrent_torch(q, k, v, g, beta, S)
        else:
            o, new["S"] = delta_rule_chunked_torch(q, k, v, g, beta, m.linear_chunk, S)
        if state is not None:
            state.update(new)
        gate = self.g_proj(x).view(B, T, N, Hv)
        o = (self.o_norm(o) * F.silu(gate.float())).to(x.dtype)
        return self.o_proj(o.reshape(B, T, N * Hv))


class Block(nn.Module):
    def __init__(self, m, window=0, kind="F"):
        super().__init__()
        self.m = m
        self.mlp = MoE(m) if m.n_experts else MLP(m)
        if kind == "G":  # OLMo Hybrid's linear layer: pre-norm under its checkpoints' names
            self.linear_attn = GatedDeltaNet(m)
            self.attention_layer_norm = RMSNorm(m.d_model, m.norm_eps)
            self.feedforward_layer_norm = RMSNorm(m.d_model, m.norm_eps)
            return
        self.self_attn = Attention(m, window)
        if m.family == "olmoe":  # Llama's names: each sublayer's input norm
            self.input_layernorm = RMSNorm(m.d_model, m.norm_eps)
            self.post_attention_layernorm = RMSNorm(m.d_model, m.norm_eps)
        elif m.family != "olmo1":
            self.post_attention_layernorm = RMSNorm(m.d_model, m.norm_eps)
            self.post_feedforward_layernorm = RMSNorm(m.d_model, m.norm_eps)

    # exercise: rmsnorm
    def forward(self, x, cos, sin, mask, remat_mlp=False, cache=None, pos=0):
        """block: x (B, T, D) -> (x (B, T, D), the MLP's auxiliary loss terms). cos, sin (T, H):
        RoPE at this layer's positions (rope_cos_sin_torch); mask: this layer's window's mask
        (attention_masks_torch); remat_mlp: run the MLP under activation checkpointing, which
        keeps only its input and reruns it in the backward (train.remat = "mlp"); cache: this
        layer's keys and values in generation (OLMo.new_cache), None in training; pos: the
        position of x's first token (0 but in generation, where x holds the new tokens only).
        self_attn takes mask, cache and pos; the block only hands them on."""
        ffn = partial(checkpoint, self.mlp, use_reentrant=False) if remat_mlp else self.mlp
        if hasattr(self, "linear_attn"):  # a G layer: no positions, its state is its cache
            x = x + self.linear_attn(self.attention_layer_norm(x), cache)
            y, terms = ffn(self.feedforward_layer_norm(x))
            return x + y, terms
        if self.m.family == "olmo1":
            x = x + self.self_attn(layer_norm_torch(x, self.m.norm_eps), cos, sin, mask, cache, pos)
            y, terms = ffn(layer_norm_torch(x, self.m.norm_eps))
            return x + y, terms
        if self.m.family == "olmoe":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, pos)
            y, terms = ffn(self.post_attention_layernorm(x))
            return x + y, terms
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, mask, cache, pos))
        y, terms = ffn(x)
        return x + self.post_feedforward_layernorm(y), terms


ROPE_BUFFERS = ("inv_freq", "rope_scale")  # (L, H/2), (L,) of layer_arrays


# remat="dots" in torch: selective activation checkpointing keeps the outputs of these ops (the
# linear layers' matmuls; F.linear runs as one of them) and reruns every other op in the backward
SAVE_MATMULS = partial(create_selective_checkpoint_contexts,
                       [torch.ops.aten.mm.default, torch.ops.aten.addmm.default])


class OLMo(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.embed_tokens = nn.Embedding(m.vocab_size, m.d_model)
        window, *rope = layer_arrays(m)
        self.windows = [int(w) for w in window]
        self.layers = nn.ModuleList(Block(m, w, kind) for w, kind in zip(self.windows,
                                                                          m.layer_types()))
        if m.family != "olmo1":
            self.norm = RMSNorm(m.d_model, m.norm_eps)
        if not m.tie_embeddings:
            self.lm_head = Linear(m.d_model, m.vocab_size)
        for name, value in zip(ROPE_BUFFERS, rope):  # from numpy: CPU tensors even on meta
            self.register_buffer(name, torch.from_numpy(value), persistent=False)

    def reset_buffers(self):
        """Refill the RoPE buffers once a meta model has storage (to_empty)."""
        for name, value in zip(ROPE_BUFFERS, layer_arrays(self.m)[1:]):
            getattr(self, name).copy_(torch.from_numpy(value))

    def forward(self, tokens, dtype=torch.float32, remat="none", segments=None, cache=None, pos=0,
                labels=None, chunks=1, temperature=1.0):
        """tokens (B, T) long -> logits (B, T, V) in dtype; remat, segments: as in JAX's forward;
        with a cache (new_cache): at positions pos..; with labels (B, T), the training step's form:
        token_logps_torch's (log p(label), logsumexp) and the MLPs' auxiliary loss terms summed
        over the layers (JAX's forward with head=False), the head in `chunks` passes (in forward:
        FSDP2 gathers the head only for a forward call), logits divided by `temperature` (GRPO's
        sampling temperature)."""
        T = tokens.shape[1]
        x = self.embed_tokens(tokens).to(dtype)  # (B, T, D)
        positions = torch.arange(pos, pos + T, device=tokens.device)
        masks = attention_masks_torch(self.m, self.windows, T, segments, tokens.device, pos)
        caches = cache or [None] * len(self.layers)
        rope = zip(self.inv_freq, self.rope_scale)
        terms = {}  # the layers' auxiliary loss terms, summed (add_terms; LOAD: a list)
        for layer, w, (f, s), c in zip(self.layers, self.windows, rope, caches):
            cos, sin = rope_cos_sin_torch(positions, f, s)
            run = partial(checkpoint, layer, use_reentrant=False) if remat == "block" else layer
            if remat == "dots":  # JAX's policy: the projections' outputs kept, the rest rerun
                run = partial(checkpoint, layer, use_reentrant=False, context_fn=SAVE_MATMULS)
            x, layer_terms = run(x, cos, sin, masks[w], remat == "mlp", c, pos)
            terms = add_terms(terms, layer_terms)
        if LOAD in terms:
            terms[LOAD] = torch.stack(terms[LOAD])  # (L, E)
        if labels is not None:
            return (*token_logps_torch(self, x, labels, chunks, temperature), terms)
        return self.unembed(x, dtype)

    def new_cache(self, B, S, dtype):
        """Empty keys and values per layer (B, K, S, H), S on sliding layers too (no ring); an
        OLMo Hybrid G layer's state (new_linear_state's shapes), whatever S."""
        shape, device = (B, self.m.n_kv_heads, S, self.m.head_dim), self.embed_tokens.weight.device
        new = partial(torch.zeros, shape, dtype=dtype, device=device)

        def linear_state():  # new_linear_state
            return {n: torch.zeros(shape, dtype=torch.float32 if n == "S" else dtype, device=device)
                    for n, shape in linear_state_shapes(self.m, B).items()}
        caches = []
        for kind in self.m.layer_types():
            caches.append(linear_state() if kind == "G" else {n: new() for n in "kv"})
        return caches

    def unembed(self, x, dtype):
        """The final norm and the head: x (B, T, D) -> (B, T, V)."""
        x = layer_norm_torch(x, self.m.norm_eps) if self.m.family == "olmo1" else self.norm(x)
        head = self.embed_tokens.weight if self.m.tie_embeddings else self.lm_head.weight
        return F.linear(x, head.to(dtype))


def label_logps_torch(logits, labels, temperature=1.0):
    """label_logps: (log p(label), logsumexp)."""
    logits = logits.float()  # (B, T, V): at 1 no second fp32 copy for the division
    logits = logits / temperature if temperature != 1.0 else logits
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != IGNORE_INDEX, target - lse, 0.0), lse


cross_entropy_torch = partial(cross_entropy, logps=label_logps_torch, xp=torch)


def token_logps_torch(net, x, labels, chunks=1, temperature=1.0):
    """token_logps: label_logps_torch (B, T) of net's head on the last layer's output x (B, T, D)
    in `chunks` passes, chunk j: positions j (mod n), so (B, T/n, V) logits at a time. Under
    autograd each pass is recomputed in the backward, as in JAX's token_logps: only one pass's
    logits exist at a time then too (kept, all n would add up to the whole logits again)."""
    (B, T, D), n = x.shape, min(chunks, x.shape[1])

    def one(x, labels):  # (B, t, D), (B, t) -> log p, logsumexp (B, t)
        return label_logps_torch(net.unembed(x, x.dtype), labels, temperature)
    if n == 1:
        return one(x, labels)
    if torch.is_grad_enabled():
        one = partial(checkpoint, one, use_reentrant=False)
    pad = -T % n  # (no targets; cut below)
    x = F.pad(x, (0, 0, 0, pad)).reshape(B, -1, n, D)  # (B, T/n, n, D)
    labels = F.pad(labels, (0, pad), value=IGNORE_INDEX).reshape(B, -1, n)  # (B, T/n, n)
    parts = [one(x[:, :, j], labels[:, :, j]) for j in range(n)]  # n of (log p, lse), (B, T/n)
    return tuple(torch.stack(p, dim=2).reshape(B, -1)[:, :T] for p in zip(*parts))  # (B, T) each


def torch_model(m, params=None):
    """An OLMo module on the memory of `params` (stacked, any array type; default: init_params
    from seed 0)."""
    params = init_params(m, jax.random.PRNGKey(0)) if params is None else params
    with torch.device("meta"):
        net = OLMo(m)
    state = unstack_layers(params, m)
    net.load_state_dict({k: as_torch(v) for k, v in state.items()}, assign=True)
    return net


def as_torch(a):
    """A numpy array as a torch tensor on its memory (a read-only one: a copy)."""
    a = a if a.flags.writeable else a.copy()
    if a.dtype == jnp.bfloat16:  # torch.from_numpy refuses ml_dtypes' bf16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def main(argv):
    cfg = parse_config_args(argv, "model.py", __doc__)
    m = cfg.model
    print(describe(cfg), end="\n\n")
    print(f"{'name':<42} {'shape':<19} {'count':>14}  {'logical axes':<26} init")
    for name, p in param_table(m).items():
        ends = (p.std[0], p.std[-1]) if isinstance(p.std, tuple) else (p.std,)  # (per layer)
        if callable(p.std):
            init = p.std.__name__
        else:
            init = "ones" if p.std is None else f"trunc N(0, {'..'.join(f'{s:.4g}' for s in ends)})"
        count, axes = math.prod(p.shape), ", ".join(p.axes)
        print(f"{name:<42} {str(p.shape):<19} {count:>14,}  {axes:<26} {init}")
    flops = flops_per_token(m)
    print(f"FLOPs/token (train, T={m.max_seq_len}): {flops:,} ({flops / 1e9:.2f} GFLOP)")
    if m.n_experts:  # what a token is computed with: k of the E experts
        print(f"active params per token: {active_params(m):,} ({m.experts_per_token} of "
              f"{m.n_experts} experts)")
    print(f"total_params={count_params(m)}")


if __name__ == "__main__":
    run_cli(main)
