"""Checkpoints in and out: every OLMo checkpoint format to ours (an HF model directory:
config.json + model.safetensors) and out as a release-style HF directory; `check` compares two.

    python convert.py SRC OUT [--dtype bfloat16] [--config FILE]  # any OLMo checkpoint -> ours
    python convert.py SRC OUT --to-hf [--tokenizer dolma2] [--shard-size 5]  # -> release-style HF
    python convert.py check jax:OUT hf:SRC --tokens TOKENS [--seq-len T] [--rows N] [--dtype D]
    python convert.py soup CKPT CKPT ... --out SOUP  # their average
    python convert.py info SRC  # what it reads in SRC

SRC formats: hf (ours), hf_olmo (allenai/OLMo-* repos), olmo (the old trainer), olmo_core
(FORMATS says which files each is). Written to OUT.tmp, renamed OUT at the end; nothing is
unpickled freely. Also here: our own checkpoint format, the step_N folders train.py saves and
resumes from (its section says what is in one).
"""

import base64
import dataclasses
import functools
import io
import json
import math
import mmap
import os
import pickle
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np
import yaml

import data
import model
from configs import ConfigError, ModelConfig, build, in_range, read_json, run_cli, to_dict
from model import param_table, stack_layers, unstack_layers

# --- safetensors, in numpy ---

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def _json(obj, **kw):  # a JSON file's text, as HF indents it
    return json.dumps(obj, indent=2, **kw) + "\n"


