"""The benchmarks: each prints a table of speed or memory, side by side, measured in one run.

    python tests/bench.py train configs/tiny.toml [--key=value ...]  # JAX, torch, transformers
    python tests/bench.py attention                  # sliding vs full layers: what a window saves
    python tests/bench.py data                       # the data pipeline's throughput
    python tests/bench.py generate olmo2-1b|olmo3-7b # a released shape: nanolmo vs transformers
    python tests/bench.py fsdp configs/olmo2-1b.toml # bytes a sharded step moves; its MFU bound
    python tests/bench.py moe [--dtype both]         # the experts: JAX dense vs grouped, torch
    python tests/bench.py hybrid                     # OLMo Hybrid: its cache and decode against
                                                     # prompt length; the delta rule's two forms

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

    import shard
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
                shard.pick_attention(dataclasses.replace(m, attention=attention), dtype)
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
    """transformers' model of the shape, torch.optim.AdamW, micro-batched as ours; bf16: autocast,
    fp32 weights."""
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

    # train.micro_batch instances a pass, as our rows accumulate (0: all at once): one pass of
    # the device check's 4 x 4,096 tokens holds their 100,352-wide logits at once (6.6 GB fp32)
    micro = tc.micro_batch or len(ids)

    def step():
        for part in ids.split(micro):  # equal parts: the mean of their means is the batch's
            with autocast:
                loss = hf(part, labels=part).loss * len(part) / len(ids)
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
    """Forward + backward time of sliding against full layers on this device's default attention:
    what a window saves. D 256, 4 heads of 64, 2 layers, W 512, B 1."""
    import time
    from functools import partial

    import jax
    import jax.numpy as jnp

    from configs import ModelConfig
    from model import init_params, loss_fn
    from shard import ATTEND, pick_attention

    W = 512
    print(f"{'T':>6} {'impl':>6} {'full ms':>9} {'sliding ms':>11} {'ratio':>6} {'ideal':>6}")
    for T in (2048, 8192):
        times = {}
        for kind in "FS":
            window = W if kind == "S" else 0
            m = ModelConfig(d_model=256, n_layers=2, n_heads=4, mlp_hidden=512, vocab_size=512,
                            max_seq_len=T, layer_pattern=kind, sliding_window=window,
                            eos_token_id=0, pad_token_id=1)
            params = init_params(m, jax.random.PRNGKey(0))
            toks = jnp.zeros((1, T), jnp.int32)  # (B, T)
            impl = pick_attention(m, jnp.float32)  # this device's kernel, as eval.py runs it
            step = jax.jit(jax.grad(partial(loss_fn, m=m, attend_fn=ATTEND[impl])))
            jax.block_until_ready(step(params, toks, toks))  # compile
            t0 = time.perf_counter()
            for _ in range(3):
                jax.block_until_ready(step(params, toks, toks))
            times[kind] = (time.perf_counter() - t0) / 3 * 1e3
        ideal = W / (T / 2)  # keys per query: W against T/2 on average under the causal mask
        ratio = times["S"] / times["F"]
        print(f"{T:>6} {impl:>6} {times['F']:>9.0f} {times['S']:>11.0f} {ratio:>6.2f} "
              f"{ideal:>6.3f}")


# --- data: the pipeline's throughput ------------------------------------------------------------

def data_bench(argv):
    """Tokenization MB/s (one core; all cores through prepare) and Loader tokens/s against a bare
    np.memmap."""
    import argparse
    import functools
    import json
    import os
    import tempfile
    import timeit

    import numpy as np
    import pydoc_data.topics  # English prose that ships with Python itself

    from data import Instances, Loader, load_tokenizer, open_token_file, prepare

    ap = argparse.ArgumentParser(prog="tests/bench.py data", description=data_bench.__doc__)
    ap.parse_args(argv)
    topics, cores = pydoc_data.topics.topics, os.cpu_count()
    seconds = functools.partial(timeit.timeit, number=1)
    text = "\n\n".join(topics.values())
    mb = len(text.encode()) / 1e6
    row = "{:<44} {:<14} {:<16} {}".format  # what, size, rate, note
    print(row("what", "size", "rate", "note"))
    encode = load_tokenizer("dolma2").encode_document
    rate = 3 * mb / seconds(lambda: [encode(text) for _ in range(3)])
    print(row("tokenize, 1 core, dolma2", f"{mb:.2f} MB x3", f"{rate:.2f} MB/s", "per core"))
    with tempfile.TemporaryDirectory() as tmp:
        docs, copies = Path(tmp) / "docs.jsonl", 32
        docs.write_text("".join(json.dumps({"text": f"{r} {v}"}) + "\n"
                                for r in range(copies) for v in topics.values()))
        rate = copies * mb / seconds(
            lambda: prepare([docs], f"{tmp}/prep", "dolma2", workers=cores, quiet=True))
        print(row(f"prepare dolma2, {cores} workers", f"{copies * mb:.1f} MB", f"{rate:.2f} MB/s",
                  f"{rate / cores:.2f} MB/s per core"))
        # Batch assembly from 32M random uint16 tokens, then the same slices from a bare memmap
        # (the floor)
        T, G, steps = 1024, 32, 300
        path = Path(tmp) / "tok.bin"
        np.random.default_rng(0).integers(0, 4096, 1 << 25, dtype=np.uint16).tofile(path)
        loader = Loader(Instances([("b", [open_token_file(path, np.uint16)], None)], T), G, seed=0)
        mm, n = np.memmap(path, np.uint16, "r"), steps * G * T

        def bare(s):  # step s's instances, sliced from the memmap
            return np.stack([mm[i * T:(i + 1) * T] for i in loader.global_ids(s)]).astype(np.int32)

        ours = n / seconds(lambda: [loader.batch(s) for s in range(steps)])
        floor = n / seconds(lambda: [bare(s) for s in range(steps)])
        print(row(f"batch assembly: Loader (G={G}, T={T})", f"{steps} steps",
                  f"{ours / 1e6:.1f} M tok/s", f"{ours / floor:.2f}x bare memmap"))
        print(row("  bare np.memmap, the same instance slices", f"{steps} steps",
                  f"{floor / 1e6:.1f} M tok/s", "1.00x"))


# --- generate: a released shape, nanolmo and transformers side by side --------------------------
# Each runner is a process of its own, so that its peak memory (max RSS, from wait4) is its own.
BENCH_SHAPES = {"olmo2-1b": "configs/olmo2-1b.toml", "olmo3-7b": "configs/olmo3-7b.toml"}
RUNNERS = {"hf": "transformers", "jax": "nanolmo JAX", "torch": "nanolmo torch"}


def bench_checkpoint(shape, root=ROOT / "data/bench"):
    """data/bench/SHAPE: random weights in a release's shape, bf16, made once by transformers (no
    download)."""
    import configs
    import convert
    d = Path(root) / shape
    if (d / "config.json").is_file():
        return d
    import torch
    import transformers
    m = configs.load_config([str(ROOT / BENCH_SHAPES[shape])]).model
    cfg = transformers.AutoConfig.for_model(**{**convert.config_to_hf(m), "dtype": "bfloat16"})
    print(f"writing {d}: random {shape} weights in bf16 (transformers {transformers.__version__})")
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    net.save_pretrained(d.with_name(shape + ".tmp"))
    del net
    convert.replace(d.with_name(shape + ".tmp"), d)
    return d


def timed_generate(ckpt, runner, prompt, n_new):
    """One runner of RUNNERS on ckpt, in its dtype, greedy: {ids, load_s, prefill_s, step_s}."""
    import time

    import numpy as np

    import eval as evaluate
    t0 = time.perf_counter()
    if runner != "hf":
        m, params, dtype = evaluate.load_checkpoint(ckpt)
        load_s = time.perf_counter() - t0
        # compile both steps first, so that prefill times the prompt alone
        if runner == "jax":
            evaluate.generate(params, m, prompt, n_new, runner, dtype)
        ids, t = evaluate.generate(params, m, prompt, n_new, runner, dtype)
        return dict(ids=ids, load_s=load_s, prefill_s=t["prefill_s"], step_s=t["step_s"])
    import torch
    import transformers
    auto = transformers.AutoModelForCausalLM
    net = auto.from_pretrained(ckpt, dtype="auto", local_files_only=True)
    load_s, times = time.perf_counter() - t0, []

    class Clock(transformers.generation.BaseStreamer):  # called with the prompt, then each token
        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass
    start = time.perf_counter()
    out = net.eval().generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, streamer=Clock(),
                              pad_token_id=net.config.pad_token_id)
    return dict(ids=out[0, len(prompt):].tolist(), load_s=load_s, prefill_s=times[1] - start,
                step_s=float(np.median(np.diff(times[1:]))))  # times[1]: the first new token


def agree(a, b):
    """How many leading ids a and b share (bf16 sums can flip random weights' near ties)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def read_bandwidth(gib=1):
    """Memory read bandwidth (bytes/s): torch summing 1 GiB (past the caches), best of 5."""
    import time

    import torch
    x, best = torch.ones(gib * 2**28), float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def generate_bench(argv, prompt_len=32):
    """Peak RSS, load time, prefill and decode tokens/s of RUNNERS on SHAPE, side by side; decode
    against its CPU bound, read bandwidth / weight bytes (docs/evaluation.md)."""
    import argparse
    import json
    import math
    import os
    import subprocess

    import numpy as np

    import convert
    from configs import in_range
    ap = argparse.ArgumentParser(prog="bench.py generate", description=generate_bench.__doc__)
    ap.add_argument("shape", choices=list(BENCH_SHAPES))
    ap.add_argument("--max-new", type=in_range(int, 2), default=16)
    args = ap.parse_args(argv)
    shape, n_new = args.shape, args.max_new
    d = bench_checkpoint(shape)
    m = convert.open_hf(d)[0]
    prompt = np.random.default_rng(0).integers(1000, 50000, prompt_len).tolist()
    rows = {}
    for runner in RUNNERS:
        call = f"bench.timed_generate({str(d)!r}, {runner!r}, {prompt}, {n_new})"
        # this file imported as `bench`: its own folder on the path (it puts the repo's there)
        path = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})"
        code = f"{path}; import bench, json; print(json.dumps({call}))"
        p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)  # ru_maxrss: KiB on Linux
        rows[runner] = dict(json.loads(out.splitlines()[-1]) if status == 0 else {}, status=status,
                            rss=usage.ru_maxrss * 1024)
    ref = rows["hf"]
    if ref["status"]:
        raise RuntimeError(f"transformers' runner failed (wait status {ref['status']})")
    stored = sum(math.prod(s) for s in convert.expected_tensors(m).values()) * 2  # bytes in bf16
    per_token = stored - 2 * m.vocab_size * m.d_model * (not m.tie_embeddings)  # one embedding row
    bw = read_bandwidth()
    print(f"{shape}: {stored / 2e9:.2f}B params, bf16 ({stored / 2**30:.2f} GiB); "
          f"{prompt_len} prompt tokens, {n_new} new, greedy; read bandwidth {bw / 1e9:.1f} GB/s "
          f"-> decode bound {bw / per_token:.2f} tokens/s")
    # same ids: how many of the new ids, from the first, equal transformers'
    print(f"{'':<16}{'peak RSS':>17}{'load':>8}{'prefill':>10}{'decode':>17}{'same ids':>10}")
    for k, r in rows.items():
        memory = f"{RUNNERS[k]:<16}{r['rss'] / 2**30:>7.2f} GiB{r['rss'] / ref['rss']:>5.2f}x"
        if r["status"]:
            killed = os.WIFSIGNALED(r["status"]) and os.WTERMSIG(r["status"]) == 9  # the OOM killer
            why = " (SIGKILL: out of memory?)" * killed
            print(f"{memory}  failed: wait status {r['status']}{why}")
            continue
        speed = f"{prompt_len / r['prefill_s']:>6.1f} t/s{1 / r['step_s']:>6.2f} t/s"
        print(f"{memory}{r['load_s']:>7.1f}s{speed}{ref['step_s'] / r['step_s']:>6.2f}x"
              f"{agree(r['ids'], ref['ids']):>7}/{n_new}")
    return rows


