"""The config schema and its loader: dataclass defaults, then TOML files (only what differs, under
`[section]` headers) merged left to right, then dotted `--section.key=value` overrides.

    python model.py configs/olmo2-7b.toml                    # a released shape
    python model.py configs/tiny.toml --model.n_layers=8     # a file plus an override

Standard library only: everything imports it. Notes on the fields: docs/design.md#config-notes.
"""

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config that cannot be right: the message names the source, the field and the value."""


def _need(cfg, ok, name, why):
    """Unless ok, raise 'section.name=value: why' (section from the class: ModelConfig -> model)."""
    if not ok:
        section = type(cfg).__name__.removesuffix("Config").lower()
        raise ConfigError(f"{section}.{name}={getattr(cfg, name)!r}: {why}")


def _checks(cfg, positive="", nonneg="", unit="", devices="", **choices):
    """Check single fields: each one named (space-separated) > 0, >= 0, in [0, 1), a device count,
    or in its list. Each test fails a NaN (TOML's nan) too."""
    tests = [(positive, lambda v: v > 0, "must be positive"),
             (nonneg, lambda v: v >= 0, "must be >= 0"),
             (unit, lambda v: 0 <= v < 1, "must be in [0, 1)"),
             (devices, lambda v: v > 0 or v == -1,
              "a positive number of devices, or -1 for the rest")]
    for names, ok, why in tests:
        for name in names.split():
            _need(cfg, ok(getattr(cfg, name)), name, why)
    for name, allowed in choices.items():
        _need(cfg, getattr(cfg, name) in allowed, name, f"must be one of {allowed}")


@dataclass
class ModelConfig:
    # Defaults: OLMo 2/3 at a laptop size
    family: str = "olmo3"         # olmo1 | olmo2 (post-norm, QK-norm) | olmo3 (+ windows, YaRN)
    d_model: int = 256            # D
    n_layers: int = 4             # L
    n_heads: int = 4              # N query heads
    n_kv_heads: int = 0           # K; 0 = n_heads (no GQA)
    head_dim: int = 0             # H; 0 = d_model // n_heads
    mlp_hidden: int = 0           # F, per SwiGLU branch (HF intermediate_size); 0 = llama rule
    vocab_size: int = 100352      # V rows: dolma2's 100278 ids padded to a multiple of 128
    tie_embeddings: bool = False  # lm_head reuses embed_tokens (OLMo-1B)
    norm_eps: float = 1e-6        # RMSNorm eps; OLMo 1's LayerNorm uses 1e-5 (HF hard-codes it)
    rope_theta: float = 500000.0
    max_seq_len: int = 4096       # HF max_position_embeddings; T in the FLOP count
    clip_qkv: float = 0.0         # olmo1: clamp q, k, v to +-this (releases 0424/0724: 8); 0 = off
    sliding_window: int = 0       # W: a sliding layer's query sees W keys (itself too); 0 = none
    layer_pattern: str = "F"      # S = sliding, F = full; repeated to n_layers (OLMo 3: "SSSF")
    yarn_factor: float = 0.0      # YaRN on full layers' RoPE; 0 = off (OLMo 3 long context: 8)
    yarn_original_max_seq_len: int = 8192
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 0.0  # 0 = 0.1·ln(factor) + 1, as HF and OLMo-core
    init: str = "normal"          # normal: init_std cut at +-3σ (OLMo 2/3); mitchell: OLMo 1
    init_std: float = 0.02
    eos_token_id: int = 100257    # written to the HF config.json; dolma2's <|endoftext|>
    pad_token_id: int = 100277    # dolma2's <|pad|>
    attention: str = "auto"       # how attention is computed, not what; auto: by device

    def __post_init__(self):
        # A field left at 0 takes its derived value; `derived` (not a field: not saved) its formula
        self.derived = {}
        head_dim = self.d_model // self.n_heads if self.n_heads > 0 else 0
        mlp_hidden = 256 * math.ceil(int(8 * self.d_model / 3) / 256)  # OLMo-core's llama rule
        yarn_attention = 0.1 * math.log(self.yarn_factor) + 1 if self.yarn_factor > 0 else 0.0
        for name, value, formula in [
            ("n_kv_heads", self.n_heads, "n_heads"),
            ("head_dim", head_dim, "d_model / n_heads"),
            ("mlp_hidden", mlp_hidden, "256·ceil(int(8·d_model/3) / 256)"),
            ("yarn_attention_factor", yarn_attention, "0.1·ln(yarn_factor) + 1"),
        ]:
            if getattr(self, name) == 0 and value:
                setattr(self, name, value)
                self.derived[name] = formula
        # In order: each check may rely on those above (n_kv_heads > 0 before n_heads % it)
        _checks(self, positive="d_model n_layers n_heads n_kv_heads head_dim mlp_hidden vocab_size "
                               "max_seq_len",
                nonneg="sliding_window clip_qkv", family=["olmo1", "olmo2", "olmo3"],
                init=["normal", "mitchell"],
                attention=["auto", "xla", "splash", "cudnn", "sdpa", "flex"])
        need = functools.partial(_need, self)
        pattern = self.layer_pattern
        need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", f"n_heads={self.n_heads} must be a "
             "multiple of n_kv_heads (each kv head serves n_heads/n_kv_heads query heads)")
        need(self.head_dim % 2 == 0, "head_dim", "must be even: RoPE rotates pairs of dimensions")
        need(pattern and not set(pattern) - {"S", "F"}, "layer_pattern",
             "must be a string of S (sliding window) and F (full attention), e.g. 'SSSF'")
        need(self.n_layers % len(pattern) == 0, "layer_pattern",
             f"its length {len(pattern)} must divide n_layers={self.n_layers}")
        need(("S" in pattern) == (self.sliding_window > 0), "sliding_window",
             f"layer_pattern={pattern!r} needs sliding_window > 0 exactly when it has an S layer")
        need(self.family == "olmo3" or not (self.sliding_window or self.yarn_factor), "family",
             "sliding windows and YaRN need family 'olmo3' (HF Olmo3ForCausalLM)")
        need(not self.clip_qkv or self.family == "olmo1", "clip_qkv",
             "only OLMo 1 clamps q, k, v (HF Olmo2/3 do not)")
        need(self.family != "olmo1" or self.norm_eps == 1e-5, "norm_eps",
             "OLMo 1's LayerNorm eps is 1e-5 (HF OlmoLayerNorm hard-codes it)")
        need(not self.yarn_factor or self.yarn_factor > 1, "yarn_factor",
             "must be > 1 (or 0 for no YaRN)")
        for name in ("eos_token_id", "pad_token_id"):
            need(0 <= getattr(self, name) < self.vocab_size, name,
                 f"must be a token id below vocab_size={self.vocab_size}")

    def layer_types(self):
        """Per-layer "S"/"F", the pattern repeated to n_layers."""
        return self.layer_pattern * (self.n_layers // len(self.layer_pattern))

    def differences(self, other, ignore=()):
        """'field: this vs other' where two models differ, init and init_std aside (they shape no
        tensor)."""
        skip = ("init", "init_std", *ignore)
        names = [f.name for f in dataclasses.fields(self) if f.name not in skip]
        return [f"{n}: {getattr(self, n)!r} vs {getattr(other, n)!r}" for n in names
                if getattr(self, n) != getattr(other, n)]


@dataclass
class DataConfig:
    path: str = "data/tiny"       # a `data.py prepare` folder (train split), a mix or a token file
    seq_len: int = 256            # T: tokens per instance
    global_batch: int = 16        # G: instances per optimizer step, over all devices
    seed: int = 0                 # the order: epoch e shuffles with PCG64(seed + e), as OLMo-core
    doc_mask: bool = False        # attention kept inside each document (Olmo 3: off in stages 1-2)
    packing: str = "fsl"          # fsl: the stream cut every seq_len | packed: whole docs, padded
    source_group_size: int = 8          # packed: files packed together (Olmo 3 stage 3: 8; SFT: 1)
    source_permutation_seed: int = 123  # packed: random.Random(seed).shuffle of the files first
    long_docs: str = "truncate"         # packed: a doc over seq_len keeps its start, or is cut up
    chat_template: str = "tulu"   # GRPO's prompts (*.jsonl) rendered in it (data.CHAT_TEMPLATES)
    instance_filter: bool = False  # OLMo-core's: no loss on instances of a repeating pattern
    repetition_min_period: int = 1  # the pattern's length in tokens: min..max_period
    repetition_max_period: int = 13
    repetition_max_count: int = 32  # repeats back to back that filter an instance

    def __post_init__(self):
        _checks(self, positive="seq_len global_batch source_group_size repetition_min_period "
                               "repetition_max_period repetition_max_count",
                packing=["fsl", "packed"], long_docs=["truncate", "fragment"],
                chat_template=["tulu", "olmo"])
        _need(self, self.repetition_min_period <= self.repetition_max_period,
              "repetition_min_period",
              f"must be <= repetition_max_period ({self.repetition_max_period})")
        _need(self, self.packing == "fsl" or self.doc_mask, "doc_mask", "packing='packed' puts "
              "several documents in an instance with padding after them: set data.doc_mask=true to "
              "keep them apart")


@dataclass
class MeshConfig:
    # Devices along each mesh axis; one may be -1 (= what remains). What splits over which: shard.py
    data: int = -1
    fsdp: int = 1
    context: int = 1              # context parallelism: devices that share one instance's tokens
    tensor: int = 1
    device: str = ""              # the target `train.py plan` fits to (shard.DEVICES); "" = none
    devices: int = 0              # the target's JAX devices (v5p-512: 256 chips); 0 = none

    def __post_init__(self):
        _checks(self, devices="data fsdp context tensor", nonneg="devices")


@dataclass
class TrainConfig:
    # run
    run_dir: str = "runs/tiny"    # checkpoints, metrics.jsonl, config.json, loss.png; reruns resume
    backend: str = "jax"          # jax: any mesh, TPU/GPU/CPU | torch: a device or torchrun + FSDP2
    compile: bool = False         # torch backend: torch.compile each block (JAX always compiles)
    steps: int = 1000             # optimizer steps in this stage
    micro_batch: int = 0          # instances per device per pass; 0 = all of them (no accumulation)
    compute_dtype: str = "float32"  # float32 | bfloat16 (params and optimizer state stay fp32)
    remat: str = "none"           # activation checkpoints: none | block | mlp (OLMo 3 mid-training)
    loss_chunks: int = 8          # JAX: the head and softmax in this many passes over the positions
    scan_layers: bool = True      # JAX: loop over layers (compile time flat in L); false unrolls
    init_seed: int = 0
    init_from: str = ""           # a new stage from this checkpoint's params (and moments), step 0
    load_optimizer: bool = True   # init_from: also its AdamW moments (OLMo 3 mid-training does)
    # schedule
    lr: float = 4e-4
    schedule: str = "cosine"      # cosine | linear | half_cosine | constant, after a linear warmup
    units: str = "steps"          # steps | tokens: what warmup and t_max count
    warmup: int = 100
    warmup_min_lr: float = 0.0    # OLMo 1 (Feb 2024) warmed up from 0.1·lr
    t_max: int = 0                # schedule length; 0 = this stage's steps (or their tokens)
    alpha_f: float = 0.1          # the schedule ends at alpha_f·lr
    # optimizer
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8             # OLMo 1 used 1e-5
    weight_decay: float = 0.1     # on every weight but the embedding (the table's `decay` flag)
    clip: float = 1.0             # global gradient-norm clipping; 0 = off
    # stability
    z_loss: float = 1e-5          # OLMo 2/3; OLMo 1 had none
    skip_step: bool = False       # OLMo 3: skip updates whose loss or grad norm is a 6σ outlier
    # checkpoints (and logging)
    log_every: int = 10
    checkpoint_every: int = 500
    keep: int = 2                 # checkpoints kept (the newest)
    # post-training (docs/posttrain.md)
    loss: str = "ce"              # ce: cross-entropy (pretraining, SFT) | dpo | dpo_norm | grpo
    epochs: int = 0               # > 0: steps = epochs x the data's steps per epoch
    warmup_fraction: float = 0.0  # > 0: warmup = this fraction of steps (SFT 0.03, DPO 0.1)
    dpo_beta: float = 0.1         # β: 0.1 for sigmoid DPO (Tulu 2), 5 for dpo_norm (OLMo 2/3)
    grpo_group: int = 8           # GRPO: completions per prompt (Olmo 3: 8), in global_batch
    grpo_max_new: int = 8         # GRPO: tokens per completion at most
    grpo_temperature: float = 1.0  # GRPO: sampling temperature (Olmo 3: 1.0)

    def __post_init__(self):
        _checks(self, positive="steps log_every checkpoint_every keep eps dpo_beta grpo_group "
                               "grpo_max_new loss_chunks grpo_temperature",
                unit="beta1 beta2 warmup_fraction",
                nonneg="micro_batch warmup t_max lr warmup_min_lr alpha_f weight_decay clip "
                       "z_loss epochs",
                backend=["jax", "torch"], compute_dtype=["float32", "bfloat16"],
                units=["steps", "tokens"], remat=["none", "block", "mlp"],
                schedule=["cosine", "linear", "half_cosine", "constant"],
                loss=["ce", "dpo", "dpo_norm", "grpo"])


@dataclass
class EvalConfig:
    every: int = 200              # held-out loss and bits/byte every N steps; 0 = only at the end
    batches: int = 8              # held-out batches per in-loop eval (the last uses all); 0 = all
    prompt: str = "It is a truth universally acknowledged"  # sampled at the end; "" = no sample
    sample_tokens: int = 48
    temperature: float = 0.8
    tasks: str = ""               # eval.TASKS run with the held-out eval, e.g. "arc_easy,piqa"
    tasks_data: str = "../shared/evaldata"  # a folder laid out like it (eval.py tasks --data)
    tasks_limit: int = 100        # the first N documents of each task; 0 = all
    tasks_norm: str = "olmes"     # olmes | catwalk | olmo_core: task definitions (eval.py --norm)

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


# --- loading -------------------------------------------------------------------------------------

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}  # "model" -> ModelConfig, ...