def read_safetensors(path, writable=False):
    """(name -> array over a memmap of `path`, writable or not; __metadata__)."""
    path, size = Path(path), os.path.getsize(path)
    with open(path, "r+b" if writable else "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:  # also every file of fewer than 8 bytes
            raise ValueError(f"{path}: header claims {n} bytes of {size}: truncated, or too short "
                             "to be a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: its header is not JSON ({e})") from None
        # an ndarray over the map (its .base), read lazily
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        mapped = mmap.mmap(f.fileno(), 0, access=access)
    metadata, data_size = header.pop("__metadata__", None) or {}, size - 8 - n
    data = np.frombuffer(mapped, np.uint8, data_size, 8 + n) if data_size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, not one of "
                             f"{sorted(DTYPES)}")
        dtype = np.dtype(DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        want = math.prod(info["shape"]) * dtype.itemsize
        if end - start != want or not 0 <= start <= end <= data_size:
            raise ValueError(f"{path}: tensor {name} {info['dtype']}{info['shape']} needs bytes "
                             f"[{start}, {start + want}) of {data_size}: the file is truncated or "
                             "corrupt")
        out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out, metadata


def copy_out(dst, src, block=64 << 20):
    """dst[...] = src, `block` bytes at a time, each block's pages then handed back (once read, a
    mapped page counts in RSS until unmapped)."""
    mapped = getattr(src, "base", None)  # (a Pieced tensor has none)
    while isinstance(mapped, (np.ndarray, memoryview)):  # view -> the map's array -> the map
        mapped = mapped.obj if isinstance(mapped, memoryview) else mapped.base
    rows = max(1, block // max(src[:1].nbytes, 1))
    for i in range(0, len(src), rows):
        view = src[i:i + rows]
        dst[i:i + rows] = view
        if isinstance(mapped, mmap.mmap) and hasattr(mapped, "madvise"):  # (none on macOS)
            start = view.ctypes.data - np.frombuffer(mapped, np.uint8, 1).ctypes.data
            first = start - start % mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, first, start + view.nbytes - first)


def allocate_safetensors(path, entries, metadata=None):
    """A safetensors file of {name: (shape, dtype)} to fill, its disk claimed now (a map filling a
    sparse file dies of SIGBUS, silently, on a full disk)."""
    header, offset = {}, 0
    for name, (shape, dtype) in entries.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = dict(dtype=NAMES[np.dtype(dtype)], shape=list(shape),
                            data_offsets=[offset, offset + nbytes])
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        size = f.tell() + offset
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(f.fileno(), 0, size)
            else:  # macOS: write the zeros
                while f.tell() < size:
                    f.write(bytes(min(size - f.tell(), 1 << 26)))
        except OSError as e:
            why = f"{size:,} bytes ({os.strerror(e.errno)})"
            raise OSError(e.errno, f"{path}: cannot reserve {why}; free space there") from None


def fsync(path):
    """A file's bytes, or a directory's entries, on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp, path):
    """os.replace, durable: tmp's bytes on disk before the rename, the directory after it."""
    fsync(tmp)
    os.replace(tmp, path)
    fsync(Path(path).parent)


def write_safetensors(path, tensors, metadata=None, progress=lambda nbytes: None):
    """{name: array or Lazy} -> a safetensors file, atomically, one tensor at a time."""
    path, tensors = Path(path), {k: Lazy.of(t) for k, t in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    allocate_safetensors(tmp, {k: (t.shape, t.dtype) for k, t in tensors.items()}, metadata)
    views, _ = read_safetensors(tmp, writable=True)
    for k, t in tensors.items():
        views[k][...] = t.load().astype(t.dtype, copy=False)
        progress(views[k].nbytes)
    del views
    replace(tmp, path)


# --- HF config.json <-> ModelConfig ---

HF_CLASS = {"olmo1": ("olmo", "OlmoForCausalLM"), "olmo2": ("olmo2", "Olmo2ForCausalLM"),
            "olmo3": ("olmo3", "Olmo3ForCausalLM"), "olmoe": ("olmoe", "OlmoeForCausalLM"),
            "flex_olmo": ("flex_olmo", "FlexOlmoForCausalLM"),
            "olmo_hybrid": ("olmo_hybrid", "OlmoHybridForCausalLM")}
FAMILY_OF = {model_type: family for family, (model_type, _) in HF_CLASS.items()}


def _names_file(read):
    """A config reader (config, its file) whose errors, a missing key too, name the file."""
    @functools.wraps(read)
    def wrapped(c, source="config.json"):
        try:
            return read(c)
        except KeyError as e:
            raise ConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    return wrapped


def _layer_pattern(kinds, window):
    """Per layer "S" (sliding), "F" (full) or "G" (Gated DeltaNet) -> ModelConfig's pattern (the
    shortest that repeats to them) and window."""
    if set(kinds) == {"F"}:
        return dict(layer_pattern="F", sliding_window=0)
    n = next(n for n in range(1, len(kinds) + 1) if kinds[:n] * (len(kinds) // n) == kinds)
    return dict(layer_pattern=kinds[:n], sliding_window=(window or 0) if "S" in kinds else 0)


def _hf_linear(hf, family):
    """ModelConfig's Gated DeltaNet fields of an OlmoHybridConfig (its linear_* keys; HF's
    defaults where absent, as ModelConfig derives them); none for the other families. Its
    linear_a_log_* and linear_dt_* keys are init ranges, which a checkpoint's weights make moot."""
    if family != "olmo_hybrid":
        return {}
    return dict(linear_key_heads=hf.get("linear_num_key_heads") or 0,
                linear_value_heads=hf.get("linear_num_value_heads") or 0,
                linear_key_head_dim=hf.get("linear_key_head_dim") or 0,
                linear_value_head_dim=hf.get("linear_value_head_dim") or 0,
                linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                linear_neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)))


def _refuse(c, rules, who):
    """Each rule (key, the value(s) we implement[, why]) holds in c, or a ConfigError names the
    key, its value and ours. Flags compare as bools (null = false)."""
    for key, want, *why in rules:
        got, wants = c.get(key), want if isinstance(want, tuple) else (want,)
        if (bool(got) if isinstance(want, bool) else got) not in wants:
            ours = ", ".join([" or ".join(map(repr, wants)), *why])
            raise ConfigError(f"{key}={got!r} is not supported ({who}: {ours})")


# The mixture of experts' settings in HF's OlmoeConfig and FlexOlmoConfig that change the function
# and that no released model sets (a router bias, shared experts, capacity: other models' keys,
# refused so that a config borrowing them cannot load as something else)
HF_MOE_FLAGS = [("router_bias", False), ("num_shared_experts", (None, 0)),
                ("moe_capacity_factor", None), ("router_jitter_noise", (None, 0, 0.0))]


def _hf_experts(hf, family):
    """ModelConfig's expert fields of an HF config; none for a dense family. HF's
    router_aux_loss_coef becomes lb_loss, the weight of OLMo-core's load-balancing loss (the same
    0.01 in OLMoE's release; the two losses differ by a normalisation: docs/moe.md); its configs
    have no z-loss, so router_z_loss is ours (router_z_loss_coef, which transformers ignores), else
    OLMoE's 0.001."""
    if family not in ("olmoe", "flex_olmo"):
        return {}
    _refuse(hf, HF_MOE_FLAGS, "OLMoE and FlexOlmo")
    return dict(n_experts=hf.get("num_experts") or hf["num_local_experts"],
                experts_per_token=hf["num_experts_per_tok"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                lb_loss=float(hf.get("router_aux_loss_coef", 0.01)),
                router_z_loss=float(hf.get("router_z_loss_coef", 0.001)))


@_names_file
def config_from_hf(hf):
    rules = [("model_type", tuple(FAMILY_OF)), ("attention_bias", False), ("hidden_act", "silu")]
    _refuse({"hidden_act": "silu", **hf}, rules, "OLMo")
    family = FAMILY_OF[hf["model_type"]]
    N = hf["num_attention_heads"]
    L = hf["num_hidden_layers"]
    olmo3, hybrid = family == "olmo3", family == "olmo_hybrid"
    # only Olmo3 slides; without layer_types, HF's default: every 4th full (OLMo-core: the last too)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(L)]
    if hybrid and not hf.get("layer_types"):  # the default of OlmoHybridConfig: every 4th full
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
        types[-1] = types[-1] if "full_attention" in types else "full_attention"
    letter = {"full_attention": "F"}
    if hybrid:  # OlmoHybridConfig's kinds (its attention layers never slide)
        letter["linear_attention"] = "G"
    else:  # (only Olmo3 slides; the others' HF classes attend in full whatever it says)
        letter["sliding_attention"] = "S" if olmo3 else "F"
    if unknown := sorted(set(types) - set(letter)):
        raise ConfigError(f"layer_types {unknown} are not supported ({family}: {sorted(letter)})")
    kinds = "".join(letter[t] for t in types)
    eos, pad = hf.get("eos_token_id"), hf.get("pad_token_id")
    eos = (eos[0] if isinstance(eos, list) else eos) or 0
    # transformers 5's rope_parameters (flat, or per layer type) or 4's rope_theta/_scaling
    params = hf.get("rope_parameters")
    if params is None:
        theta = hf.get("rope_theta", 500000.0 if olmo3 else 10000.0)
        if olmo3 and theta != 500000.0:
            raise ConfigError(f"rope_theta={theta} atop an Olmo3 config: transformers 4 and 5 "
                              "read it differently; write rope_parameters per layer type")
        full = {"rope_theta": theta, **(hf.get("rope_scaling") or {})}
        sliding = {"rope_theta": theta}
    elif "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {"rope_theta": full.get("rope_theta")}
    else:
        full = sliding = params
    if hybrid and "rope_theta" in full and full["rope_theta"] is None:
        full = sliding = dict(full, rope_theta=0.0)  # OLMo Hybrid's released configs: no RoPE
    theta = full.get("rope_theta", 10000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    scaled = {sliding.get("rope_type"), sliding.get("type")} - {None, "default"}
    if sliding is not full and (sliding.get("rope_theta", theta) != theta or scaled):
        raise ConfigError(f"RoPE {sliding} on sliding layers is not supported (OLMo 3: plain, at "
                          f"rope_theta {theta})")
    if kind != "default" and (kind != "yarn" or full.get("mscale") or full.get("mscale_all_dim")):
        raise ConfigError(f"RoPE scaling {full} is not supported (only plain YaRN, as OLMo 3)")
    yarn = {} if kind == "default" else dict(
        yarn_factor=float(full["factor"]),
        yarn_original_max_seq_len=int(full["original_max_position_embeddings"]),
        yarn_beta_fast=float(full.get("beta_fast") or 32.0),
        yarn_beta_slow=float(full.get("beta_slow") or 1.0),
        yarn_attention_factor=float(full.get("attention_factor") or 0.0))
    return ModelConfig(
        family=family, d_model=hf["hidden_size"], n_layers=L, n_heads=N,
        n_kv_heads=hf.get("num_key_value_heads") or N,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // N, mlp_hidden=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=1e-5 if family == "olmo1" else float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta), max_seq_len=hf.get("max_position_embeddings", 2048),
        clip_qkv=float(hf.get("clip_qkv") or 0), init_std=float(hf.get("initializer_range", 0.02)),
        eos_token_id=eos, pad_token_id=eos if pad is None else pad,
        **_layer_pattern(kinds, hf.get("sliding_window")), **yarn, **_hf_experts(hf, family),
        **_hf_linear(hf, family))


def config_to_hf(m: ModelConfig):
    model_type, arch = HF_CLASS[m.family]
    plain = {"rope_type": "default", "rope_theta": m.rope_theta}
    norm = {"clip_qkv": m.clip_qkv or None} if m.family == "olmo1" else {"rms_norm_eps": m.norm_eps}
    if m.family == "olmoe":
        norm["clip_qkv"] = m.clip_qkv or None
    hf = dict(
        architectures=[arch], model_type=model_type, vocab_size=m.vocab_size, hidden_size=m.d_model,
        intermediate_size=m.mlp_hidden, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_act="silu",
        max_position_embeddings=m.max_seq_len, initializer_range=m.init_std, attention_bias=False,
        attention_dropout=0.0, tie_word_embeddings=m.tie_embeddings, bos_token_id=None,
        eos_token_id=m.eos_token_id, pad_token_id=m.pad_token_id, use_cache=True, dtype="float32",
        **norm, rope_parameters=plain)
    if m.n_experts:
        hf.update(num_experts=m.n_experts, num_experts_per_tok=m.experts_per_token,
                  norm_topk_prob=m.norm_topk_prob, router_aux_loss_coef=m.lb_loss,
                  router_z_loss_coef=m.router_z_loss, output_router_logits=False)
    if m.family == "olmo_hybrid":
        types = ["linear_attention" if k == "G" else "full_attention" for k in m.layer_types()]
        # no RoPE: rope_theta null, as the released checkpoints (transformers then builds none)
        hf.update(layer_types=types, rope_parameters=dict(plain, rope_theta=m.rope_theta or None),
                  linear_num_key_heads=m.linear_key_heads,
                  linear_num_value_heads=m.linear_value_heads,
                  linear_key_head_dim=m.linear_key_head_dim,
                  linear_value_head_dim=m.linear_value_head_dim,
                  linear_conv_kernel_dim=m.linear_conv_kernel,
                  linear_allow_neg_eigval=m.linear_neg_eigval)
    if m.family == "olmo3":
        full = dict(plain, rope_type="yarn", factor=m.yarn_factor,
                    original_max_position_embeddings=m.yarn_original_max_seq_len,
                    beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                    attention_factor=m.yarn_attention_factor) if m.yarn_factor else plain
        # per layer type: no reader guesses which layers a top-level rope_theta is for
        types = ["sliding_attention" if k == "S" else "full_attention" for k in m.layer_types()]
        hf.update(sliding_window=m.sliding_window or None, layer_types=types,
                  rope_parameters={"full_attention": full, "sliding_attention": plain})
    return hf


# --- HF model directories ---

HF_SAFETENSORS = ["model.safetensors.index.json", "model.safetensors"]
# (train.py's checkpoints of several processes: read in pieces; `convert.py` joins them into
# one HF folder)
PIECES = "model.process*-of-*.safetensors"


def hf_name(name):
    """Our unstacked name -> HF's name: "model." before all but the head."""
    return name if name == "lm_head.weight" else "model." + name


def expected_tensors(m):
    """Our unstacked names -> shapes, in file order (broadcast zeros: no memory)."""
    zeros = {k: np.broadcast_to(np.float32(0), p.shape) for k, p in param_table(m).items()}
    return {name: a.shape for name, a in unstack_layers(zeros, m).items()}


def open_hf(d):
    """An HF OLMo directory -> (ModelConfig, our unstacked names -> unread maps), checked."""
    cfg = Path(d) / "config.json"
    if not Path(d).exists():
        raise FileNotFoundError(f"{d}: no such file or directory: pass a checkpoint folder "
                                "(a training run's step_N or a Hugging Face model directory)")
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg} not found: pass a Hugging Face model directory")
    m, d = config_from_hf(read_json(cfg), str(cfg)), cfg.parent
    pickles = [p.name for p in [*d.glob("*.bin"), *d.glob("*.pt")]]
    if pickles and not any((d / n).is_file() for n in HF_SAFETENSORS):
        raise FileNotFoundError(f"{d}: no model.safetensors ({', '.join(pickles)} are pickles, "
                                f"which we never load here: `python convert.py {d} OUT` converts)")
    return m, _bind(read_weights(d, HF_SAFETENSORS + [PIECES]), 0, m, str(d), "config.json")


def load_hf(d, dtype=None):
    """An HF OLMo directory -> (ModelConfig, name -> numpy stacked on L, in its dtype or `dtype`),
    in memory once."""
    m, state = open_hf(d)
    total, params = sum(v.nbytes for v in state.values()), {}
    with data.Progress(total=total, unit="B", unit_scale=True, desc=f"load {d}",
              disable=total < 2**30) as bar:
        for name, p in param_table(m).items():
            # HF's tensors at every index of the stacked axes (layers; experts), in order
            parts = [state[model.layer_name(name, *i)] for i in model.hf_indices(name, p)]
            # on a 64-byte boundary: JAX's CPU client takes it without a copy
            dt = np.dtype(dtype or parts[0].dtype)
            raw = np.empty(len(parts) * parts[0].size * dt.itemsize + 64, np.uint8)
            start = -raw.ctypes.data % 64
            out = raw[start:start + raw.size - 64].view(dt).reshape(len(parts), *parts[0].shape)
            for part, src in zip(out, parts):
                copy_out(part, src)
                bar.update(src.nbytes)
            params[name] = out.reshape(p.shape)
    return m, params


def save_hf(d, m, params, dtype=np.float32):
    """config.json + model.safetensors, as transformers loads them."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): np.asarray(v).astype(dtype)
               for k, v in unstack_layers(params, m).items()}
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
    (d / "config.json").write_text(_json(config_to_hf(m)))


# --- our checkpoint format: step_N folders ---
# train.py saves run_dir/step_N/ every train.checkpoint_every steps (save_step) and a rerun resumes
# from the folder `latest` names (latest_checkpoint, open_checkpoint). A step_N folder is an HF
# model directory, so transformers, eval.py and `convert.py check` read it as it is:
#   config.json            the model, as transformers reads it (config_to_hf)
#   model.safetensors      the parameters, float32, one tensor per layer under its HF name
#                          (hf_name: "model.layers.3.mlp.up_proj.weight"), whatever the backend,
#                          the mesh or scan_layers; metadata format "pt", as transformers writes it
#   optimizer.safetensors  AdamW's moments, float32, under "exp_avg." or "exp_avg_sq." + our name
#                          (no "model.": "exp_avg.layers.3.mlp.up_proj.weight"), and "step"
#                          (int32, the updates so far); metadata format "nanolmo": only we read it
#   nanolmo.json           the train state: step, the resolved config, the data loader's position,
#                          the losses since the last log line, the skip-step history
#   tokenizer.json, ...    the run's tokenizer, as `--to-hf` writes it (hf_tokenizer_files)
# One process (any number of devices) writes each .safetensors file whole. Several processes
# (hosts, torchrun ranks) each write their own model.processR-of-P.safetensors and
# optimizer.processR-of-P.safetensors instead: the next section says why and how their pieces are
# named; `python convert.py step_N OUT` joins them into one HF folder.
# Nothing is ever half there: all is written into step_N.tmp/ and fsynced, the folder is renamed
# step_N, then the file `latest` (its text: "step_N") is replaced, and the folders past train.keep
# are renamed step_N.trash, then deleted. A kill at any moment leaves the last whole checkpoint;
# the next start clears the leftovers (train.tidy).
# A tensor's way out: the backend's pieces(kind) (train.py) yields each piece its devices hold
# (shard.jax_pieces, shard.stored_slices: a stacked (L, ...) parameter as one HF name per layer;
# torch: shard.torch_local), and write_pieces stores them. Its way back: open_checkpoint ->
# open_hf (read_weights maps the files, read_pieces joins a several-process folder as Pieced;
# _bind checks every name and shape against the config) -> the backend's load, which reads only
# the slices its devices hold (shard.jax_read through jax.make_array_from_callback; torch: each
# rank's rows), so a checkpoint resumes on any mesh and any number of processes.

STEP_FOLDER = re.compile(r"step_([0-9]+)")  # a whole checkpoint; step_N.tmp, step_N.trash are not

# What a new stage (train.init_from) may change: the context it trains at (max_seq_len, and the
# RoPE base and the YaRN settings of a long-context stage), never a parameter's shape
STAGE_MAY_CHANGE = ("max_seq_len", "rope_theta", "yarn_factor", "yarn_original_max_seq_len",
                    "yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor")


def step_number(path):
    """N of a step_N folder; None for any other name (step_N.tmp, step_N.trash, latest)."""
    found = STEP_FOLDER.fullmatch(Path(path).name)
    return int(found[1]) if found else None


def saved_steps(run_dir):
    """N of every whole checkpoint folder in run_dir, oldest first."""
    numbers = [step_number(p) for p in Path(run_dir).glob("step_*")]
    return sorted(n for n in numbers if n is not None)


def checkpoint_entries(m):
    """{name: (shape, dtype)} of model.safetensors and optimizer.safetensors, in file order."""
    shapes = expected_tensors(m)  # unstacked names, as stored
    model_e = {hf_name(n): (s, np.float32) for n, s in shapes.items()}
    opt_e = {}
    for p in ("exp_avg.", "exp_avg_sq."):
        opt_e.update({p + n: (s, np.float32) for n, s in shapes.items()})
    opt_e["step"] = ((), np.int32)
    return model_e, opt_e


def save_step(step, backend, cfg, loader_state, log_window, extra):
    """step_N.tmp/ -> fsync -> step_N/ -> `latest` -> drop those past `keep`: a crash leaves the
    last whole. Every process calls it and writes its own files; backend: train.py's JaxBackend or
    TorchBackend (lead, rank, processes, barrier, pieces, history). extra: {file: text}."""
    run_dir = Path(cfg.train.run_dir)
    lead = backend.lead
    barrier = backend.barrier
    final = run_dir / f"step_{step}"
    tmp = run_dir / f"step_{step}.tmp"
    try:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        formats = dict(model="pt", optimizer="nanolmo")
        for (kind, fmt), entries in zip(formats.items(), checkpoint_entries(cfg.model)):
            # each process its own file (the next section says why)
            path = tmp / pieces_file(kind, backend.rank, backend.processes)
            write_pieces(path, lambda kind=kind: backend.pieces(kind), entries, {"format": fmt})
        barrier()  # every file whole before the lead renames the folder
        if lead:
            history = {k: np.asarray(v).tolist() for k, v in backend.history.items()}
            meta = dict(step=step, config=to_dict(cfg), data=loader_state, log_window=log_window,
                        history=history)
            texts = {"config.json": _json(config_to_hf(cfg.model)),
                     "nanolmo.json": json.dumps(meta, indent=1) + "\n", **extra}
            for f, text in texts.items():
                (tmp / f).write_text(text)
                fsync(tmp / f)
    except BaseException as e:  # a full disk, or Ctrl-C: no half-written step_N.tmp stays behind
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"checkpoint {final.name} not written ({e}); {tmp} removed, "
                          f"{run_dir / 'latest'} unchanged") from None
        raise
    if lead:
        if final.exists():  # left by a run that crashed before updating `latest`: redo it
            discard(final)
        replace(tmp, final)
        (run_dir / "latest.tmp").write_text(final.name + "\n")
        replace(run_dir / "latest.tmp", run_dir / "latest")
        for old in saved_steps(run_dir)[:-cfg.train.keep]:
            discard(run_dir / f"step_{old}")
    barrier()
    return final


def discard(path):
    """Renamed, then deleted: a kill mid-delete leaves step_N.trash, not a half step_N."""
    trash = path.with_name(path.name + ".trash")
    os.replace(path, trash)
    shutil.rmtree(trash)


def latest_checkpoint(run_dir):
    """The step_N folder `latest` names, or None before the first save."""
    pointer = Path(run_dir) / "latest"
    path = pointer.parent / pointer.read_text().strip() if pointer.is_file() else None
    if path and not (path / "nanolmo.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which has no nanolmo.json: point "
                                "it at a whole checkpoint")
    return path


def open_checkpoint(path, m, with_optimizer=True, new_stage=False):
    """(model, optimizer or None, meta) memory maps of an HF OLMo dir of model `m`: a step_N
    folder, or any HF directory (no optimizer, meta {}) for train.init_from."""
    path = Path(path)
    saved_m, state = open_hf(path)
    fix = f"delete {path} (and fix {path.parent / 'latest'}) to resume the one before"
    meta = read_json(path / "nanolmo.json", fix) if (path / "nanolmo.json").is_file() else {}
    theirs = build({"model": meta["config"]["model"]}).model if meta else saved_m
    if diff := theirs.differences(m, STAGE_MAY_CHANGE if new_stage else ()):
        raise ConfigError(f"{path} holds a different model (there vs here: {'; '.join(diff)})")
    opt = None
    files = ["optimizer.safetensors", "optimizer.process*-of-*.safetensors"]
    if with_optimizer and any(any(path.glob(f)) for f in files):
        opt = read_weights(path, files)
        if missing := [f for f in checkpoint_entries(m)[1] if f not in opt]:
            raise ValueError(f"{path}: its optimizer has no tensor {missing[0]}")
    return state, opt, meta


# --- our checkpoint format in pieces: one file per process, so that no page has two writers ---
# A training run over several hosts saves each host's share of every tensor into a file only that
# host writes. Writing through one shared file would lose data on a network file system: an NFS
# client writes a dirty page back whole, and with `embed` split over fsdp a 4 KiB page holds the
# bytes of many hosts, so the last host to flush a page overwrites the others' bytes with what it
# saw there (zeros). One process (any number of devices) still writes `model.safetensors` whole.
# save_step writes through write_pieces; read_weights reads a folder of pieces through read_pieces.

PIECE = re.compile(r"(.+)\[([0-9:,]*)\]")  # "model.norm.weight[0:512]": a stored piece's name


def pieces_file(stem, rank, processes):
    """The file process `rank` writes its share of `stem` (model, optimizer) into."""
    if processes == 1:
        return f"{stem}.safetensors"  # as transformers reads it
    return f"{stem}.process{rank}-of-{processes}.safetensors"


def _span(idx, shape):  # [(start, stop)] per axis of a tuple of slices
    return [s.indices(n)[:2] for s, n in zip(idx, shape)]


def piece_name(name, idx, shape):
    """The name a piece of tensor `name` is stored under: its rows and columns, e.g. w[0:4,8:16]."""
    return f"{name}[{','.join(f'{a}:{b}' for a, b in _span(idx, shape))}]"


def write_pieces(path, pieces, entries, metadata):
    """One process's pieces -> a safetensors file only it writes. pieces(): a fresh iterator of
    (name, index, read) where read() gives the piece as numpy; entries: {name: (shape, dtype)}.
    A tensor all of whose pieces are here is stored whole under its name; else each piece under
    piece_name. Two passes over pieces(): the header first, then one piece in memory at a time."""
    here = {}
    for name, idx, _ in pieces():
        here.setdefault(name, []).append(idx)
    stored, whole = {}, set()
    for name, idxs in here.items():
        shape, dtype = entries[name]
        sizes = [math.prod(b - a for a, b in _span(i, shape)) for i in idxs]
        if sum(sizes) == math.prod(shape):  # (one replica's pieces never overlap)
            stored[name] = (shape, dtype)
            whole.add(name)
        else:
            for i in idxs:
                stored[piece_name(name, i, shape)] = ([b - a for a, b in _span(i, shape)], dtype)
    allocate_safetensors(path, stored, metadata)
    views, _ = read_safetensors(path, writable=True)  # ours alone: no other process maps it
    for name, idx, read in pieces():
        if name in whole:
            views[name][idx] = read()
        else:
            views[piece_name(name, idx, entries[name][0])][...] = read()
    del views
    fsync(path)


class Pieced:
    """A tensor stored in pieces by several processes, indexed like an array: reading a slice reads
    only the pieces it overlaps (a host restoring its share reads no other host's bytes)."""

    def __init__(self, name, pieces):  # pieces: [(tuple of slices, array)]
        self.name, self.pieces = name, pieces
        ndim = len(pieces[0][0])
        # the pieces tile the tensor: its shape is where they end
        self.shape = tuple(max(where[axis].stop for where, _ in pieces) for axis in range(ndim))
        self.dtype, self.ndim = pieces[0][1].dtype, len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        if (held := sum(a.size for _, a in pieces)) != self.size:
            raise ValueError(f"{name}: its pieces hold {held:,} of its {self.size:,} numbers: a "
                             "process's file is incomplete (delete this checkpoint)")

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx += (slice(None),) * (self.ndim - len(idx))
        dropped = tuple(axis for axis, s in enumerate(idx) if not isinstance(s, slice))
        idx = [slice(s, s + 1 or None) if axis in dropped else s  # (s = -1: to the end)
               for axis, s in enumerate(idx)]
        if any(s.step not in (None, 1) for s in idx):
            raise IndexError(f"{self.name}: only contiguous slices of a pieced tensor are read")
        want = _span(idx, self.shape)
        out, filled = np.empty([b - a for a, b in want], self.dtype), 0
        for where, array in self.pieces:
            lo = [max(a, w.start) for (a, _), w in zip(want, where)]
            hi = [min(b, w.stop) for (_, b), w in zip(want, where)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue  # this piece is not read at all
            into = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, want))
            out[into] = array[tuple(slice(x - w.start, y - w.start)
                                    for x, y, w in zip(lo, hi, where))]
            filled += math.prod(y - x for x, y in zip(lo, hi))
        if filled != out.size:
            raise ValueError(f"{self.name}: slice {want} is not covered by its pieces")
        return out.squeeze(dropped) if dropped else out

    def __array__(self, dtype=None, copy=None):
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)


def read_pieces(files):
    """name -> array or Pieced, over the files of every process (stem.processR-of-P.safetensors);
    all P must be there."""
    d = files[0].parent
    found = {(f.name.split(".process")[0], f.name.split("-of-")[-1].split(".")[0]) for f in files}
    (stem, count), *others = found
    if others or not count.isdigit():
        raise ValueError(f"{d}: files of different runs: {sorted(f.name for f in files)}")
    want = [pieces_file(stem, r, int(count)) for r in range(int(count))]
    if missing := [f for f in want if not (d / f).is_file()]:
        raise FileNotFoundError(f"{d}: no {missing[0]}: a host's share was not "
                                "written (delete this checkpoint)")
    wholes, parts = {}, {}
    for f in want:
        for key, array in read_safetensors(d / f)[0].items():
            if piece := PIECE.fullmatch(key):
                spans = [r.split(":") for r in piece[2].split(",") if r]
                parts.setdefault(piece[1], []).append(
                    (tuple(slice(int(a), int(b)) for a, b in spans), array))
            else:
                wholes[key] = array
    if twice := sorted(set(wholes) & set(parts)):
        raise ValueError(f"{d}: {twice[0]} is stored whole and in pieces")
    return {**wholes, **{k: Pieced(k, v) for k, v in parts.items()}}


# --- the old trainer's and OLMo-core's configs -> ModelConfig ---
# Every field that changes the forward is mapped onto ours or refused in one line naming it, its
# value and ours (_refuse: "embedding_layer_norm=True is not supported (OLMo 1: False)"). A field
# a reader ignored would convert into a different model with no message: the OLMo 1 field
# embedding_layer_norm is a LayerNorm without weights, so no tensor goes missing, and the logits
# come out 0.7-15 off. An absent key means what it means to its trainer (the *_DEFAULTS below).

# The old trainer's ModelConfig defaults (ai2-olmo 0.6.0): what an absent key means
OLMO_DEFAULTS = dict(
    n_kv_heads=None, clip_qkv=None, mlp_ratio=4, mlp_hidden_size=None, activation_type="swiglu",
    block_type="sequential", block_group_size=1, alibi=False, rope=False, rope_theta=10000,
    multi_query_attention=None, attention_layer_norm=False, embedding_layer_norm=False,
    layer_norm_type="default", layer_norm_with_affine=True, layer_norm_eps=1e-5,
    attention_layer_norm_with_affine=True, max_sequence_length=1024, include_bias=True,
    bias_for_layer_norm=None, scale_logits=False, vocab_size=50257, embedding_size=50304,
    weight_tying=True, eos_token_id=50256, pad_token_id=50256, init_fn="normal", init_std=0.02,
    norm_after=False)
# Its fields that change the forward (_refuse's rules): those both families share, then those of
# each family. config_from_olmo maps the rest. Read nowhere, as they leave the forward as it is:
# rope_full_precision (we rotate in fp32), alibi_bias_max (alibi is refused), flash_attention,
# the dropouts, init_device, init_cutoff_factor, precision, scale_emb_init, emb_init_std
OLMO_FLAGS = [
    ("rope", True), ("alibi", False), ("include_bias", False), ("scale_logits", False),
    ("activation_type", "swiglu"), ("block_type", "sequential"),
    ("block_group_size", 1, "grouped blocks' names are not read"),
    ("embedding_layer_norm", False)]
# OLMo 1's low_precision LayerNorm differs in rounding only; OLMo 1 never reads
# attention_layer_norm_with_affine or bias_for_layer_norm (no QK-norm, no norm weights)
OLMO_FAMILY_FLAGS = {
    "olmo1": [("attention_layer_norm", False), ("layer_norm_with_affine", False),
              ("layer_norm_type", ("default", "low_precision"))],
    "olmo2": [("attention_layer_norm", True), ("layer_norm_type", "rms"),
              ("layer_norm_with_affine", True), ("attention_layer_norm_with_affine", True),
              ("bias_for_layer_norm", False)]}


@_names_file
def config_from_olmo(c):
    """The old trainer's config.yaml `model:`, or hf_olmo's config.json."""
    c = {**OLMO_DEFAULTS, **c}
    family = "olmo2" if c["norm_after"] else "olmo1"  # OLMo 2: norm_after, QK-norm, RMSNorm
    _refuse(c, OLMO_FLAGS + OLMO_FAMILY_FLAGS[family], family.replace("olmo", "OLMo "))
    D, N = c["d_model"], c["n_heads"]
    return ModelConfig(
        family=family, d_model=D, n_layers=c["n_layers"], n_heads=N,
        n_kv_heads=c["n_kv_heads"] or (1 if c["multi_query_attention"] else N), head_dim=D // N,
        # the trainer's size counts both SwiGLU halves of ff_proj
        mlp_hidden=(c["mlp_hidden_size"] or D * c["mlp_ratio"]) // 2,
        vocab_size=c["embedding_size"] or c["vocab_size"], tie_embeddings=bool(c["weight_tying"]),
        norm_eps=float(c["layer_norm_eps"]), rope_theta=float(c["rope_theta"]),
        max_seq_len=c["max_sequence_length"], clip_qkv=float(c["clip_qkv"] or 0.0),
        init="mitchell" if c["init_fn"] == "mitchell" else "normal", init_std=float(c["init_std"]),
        eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"])


def _flat(d, prefix):
    """Nested dicts -> {dotted path: value}, dicts and leaves; None (unset) left out."""
    out = {}
    for k, v in d.items():
        if v is not None:
            out[prefix + k] = v
            out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {})
    return out


# OLMo-core's TransformerConfig and modules' configs (3.0.0), by dotted path: defaults for unset
# keys (OLMo-core writes configs without their nulls: an unset key is the module's own default,
# e.g. an unset `bias` is true), then the fields that change the forward, each with the value we
# implement (else refused). config_from_olmo_core maps the sizes, norm_eps (every norm's eps must
# equal the block norm's eps), rope.theta, the sliding_window pattern (one window size) and YaRN
# on full layers. Read nowhere, as they leave our forward as it is (we compute norms and RoPE in
# fp32): the dtypes, full_precision flags, the attention's backend, use_flash, mxfp8_*,
# use_recompute_qkv_prep, dropouts, init_*, freeze_params, lm_head.loss_implementation
_BLOCK = "model.block"  # each layer's block
_MIXER = "model.block.sequence_mixer"  # the block's attention
_NORMS = (f"{_BLOCK}.layer_norm", f"{_MIXER}.qk_norm", "model.lm_head.layer_norm")
_BIASED = (f"{_BLOCK}.feed_forward", _MIXER, "model.lm_head", *_NORMS)
_NAMED = ("model", _BLOCK, f"{_BLOCK}.feed_forward", _MIXER, f"{_MIXER}.rope", "model.lm_head",
          *_NORMS)
OLMO_CORE_DEFAULTS = {
    **{k + ".name": "default" for k in _NAMED}, **{k + ".bias": True for k in _BIASED},
    **{k + ".eps": 1e-5 for k in _NORMS}, **{k + ".elementwise_affine": True for k in _NORMS},
    f"{_BLOCK}.feed_forward.activation": "silu", f"{_MIXER}.type": "attention",
    f"{_MIXER}.rope.theta": 500000, f"{_MIXER}.rope.partial_rotary_factor": 1}
RMS = ("rms", "fused_rms", "cute_rms", "qwen_rms", "nemotron_rms")  # kernels / rounding aside
OLMO_CORE_FLAGS = [
    ("model.name", "default"), ("model.embedding_norm", None), ("model.embed_scale", (None, 1)),
    ("model.block_pattern", None),
    (f"{_BLOCK}.name", "reordered_norm"),
    (f"{_BLOCK}.attention_residual_alpha", (None, 1)),
    (f"{_BLOCK}.feed_forward_residual_alpha", (None, 1)),
    (f"{_BLOCK}.feed_forward.name", "default"), (f"{_BLOCK}.feed_forward.activation", "silu"),
    (f"{_MIXER}.type", "attention"), (f"{_MIXER}.name", "default"), (f"{_MIXER}.gate", None),
    (f"{_MIXER}.clip_qkv", None, "only OLMo 1 clamps q, k, v"),
    (f"{_MIXER}.use_head_qk_norm", False), (f"{_MIXER}.qk_norm_per_head_gains", False),
    (f"{_MIXER}.scalable_softmax", False), (f"{_MIXER}.attention_sinks", False),
    (f"{_MIXER}.rope.name", "default", "not interleaved pairs"),
    (f"{_MIXER}.rope.no_global_rope", False), (f"{_MIXER}.rope.partial_rotary_factor", 1),
    ("model.lm_head.name", "default"), *[(k + ".bias", False, "unset is true") for k in _BIASED]]
for _norm in _NORMS:  # each an RMSNorm with a weight
    OLMO_CORE_FLAGS += [(f"{_norm}.name", RMS), (f"{_norm}.elementwise_affine", True)]
YARN_KEYS = {"_CLASS_", "factor", "beta_fast", "beta_slow", "old_context_len",
             "attention_rescale_factor"}  # the last: legacy, OLMo-core ignores it


# OLMo-core's mixture of experts (nn/moe: MoEConfig, MoERouterConfig), by dotted path under the
# block: defaults for unset keys, then the settings we implement. Its "moe" block is the OLMoE
# block (a norm on each sublayer's input), "moe_reordered_norm" the FlexOlmo one (OLMo 2's). Read
# nowhere: dtypes, capacity_factor (a dropless MoE has no capacity)
_MOE = f"{_BLOCK}.feed_forward_moe"
OLMO_CORE_MOE_DEFAULTS = {
    f"{_MOE}.name": "default", f"{_MOE}.router.name": "default", f"{_MOE}.router.top_k": 1,
    f"{_MOE}.router.gating_function": "softmax", f"{_MOE}.lb_loss_weight": 0.01,
    f"{_MOE}.lb_loss_granularity": "local_batch", f"{_MOE}.scale_loss_by_num_layers": True}
OLMO_CORE_MOE_FLAGS = [
    ("model.name", "moe"), (f"{_BLOCK}.name", ("moe", "moe_reordered_norm")),
    (f"{_MOE}.name", "dropless", "every token reaches its experts"),
    (f"{_MOE}.router.name", "default"), (f"{_MOE}.router.gating_function", "softmax"),
    (f"{_MOE}.router.normalize_expert_weights", (None, 1, 1.0), "none, or 1: norm_topk_prob"),
    (f"{_MOE}.router.jitter_eps", None), (f"{_MOE}.router.uniform_expert_assignment", False),
    (f"{_MOE}.router.bias_gamma", None, "no auxiliary-loss-free bias"),
    (f"{_MOE}.shared_mlp", None), (f"{_MOE}.lb_loss_granularity", "local_batch"),
    (f"{_MOE}.scale_loss_by_num_layers", True)]


def _olmo_core_experts(f):
    """ModelConfig's expert fields (and family, mlp_hidden) of an OLMo-core MoE config, flat."""
    f = {**OLMO_CORE_MOE_DEFAULTS, **f}
    _refuse(f, OLMO_CORE_MOE_FLAGS, "OLMoE and FlexOlmo")
    return dict(family="olmoe" if f[f"{_BLOCK}.name"] == "moe" else "flex_olmo",
                mlp_hidden=f[f"{_MOE}.hidden_size"], n_experts=f[f"{_MOE}.num_experts"],
                experts_per_token=f[f"{_MOE}.router.top_k"],
                norm_topk_prob=f.get(f"{_MOE}.router.normalize_expert_weights") == 1,
                lb_loss=float(f.get(f"{_MOE}.lb_loss_weight") or 0.0),
                router_z_loss=float(f.get(f"{_MOE}.z_loss_weight") or 0.0))


# OLMo-core's OLMo Hybrid (TransformerConfig.block {name: block}, block_pattern; its
# GatedDeltaNetConfig in nn/attention/recurrent.py): the Gated DeltaNet block's settings, by
# dotted path under it, with GatedDeltaNetConfig's defaults for unset keys, then those we
# implement. Its block must be the pre-norm "default" one: the released model's G layers, which
# transformers computes; OLMo-core's official scripts at HEAD build them from the attention block
# (OLMo 2's post-norm "reordered_norm"), which its own HF converter warns transformers does not
# compute (docs/hybrid.md)
_GDN = "sequence_mixer"
OLMO_CORE_GDN_DEFAULTS = {
    "name": "default", f"{_GDN}.n_heads": 16, f"{_GDN}.expand_v": 2.0,
    f"{_GDN}.allow_neg_eigval": True, f"{_GDN}.conv_size": 4, f"{_GDN}.conv_bias": False,
    f"{_GDN}.norm_eps": 1e-5, "feed_forward.name": "default", "layer_norm.name": "rms"}
OLMO_CORE_GDN_FLAGS = [
    ("name", "default", "a norm on each sublayer's input, as the released checkpoints"),
    (f"{_GDN}.conv_bias", False), (f"{_GDN}.norm_eps", (1e-5,), "FLA's, which transformers keeps"),
    ("feed_forward.name", "default"), ("layer_norm.name", RMS)]


def _is_gdn(block):
    mixer = block.get(_GDN) or {}
    return "GatedDeltaNet" in str(mixer.get("_CLASS_", "")) or "expand_v" in mixer


def _olmo_core_hybrid(cfg, read):
    """An OLMo-core OLMo Hybrid config -> ModelConfig: its attention block by `read`
    (config_from_olmo_core's rules, as if every layer had it), its Gated DeltaNet block by
    OLMO_CORE_GDN_FLAGS, the layer kinds from block_pattern (cycled over the layers)."""
    t = cfg["model"]
    pattern, blocks = t["block_pattern"], t["block"]
    if not isinstance(blocks, dict) or set(pattern) - set(blocks):
        raise ConfigError(f"model.block_pattern={pattern!r} is not supported (OLMo Hybrid's: each "
                          "name a key of model.block, a dict of blocks)")
    gdn = {n for n, b in blocks.items() if _is_gdn(b)}
    attn = sorted(set(blocks) - gdn)
    if len(attn) != 1 or not gdn:
        raise ConfigError(f"model.block {sorted(blocks)}: OLMo Hybrid has one attention block and "
                          "Gated DeltaNet blocks")
    a = blocks[attn[0]]
    mixer = a.get("sequence_mixer") or a.get("attention") or {}
    no_rope = not mixer.get("rope")  # its long-context stage and after: rope None
    if no_rope:  # (read's rules want one; its theta is not used)
        a = {**a, "sequence_mixer": {**mixer, "rope": {"name": "default"}}}
    base = read({**cfg, "model": {**t, "block": a, "block_pattern": None}})
    L = t["n_layers"]
    kinds = "".join("G" if pattern[i % len(pattern)] in gdn else "F" for i in range(L))
    sliding = [i for i, (k, own) in enumerate(zip(kinds, base.layer_types())) if k == "F" != own]
    if sliding or base.yarn_factor:
        raise ConfigError(f"model.block.{attn[0]}: sliding windows or YaRN on the attention layers "
                          f"{sliding} are not supported (OLMo Hybrid's attention layers are full)")
    sizes = set()
    for name in sorted(gdn):
        f = {**OLMO_CORE_GDN_DEFAULTS, **_flat(blocks[name], "")}
        where = f"model.block.{name}."  # (the messages name the whole path)
        _refuse({where + k: v for k, v in f.items()},
                [(where + key, *rule) for key, *rule in OLMO_CORE_GDN_FLAGS], "OLMo Hybrid")
        same = [(k, f.get(k), _flat(a, "").get(k)) for k in ("feed_forward.hidden_size",
                                                             "layer_norm.eps")]
        for key, got, want in same:
            if got != want:
                raise ConfigError(f"model.block.{name}.{key}={got!r} is not supported (the "
                                  f"attention block's, {want!r})")
        K = f[f"{_GDN}.n_heads"]
        Hk = f.get(f"{_GDN}.head_dim") or t["d_model"] // K
        sizes.add((K, f.get(f"{_GDN}.n_v_heads") or K, Hk, int(Hk * f[f"{_GDN}.expand_v"]),
                   f[f"{_GDN}.conv_size"], bool(f[f"{_GDN}.allow_neg_eigval"])))
    if len(sizes) > 1:
        raise ConfigError(f"model.block: Gated DeltaNet blocks of different shapes {sizes} are "
                          "not supported")
    K, N, Hk, Hv, W, neg = sizes.pop()
    return dataclasses.replace(
        base, family="olmo_hybrid", **_layer_pattern(kinds, 0),
        rope_theta=0.0 if no_rope else base.rope_theta, linear_key_heads=K,
        linear_value_heads=N, linear_key_head_dim=Hk, linear_value_head_dim=Hv,
        linear_conv_kernel=W, linear_neg_eigval=neg)


@_names_file
def config_from_olmo_core(cfg):
    """An OLMo-core experiment's config.json (model, dataset.tokenizer, ...)."""
    def bad(why):
        raise ConfigError(why)

    if cfg["model"].get("block_pattern"):  # OLMo Hybrid: a block per layer kind
        return _olmo_core_hybrid(cfg, config_from_olmo_core.__wrapped__)

    def attn(block):
        mixer = block.get("sequence_mixer") or block.get("attention")
        return mixer or bad("model.block has no sequence_mixer or attention (OLMo 2/3 have one)")

    def without_scaling(block):  # all but its RoPE scaling
        a = {**attn(block), "rope": {**(attn(block).get("rope") or {}), "scaling": None}}
        return {k: v for k, v in {**block, "sequence_mixer": a}.items() if k != "attention"}

    t = cfg["model"]  # open_source saw model.block
    L = t["n_layers"]
    base = t["block"]  # every layer's block, but for block_overrides
    a = attn(base)
    f = {**OLMO_CORE_DEFAULTS, **_flat({**t, "block": {**base, "sequence_mixer": a}}, "model.")}
    for key in (f"{_MIXER}.rope", *_NORMS[1:]):
        if key not in f:
            bad(f"{key}=None is not supported (OLMo 2/3 have one)")
    experts = {}
    if f.get(f"{_BLOCK}.feed_forward_moe") is not None:  # a mixture of experts: its own rules
        experts = _olmo_core_experts(f)
        # (no dense feed_forward: its defaults checked below do not apply)
        f = {**f, "model.name": "default", f"{_BLOCK}.name": "reordered_norm",
             f"{_BLOCK}.feed_forward_moe": None, f"{_BLOCK}.feed_forward.bias": False}
    _refuse(f, OLMO_CORE_FLAGS, "OLMo 2/3")
    eps = f[f"{_BLOCK}.layer_norm.eps"]
    _refuse(f, [(k + ".eps", eps, "one eps for all norms") for k in _NORMS[1:]], "OLMo 2/3")
    overrides = {int(k): v for k, v in (t.get("block_overrides") or {}).items()}
    for i, block in overrides.items():
        if without_scaling(block) != without_scaling(base):
            bad(f"model.block_overrides.{i}={block} is not supported (it changes more than RoPE "
                "scaling)")
    # OLMo-core's SlidingWindowAttentionConfig._get_window_size per layer (-1: full); the pattern
    # starts after a forced first layer
    sw = a.get("sliding_window") or {"pattern": [-1]}
    pattern = sw["pattern"]
    first = sw.get("force_full_attention_on_first_layer", True)
    last = sw.get("force_full_attention_on_last_layer", True)
    ws = []  # per layer: its window, -1 full
    for i in range(L):
        if (first and i == 0) or (last and i == L - 1):
            ws.append(-1)
        else:
            n = i - 1 if first else i  # the layers since the pattern started
            ws.append(pattern[n % len(pattern)])
    kinds = "".join("F" if w == -1 else "S" for w in ws)
    windows = set(ws) - {-1}
    if len(windows) > 1:
        bad(f"{_MIXER}.sliding_window.pattern={pattern} is not supported (one window size)")
    yarns = [(attn(overrides.get(i, base)).get("rope") or {}).get("scaling") or None
             for i in range(L)]
    y = next((y for y in yarns if y), None)
    if y and any(s != (y if k == "F" else None) for s, k in zip(yarns, kinds)):
        bad(f"{_MIXER}.rope.scaling={y} is not supported on sliding layers (OLMo 3: the same on "
            "each full layer)")
    if y and ("YaRN" not in y.get("_CLASS_", "YaRN") or set(y) - YARN_KEYS):
        bad(f"{_MIXER}.rope.scaling={y} is not supported (only YaRN, as OLMo 3)")
    yarn = dict(
        yarn_factor=float(y.get("factor", 8.0)), yarn_beta_fast=float(y.get("beta_fast", 32)),
        yarn_beta_slow=float(y.get("beta_slow", 1)),
        yarn_original_max_seq_len=int(y.get("old_context_len", 8192))) if y else {}
    ds = cfg.get("dataset") or {}
    tok = ds.get("tokenizer") or {}
    seq = ds.get("sequence_length") or (cfg.get("train_module") or {}).get("max_sequence_length")
    D, N = t["d_model"], a["n_heads"]
    family = "olmo3" if "S" in kinds or yarn else "olmo2"
    return ModelConfig(
        family=experts.pop("family", family), d_model=D, n_layers=L, n_heads=N,
        n_kv_heads=a.get("n_kv_heads") or N, head_dim=a.get("head_dim") or D // N,
        mlp_hidden=experts.pop("mlp_hidden", None) or base["feed_forward"]["hidden_size"],
        vocab_size=t["vocab_size"], **experts,
        tie_embeddings=bool(t.get("tie_word_embeddings")), norm_eps=float(eps),
        rope_theta=float(f[f"{_MIXER}.rope.theta"]), max_seq_len=seq or 8192,
        init_std=float(t.get("init_std", 0.02)),
        eos_token_id=tok.get("eos_token_id", 100257), pad_token_id=tok.get("pad_token_id", 100277),
        **_layer_pattern(kinds, max(windows, default=0)), **yarn)


# --- tensor stores: name -> array (a map) or Lazy ---

class Lazy(NamedTuple):
    """A tensor not read yet: `load()` reads it (numpy, native dtype)."""
    shape: tuple
    dtype: np.dtype
    load: Callable

    @staticmethod
    def of(a):  # an array (a map is read on load) or a Lazy
        return a if isinstance(a, Lazy) else Lazy(tuple(a.shape), np.dtype(a.dtype),
                                                  lambda: np.asarray(a))


def _from_torch(t):
    import torch
    t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: ml_dtypes' over the same bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_store(path):
    """A .bin / .pt state dict, through torch.load(weights_only=True)."""
    import torch
    # mmap: tensors stay on disk until used (zip files only: torch >= 1.6)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
        why = str(e).splitlines()[0]
        raise ValueError(f"{path}: not readable by torch.load(weights_only=True): {why}") from None
    while isinstance(sd, dict) and len(sd) == 1 and next(iter(sd)) in ("model", "state_dict"):
        sd = next(iter(sd.values()))  # {"model": {...}}, as some writers wrap it
    return {k: _from_torch(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}


# A DCP .metadata is a pickle: dcp_store resolves only these, so a hostile one runs no code
_DCP_NAMES = {  # module -> its names
    "torch.distributed.checkpoint.metadata": "Metadata TensorStorageMetadata BytesStorageMetadata "
    "ChunkStorageMetadata TensorProperties StorageMeta MetadataIndex _MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem": "_StorageInfo", "torch": "Size",
    "torch.serialization": "_get_layout", "pathlib": "PosixPath WindowsPath",
    "collections": "OrderedDict"}
_DCP_GLOBALS = set()  # (module, name)
for _module, _names in _DCP_NAMES.items():
    _DCP_GLOBALS.update((_module, name) for name in _names.split())
# OLMo-core pickles its own copy of torch's _StorageInfo (the same fields): read as torch's class
_DCP_RENAMES = {("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"):
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # plain data (tuples, str, bool) names no global
        raise pickle.UnpicklingError(f"it names {module}.{name}, which we never load")


def trainer_store(store, path):
    """The old trainer's model.safetensors: each name is the urlsafe base64 of a pickle of (keys,
    value_is_pickled), read loading no global; pickled values skipped."""
    out = {}
    for name, t in store.items():
        try:
            raw = base64.b64decode(name, altchars=b"-_", validate=True)
            keys, pickled = _PlainUnpickler(io.BytesIO(raw)).load()
            if not (isinstance(keys, tuple) and keys and isinstance(pickled, bool)
                    and all(isinstance(k, str) for k in keys)):
                raise ValueError(f"it holds {keys!r}, {pickled!r}")
        except Exception as e:  # bad base64, a broken or hostile pickle, other data
            raise ValueError(f"{path}: tensor name {name[:80]!r} is not the old trainer's (a "
                             f"pickled (keys, bool) in base64): {type(e).__name__}: {e}") from None
        if not pickled:
            out[".".join(keys)] = t
    return out


def dcp_store(d):
    """A DCP checkpoint's model.* tensors, each read on use (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            module, name = _DCP_RENAMES.get((module, name), (module, name))
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if (module, name) in _DCP_GLOBALS or is_dtype:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")

    try:
        with open(d / ".metadata", "rb") as f:
            md = Unpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise ValueError(f"{f.name}: not DCP metadata ({e})") from None

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the checked copy, not a pickle.load
            md.storage_meta = getattr(md, "storage_meta", None) or dcp.metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    def load(key, meta, reader=Reader(d)):
        t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled": yes, one process
            dcp.load({key: t}, storage_reader=reader, no_dist=True)
        return _from_torch(t)

    return {key.removeprefix("model."): Lazy(
        tuple(meta.size), _from_torch(torch.empty(0, dtype=meta.properties.dtype)).dtype,
        functools.partial(load, key, meta)) for key, meta in md.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, dcp.metadata.TensorStorageMetadata)}


def read_weights(d, names, trainer=False):
    """Their name -> tensor, from the first of `names` in d: a weight file, shard index, DCP, or
    a glob of train.py's per-process pieces (read_pieces)."""
    for name in names:
        p = d / name
        if name.endswith(".index.json") and p.is_file():
            files = sorted(set(read_json(p)["weight_map"].values()))
            for f in files:
                if not (d / f).is_file():
                    raise FileNotFoundError(f"{p} names shard {f}, which is missing")
            out = {}
            for f in files:
                out.update(read_weights(d, [f], trainer))
            return out
        if "*" in name and (files := sorted(d.glob(name))):  # a multi-host run's pieces
            return read_pieces(files)
        if name == "model_and_optim" and (p / ".metadata").is_file():
            return dcp_store(p)
        if p.is_file() and name.endswith(".safetensors"):
            store = read_safetensors(p)[0]
            return trainer_store(store, p) if trainer else store
        if p.is_file():
            return torch_store(p)
    raise FileNotFoundError(f"{d}: no weights: looked for {', '.join(names)}")


# --- sources: any checkpoint -> Source ---

class Source(NamedTuple):
    kind: str  # a FORMATS key
    path: Path
    m: ModelConfig
    tensors: dict  # our unstacked names -> Lazy, in file order
    tokenizer: str  # "dolma2" if the checkpoint says so


# Per layer, a tensor's names: ours (HF's names too), the old trainer's name, OLMo-core's name.
# A fused tensor's parts in this order: att_proj = [q; k; v], ff_proj = [up; gate]
# (`x, gate = ff_proj(x).chunk(2); silu(gate) * x`)
LAYER_NAMES = [
    *[(f"self_attn.{x}_proj", "att_proj", f"attention.w_{x}") for x in "qkv"],
    ("self_attn.o_proj", "attn_out", "attention.w_out"),
    ("mlp.up_proj", "ff_proj", "feed_forward.w3"), ("mlp.gate_proj", "ff_proj", "feed_forward.w1"),
    ("mlp.down_proj", "ff_out", "feed_forward.w2"),
    *[(f"self_attn.{x}_norm", f"{x}_norm", f"attention.{x}_norm") for x in "qk"],
    ("post_attention_layernorm", "attn_norm", "attention_norm"),
    ("post_feedforward_layernorm", "ff_norm", "feed_forward_norm"),
    # OLMoE and FlexOlmo (None: the old trainer has no mixture of experts; OLMo-core's names for
    # them, its router flat and its norms by block type, are planned in _bind)
    ("input_layernorm", None, None), ("mlp.gate", None, None)]
# OLMo Hybrid's G layers: ours (the Hub's HF names), OLMo-core's (GatedDeltaNet in a pre-norm
# block); the old trainer has none
LINEAR_NAMES = [
    *[(f"linear_attn.{x}_proj.weight", f"attention.w_{x}.weight") for x in "qkvabg"],
    ("linear_attn.o_proj.weight", "attention.w_out.weight"),
    *[(f"linear_attn.{x}_conv1d.weight", f"attention.{x}_conv1d.weight") for x in "qkv"],
    ("linear_attn.A_log", "attention.A_log"), ("linear_attn.dt_bias", "attention.dt_bias"),
    ("linear_attn.o_norm.weight", "attention.o_norm.weight"),
    ("attention_layer_norm.weight", "attention_norm.weight"),
    ("feedforward_layer_norm.weight", "feed_forward_norm.weight")]


def _hybrid_hf_names(store, m):
    """An OLMo Hybrid HF store (names without "model.") under the Hub's names (ours), whichever
    writer made it:
    - transformers' save_pretrained (5.24) saves an attention layer's post_attention_layernorm as
      feedforward_layer_norm (it reverses its rename feedforward_layer_norm -> post_attention_
      layernorm on every layer), and q/k/v_conv1d as equal thirds of its fused conv1d (the reverse
      of its Concatenate is an equal split): the three are joined and cut at the real sizes;
    - OLMo-core's converter writes linear_attn.out_proj and linear_attn.norm, and the G layers'
      norms as input_layernorm and post_attention_layernorm (transformers' in-memory names);
    - a transformers state_dict holds the fused linear_attn.conv1d."""
    out, kinds = dict(store), m.layer_types()

    def move(old, new):
        if old in out and new not in out:
            out[new] = out.pop(old)
    K, N = m.linear_key_heads, m.linear_value_heads
    sizes = [K * m.linear_key_head_dim, K * m.linear_key_head_dim, N * m.linear_value_head_dim]
    for i, kind in enumerate(kinds):
        at = f"layers.{i}."
        if kind != "G":
            move(at + "feedforward_layer_norm.weight", at + "post_attention_layernorm.weight")
            continue
        a = at + "linear_attn."
        move(a + "out_proj.weight", a + "o_proj.weight")
        move(a + "norm.weight", a + "o_norm.weight")
        move(at + "input_layernorm.weight", at + "attention_layer_norm.weight")
        move(at + "post_attention_layernorm.weight", at + "feedforward_layer_norm.weight")
        convs = [f"{a}{x}_conv1d.weight" for x in "qkv"]
        parts = [out[c] for c in convs if c in out] or [out.get(a + "conv1d.weight")]
        if parts[0] is None or [p.shape[0] for p in parts] == sizes:
            continue  # (as the Hub stores them; or missing, which _bind will name)
        for c in convs + [a + "conv1d.weight"]:
            out.pop(c, None)
        # (small: C·W numbers a layer, read here)
        joined = np.concatenate([Lazy.of(p).load() for p in parts])
        starts = np.cumsum([0] + sizes)
        if len(joined) == starts[-1]:  # else the shapes stay wrong, for _bind to name
            out.update({c: joined[lo:hi] for c, lo, hi in zip(convs, starts, starts[1:])})
        else:
            out.update(zip(convs, parts))
    return out
# Per expert E of layer I: "layers.I.mlp.experts.E.up_proj.weight" (HF's files; ours)
EXPERT_NAMES = [f"mlp.experts.{{}}.{x}_proj" for x in ("gate", "up", "down")]
# Outside the layers; each column's layer prefix
TOP_NAMES = [("embed_tokens", "transformer.wte", "embeddings"),
             ("norm", "transformer.ln_f", "lm_head.norm"),
             ("lm_head", "transformer.ff_out", "lm_head.w_out")]
LAYER_PREFIX = ["layers.{}.", "transformer.blocks.{}.", "blocks.{}."]

HF_WEIGHTS = HF_SAFETENSORS + [PIECES, "pytorch_model.bin.index.json", "pytorch_model.bin"]
# The formats open_source tells apart by their files (`convert.py info SRC` says which it saw):
# - hf: HF OLMo, Olmo2, Olmo3, ours too: config.json (model_type olmo, olmo2 or olmo3) and
#   model.safetensors, shards and an index, or pytorch_model*.bin. A rename.
# - hf_olmo: the original allenai/OLMo-* repos (custom code): a config.json with the keys of the
#   old trainer, model.transformer.* weights; the fused tensors are split.
# - olmo: the old OLMo trainer (OLMo 1 and 2), unsharded: config.yaml and model.safetensors (read
#   first, as ai2-olmo does; its names are pickles: trainer_store) or model.pt; the fused att_proj
#   and ff_proj are split.
# - olmo_core: OLMo-core (OLMo 2, 3; its MoEs, as OLMoE or FlexOlmo): config.json ({"model":
#   TransformerConfig, ...}) and model.pt or model.safetensors (its unshard_checkpoint), or
#   model_and_optim/ (torch's DCP); the window pattern from the block's sliding_window, YaRN from
#   block_overrides; its experts' fused tensors sliced per expert, w2 transposed (_bind).
# Names map one to one onto ours: a rename, a split of the fused tensors, never a RoPE permute,
# and a transpose only for OLMo-core's experts' w2.
# kind -> (config reader, weight files by preference, its name tables' column)
FORMATS = {
    "hf": (config_from_hf, HF_WEIGHTS, 0),
    "hf_olmo": (config_from_olmo, HF_WEIGHTS, 1),
    "olmo": (config_from_olmo, ["model.safetensors", "model.pt"], 1),
    "olmo_core": (config_from_olmo_core, ["model_and_optim", "model.safetensors", "model.pt"], 2)}


def _bind(store, column, m, where, what):
    """Our name -> its tensor in `store` (or a Lazy of its rows in a fused one), named as in the
    tables' `column`; every stored tensor used, in the shape the config implies."""
    # HF's "model.layers.0...", unsharding's "model.transformer.wte.weight"; old converters'
    # rotary_emb.inv_freq we recompute
    renamed = {}
    for k, v in store.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if "transformer." in k:
            renamed[k[k.find("transformer."):]] = v
        else:
            renamed[k.removeprefix("model.")] = v
    store = renamed
    if column == 0 and "G" in m.layer_pattern:
        store = _hybrid_hf_names(store, m)
    if m.tie_embeddings:  # some tied files hold a copy of the head (OLMo-core and HF write one)
        store.pop(f"{TOP_NAMES[-1][column]}.weight", None)
    want, prefix = expected_tensors(m), LAYER_PREFIX[column]
    # OLMo-core's experts: w1, w3 (E·F, D) hold each expert's gate and up rows, w2 (E·F, D) its
    # down_proj transposed; the router is flat, (E·D,)
    core = column == 2 and m.n_experts > 0
    plan = {}  # ours -> theirs
    for i in range(m.n_layers):
        at = prefix.format(i)
        for row in LAYER_NAMES:
            plan[f"layers.{i}.{row[0]}.weight"] = f"{at}{row[column]}.weight"
        for ours, core_name in LINEAR_NAMES if "G" in m.layer_pattern else ():
            plan[f"layers.{i}.{ours}"] = at + (core_name if column == 2 else ours)
        for e in range(m.n_experts):  # HF names; in OLMo-core: rows of one tensor each
            for name, w in zip(EXPERT_NAMES, ("w1", "w3", "w2")):
                expert = f"{name.format(e)}.weight"
                plan[f"layers.{i}.{expert}"] = at + (f"feed_forward_moe.experts.mlp.{w}" if core
                                                     else expert)
        if core:
            plan[f"layers.{i}.mlp.gate.weight"] = f"{at}feed_forward_moe.router.weight"
        if core and m.family == "olmoe":  # OLMo-core's "moe" block: a norm before each sublayer
            plan[f"layers.{i}.input_layernorm.weight"] = f"{at}attention_norm.weight"
            plan[f"layers.{i}.post_attention_layernorm.weight"] = f"{at}feed_forward_norm.weight"
    plan.update({f"{row[0]}.weight": f"{row[column]}.weight" for row in TOP_NAMES})

    def stored(ours):  # (its shape as stored, transposed?)
        if core and ours.endswith("down_proj.weight"):
            return want[ours][::-1], True
        if core and ours.endswith("mlp.gate.weight"):
            return (math.prod(want[ours]),), False
        return want[ours], False
    rows, shapes = {}, {}
    for ours, theirs in plan.items():
        if ours in want:
            shape = stored(ours)[0]
            start = shapes.get(theirs, [0])[0]
            rows[ours] = slice(start, start + shape[0])
            shapes[theirs] = (rows[ours].stop, *shape[1:])
    missing, unexpected = sorted(set(shapes) - set(store)), sorted(set(store) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{where}: tensors do not match {what}: missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    for theirs, shape in shapes.items():
        if (got := tuple(store[theirs].shape)) != shape:
            raise ValueError(f"{where}: tensor {theirs} has shape {got}, {what} implies {shape}")
    out = {ours: store[plan[ours]] for ours in want}

    # A stored tensor read whole once for all its parts, which are read one after another (want's
    # order: an expert tensor's E parts in a row): a Lazy (DCP) would read it again for each part,
    # E times over for OLMo-core's (E·F, D) experts. One tensor held at a time.
    @functools.lru_cache(maxsize=1)
    def whole(theirs):
        return Lazy.of(store[theirs]).load()
    for ours, r in rows.items():
        shape, transposed = stored(ours)
        if r != slice(0, shapes[plan[ours]][0]) or shape != want[ours]:  # a part, or another shape
            def load(theirs=plan[ours], r=r, transposed=transposed, shape=want[ours]):
                part = whole(theirs)[r]
                return np.ascontiguousarray(part.T) if transposed else part.reshape(shape)
            out[ours] = Lazy(want[ours], Lazy.of(out[ours]).dtype, load)
    return out


def open_source(path, config=None):
    """Any supported checkpoint, a directory or a file -> Source, checked (_bind)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    d = path.parent if path.is_file() else path
    d = d.parent if d.name == "model_and_optim" else d  # an OLMo-core step's DCP folder
    names = ("config.json", "config.yaml")
    cfg = Path(config) if config else next((d / n for n in names if (d / n).is_file()), None)
    if cfg is None:
        seen = sorted(p.name for p in d.iterdir())[:8]
        raise ValueError(f"{path}: not a checkpoint format I know: found {seen}, no config.json "
                         "or config.yaml (pass --config FILE)")
    if cfg.suffix in (".yaml", ".yml"):  # safe_load: plain data, no Python objects
        try:
            kind, c = "olmo", yaml.safe_load(cfg.read_text())["model"]
        except (yaml.YAMLError, KeyError, TypeError) as e:
            raise ConfigError(f"{cfg}: not a config.yaml with a `model:` ({e!r})") from None
    else:
        c = read_json(cfg)
        core = isinstance(c.get("model"), dict) and "block" in c["model"]
        kind = "olmo_core" if core else "hf_olmo" if "d_model" in c else "hf"
        if kind == "hf" and c.get("model_type") not in FAMILY_OF:
            raise ValueError(f"{cfg}: not a config I know (model_type {c.get('model_type')!r}, no "
                             "d_model or model.block)")
    read, files, column = FORMATS[kind]
    m = read(c, str(cfg))
    store = read_weights(d, ([path.name] if path.is_file() else []) + files, trainer=kind == "olmo")
    tensors = {k: Lazy.of(t) for k, t in _bind(store, column, m, str(path), cfg.name).items()}
    # OLMo-core names its tokenizer; elsewhere dolma2's EOS 100257 and rows for its ids say so
    ident = str(((c.get("dataset") or {}).get("tokenizer") or {}).get("identifier", ""))
    named = "dolma2" in ident or "dolma3" in ident
    dolma2 = named or (m.eos_token_id == 100257 and m.vocab_size >= 100278)
    return Source(kind, path, m, tensors, "dolma2" if dolma2 else None)


# --- writing: ours, or a release-style HF directory ---

def write_checkpoint(out, m, tensors, dtype=None, files=None, shard_bytes=None):
    """Tensors (our name -> Lazy) -> OUT via OUT.tmp, with config.json and `files` (name: text)."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; convert never overwrites (delete it or pick another)")
    tensors = {hf_name(k): Lazy(t.shape, np.dtype(dtype or t.dtype), t.load)
               for k, t in tensors.items()}
    sizes = {k: math.prod(t.shape) * t.dtype.itemsize for k, t in tensors.items()}
    total, groups = sum(sizes.values()), [[]]
    for k, size in sizes.items():  # greedy, in file order, as transformers' save_pretrained
        if shard_bytes and groups[-1] and sum(map(sizes.get, groups[-1])) + size > shard_bytes:
            groups.append([])
        groups[-1].append(k)
    n = len(groups)
    if n == 1:
        shards = {"model.safetensors": groups[0]}
    else:
        shards = {f"model-{i:05d}-of-{n:05d}.safetensors": keys
                  for i, keys in enumerate(groups, 1)}
    kinds = {t.dtype.name for t in tensors.values()}
    hf = {**config_to_hf(m), "dtype": kinds.pop() if len(kinds) == 1 else "float32"}
    files = {"config.json": _json(hf), **(files or {})}
    if n > 1:
        weight_map = {}  # tensor name -> its file
        for f, keys in shards.items():
            weight_map.update(dict.fromkeys(keys, f))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files["model.safetensors.index.json"] = _json(index)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a previous run's leftovers: never complete
    tmp.mkdir(parents=True)
    try:
        with data.Progress(total=total, unit="B", unit_scale=True, desc=f"write {out.name}",
                  disable=total < 2**27) as bar:
            for fname, keys in shards.items():
                shard = {k: tensors[k] for k in keys}
                write_safetensors(tmp / fname, shard, {"format": "pt"}, bar.update)
        for name, text in files.items():
            (tmp / name).write_text(text)
            fsync(tmp / name)
        replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert(src, out, to_hf=False, dtype=None, tokenizer=None, config=None, shard_gb=5.0):
    """SRC -> OUT; to_hf: as the releases (shards past shard_gb, generation config, tokenizer
    files: `tokenizer`, else SRC's tokenizer files, else dolma2 if SRC's ids are dolma2 ids;
    Olmo 3's V cut to it)."""
    s = open_source(src, config)
    m = s.m
    tensors = dict(s.tensors)
    spec = tokenizer or s.tokenizer
    tok = None
    if not to_hf:
        write_checkpoint(out, m, tensors, dtype)
        return s, m
    ids = dict(eos_token_id=m.eos_token_id, pad_token_id=m.pad_token_id)
    files = {"generation_config.json": _json(dict(_from_model_config=True, **ids))}
    try:  # the checkpoint's own files first
        tok = None if tokenizer else read_hf_tokenizer(s.path if s.path.is_dir() else s.path.parent)
    except ValueError as e:
        print(f"note: {e}", file=sys.stderr)
    if tok or spec:
        tok = tok or data.load_tokenizer(spec)
        V, spec = tok.vocab_size, tok.name
        if V > m.vocab_size:
            raise ValueError(f"tokenizer {spec} has {V} ids, the model only {m.vocab_size} rows")
        if m.family == "olmo3" and V < m.vocab_size:  # as Olmo 3's releases (not OLMo 2's releases)
            for k in {"embed_tokens.weight", "lm_head.weight"} & set(tensors):
                t = tensors[k]
                tensors[k] = Lazy((V, *t.shape[1:]), t.dtype, lambda t=t: t.load()[:V])
            m = dataclasses.replace(m, vocab_size=V)
        files.update(hf_tokenizer_files(tok, m.max_seq_len))
        print(f"tokenizer files: {spec} ({V} ids)", file=sys.stderr)
    else:
        print(f"note: no tokenizer files written (pass --tokenizer SPEC; model vocab "
              f"{m.vocab_size})", file=sys.stderr)
    write_checkpoint(out, m, tensors, dtype, files, shard_gb * 2**30)
    return s, m


# --- tokenizers: tiktoken ranks <-> HF tokenizer.json ---

# (the tokenizer.json layouts we write and read: data.py's BYTE_CHARS, BPE_MODEL and
# split_pre_tokenizer)

def hf_tokenizer_files(tok, max_len):
    """HF tokenizer files (tokenizer.json as allenai_dolma2.json) that tokenize as data.py."""
    enc, ranks = tok.enc, tok.enc._mergeable_ranks

    def text(b):  # bytes -> BPE characters
        return "".join(data.BYTE_CHARS[x] for x in b)

    merges = []  # in rank order: tiktoken's priority
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 1:  # its merge: tiktoken's BPE on its bytes, lower ranks only
            pairs = [ranks.get(a + b, math.inf) for a, b in zip(parts, parts[1:])]
            i = pairs.index(min(pairs))
            if pairs[i] >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) > 2:
            raise ValueError(f"rank {rank} ({token!r}) is not the merge of two lower ranks: not a "
                             "BPE vocabulary")
        if len(parts) == 2:
            merges.append(" ".join(map(text, parts)))
    # special: as allenai's files, "<|...|>" but dolma2's "<|extra_id_N|>" (OLMo 1's "|||...|||"
    # and runs of spaces are not special either)
    added = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False,
                  normalized=s in tok.normalized_added,
                  special=s.startswith("<|") and not s.startswith("<|extra_id_"))
             for s, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])]
    vocab = {text(t): r for t, r in ranks.items()}
    # HF gives an added token missing from the vocab the next id past it: right for ours and
    # dolma2 (added tokens after the ranks), not for OLMo 1 (0 and 1 are added tokens), whose
    # vocab lists them, as allenai's file does
    if sorted(ranks.values()) != list(range(len(ranks))):
        vocab.update(enc._special_tokens)
    # ignore_merges: tiktoken's shortcut, a whole token stays one
    bpe = dict(**data.BPE_MODEL, ignore_merges=True, vocab=vocab, merges=merges)
    to_text = dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True, use_regex=True)
    normalizer = tok.normalizer and dict(type=tok.normalizer)  # (OLMo 1: NFC)
    tj = dict(version="1.0", truncation=None, padding=None, added_tokens=added,
              normalizer=normalizer, pre_tokenizer=data.split_pre_tokenizer(enc._pat_str),
              post_processor=None, decoder=to_text, model=bpe)
    eos, pad = enc.decode([tok.eos_id]), enc.decode([tok.pad_id])
    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    specials = dict(bos_token=eos, eos_token=eos, pad_token=pad, unk_token=eos)
    # not GPT2Tokenizer: transformers 5 would rebuild GPT-2's pre-tokenizer
    cfg = dict(add_bos_token=False, add_eos_token=False, added_tokens_decoder=decoder, **specials,
               clean_up_tokenization_spaces=False, model_max_length=max_len,
               tokenizer_class="PreTrainedTokenizerFast")
    return {"tokenizer.json": json.dumps(tj, ensure_ascii=False) + "\n",
            "tokenizer_config.json": _json(cfg, ensure_ascii=False),
            "special_tokens_map.json": _json(specials)}