# --- fsdp: what a sharded step moves between devices, read from its compiled program -----------

def collective_bytes(hlo):
    """{(collective, dtype): bytes of its results} over an HLO text, each instruction once (a
    loop's body once, whatever its trip count)."""
    import re
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f16": 2}
    found = {}
    for line in hlo.splitlines():
        op = re.search(r" (all-gather|reduce-scatter|all-reduce)(?:-start)?\(", line)
        if not op:
            continue
        result = line.split(" = ", 1)[1][:op.start() - len(line.split(" = ", 1)[0]) - 3]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            key = (op[1], dtype)
            found[key] = found.get(key, 0) + n * sizes.get(dtype, 4)
    return found


def fsdp_bench(argv):
    """python tests/bench.py fsdp CONFIG [--key=value ...] [--link-gbs 350]: the config's step
    compiled for its mesh on fake CPU devices, at 1 and 2 layers (a layer's collectives are their
    difference; the real step runs them L times), one micro-batch. Per step and device: FLOPs,
    bytes gathered and reduced, their times at the device's peak and at --link-gbs (the NCCL or
    ICI bandwidth you measured: nccl-tests' all_gather busbw), and MFU with the traffic hidden
    under the compute and with it in series. The CPU compiler emits gradient reductions as
    all-reduce; they are counted as the reduce-scatter a GPU or TPU runs ((n-1)/n of the bytes)."""
    import argparse
    import os
    ap = argparse.ArgumentParser(prog="bench.py fsdp", description=fsdp_bench.__doc__)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--link-gbs", type=float, default=350.0)
    args, overrides = ap.parse_known_args(argv)
    from configs import load_config
    cfg = load_config(args.configs + overrides)
    n = cfg.mesh.devices
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    import jax
    import jax.numpy as jnp

    import model
    import shard
    import train
    m, dc, tc = cfg.model, cfg.data, cfg.train
    dp = shard.dp_size(shard.make_mesh(cfg.mesh, jax.devices()[:n]))
    _, micro_batch, accum = shard.check_batch(dc.global_batch, tc.micro_batch, dp, "the mesh")
    unit = len(m.layer_pattern or "F")  # (layers come in whole patterns: SSSF)
    per_layer = {}
    for layers in (1, 2):
        small = load_config(args.configs + overrides + [
            f"--model.n_layers={layers * unit}", "--model.attention=xla",
            # unrolled: a scan's body is in the program once whatever L (1 and 2 would read equal)
            "--train.scan_layers=false",
            f"--data.global_batch={micro_batch * dp}", f"--train.micro_batch={micro_batch}"])
        mesh = shard.make_mesh(small.mesh, jax.devices()[:n])
        table = model.param_table(small.model)
        p_sh, o_sh, h_sh = shard.state_shardings(mesh, table)

        def abstract(shape, dtype, sh):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
        params = {k: abstract(p.shape, jnp.float32, p_sh[k]) for k, p in table.items()}
        opt = dict(m=params, v=params, count=abstract((), jnp.int32, o_sh["count"]))
        hist = jax.tree.map(lambda x: abstract(x.shape, x.dtype, h_sh),
                            jax.eval_shape(train.new_history))
        tokens = abstract((1, micro_batch * dp, dc.seq_len), jnp.int32, shard.batch_sharding(mesh, 3))
        step = train.make_train_step(small, mesh)
        hlo = step.lower(params, opt, hist, {"tokens": tokens}, jnp.float32(1e-4)).compile()
        per_layer[layers] = collective_bytes(hlo.as_text())
    keys = sorted(set(per_layer[1]) | set(per_layer[2]))
    one, two = ({k: per_layer[i].get(k, 0) for k in keys} for i in (1, 2))
    micro = {k: one[k] + (m.n_layers / unit - 1) * (two[k] - one[k]) for k in keys}  # at L
    share = (n - 1) / n  # what a device receives of an all-gather, sends of a reduce-scatter
    print(f"{' + '.join(args.configs)}: {n} devices, {accum} micro-batch(es) of {micro_batch} "
          f"rows a device, {m.n_layers} layers, compute {tc.compute_dtype}")
    print(f"{'collective (per micro-batch)':<34}{'dtype':>6}{'MB':>10}")
    floats = {k: b for k, b in micro.items() if k[1] in ("f32", "bf16", "f16")}  # (not ids)
    for (op, dtype), b in sorted(floats.items()):
        print(f"{op:<34}{dtype:>6}{b / 1e6:>10,.1f}")
    moved = accum * share * sum(floats.values())
    flops = dc.global_batch // n * dc.seq_len * model.flops_per_token(m, dc.seq_len)
    device = shard.DEVICES.get(cfg.mesh.device)
    peak = device.peak if device else float("nan")
    comm_s, compute_s = moved / (args.link_gbs * 1e9), flops / peak
    print(f"per step and device: {flops / 1e15:.2f} PFLOP ({compute_s:.2f} s at the "
          f"{cfg.mesh.device or '?'}'s peak), {moved / 1e9:.0f} GB moved ({comm_s:.2f} s at "
          f"{args.link_gbs:.0f} GB/s)")
    print(f"{'matmul efficiency':<20}{'MFU, traffic hidden':>22}{'MFU, in series':>16}"
          f"{'tokens/s/device':>17}")
    for eff in (0.5, 0.6, 0.7):
        busy = compute_s / eff
        hidden, serial = compute_s / max(busy, comm_s), compute_s / (busy + comm_s)
        tps = dc.global_batch // n * dc.seq_len / max(busy, comm_s)
        print(f"{eff:<20.0%}{hidden:>22.1%}{serial:>16.1%}{tps:>17,.0f}")


