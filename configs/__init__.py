"""The config schema and its loader: dataclass defaults, then TOML files merged left to right, then
dotted `--section.key=value` overrides, each checked against the field's type.

    python model.py configs/olmo2-7b.toml                    # a released shape
    python model.py configs/tiny.toml --model.n_layers=8     # a file plus an override

A TOML file holds only what differs from the defaults below, under `[section]` headers. An
unknown section or key is an error that names the file (or the flag) and suggests a close match.
Derived values (head_dim, n_kv_heads, mlp_hidden, the YaRN attention factor) are filled in one
place, `ModelConfig.__post_init__`, which remembers the formula so `describe()` can print it.
Standard library only: every other file imports this one.
"""

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot be right: the message names the source, the field and the value."""


FAMILIES = {"olmo1", "olmo2", "olmo3"}


@dataclass
class ModelConfig:
    # Which OLMo: olmo1 = pre-norm, parameter-free LayerNorm (HF OlmoForCausalLM); olmo2 = RMSNorm on
    # each sublayer's output + QK-norm (Olmo2ForCausalLM); olmo3 = olmo2 + sliding-window layers and
    # YaRN (Olmo3ForCausalLM). The defaults are the OLMo 2/3 settings at a laptop size.
    family: str = "olmo3"
    d_model: int = 256            # D
    n_layers: int = 4             # L
    n_heads: int = 4              # N query heads
    n_kv_heads: int = 0           # K; 0 = n_heads (no GQA)
    head_dim: int = 0             # H; 0 = d_model // n_heads
    mlp_hidden: int = 0           # F, per SwiGLU branch (HF intermediate_size); 0 = OLMo-core's llama rule
    vocab_size: int = 100352      # V = embedding rows: dolma2's 100278 ids padded to a multiple of 128
    tie_embeddings: bool = False  # lm_head reuses embed_tokens (OLMo-1B)
    norm_eps: float = 1e-6        # RMSNorm eps; OLMo 1's LayerNorm uses 1e-5 (HF hard-codes it)
    rope_theta: float = 500000.0
    max_seq_len: int = 4096       # HF max_position_embeddings; T in the FLOP count
    clip_qkv: float = 0.0         # olmo1 only: clamp q, k, v to +-clip_qkv (the 0424/0724 releases use 8); 0 = off
    sliding_window: int = 0       # W: a sliding layer's query sees W keys, itself included; 0 = none
    layer_pattern: str = "F"      # S = sliding, F = full attention; repeated to n_layers (OLMo 3: "SSSF")
    yarn_factor: float = 0.0      # YaRN RoPE scaling on full-attention layers only; 0 = off (OLMo 3 long context: 8)
    yarn_original_max_seq_len: int = 8192
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 0.0  # 0 = 0.1·ln(factor) + 1, as HF and OLMo-core
    init: str = "normal"          # normal: truncated normal init_std at +-3σ (OLMo 2/3); mitchell: OLMo 1
    init_std: float = 0.02
    eos_token_id: int = 100257    # written to the HF config.json; dolma2's <|endoftext|>
    pad_token_id: int = 100277    # dolma2's <|pad|>

    def __post_init__(self):
        self.derived = {}  # name -> formula, for describe(); not a field, so not saved
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
            self.derived["n_kv_heads"] = "n_heads"
        if self.head_dim == 0 and self.n_heads > 0:
            self.head_dim = self.d_model // self.n_heads
            self.derived["head_dim"] = "d_model / n_heads"
        if self.mlp_hidden == 0:
            # OLMo-core TransformerConfig.llama_like: int(8·D/3) rounded up to a multiple of 256.
            self.mlp_hidden = 256 * math.ceil(int(8 * self.d_model / 3) / 256)
            self.derived["mlp_hidden"] = "256·ceil(int(8·d_model/3) / 256)"
        if self.yarn_factor and self.yarn_attention_factor == 0:
            self.yarn_attention_factor = 0.1 * math.log(self.yarn_factor) + 1.0
            self.derived["yarn_attention_factor"] = "0.1·ln(yarn_factor) + 1"
        self.validate()

    def validate(self):
        def bad(name, why):
            raise ConfigError(f"model.{name}={getattr(self, name)!r}: {why}")

        if self.family not in FAMILIES:
            bad("family", f"must be one of {sorted(FAMILIES)}")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                bad(name, "must be positive")
        if self.n_heads % self.n_kv_heads:
            bad("n_kv_heads", f"n_heads={self.n_heads} must be a multiple of n_kv_heads (each kv head serves n_heads/n_kv_heads query heads)")
        if self.head_dim % 2:
            bad("head_dim", "must be even: RoPE rotates pairs of dimensions")
        if not self.layer_pattern or set(self.layer_pattern) - {"S", "F"}:
            bad("layer_pattern", "must be a string of S (sliding window) and F (full attention), e.g. 'SSSF'")
        if self.n_layers % len(self.layer_pattern):
            bad("layer_pattern", f"its length {len(self.layer_pattern)} must divide n_layers={self.n_layers}")
        if ("S" in self.layer_pattern) != (self.sliding_window > 0):
            bad("sliding_window", f"layer_pattern={self.layer_pattern!r} needs sliding_window > 0 exactly when it has an S layer")
        if self.sliding_window < 0:
            bad("sliding_window", "must be >= 0")
        if self.family != "olmo3" and (self.sliding_window or self.yarn_factor):
            bad("family", "sliding windows and YaRN need family 'olmo3' (HF Olmo3ForCausalLM)")
        if self.clip_qkv and self.family != "olmo1":
            bad("clip_qkv", "only OLMo 1 clamps q, k, v (HF Olmo2/Olmo3 have no clip_qkv)")
        if self.clip_qkv < 0:
            bad("clip_qkv", "must be >= 0 (0 = off)")
        if self.family == "olmo1" and self.norm_eps != 1e-5:
            bad("norm_eps", "OLMo 1's LayerNorm eps is 1e-5 (HF OlmoLayerNorm hard-codes it)")
        if self.yarn_factor and self.yarn_factor <= 1:
            bad("yarn_factor", "must be > 1 (or 0 for no YaRN)")
        if self.init not in ("normal", "mitchell"):
            bad("init", "must be 'normal' (OLMo 2/3) or 'mitchell' (OLMo 1)")
        for name in ("eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                bad(name, f"must be a token id below vocab_size={self.vocab_size}")

    def layer_types(self):
        """Per-layer "S"/"F", the pattern repeated to n_layers."""
        return self.layer_pattern * (self.n_layers // len(self.layer_pattern))


@dataclass
class DataConfig:
    path: str = "data/tiny"       # a folder from `data.py prepare` (its train split), a mix file, or a token file
    seq_len: int = 256            # T: tokens per instance
    global_batch: int = 16        # G: instances per optimizer step, over all devices
    seed: int = 0                 # the order: epoch e shuffles with PCG64(seed + e), as OLMo-core

    def __post_init__(self):
        for name in ("seq_len", "global_batch"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name}={getattr(self, name)}: must be positive")


@dataclass
class MeshConfig:
    # Devices along each mesh axis; one may be -1 (= what remains). The batch splits over data x fsdp;
    # weights split over fsdp (their embed dimension) and tensor (heads, mlp, vocab). See shard.py.
    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor"):
            if getattr(self, name) == 0 or getattr(self, name) < -1:
                raise ConfigError(f"mesh.{name}={getattr(self, name)}: a positive number of devices, or -1 for the rest")


@dataclass
class TrainConfig:
    run_dir: str = "runs/tiny"    # checkpoints, metrics.jsonl, config.json, loss.png; a rerun resumes from here
    backend: str = "jax"          # jax (any mesh, TPU/GPU/CPU) | torch (one device, or torchrun + FSDP2)
    compile: bool = False         # torch backend: torch.compile each block (JAX always compiles)
    steps: int = 1000             # optimizer steps in this stage
    micro_batch: int = 0          # instances per device per forward/backward; 0 = all of them (no accumulation)
    compute_dtype: str = "float32"  # float32 | bfloat16 (params and optimizer state stay fp32)
    remat: str = "none"           # activation checkpointing: none | block (recompute each layer) | mlp (OLMo 3 mid-training)
    init_seed: int = 0
    init_from: str = ""           # start a new stage from this checkpoint: its params (and moments), step 0
    load_optimizer: bool = True   # with init_from: also take its AdamW moments (OLMo 3 mid-training does)
    lr: float = 4e-4
    schedule: str = "cosine"      # cosine | linear | half_cosine | constant, after a linear warmup
    units: str = "steps"          # steps | tokens: what warmup and t_max count
    warmup: int = 100
    warmup_min_lr: float = 0.0    # OLMo 1 (Feb 2024) warmed up from 0.1·lr
    t_max: int = 0                # schedule length; 0 = this stage's steps (or their tokens)
    alpha_f: float = 0.1          # the schedule ends at alpha_f·lr
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8             # OLMo 1 used 1e-5
    weight_decay: float = 0.1     # on every weight but the embedding (the table's `decay` flag)
    clip: float = 1.0             # global gradient-norm clipping; 0 = off
    z_loss: float = 1e-5          # OLMo 2/3; OLMo 1 had none
    skip_step: bool = False       # OLMo 3: skip updates whose loss or grad norm is a 6σ outlier
    log_every: int = 10
    checkpoint_every: int = 500
    keep: int = 2                 # checkpoints kept (the newest)

    def __post_init__(self):
        choices = dict(backend=("jax", "torch"), compute_dtype=("float32", "bfloat16"), remat=("none", "block", "mlp"), schedule=("cosine", "linear", "half_cosine", "constant"),
                       units=("steps", "tokens"))
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.{name}={getattr(self, name)!r}: must be one of {list(allowed)}")
        for name in ("steps", "log_every", "checkpoint_every", "keep"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)}: must be positive")
        if self.micro_batch < 0 or self.warmup < 0 or self.t_max < 0:
            raise ConfigError("train.micro_batch, train.warmup and train.t_max must be >= 0")


@dataclass
class EvalConfig:
    every: int = 200              # held-out loss and bits per byte every N steps (and at the end); 0 = only at the end
    batches: int = 8              # held-out batches per in-loop eval (the final one uses all); 0 = all
    prompt: str = "It is a truth universally acknowledged"  # sampled from at the end of training; "" = no sample
    sample_tokens: int = 48
    temperature: float = 0.8
    # Downstream tasks (eval.py tasks) scored with the same schedule as the held-out eval, logged as
    # <task>_acc. Single-process runs only; scored by the JAX forward on the gathered params.
    tasks: str = ""               # comma list, e.g. "arc_easy,hellaswag,piqa" (eval.TASKS); "" = none
    tasks_data: str = "../shared/evaldata"  # a folder laid out like ../shared/evaldata (eval.py tasks --data)
    tasks_limit: int = 100        # the first N documents of each task; 0 = all
    tasks_norm: str = "olmes"     # olmes | catwalk: prompts and per-task normalisation (eval.py tasks --norm)

    def __post_init__(self):
        if self.tasks_norm not in ("olmes", "catwalk"):
            raise ConfigError(f"eval.tasks_norm={self.tasks_norm!r}: must be one of ['olmes', 'catwalk']")
        if self.tasks_limit < 0:
            raise ConfigError(f"eval.tasks_limit={self.tasks_limit}: must be >= 0 (0 = all)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --- loading -------------------------------------------------------------------------------------

def _sections():
    return {f.name: f.type for f in dataclasses.fields(Config)}


def _check(section, key, value, source):
    """Type-check one value against the dataclass field; return it (ints widen to float)."""
    sections = _sections()
    if section not in sections:
        hint = difflib.get_close_matches(section, sections, n=1)
        raise ConfigError(f"{source}: unknown section [{section}]" + (f" (did you mean [{hint[0]}]?)" if hint else ""))
    cls = sections[section]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        hint = difflib.get_close_matches(key, names, n=1)
        raise ConfigError(f"{source}: unknown key {section}.{key}" + (f" (did you mean {section}.{hint[0]}?)" if hint else ""))
    want = hints[key]
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:  # exact: a bool is not an int here, an int is not a str
        raise ConfigError(f"{source}: {section}.{key}={value!r} is {type(value).__name__}, expected {want.__name__}")
    return value


def _parse_override(arg):
    """'--model.d_model=512' -> ('model', 'd_model', 512). Values follow TOML; a bare word is a string."""
    body = arg[2:]
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise ConfigError(f"{arg}: overrides look like --section.key=value, e.g. --model.n_layers=8")
    dotted, raw = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load_config(argv):
    """Build a Config from TOML paths and --section.key=value overrides, in the order given."""
    merged, sources = {}, []
    for arg in argv:
        if arg.startswith("--"):
            section, key, value = _parse_override(arg)
            merged.setdefault(section, {})[key] = _check(section, key, value, arg)
            sources.append(arg)
            continue
        path = Path(arg)
        if not path.is_file():
            raise ConfigError(f"config file {arg} not found")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{arg}: not valid TOML: {e}") from e
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{arg}: top-level key {section!r} must sit under a [section] header such as [model]")
            for key, value in table.items():
                merged.setdefault(section, {})[key] = _check(section, key, value, arg)
        sources.append(arg)
    return build(merged, " + ".join(sources) or "defaults")


def build(merged, source="config"):
    """Config from {section: {key: value}}; errors from validation name the sources."""
    for section, table in merged.items():
        for key, value in table.items():
            _check(section, key, value, source)
    try:
        return Config(**{s: cls(**merged.get(s, {})) for s, cls in _sections().items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def save_json(cfg, path):
    """The resolved config, every field, as saved with each run."""
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def load_json(path):
    return build(json.loads(Path(path).read_text()), str(path))


def describe(cfg):
    """The resolved config as aligned lines, derived values with their formula."""
    lines = []
    for section in _sections():
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            formula = getattr(sub, "derived", {}).get(f.name)
            lines.append(f"{section}.{f.name:<26} {value!r}" + (f"    = {formula}" if formula else ""))
    return "\n".join(lines)