# What hf_tokenizer_files writes, and a soup copies from its sources
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_hf_tokenizer(d):
    """d's tokenizer.json (ours, dolma2 or OLMo 1) -> data.Tokenizer, with EOS and PAD
    as d's tokenizer_config.json names them, or None; another layout, or a damaged file, is a
    ValueError naming it (data.read_tokenizer_json)."""
    path = Path(d) / "tokenizer.json"
    if not path.is_file():
        return None
    return data.load_tokenizer(str(path))


# --- soups ---

def soup(srcs, out):
    """The fp32 average of checkpoints of one model (any formats), as OLMo 2's recipe."""
    first, *rest = sources = [open_source(s) for s in srcs]
    for s in rest:
        if diff := first.m.differences(s.m):
            raise ConfigError(f"{s.path} is a different model from {first.path} "
                              f"({'; '.join(diff)})")
    n = np.float32(len(sources))

    def mean(k):
        return sum(s.tensors[k].load().astype(np.float32) for s in sources) / n

    tensors = {k: Lazy(t.shape, t.dtype, functools.partial(mean, k))
               for k, t in first.tensors.items()}
    # the tokenizer files go with the soup, so eval.py reads it as it reads its sources
    folders = [s.path if s.path.is_dir() else s.path.parent for s in sources]
    texts = [{n: (d / n).read_text() for n in TOKENIZER_FILES if (d / n).is_file()}
             for d in folders]
    for s, own in zip(rest, texts[1:]):
        if own and texts[0] and own != texts[0]:
            raise ConfigError(f"{s.path} has other tokenizer files than {first.path}")
    return write_checkpoint(out, first.m, tensors, files=texts[0])