# --- moe: the experts computed three ways, one MoE layer forward + backward ---------------------
# name -> (D, F, E, k, B·T tokens): tiny-olmoe.toml's layer, OLMoE-1B-7B's E and k at a width that
# a 2-core CPU runs in seconds, and FlexOlmo's few experts with most of them chosen
MOE_SHAPES = {"tiny-olmoe": (64, 64, 8, 2, 2048), "olmoe-like": (512, 256, 64, 8, 1024),
              "flexolmo-like": (256, 512, 7, 5, 1024)}


def moe_layer(D, F, E, k, compute="auto"):
    """A one-layer olmoe ModelConfig of this expert shape and its layer's moe params: init_params
    at std 1/sqrt(D), router logits of order 1, so that rounding does not flip a token's top k
    between the rows (tiny logits would leave near ties)."""
    import jax

    import model
    from configs import ModelConfig
    m = ModelConfig(family="olmoe", d_model=D, mlp_hidden=F, n_experts=E, experts_per_token=k,
                    n_layers=1, vocab_size=256, eos_token_id=0, pad_token_id=1,
                    init_std=D ** -0.5, moe_compute=compute)
    names = [n for n in model.param_table(m) if n.startswith("layers.mlp.")]
    stacked = model.init_params(m, jax.random.PRNGKey(0), names)
    return m, {n.removeprefix("layers."): v[0] for n, v in stacked.items()}  # layer 0 of L = 1


