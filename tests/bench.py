"""The benchmarks: each prints a table of speed or memory, side by side, measured in one run.

    python tests/bench.py train configs/tiny.toml [--key=value ...]  # tokens/s: JAX, torch, transformers
    python tests/bench.py attention                    # sliding vs full layers: what a window saves
    python tests/bench.py data                         # the data pipeline's throughput
    python tests/bench.py generate olmo2-1b|olmo3-7b   # a released shape: nanolmo vs transformers

They live here, not in the files a learner reads; `python tests/tables.py` runs them to regenerate
the tables in docs/ (each table shows its command).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# --- train: a few steps of a config in each backend ---------------------------------------------

def bench_rows(cfg, platform, cuda):
    """[(label, dtype, on the accelerator, make)] of the train bench, make(tokens) -> (step, peak
    FLOP/s, devices): the rows that can run here (docs/training.md)."""
    import dataclasses
    import importlib.util
    from functools import partial

    import model
    import train
    from configs import build, to_dict
    m, tc = cfg.model, cfg.train
    dtypes = ("float32", "bfloat16")
    rows = []

    def changed(**sections):  # the config with {section: {key: value}} changed
        return build({k: {**v, **sections.get(k, {})} for k, v in to_dict(cfg).items()})

    for dtype in dtypes:
        for attention in {"tpu": ["splash", "xla"], "gpu": ["cudnn", "xla"]}.get(platform, ["xla"]):
            try:
                model.pick_attention(dataclasses.replace(m, attention=attention), dtype)
            except ValueError:
                continue  # (cudnn in fp32)
            run = changed(model=dict(attention=attention), train=dict(compute_dtype=dtype))
            label = f"nanolmo JAX {attention} ({platform}, {dtype})"
            make = partial(nanolmo_step, train.JaxBackend, run)
            rows.append((label, dtype, platform != "cpu", make))
    if platform != ("gpu" if cuda else "cpu"):
        return rows  # torch is on another device than JAX (a TPU host): it would compare machines
    device = "cuda" if cuda else "cpu"
    for dtype in dtypes if cuda else (tc.compute_dtype,):  # (torch's bf16 on a CPU is not its path)
        for attention in ["sdpa", "flex"] if cuda else ["sdpa"]:
            for compiled in (False, True):
                run = changed(model=dict(attention=attention),
                              train=dict(compute_dtype=dtype, compile=compiled))
                how = "compiled" if compiled else "eager"
                label = f"nanolmo torch {attention} {how} ({device}, {dtype})"
                rows.append((label, dtype, cuda, partial(nanolmo_step, train.TorchBackend, run)))
    if importlib.util.find_spec("transformers"):  # a test extra: without it, no reference row
        for dtype in dtypes if cuda else ("float32",):
            label = f"transformers ({device}, {dtype})"
            rows.append((label, dtype, cuda, partial(transformers_step, cfg, device, dtype)))
    return rows


def nanolmo_step(backend_cls, cfg, tokens):
    """A train step of a nanolmo backend on its own state -> (step, peak FLOP/s, devices)."""
    backend = backend_cls(cfg)
    backend.init(0)

    def step():
        return backend.step(dict(tokens=tokens), cfg.train.lr)
    return step, backend.peak, backend.n_devices


def transformers_step(cfg, device, dtype, tokens):
    """transformers' model of the shape, torch.optim.AdamW; bf16: autocast, fp32 weights."""
    import numpy as np
    import torch
    import transformers

    import convert
    import train
    m, tc = cfg.model, cfg.train
    hf_cfg = {k: v for k, v in convert.config_to_hf(m).items() if k != "architectures"}
    hf_cfg = transformers.AutoConfig.for_model(**hf_cfg)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(device)  # (in train mode)
    optim = torch.optim.AdamW(hf.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                              weight_decay=tc.weight_decay)
    ids = torch.from_numpy(tokens.astype(np.int64)).to(device)
    autocast = torch.autocast(device, getattr(torch, dtype), enabled=dtype != "float32")

    def step():
        with autocast:
            loss = hf(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.clip or 1e9)
        optim.step()
        optim.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()  # (the JAX rows block on their output)
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return step, train.peak_flops(kind), 1