def _hint(word, known, show="{}"):
    """' (did you mean X?)' for the closest of `known`, X written show.format(it); "" if none."""
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {show.format(close[0])}?)" if close else ""


def _typed(section, key, value, source):
    """One value checked against its dataclass field's type; returned (ints widen to float)."""
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]"
                          + _hint(section, SECTIONS, "[{}]"))
    types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}
    if key not in types:
        raise ConfigError(f"{source}: unknown key {section}.{key}"
                          + _hint(key, types, section + ".{}"))
    want = types[key]
    value = float(value) if want is float and type(value) is int else value
    if type(value) is not want:  # exact: a bool is not an int here, an int is not a str
        raise ConfigError(f"{source}: {section}.{key}={value!r} is {type(value).__name__}, "
                          f"expected {want.__name__}")
    return value


def _read(arg):
    """{section: {key: value}} of one argument: a --section.key=value override or a TOML file."""
    if arg.startswith("--"):
        dotted, eq, raw = arg[2:].partition("=")
        if not eq or not re.fullmatch(r"\w+\.\w+", dotted, re.ASCII):
            raise ConfigError(f"{arg}: overrides look like --section.key=value, "
                              "e.g. --model.n_layers=8")
        try:  # a dotted TOML key is {section: {key: value}}
            return tomllib.loads(f"{dotted} = {raw}")
        except tomllib.TOMLDecodeError:  # a bare word is a string
            return tomllib.loads(f"{dotted} = {json.dumps(raw)}")
    if not Path(arg).is_file():
        raise ConfigError(f"config file {arg} not found")
    try:
        return tomllib.loads(Path(arg).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{arg}: not valid TOML: {e}") from e


def load_config(argv):
    """A Config from TOML paths and --section.key=value overrides, merged in order; errors name the
    argument."""
    merged = {}
    for arg in argv:
        for section, table in _read(arg).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{arg}: top-level key {section!r} must sit under a [section] "
                                  "header such as [model]")
            for key, value in table.items():
                merged.setdefault(section, {})[key] = _typed(section, key, value, arg)
    return build(merged, " + ".join(argv) or "defaults")