def moe_jax_step(m, p, x, ct):
    """moe's forward + backward, jitted and compiled: (run() -> (y, ∂x) on the host, whether JAX
    lowered ragged_dot to XLA's ragged-dot op: its own lowering for GPUs and TPUs; elsewhere
    lax's _ragged_dot_general_impl, a dense dot over all E groups' masked rows). The scalar is
    y's dot with ct, so that the backward starts from a random cotangent; the gradients are the
    params' and x's, as in training."""
    import jax
    import jax.numpy as jnp

    import model

    def loss(p, x):  # -> (the scalar, y as aux)
        y = model.moe(p, x, m)[0]
        return (y.astype(jnp.float32) * ct).sum(), y
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    lowered = step.lower(p, x)
    compiled = lowered.compile()  # (outside the timing)

    def run():  # (the copies to the host after the timing: moe_bench compares them)
        (_, y), (_, dx) = compiled(p, x)
        return jax.block_until_ready((y, dx))
    return run, "chlo.ragged_dot" in lowered.as_text()


def moe_torch_step(m, p, x, ct):
    """The torch MoE module on p's weights (HF's per-expert names), x and ct as in moe_jax_step:
    run() -> (y, ∂x) after .backward(); the params' gradients too."""
    import numpy as np
    import torch

    import model
    net = model.MoE(m)
    state = {"gate.weight": np.asarray(p["mlp.gate.weight"])}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for e, w in enumerate(np.asarray(p[f"mlp.experts.{proj}.weight"])):
            state[f"experts.{e}.{proj}.weight"] = w
    net.load_state_dict({n: model.as_torch(w) for n, w in state.items()})
    x, ct = torch.from_numpy(x).requires_grad_(), torch.from_numpy(ct)

    def run():
        net.zero_grad(set_to_none=True)
        x.grad = None
        y = net(x)[0]
        (y * ct).sum().backward()
        return y.detach().numpy(), x.grad.numpy()
    return run