def train_bench(argv, steps=10, rounds=3, seconds=5.0):
    """Tokens/s of train steps of the configured model and batch, every bench_rows row in one
    process: 2 untimed steps, then the best of `rounds` rounds of `steps` steps (fewer past
    `seconds`); how rows share the device: docs/training.md."""
    import gc
    import os
    import time

    import jax
    import numpy as np
    import torch

    import model
    from configs import load_config
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else JAX takes 75% of a GPU
    cfg = load_config(argv)
    m, B, T = cfg.model, cfg.data.global_batch, cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (B, T)).astype(np.int32)
    flops = model.flops_per_token(m, T)
    platform = jax.default_backend()
    rows = bench_rows(cfg, platform, torch.cuda.is_available())
    if platform == "cpu":  # (shared, noisy) all at once, taking turns round by round
        groups = [list(range(len(rows)))]
    else:  # each alone, freed before the next; JAX's last: its allocator keeps what it took
        later = lambda i: rows[i][0].startswith("nanolmo JAX")  # noqa: E731
        groups = [[i] for i in sorted(range(len(rows)), key=later)]
    best, reps, peaks = [0.0] * len(rows), [steps] * len(rows), [None] * len(rows)
    for group in groups:
        made = {i: rows[i][3](tokens) for i in group}  # i -> (step, peak, devices)
        # Round -1: 2 steps each, not counted (compiles, warm caches); the second sets reps
        for r in range(-1, rounds):
            for i, (step, _, _) in made.items():
                if r < 0:
                    jax.block_until_ready(step())
                t0 = time.perf_counter()
                for _ in range(1 if r < 0 else reps[i]):
                    out = step()
                jax.block_until_ready(out)  # the JAX steps are still running
                dt = time.perf_counter() - t0
                if r < 0:
                    reps[i] = max(1, min(steps, int(seconds / dt)))
                else:
                    best[i] = max(best[i], reps[i] * B * T / dt)
        for i, (_, peak, devices) in made.items():
            peaks[i] = peak and peak * devices
        del made, step, out
        gc.collect()  # the row's state, before the next row's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    refs = {dtype: tps for (label, dtype, *_), tps in zip(rows, best) if "transformers" in label}
    print(f"{'':<52} {'tokens/s':>10} {'vs transformers':>16} {'MFU':>6} {'GFLOP/s':>9}")
    for (label, dtype, _, _), tps, peak in zip(rows, best, peaks):
        ref = refs.get(dtype) or refs.get("float32")
        mfu = f"{100 * flops * tps / peak:.1f}%" if peak else "n/a"
        ratio = f"{tps / ref:.2f}x" if ref else "n/a"
        print(f"{label:<52} {tps:>10,.0f} {ratio:>16} {mfu:>6} {flops * tps / 1e9:>9.1f}")
    how = "the rows taking turns" if platform == "cpu" else "one row at a time"
    malloc = Path(os.environ.get("LD_PRELOAD") or "glibc").name
    print(f"(B={B}, T={T}, {model.count_params(m):,} params; best of {rounds} rounds of "
          f"{'/'.join(map(str, sorted(set(reps))))} steps each, {how}, one process; each ratio "
          f"against transformers in its dtype where that has a row; malloc: {malloc})")


# --- attention: sliding-window vs full layers ---------------------------------------------------

def attention_bench(argv):
    raise NotImplementedError  # moved here from model.py


# --- data: the pipeline's throughput ------------------------------------------------------------

def data_bench(argv):
    raise NotImplementedError  # moved here from data.py


# --- generate: a released shape, nanolmo and transformers side by side --------------------------

def generate_bench(argv):
    raise NotImplementedError  # moved here from eval.py


COMMANDS = {"train": train_bench, "attention": attention_bench, "data": data_bench,
            "generate": generate_bench}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](sys.argv[2:])