# --- check: two models on the same tokens ---

def load_tokens(path, seq_len=None, rows=0):
    """(B, T) int64 from a .npy (no pickles) or a token file, 1-D cut into rows."""
    with open(path, "rb") as f:
        is_npy = f.read(6) == b"\x93NUMPY"
    try:
        a = np.load(path, allow_pickle=False) if is_npy else data.open_token_file(path).array()
    except ValueError as e:  # an object array (pickles: never loaded), or damage
        raise ValueError(f"{path}: not a readable array of token ids ({e}); pass an integer .npy "
                         "(int32, int64, uint16, uint32) or a token file") from None
    if a.ndim not in (1, 2) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{path}: {a.dtype} values of shape {a.shape}; pass integer ids, (T,) "
                         "or (B, T)")
    T = seq_len or a.shape[-1] or 1
    out = (a[:len(a) // T * T].reshape(-1, T) if a.ndim == 1 else a[:, :T])[:rows or None]
    if not out.size or out.shape[1] < T:
        raise ValueError(f"{path}: token ids of shape {a.shape} hold no full row of {T} "
                         f"(--seq-len {seq_len})")
    return np.asarray(out, np.int64)


def open_runner(spec, dtype="float32"):
    """'jax:DIR' / 'torch:DIR' (ours) or 'hf:DIR' -> (run: (1, T) -> fp32 (T, V), V, label, m)."""
    kind, sep, path = spec.partition(":")
    if not sep or kind not in ("jax", "torch", "hf"):
        kind, path = "jax", spec
    import torch
    dt = getattr(torch, dtype)
    if kind == "hf":
        import transformers
        net = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dt, local_files_only=True).eval()
        m = None

        def fwd(t):
            return net(t).logits
        V = net.config.vocab_size
        label = f"hf:{path} (transformers {transformers.__version__}, {type(net).__name__})"
    else:
        s = open_source(path)
        m = s.m
        V = s.m.vocab_size
        label = f"{kind}:{path} (ours, {s.kind} format, {s.m.family})"
        params = stack_layers({k: t.load().astype(np.float32) for k, t in s.tensors.items()}, m)
        if kind == "jax":
            import jax
            import jax.numpy as jnp
            params = {k: jnp.asarray(v) for k, v in params.items()}
            cdt = jnp.dtype(dtype)
            jit = jax.jit(lambda p, t: model.forward(p, t, m, cdt)[0].astype(np.float32))
            return (lambda tokens: np.asarray(jit(params, jnp.asarray(tokens)))), V, label, m
        net = model.torch_model(m, params).eval()
        del params
        fwd = functools.partial(net, dtype=dt)

    @torch.no_grad()
    def run(tokens):
        return fwd(torch.from_numpy(tokens))[0].float().numpy()
    return run, V, label, m


def compare_logits(a, b, rows=256):
    """Per position KL(A||B) (nats), top-1 agreement, max |logit difference|, in float64, over
    min(V_A, V_B) ids (the rest: padding one side lacks)."""
    V = min(a.shape[-1], b.shape[-1])
    kl = []
    agree = []
    diff = 0.0
    for i in range(0, len(a), rows):
        x, y = a[i:i + rows, :V].astype(np.float64), b[i:i + rows, :V].astype(np.float64)
        lx, ly = (z - z.max(-1, keepdims=True) for z in (x, y))
        lx, ly = (z - np.log(np.exp(z).sum(-1, keepdims=True)) for z in (lx, ly))  # log-softmax
        kl.append((np.exp(lx) * (lx - ly)).sum(-1))
        agree.append(x.argmax(-1) == y.argmax(-1))
        diff = max(diff, float(np.abs(x - y).max()))
    return np.concatenate(kl), np.concatenate(agree), diff


def check(a, b, tokens, dtype="float32"):
    """Models A and B on tokens (B, T), row by row: print how close they are."""
    run_a, Va, label_a, m = open_runner(a, dtype)
    run_b, Vb, label_b, _ = open_runner(b, dtype)
    if m is not None:
        model.check_tokens(tokens, m)
    if tokens.max() >= (V := min(Va, Vb)):
        raise ValueError(f"token id {tokens.max()} is out of range for vocab {V}")
    rows = data.Progress(tokens, desc="check", disable=len(tokens) < 2)
    kls, agrees, diffs = zip(*[compare_logits(run_a(row[None]), run_b(row[None])) for row in rows])
    kl, agree = np.concatenate(kls), np.concatenate(agrees)
    sizes = f" (A has {Va}, B {Vb})" if Va != Vb else ""
    print(f"A = {label_a}\nB = {label_b}\n{len(tokens)} x {tokens.shape[1]} tokens, {dtype} "
          f"compute, compared over {V} ids{sizes}")
    print(f"KL(A||B) per token: mean {kl.mean():.3e}  max {kl.max():.3e}   top-1 agreement "
          f"{100 * agree.mean():.2f}% ({agree.sum()}/{agree.size})   "
          f"max |logit A - logit B| {max(diffs):.4g}")


# --- command line: one function per command ---

DTYPE_NAMES = ["float32", "bfloat16"]


def _source_args(arg):  # the arguments convert and info share
    arg("src")
    arg("--config", help="SRC's config.json / config.yaml, if not beside its weights")


def convert_command(arg, parse):
    _source_args(arg)
    arg("out")
    arg("--to-hf", action="store_true", help="release-style: shards, tokenizer, generation config")
    arg("--dtype", choices=DTYPE_NAMES, help="cast every tensor (default: keep their dtypes)")
    arg("--tokenizer", help="with --to-hf: dolma2, olmo1, a ranks file or a tokenizer.json "
        "(default: SRC's tokenizer.json, else dolma2 if SRC's ids are)")
    arg("--shard-size", type=in_range(float, 0, open_lo=True), default=5.0,
        help="with --to-hf: GiB per shard")
    a = parse()
    s, m = convert(a.src, a.out, a.to_hf, a.dtype, a.tokenizer, a.config, a.shard_size)
    n = sum(math.prod(t.shape) for t in s.tensors.values())
    print(f"{a.src} ({s.kind}, {m.family}, {n:,} params) -> {a.out}")


def check_command(arg, parse):
    arg("a", help="jax:DIR or torch:DIR (ours, any SRC format; bare DIR: jax) or hf:DIR")
    arg("b")
    arg("--tokens", required=True, help=".npy of ids, (B, T) or (N,), or a token file")
    arg("--seq-len", type=in_range(int, 1), help="T: 1-D ids cut into rows of T, rows cut to T")
    arg("--rows", type=in_range(int, 0), default=0, help="only the first N rows (0 = all)")
    arg("--dtype", choices=DTYPE_NAMES, default="float32", help="both models' compute dtype")
    a = parse()
    check(a.a, a.b, load_tokens(a.tokens, a.seq_len, a.rows), a.dtype)


def soup_command(arg, parse):
    arg("ckpts", nargs="+")
    arg("--out", required=True)
    a = parse()
    soup(a.ckpts, a.out)
    print(f"{a.out}: the average of {len(a.ckpts)} checkpoints")


def info_command(arg, parse):
    from configs import Config, describe
    _source_args(arg)
    a = parse()
    s = open_source(a.src, a.config)
    print(f"{s.path}: {s.kind} format\n{describe(Config(model=s.m))}")
    for name, t in s.tensors.items():
        print(f"{name:<52} {str(t.shape):<18} {t.dtype}")


def main(argv):
    import argparse
    commands = {"check": check_command, "soup": soup_command, "info": info_command}
    cmd = argv[0] if argv and argv[0] in commands else None  # else convert: SRC OUT
    prog = f"convert.py {cmd}" if cmd else "convert.py"
    about = __doc__.split("\n\n")[0] if cmd else __doc__
    ap = argparse.ArgumentParser(prog=prog, description=about,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    rest = argv[1:] if cmd else argv
    commands.get(cmd, convert_command)(ap.add_argument, lambda: ap.parse_args(rest))


if __name__ == "__main__":
    run_cli(main)