def take_turns(runs, repeats, seconds):
    """[(median ms, runs timed, last output)] of each run() in runs, timed in rounds, one call of
    each a round, so that what else loads a shared CPU meanwhile slows them alike. First an
    untimed warm-up call of each (compiled before), which sets its count: at most `repeats` and
    about `seconds` of calls; a warm-up longer than `seconds` is itself the one sample, so that a
    slow row costs one call's time, not repeats'."""
    import statistics
    import time

    def timed(run):
        t0 = time.perf_counter()
        out = run()
        return time.perf_counter() - t0, out
    warm = [timed(run) for run in runs]
    outs = [out for _, out in warm]
    reps = [min(repeats, int(seconds / s)) for s, _ in warm]
    times = [[] for _ in runs]
    for r in range(max(reps)):
        for i, run in enumerate(runs):
            if r < reps[i]:
                t, outs[i] = timed(run)
                times[i].append(t)
    return [(statistics.median(ts or [s]) * 1e3, len(ts) or 1, out)
            for ts, (s, _), out in zip(times, warm, outs)]


def moe_bench(argv):
    """Forward + backward ms of one mixture-of-experts layer computed three ways, side by side:
    JAX experts_dense (every expert on every token), JAX experts_grouped (the chosen pairs sorted
    by expert, jax.lax.ragged_dot) through model.moe, and the torch MoE module (on a CPU its loop
    over the experts; fp32, with the fp32 rows). The scalar: the output's dot with a fixed random
    tensor; gradients of the params and the input. Each row's output y and input gradient ∂x
    against JAX dense's in its dtype (the same routing). Shapes: MOE_SHAPES, one at a time, its
    rows compiled, then timed taking turns (take_turns: the median of --repeats calls after a
    warm-up, fewer past --seconds)."""
    import argparse
    import os
    # libgomp's threads spin at their barriers: on a small CPU that other work shares, one that is
    # descheduled stalls torch's loop for seconds (seen: 1-2.5 s on 2 cores, against 13 ms); passive
    # waits sleep instead. Read when torch loads, so before the import
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from configs import in_range
    ap = argparse.ArgumentParser(prog="bench.py moe", description=moe_bench.__doc__)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32",
                    help="the JAX rows' compute dtype (torch's is float32); bfloat16 adds about "
                         "a minute on 2 cores, most of it the olmoe-like grouped row")
    ap.add_argument("--tokens", type=in_range(int, 1),
                    help="B·T of every shape (default: its own)")
    ap.add_argument("--repeats", type=in_range(int, 1), default=5)
    ap.add_argument("--seconds", type=in_range(float, 0, open_lo=True), default=8.0,
                    help="about how long a row's timed calls may take")
    args = ap.parse_args(argv)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    print(f"{'shape':<22} {'path':<12} {'dtype':<9} {'ms':>8} {'vs dense':>9} {'ideal':>6} "
          f"{'runs':>4} {'max|Δy|':>9} {'max|Δ∂x|':>9}")
    native = {}  # dtype -> whether the grouped rows' ragged_dot became a ragged-dot op
    for name, (D, F, E, k, N) in MOE_SHAPES.items():
        N = args.tokens or N
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, N, D), np.float32)  # (B, T, D)
        ct = rng.standard_normal((1, N, D), np.float32)
        rows, runs = [], []  # (path, dtype), run() -> (y, ∂x)
        for dtype in dtypes:
            for compute in ("dense", "grouped"):
                m, p = moe_layer(D, F, E, k, compute)
                run, ragged = moe_jax_step(m, p, jnp.asarray(x, dtype), ct)
                if compute == "grouped":
                    native[dtype] = ragged
                rows.append((f"JAX {compute}", dtype))
                runs.append(run)
            if dtype == "float32":
                rows.append(("torch loop", "float32"))
                runs.append(moe_torch_step(*moe_layer(D, F, E, k), x, ct))
        timed = take_turns(runs, args.repeats, args.seconds)
        dense = {dtype: t for (path, dtype), t in zip(rows, timed) if path == "JAX dense"}
        shape = f"{name} E{E} k{k}"
        for (path, dtype), (ms, n, out) in zip(rows, timed):
            ref_ms, _, ref = dense[dtype]
            dy, ddx = (np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
                       for a, b in zip(out, ref))
            ideal = "1" if path == "JAX dense" else f"{k / E:.3f}"
            print(f"{shape:<22} {path:<12} {dtype:<9} {ms:>8.1f} {ms / ref_ms:>8.2f}x "
                  f"{ideal:>6} {n:>4} {dy:>9.2e} {ddx:>9.2e}")
        del runs, timed  # this shape's buffers, before the next one's
    tokens = args.tokens or "/".join(str(s[4]) for s in MOE_SHAPES.values())
    print(f"(D F E k: {'; '.join(f'{n} {s[:4]}' for n, s in MOE_SHAPES.items())}; {tokens} "
          f"tokens; JAX on {jax.default_backend()}; torch on cpu, {torch.get_num_threads()} "
          f"threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})")
    print("(ms: the median of `runs` calls; vs dense: the time over JAX dense's in its dtype; "
          "ideal: k/E, the chosen experts' share of dense's expert work; Δ: against JAX dense "
          "in the row's dtype)")
    for dtype, op in native.items():
        if not op:  # (why grouped can be slower than dense here)
            print(f"(grouped, {dtype}: JAX has no ragged_dot lowering for "
                  f"{jax.default_backend()}; it runs each ragged_dot as one dense dot of the "
                  "B·T·k rows, each masked to zero outside its group, over all E groups' "
                  "weights: k times dense's expert work, not k/E of it)")