def build(merged, source="config"):
    """Config from {section: {key: value}}; errors name the sources."""
    merged = {s: {k: _typed(s, k, v, source) for k, v in table.items()}
              for s, table in merged.items()}
    try:
        return Config(**{s: cls(**merged.get(s, {})) for s, cls in SECTIONS.items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


to_dict = dataclasses.asdict  # the config as plain {section: {key: value}}


def save_json(cfg, path):
    """The resolved config, every field, as saved with each run."""
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def load_json(path):
    return build(read_json(path), str(path))


def read_json(path, fix="the file is damaged: restore it or write it again"):
    """A JSON file's value; if it does not parse, an error naming the file and what to do."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e}); {fix}") from None


def describe(cfg):
    """The resolved config as aligned lines, derived values with their formula."""
    lines = []
    for section in SECTIONS:
        derived = getattr(getattr(cfg, section), "derived", {})
        for key, value in to_dict(getattr(cfg, section)).items():
            formula = f"    = {derived[key]}" if key in derived else ""
            lines.append(f"{section}.{key:<26} {value!r}{formula}")
    return "\n".join(lines)


# --- command lines -------------------------------------------------------------------------------

def run_cli(main, argv=None):
    """Every script's entry point: bad input (ValueError, OSError, a non-finite loss) prints its
    one-line error and exits 1; bugs (other exceptions), or all with NANOLMO_TRACEBACK=1, raise."""
    name = Path(main.__code__.co_filename).name
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except (ValueError, OSError, FloatingPointError) as e:
        if os.environ.get("NANOLMO_TRACEBACK"):
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C unhandled: stop as the shell expects (128 + SIGINT)
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)


def in_range(kind, lo, hi=math.inf, open_lo=False):
    """An argparse type: a `kind` in [lo, hi] ((lo, hi] if open_lo); else a usage error (exit 2)."""
    def parse(text):
        v = kind(text)  # a ValueError here: argparse says "invalid int value"
        if not (lo < v if open_lo else lo <= v) or not v <= hi:
            low = f"{'>' if open_lo else '>='} {lo}"
            span = f"in {'(' if open_lo else '['}{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{text}: must be {low if hi == math.inf else span}")
        return v
    parse.__name__ = kind.__name__
    return parse
