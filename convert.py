"""Checkpoints in and out: safetensors through numpy memmaps, and the Hugging Face bridge (an HF
OLMo / Olmo2 / Olmo3 model directory <-> our config and stacked params).

    python convert.py info HF_DIR        # what the bridge reads from an HF directory: config and tensors

HF names are ours with "model." in front (lm_head.weight has none) and the layer index spelled out;
so conversion is a rename plus stack/unstack (model.stack_layers), never a transpose or a RoPE permute.
Nothing here unpickles: .bin / .pt checkpoints are refused, safetensors are parsed by hand (an
8-byte header length, a JSON header, raw little-endian data) and mapped, not read into memory.
"""

import json
import math
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from configs import ConfigError, ModelConfig
from model import param_table, stack_layers, unstack_layers

# --- safetensors, read and written with numpy ---------------------------------------------------

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def read_safetensors(path, writable=False):
    """name -> numpy array backed by a memmap of `path` (read-only unless `writable`), plus __metadata__."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short to be a safetensors file")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path}: header claims {n} bytes but the file has {size}: truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    # A plain ndarray view of the map: still read lazily, and without np.memmap's reshape quirks (no 0-d arrays).
    mode = "r+" if writable else "r"
    data = np.memmap(path, np.uint8, mode, offset=8 + n, shape=(data_size,)).view(np.ndarray) if data_size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}, not one of {sorted(DTYPES)}")
        dtype = np.dtype(DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        want = math.prod(info["shape"]) * dtype.itemsize
        if end - start != want or not 0 <= start <= end <= data_size:
            raise ValueError(f"{path}: tensor {name} {info['dtype']}{info['shape']} needs bytes [{start}, {start + want}) "
                             f"of {data_size}: the file is truncated or corrupt")
        out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out, metadata


def _header(entries, metadata):
    """The safetensors header for {name: (shape, numpy dtype)}, tensors laid out in order."""
    header, offset = {}, 0
    for name, (shape, dtype) in entries.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    return len(blob).to_bytes(8, "little") + blob, offset


def write_safetensors(path, tensors, metadata=None):
    """Write atomically: into PATH.tmp, fsync, then rename, so a crash leaves the old file intact."""
    path = Path(path)
    arrays = {name: np.asarray(a, order="C") for name, a in tensors.items()}  # (ascontiguousarray would make 0-d 1-d)
    head, _ = _header({k: (a.shape, a.dtype) for k, a in arrays.items()}, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for a in arrays.values():
            f.write(a.tobytes())  # one tensor at a time: peak memory is the largest tensor, not the file
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def allocate_safetensors(path, entries, metadata=None):
    """Write the header for {name: (shape, dtype)} and size the file (sparse), for writers that then
    fill their own slices through read_safetensors(path, writable=True): several processes, one file."""
    head, size = _header(entries, metadata)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + size)


# --- HF config.json <-> ModelConfig --------------------------------------------------------------

FAMILY_OF = {"olmo": "olmo1", "olmo2": "olmo2", "olmo3": "olmo3"}
HF_CLASS = {"olmo1": ("olmo", "OlmoForCausalLM"), "olmo2": ("olmo2", "Olmo2ForCausalLM"),
            "olmo3": ("olmo3", "Olmo3ForCausalLM")}


def _rope_from_hf(hf, source):
    """(theta, yarn settings or None). Reads both styles: transformers 5's `rope_parameters` (flat, or
    keyed by layer type for Olmo3) and 4.x's top-level `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params is None:  # 4.x style
        theta = hf.get("rope_theta", 500000.0 if hf["model_type"] == "olmo3" else 10000.0)
        if hf["model_type"] == "olmo3" and theta != 500000.0:
            raise ConfigError(f"{source}: a top-level rope_theta={theta} in an Olmo3 config: transformers 4 and 5 read "
                              "it differently (5 keeps 500000 on sliding layers); write rope_parameters per layer type")
        full, sliding = {"rope_theta": theta, **(hf.get("rope_scaling") or {})}, {"rope_theta": theta}
    elif "full_attention" in params or "sliding_attention" in params:  # 5.x, per layer type
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {"rope_theta": full.get("rope_theta")}
    else:
        full = sliding = params
    theta = full.get("rope_theta", 10000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise ConfigError(f"{source}: RoPE scaling on sliding-window layers is not supported (OLMo 3 scales full layers only)")
    if sliding.get("rope_theta", theta) != theta:
        raise ConfigError(f"{source}: different rope_theta for sliding ({sliding['rope_theta']}) and full ({theta}) layers is not supported")
    if kind == "default":
        return float(theta), None
    if kind != "yarn" or full.get("mscale") or full.get("mscale_all_dim"):
        raise ConfigError(f"{source}: RoPE scaling {full} is not supported (only plain YaRN, as OLMo 3)")
    return float(theta), dict(yarn_factor=float(full["factor"]),
                              yarn_original_max_seq_len=int(full["original_max_position_embeddings"]),
                              yarn_beta_fast=float(full.get("beta_fast") or 32.0),
                              yarn_beta_slow=float(full.get("beta_slow") or 1.0),
                              yarn_attention_factor=float(full.get("attention_factor") or 0.0))


def _shortest_period(s):
    return next(s[:n] for n in range(1, len(s) + 1) if len(s) % n == 0 and s[:n] * (len(s) // n) == s)


def config_from_hf(hf, source="config.json"):
    if hf.get("model_type") not in FAMILY_OF:
        raise ConfigError(f"{source}: model_type {hf.get('model_type')!r} is not an OLMo ({sorted(FAMILY_OF)})")
    if hf.get("attention_bias") or hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: attention_bias / hidden_act other than false / silu are not OLMo")
    family = FAMILY_OF[hf["model_type"]]
    N, L = hf["num_attention_heads"], hf["num_hidden_layers"]
    theta, yarn = _rope_from_hf(hf, source)
    pattern, window = "F", 0
    if family == "olmo3":
        # HF's default when layer_types is absent: every 4th layer full. (OLMo-core also forces the last
        # layer full; always trust the file's list.)
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(L)]
        kinds = "".join("S" if t == "sliding_attention" else "F" for t in types)
        if "S" in kinds:
            pattern, window = _shortest_period(kinds), hf.get("sliding_window") or 0
    eos = hf.get("eos_token_id")
    eos = (eos[0] if isinstance(eos, list) else eos) or 0
    pad = hf.get("pad_token_id")
    try:
        return ModelConfig(
            family=family, d_model=hf["hidden_size"], n_layers=L, n_heads=N,
            n_kv_heads=hf.get("num_key_value_heads") or N,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // N, mlp_hidden=hf["intermediate_size"],
            vocab_size=hf["vocab_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=1e-5 if family == "olmo1" else float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=theta, max_seq_len=hf.get("max_position_embeddings", 2048),
            clip_qkv=float(hf.get("clip_qkv") or 0.0), sliding_window=window, layer_pattern=pattern,
            init_std=float(hf.get("initializer_range", 0.02)),
            eos_token_id=eos, pad_token_id=eos if pad is None else pad, **(yarn or {}))
    except KeyError as e:
        raise ConfigError(f"{source}: required key {e.args[0]!r} is missing") from None
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_to_hf(m: ModelConfig):
    model_type, arch = HF_CLASS[m.family]
    hf = dict(architectures=[arch], model_type=model_type, vocab_size=m.vocab_size, hidden_size=m.d_model,
              intermediate_size=m.mlp_hidden, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
              num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_act="silu",
              max_position_embeddings=m.max_seq_len, initializer_range=m.init_std, attention_bias=False,
              attention_dropout=0.0, tie_word_embeddings=m.tie_embeddings, bos_token_id=None,
              eos_token_id=m.eos_token_id, pad_token_id=m.pad_token_id, use_cache=True, dtype="float32")
    plain = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.family == "olmo1":
        hf.update(clip_qkv=m.clip_qkv or None, rope_parameters=plain)
    elif m.family == "olmo2":
        hf.update(rms_norm_eps=m.norm_eps, rope_parameters=plain)
    else:
        full = plain
        if m.yarn_factor:
            full = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": m.yarn_factor,
                    "original_max_position_embeddings": m.yarn_original_max_seq_len,
                    "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
                    "attention_factor": m.yarn_attention_factor}
        # Written per layer type (transformers 5 style), so no reader has to guess which layers a
        # top-level rope_theta / rope_scaling belongs to.
        hf.update(rms_norm_eps=m.norm_eps, sliding_window=m.sliding_window or None,
                  layer_types=["sliding_attention" if k == "S" else "full_attention" for k in m.layer_types()],
                  rope_parameters={"full_attention": full, "sliding_attention": plain})
    return hf


# --- HF model directories ------------------------------------------------------------------------

def read_hf_tensors(d):
    """All tensors of an HF directory: model.safetensors, or the shards its index names."""
    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_safetensors(d / shard)[0])
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index}: names {missing[:5]} are listed but not in their shard files")
        return tensors
    if (d / "model.safetensors").is_file():
        return read_safetensors(d / "model.safetensors")[0]
    pickles = [p.name for p in d.glob("*.bin")] + [p.name for p in d.glob("*.pt")]
    why = f" ({', '.join(pickles)} are pickles, which we never load: a downloaded file could run code)" if pickles else ""
    raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json{why}")