# --- hybrid: what OLMo Hybrid's linear layers keep and cost against the sequence's length ---------

def cache_gib(m, S):
    """GiB of generation's cache for one sequence of S positions (model.new_cache's arrays, as
    jax.eval_shape gives them: none allocated), bf16: (G layers' total, F layers' total)."""
    import jax
    import jax.numpy as jnp

    import model
    cache = jax.eval_shape(lambda: model.new_cache(m, 1, S, jnp.bfloat16))
    sums = {"G": 0, "F": 0}
    for kind, layer in zip(m.layer_types(), cache):
        sums["G" if kind == "G" else "F"] += sum(a.size * a.dtype.itemsize for a in layer.values())
    return sums["G"] / 2**30, sums["F"] / 2**30


def hybrid_bench(argv):
    """python tests/bench.py hybrid [--repeats 5] [--seconds 4]: (1) the cache OLMo Hybrid 7B
    (configs/olmo-hybrid-7b.toml) keeps for one sequence, its G and its F layers, against the
    prompt's length, beside OLMo 3 7B's (configs/olmo3-7b.toml, all attention; its sliding layers'
    windows of 4096); (2) a decode step of the tiny hybrid (tiny.toml + tiny-hybrid.toml) after
    prompts of growing length, JAX, beside the tiny dense model with both layers full attention:
    the G layer's state is the same whatever came before; (3) one G layer's delta rule, forward
    and backward, recurrent (a scan over tokens) against chunked (matmuls, a scan over chunks of
    64) at growing T, beside full attention over T (attend_in_blocks) at the same shape."""
    import argparse

    import jax
    import jax.numpy as jnp
    import numpy as np

    import model
    from configs import in_range, load_config
    ap = argparse.ArgumentParser(prog="bench.py hybrid", description=hybrid_bench.__doc__)
    ap.add_argument("--repeats", type=in_range(int, 1), default=5)
    ap.add_argument("--seconds", type=in_range(float, 0, open_lo=True), default=4.0)
    args = ap.parse_args(argv)
    hybrid = load_config([str(ROOT / "configs/olmo-hybrid-7b.toml")]).model
    dense = load_config([str(ROOT / "configs/olmo3-7b.toml")]).model
    print("(1) generation's cache for one sequence, GiB in bf16 (jax.eval_shape of "
          "model.new_cache)")
    print(f"{'prompt':>8} {'hybrid G (24)':>14} {'hybrid F (8)':>13} {'hybrid':>9} "
          f"{'olmo3-7b':>9}")
    for S in (1024, 8192, 65536, 131072):
        g, f = cache_gib(hybrid, S)
        print(f"{S:>8} {g:>14.4f} {f:>13.3f} {g + f:>9.3f} {sum(cache_gib(dense, S)):>9.3f}")

    print("\n(2) one decode step after a prompt of P tokens, ms (JAX, fp32, the tiny shapes)")
    tiny = load_config([str(ROOT / "configs/tiny.toml"), str(ROOT / "configs/tiny-hybrid.toml"),
                        "--model.max_seq_len=16384"]).model
    full = load_config([str(ROOT / "configs/tiny.toml"), "--model.max_seq_len=16384",
                        "--model.layer_pattern=F", "--model.sliding_window=0"]).model
    lengths = (256, 2048, 16383)
    rows = []
    for name, m in (("tiny-hybrid (G, F)", tiny), ("tiny, all full (F, F)", full)):
        params = model.init_params(m, jax.random.PRNGKey(0))
        step = jax.jit(lambda p, t, pos, c, m=m: model.forward_step(p, t, pos, c, m))
        runs = []
        for P in lengths:
            cache = model.new_cache(m, 1, P + 1)
            token = jnp.zeros((1, 1), jnp.int32)
            step(params, token, jnp.int32(P), cache)  # compiled for this cache's size

            def run(cache=cache, token=token, P=P, step=step, params=params):
                return jax.block_until_ready(step(params, token, jnp.int32(P), cache)[0])
            runs.append(run)
        rows.append((name, [ms for ms, _, _ in take_turns(runs, args.repeats, args.seconds)]))
    print(f"{'model':<24}" + "".join(f"{'P=' + str(P):>10}" for P in lengths))
    for name, times in rows:
        print(f"{name:<24}" + "".join(f"{t:>10.2f}" for t in times))

    print("\n(3) one layer's sequence mixing, forward + backward, ms (JAX, fp32; B 1, "
          "4 heads, Hk 32, Hv 64; attention: 4 heads of 64)")
    rng = np.random.default_rng(0)
    print(f"{'T':>6} {'recurrent':>10} {'chunked':>9} {'attention':>10}")
    for T in (256, 1024, 4096):
        q, k = (jnp.asarray(rng.standard_normal((1, T, 4, 32)), jnp.float32) for _ in "qk")
        v = jnp.asarray(rng.standard_normal((1, T, 4, 64)), jnp.float32)
        g = -jnp.abs(jnp.asarray(rng.standard_normal((1, T, 4)), jnp.float32))
        beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((1, T, 4)), jnp.float32))
        qa, ka = (jnp.asarray(rng.standard_normal((1, T, 4, 64)), jnp.float32) for _ in "qk")

        def grad_of(f, *a):
            fn = jax.jit(jax.grad(lambda *a: f(*a).sum(), range(len(a))))
            fn(*a)  # compiled
            return lambda: jax.block_until_ready(fn(*a))
        runs = [grad_of(lambda *a: model.delta_rule_recurrent(*a)[0], q, k, v, g, beta),
                grad_of(lambda *a: model.delta_rule_chunked(*a)[0], q, k, v, g, beta),
                grad_of(lambda q, k, v: model.attend_in_blocks(q, k, v, 0, 0.125), qa, ka, v)]
        ms = [t for t, _, _ in take_turns(runs, args.repeats, args.seconds)]
        print(f"{T:>6} {ms[0]:>10.1f} {ms[1]:>9.1f} {ms[2]:>10.1f}")
    print(f"(JAX on {jax.default_backend()}; ms: the median of up to --repeats calls, taking "
          "turns)")
    hybrid_accuracy()


def hybrid_accuracy(T=150):
    """(4) max |diff| / max |reference| of fp32 logits against transformers' OlmoHybrid in
    float64 (random weights, T tokens: chunks of 64 and a part), per variant: transformers' own
    fp32, ours in JAX and torch; then the delta rule alone, ours against transformers' recurrent
    reference (fp32) and our two forms against each other."""
    import tempfile

    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    import convert
    import model
    sys.path.insert(0, str(ROOT / "tests"))
    from common import random_params, tokens, variant
    from test_hybrid import inputs
    print(f"\n(4) fp32 logits against transformers' float64, relative max |diff| (T = {T})")
    print(f"{'variant':<44} {'hf fp32':>9} {'jax':>9} {'torch':>9}")
    cases = {"no RoPE, 2 key : 4 value heads, β in (0, 2)": {},
             "RoPE, 2 key : 4 value heads, β in (0, 1)": dict(rope_theta=500000.0,
                                                               linear_neg_eigval=False),
             "no RoPE, 2 key : 2 value heads, β in (0, 2)": dict(linear_value_heads=2)}
    for name, overrides in cases.items():
        m = variant("olmo_hybrid", **overrides)
        params = random_params(m, seed=4, std=0.15)
        toks = torch.from_numpy(tokens(m, T=T))
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            convert.save_hf(d, m, params)
            load = transformers.AutoModelForCausalLM.from_pretrained
            ref = load(d, dtype=torch.float64)(toks).logits.numpy()
            hf = load(d, dtype=torch.float32)(toks).logits.double().numpy()
            pt = model.torch_model(m, params)(toks).double().numpy()
        jx = np.asarray(model.forward(params, jnp.asarray(toks.numpy()), m), np.float64)
        rel = [np.abs(a - ref).max() / np.abs(ref).max() for a in (hf, jx, pt)]
        print(f"{name:<44} " + " ".join(f"{r:>9.1e}" for r in rel))
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as hybrid
    q, k, v, g, beta, state = inputs()
    want, _ = hybrid.torch_recurrent_gated_delta_rule(
        *map(torch.from_numpy, (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
        use_qk_l2norm_in_kernel=True)
    scale = np.abs(want.numpy()).max()
    a = [np.asarray(f(*map(jnp.asarray, (q, k, v, g, beta)), state=jnp.asarray(state))[0])
         for f in (model.delta_rule_recurrent, model.delta_rule_chunked)]
    print(f"the rule alone (tests/test_hybrid.py's inputs, T 150, output scale {scale:.2f}): "
          f"recurrent vs transformers {np.abs(a[0] - want.numpy()).max() / scale:.1e}, chunked "
          f"vs transformers {np.abs(a[1] - want.numpy()).max() / scale:.1e}, recurrent vs "
          f"chunked {np.abs(a[0] - a[1]).max() / scale:.1e}")


COMMANDS = {"train": train_bench, "attention": attention_bench, "data": data_bench,
            "generate": generate_bench, "fsdp": fsdp_bench, "moe": moe_bench,
            "hybrid": hybrid_bench}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](sys.argv[2:])