def open_hf(d):
    """An HF OLMo directory -> (ModelConfig, tensors: our unstacked names -> memory-mapped arrays), checked
    against config.json. Nothing is read yet: callers take the slices they need (train.py, per device)."""
    d = Path(d)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d / 'config.json'} not found: expected a Hugging Face model directory")
    m = config_from_hf(json.loads((d / "config.json").read_text()), str(d / "config.json"))
    state = {}
    for name, a in read_hf_tensors(d).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # written by old converters; recomputed from the config
        state[name.removeprefix("model.")] = a
    if m.tie_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is embed_tokens
    want = {}
    for name, p in param_table(m).items():
        if name.startswith("layers."):
            want.update({f"layers.{i}.{name[len('layers.'):]}": p.shape[1:] for i in range(m.n_layers)})
        else:
            want[name] = p.shape
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{d}: tensors do not match config.json: missing {missing[:6]}, unexpected {unexpected[:6]}")
    for name, shape in want.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{d}: tensor {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(shape)}")
    return m, state


def load_hf(d):
    """An HF OLMo directory -> (ModelConfig, params: name -> fp32 numpy, stacked on L), all in memory."""
    m, state = open_hf(d)
    return m, {k: v.astype(np.float32) for k, v in stack_layers(state, m).items()}


def save_hf(d, m, params, dtype=np.float32):
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {(k if k == "lm_head.weight" else "model." + k): np.asarray(v).astype(dtype)
               for k, v in unstack_layers(params).items()}
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
    (d / "config.json").write_text(json.dumps(config_to_hf(m), indent=2) + "\n")


def main(argv):
    if len(argv) != 2 or argv[0] != "info":
        sys.exit(__doc__)
    from configs import Config, describe
    m, params = load_hf(argv[1])
    print(describe(Config(model=m)))
    for name, a in params.items():
        print(f"{name:<44} {str(a.shape):<22}")


if __name__ == "__main__":
    main(sys.argv[1:])
