"""The check to run the day a GPU is lent (minutes, not hours): what the bf16 train step's matmuls
are, attention kernels against an fp32 reference, the real `train.py` loop (data, a held-out eval
and a checkpoint) on OLMo-2-1B's shape, and short runs of that shape's step in JAX, torch and
transformers. Each row runs in a process of its own, and each is written to the markdown (and a
JSON-lines file beside it) as it finishes; `python tests/tables.py gpu` places the markdown in
docs/backends.md.

    # on the GPU machine, from the repo root (what `make device-check` runs):
    python tests/device_check.py --out runs/device_check.md
    python tests/device_check.py --only loop,dots   # some rows again
    # the same code on a CPU, tiny shapes (test_accelerators.py runs it):
    python tests/device_check.py --tiny --out /tmp/check.md

Why a process per row: JAX's allocator keeps every byte it took until its process ends (only
XLA_PYTHON_CLIENT_ALLOCATOR=platform hands memory back, slowly), so torch rows after JAX's would
run out of memory; and a crash (out of memory, a kernel error, the OOM killer) loses only its own
row: the table says `failed:` and the last line of its stderr (all of it: WORK/logs/ROW.log), and
the next row runs. NANOLMO_DEVICE_CHECK_FAIL=ROW[:kill],... makes rows fail on purpose (the test):
ROW raises before it starts, ROW:kill SIGKILLs itself after writing its rows.

The whole is sized to about 8 minutes on one H100 (a lent device has 15 minutes in all): each row
states its estimate, and a row that would end past --budget seconds is skipped and says so. On a
fresh GPU machine with PyPI, `make device-check ACCEL=cuda` installs jax's CUDA plugin first.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "@device_check "  # a row's line on a child's stdout; every other line is its progress
FAIL = "NANOLMO_DEVICE_CHECK_FAIL"

# (title, columns) of each table, in the markdown's order
SECTIONS = {
    "dots": ("The bf16 train step as lowered for this device: its `dot_general`s by operand dtypes "
             "(an fp32 dot in a bf16 step runs at TF32 or fp32 speed on a GPU)",
             ["step", "dot_general by operand dtypes", "f32 x f32"]),
    "kernels": ("Attention kernels in bf16 against an fp32 reference, max |diff| / max |ref|; "
                "forward and backward timed together",
                ["backend", "implementation", "window", "documents", "output vs fp32",
                 "gradients vs fp32", "fwd+bwd"]),
    "loop": ("The real `train.py` loop on random-initialised weights: steady tokens/s is the "
             "median over steps 2..N (step 1 compiles), data included; the held-out eval half "
             "way (its step's time less a step's; its first call compiles), the checkpoint after "
             "step N and the eval of the whole held-out split",
             ["run", "tokens/s", "MFU", "start + compile", "eval half way",
              "checkpoint + final eval", "in all"]),
    "training": ("The train step alone on random tokens (2 warm-up steps, then --steps timed; "
                 "JAX's build + compile loads from the XLA cache a program an earlier row or "
                 "check compiled)",
                 ["row", "tokens/s", "MFU", "build + compile", "peak memory"]),
}
# (name, section, seconds on one H100), in the order they run: what matters most first, since
# a row past the budget is skipped. The estimates are reasoned, not yet measured: imports and
# CUDA start ~10 s a process; the 1B step compiles in ~60 s; 10 steps of 4 x 4,096 tokens ~5 s
# at 40% MFU; the checkpoint is 18 GB (fp32 weights and AdamW's two moments). They sum to 540 s:
# under the default --budget of 480 the last row runs only where the others were quicker.
UNITS = [
    ("dots", "dots", 15),  # a lowering, no compile
    ("attention:jax", "kernels", 50),  # 8 cases of (2, 4096, 16 heads of 128), each compiled
    ("loop", "loop", 150),  # data prep 10, compile 60 + eval 15, 20 steps 10, checkpoint ~45
    ("train:torch", "training", 90),  # torch.compile of the blocks ~60
    ("train:transformers", "training", 45),  # eager: no compile
    ("attention:torch", "kernels", 40),  # flex compiles a kernel per mask
    ("train:jax", "training", 75),  # the loop's step without data: the loop's overhead
    ("train:jax-xla", "training", 75),  # (the CPU's auto pick is xla: nothing more to run)
]
# The units that run as a real run does, with JAX's default pool of 75% of the GPU; the others
# ask JAX for no pool (they touch JAX only to list devices, or share the GPU with torch)
JAX_POOL = {"train:jax", "train:jax-xla", "loop"}
# (B, T, N, K, H) of the attention rows
SHAPES = {"tiny": (1, 256, 4, 2, 32), "full": (2, 4096, 16, 4, 128)}
# --tiny: OLMo-2-1B's config at a CPU's size, and no H100 as its target (a run on a CPU may
# refuse a config that names a GPU)
TINY_MODEL = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4",
              "--model.mlp_hidden=128", "--model.vocab_size=512", "--model.eos_token_id=0",
              "--model.pad_token_id=1", "--data.seq_len=128", "--model.max_seq_len=128",
              "--mesh.device=", "--mesh.devices=0"]


# --- the rows: each runs in a child process and emits its table rows ----------------------------

def emit(section, cells):
    """One table row to the parent, at once (a later crash keeps it)."""
    print(MARK + json.dumps(dict(section=section, cells=[str(c) for c in cells])), flush=True)


def emit_environment():
    import jax
    import torch

    import shard
    cuda = torch.cuda.is_available()
    device = jax.devices()[0]
    text = (f"jax {jax.__version__} on {jax.default_backend()} ({device.device_kind}); "
            f"torch {torch.__version__} on {torch.cuda.get_device_name() if cuda else 'cpu'}")
    if warning := shard.unseen_accelerator(jax.default_backend()):
        text += f" ({warning})"
    print(MARK + json.dumps(dict(section="env", text=text)), flush=True)


def bench_config(tiny):
    """OLMo-2-1B as shipped, 4 instances a step of 1 each (one H100 holds the 24 GB of weights,
    gradients and AdamW state): FSDP over whatever devices there are."""
    from configs import load_config
    flags = TINY_MODEL if tiny else []
    return load_config(["configs/olmo2-1b.toml", "--train.micro_batch=1",
                        "--data.global_batch=4"] + flags)


def dot_counts(text):
    """{"bf16 x bf16": n, ...}: a lowered program's stablehlo.dot_general by operand dtypes (and
    the algorithm's, where one is set)."""
    import re
    counts = {"f32 x f32": 0}
    for line in re.findall(r"stablehlo\.dot_general[^\n]*", text):
        # "... : (tensor<1x128x64xbf16>, tensor<64x64xbf16>) -> ...": the types after the dims
        operands = re.search(r":\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)", line)
        types = [t.split("x")[-1] for t in operands.groups()] if operands else ["unparsed"]
        key = " x ".join(types)
        # an explicit algorithm decides the precision, not the operands (f32 x bf16 run as bf16)
        if algorithm := re.search(r"lhs_precision_type = (\w+), rhs_precision_type = (\w+)", line):
            key += f" (as {' x '.join(algorithm.groups())})"
        counts[key] = counts.get(key, 0) + 1
    return counts


def dots_row(args):
    """The bf16 train step lowered for this device (no compile: seconds), counted."""
    import jax
    import jax.numpy as jnp

    import model
    import shard
    import train
    cfg = bench_config(args.tiny)
    B, T = cfg.data.global_batch, cfg.data.seq_len
    mesh = shard.make_mesh(cfg.mesh)
    table = model.param_table(cfg.model)
    p_sh, o_sh, h_sh = shard.state_shardings(mesh, table)

    def abstract(shape, dtype, sharding):  # shapes only: a 1B lowering allocates nothing
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    params = {k: abstract(p.shape, jnp.float32, p_sh[k]) for k, p in table.items()}
    opt = dict(m=params, v=params, count=abstract((), jnp.int32, o_sh["count"]))
    hist = jax.tree.map(lambda x: abstract(x.shape, x.dtype, h_sh),
                        jax.eval_shape(train.new_history))
    micro = cfg.train.micro_batch
    tokens = abstract((B // micro, micro, T), jnp.int32, shard.batch_sharding(mesh))
    step = train.make_train_step(cfg, mesh)
    args_ = (params, opt, hist, dict(tokens=tokens), jnp.float32(1e-4))
    text = step.trace(*args_).lower().as_text()
    counts = dot_counts(text)
    print(f"dot_general by operand dtypes: {counts}", flush=True)
    shape = "tiny-shaped " if args.tiny else ""
    what = (f"{shape}OLMo-2-1B, {cfg.train.compute_dtype}, {B // micro} x {micro} x {T}, "
            f"for {jax.default_backend()}")
    listed = ", ".join(f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    emit("dots", [what, listed, counts["f32 x f32"]])


def dense(q, k, v, window, segments):
    """Attention written out in fp32: every score, the mask by its definition, GQA by repeating kv
    heads."""
    import jax
    import jax.numpy as jnp
    T, N, K = q.shape[1], q.shape[2], k.shape[2]
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    keep = ((j <= i) & ((window == 0) | (i - j < window)))[None]
    if segments is not None:
        keep = keep & (segments[:, :, None] == segments[:, None, :])
    k, v = (jnp.repeat(x.astype(jnp.float32), N // K, axis=2) for x in (k, v))
    with jax.default_matmul_precision("highest"):
        scores = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k) * q.shape[-1] ** -0.5
        scores = jnp.where(keep[:, None], scores, -jnp.inf)
        return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v)


def worst(a, b):
    """max |a - b| / max |b|, over arrays or tuples of them."""
    import jax.numpy as jnp
    return max(float(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)).max()
                     / jnp.abs(jnp.asarray(y, jnp.float32)).max()) for x, y in zip(a, b))


def forward_backward(f, dy, *xs):
    """f(*xs) and its gradients for the cotangent dy, in one program: what a train step runs."""
    import jax
    y, pull = jax.vjp(f, *xs)
    return y, pull(dy)


def jax_attention_rows(args):
    """Each JAX implementation this device runs, bf16, against the fp32 reference: output and
    gradients, forward and backward timed together."""
    import dataclasses
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import model
    import shard
    B, T, N, K, H = SHAPES["tiny" if args.tiny else "full"]
    rng = np.random.default_rng(0)
    q, k, v, dy = (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.bfloat16)
                   for n in (N, K, K, N))
    segments = jnp.asarray(np.cumsum(rng.random((B, T)) < 4 / T, axis=1), jnp.int32)
    m = model.ModelConfig(d_model=N * H, n_heads=N, n_kv_heads=K, head_dim=H, vocab_size=256,
                          eos_token_id=0, pad_token_id=1, max_seq_len=T)
    for impl in ("xla", "cudnn", "splash"):
        for window in (0, T // 4):
            for docs in (None, segments):
                try:
                    shard.pick_attention(dataclasses.replace(m, attention=impl), jnp.bfloat16,
                                         docs is not None)
                except ValueError as e:
                    emit("kernels", ["JAX", impl, window, docs is not None, "refused",
                                     str(e).split(": ")[1], ""])
                    continue
                if impl == "splash" and jax.default_backend() != "tpu":
                    continue  # (interpreted off a TPU: tests/test_attention.py covers it)
                extra = () if docs is None else (docs,)

                def attend(q, k, v, w=window, e=extra, i=impl):
                    return shard.ATTEND[i](q, k, v, w, H ** -0.5, *e)
                ours = jax.jit(functools.partial(forward_backward, attend))
                ref = jax.jit(functools.partial(
                    forward_backward, lambda q, k, v, w=window, d=docs: dense(q, k, v, w, d)))
                y, grads = jax.block_until_ready(ours(dy, q, k, v))  # compiles
                t0 = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(ours(dy, q, k, v))
                ms = (time.perf_counter() - t0) / 3 * 1e3
                y_ref, grads_ref = ref(dy.astype(jnp.float32), q, k, v)
                emit("kernels", ["JAX", impl, window, docs is not None,
                                 f"{worst((y,), (y_ref,)):.1e}", f"{worst(grads, grads_ref):.1e}",
                                 f"{ms:.2f} ms"])


def torch_attention_rows(args):
    """flex_attention against SDPA (bool masks), bf16: output and gradients (flex has no backward
    on a CPU: there, the outputs and the forward's time)."""
    import torch

    import model
    B, T, N, K, H = SHAPES["tiny" if args.tiny else "full"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grads = device == "cuda"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, H, generator=g).to(device, torch.bfloat16)
               .requires_grad_(grads) for n in (N, K, K))
    segments = torch.cumsum(torch.rand(B, T, generator=g) < 4 / T, dim=1).to(device)

    def run(impl, mask):  # one forward (and backward): the outputs and gradients
        for x in (q, k, v):
            x.grad = None
        if impl == "sdpa":
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        else:
            y = model.flex_attention(q, k, v, mask, H ** -0.5)
        if grads:
            y.float().square().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()  # (kernels run asynchronously: the timer waits for them)
        return [t.detach().float() for t in (y, q.grad, k.grad, v.grad) if t is not None]

    for window in (0, T // 4):
        for docs in (None, segments):
            if window == 0 and docs is None:
                # (model.Attention runs SDPA's causal path there, whatever model.attention says)
                continue
            out, ms = {}, {}
            for impl in ("sdpa", "flex"):
                m = model.ModelConfig(d_model=N * H, n_heads=N, n_kv_heads=K, head_dim=H,
                                      vocab_size=256, eos_token_id=0, pad_token_id=1,
                                      max_seq_len=T, attention=impl)
                mask = model.attention_masks_torch(m, [window], T, docs, torch.device(device))
                out[impl] = run(impl, mask[window])  # (flex compiles here)
                t0 = time.perf_counter()
                for _ in range(3):
                    run(impl, mask[window])
                ms[impl] = (time.perf_counter() - t0) / 3 * 1e3
            diff = [float((a - b).abs().max() / b.abs().max())
                    for a, b in zip(out["flex"], out["sdpa"])]
            how = "" if grads else " (fwd only)"
            emit("kernels", ["torch", "flex vs sdpa", window, docs is not None, f"{diff[0]:.1e}",
                             f"{max(diff[1:]):.1e}" if grads else "n/a",
                             f"{ms['flex']:.2f} / {ms['sdpa']:.2f} ms{how}"])


def training_rows(args, unit):
    """The bench rows of this unit (tests/bench.py bench_rows, bf16 as a real run): tokens/s of
    --steps steps after 2 warm-up steps, MFU, peak device memory."""
    import jax
    import numpy as np
    import torch

    import model
    import shard
    from bench import bench_rows
    cfg = bench_config(args.tiny)
    B, T = cfg.data.global_batch, cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
    flops = model.flops_per_token(cfg.model, T)
    cuda = torch.cuda.is_available()
    auto = shard.pick_attention(cfg.model, "bfloat16")
    torch_row = "torch sdpa compiled" if cuda else "torch sdpa eager"  # (a CPU: eager)
    wanted = {
        "train:jax": lambda label: label.startswith(f"nanolmo JAX {auto} "),
        "train:jax-xla": lambda label: auto != "xla" and label.startswith("nanolmo JAX xla "),
        "train:torch": lambda label: torch_row in label,
        "train:transformers": lambda label: label.startswith("transformers"),
    }[unit]
    for label, dtype, _, make in bench_rows(cfg, jax.default_backend(), cuda):
        # the rows a real run would use: bf16 compute (transformers on a CPU: fp32 only)
        if not wanted(label) or (dtype != "bfloat16" and "transformers (cpu" not in label):
            continue
        t0 = time.perf_counter()
        step, peak, devices = make(tokens)
        for _ in range(2):
            jax.block_until_ready(step())
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out = step()
        jax.block_until_ready(out)
        tps = args.steps * B * T / (time.perf_counter() - t0)
        mfu = f"{100 * flops * tps / (peak * devices):.1f}%" if peak else "n/a"
        if label.startswith("nanolmo JAX"):  # (one JAX row a process: the peak is its own)
            used = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        else:
            used = torch.cuda.max_memory_allocated() if cuda else None
        memory = f"{used / 2**30:.1f} GiB" if used else "n/a"
        emit("training", [label, f"{tps:,.0f}", mfu, f"{warm:.0f} s", memory])


def loop_data(work, tiny):
    """A prepared folder (train and held-out splits) made here, offline, in seconds: Python's own
    help topics (pydoc_data) and this repository's docs, in dolma2 (OLMo 2's tokenizer); tiny: a
    384-id BPE trained on LICENSE, as tests/conftest.py does (the tiny config's 4,096-wide
    embedding takes its ids)."""
    import pydoc_data.topics

    import data
    out = work / ("data-tiny" if tiny else "data-dolma2")
    if (out / "prepare.json").is_file():  # made by an earlier check
        return out
    texts = list(pydoc_data.topics.topics.values())
    if not tiny:  # 517K train tokens (126 instances of 4,096: 20 steps read 80), 114K held out
        texts += [p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]]
        texts = [f"copy {c}\n{t}" for c in range(4) for t in texts]
    docs = work / "loop-docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = "dolma2"
    if tiny:
        tokenizer = str(work / "bpe384.tiktoken")
        data.save_ranks(data.train_bpe([(ROOT / "LICENSE").read_text()], 384), tokenizer)
    shutil.rmtree(out, ignore_errors=True)
    # 0.2 held out by a hash of each text: enough held-out tokens for a batch of 4 x 4,096
    data.prepare([docs], out, tokenizer, heldout=0.2, workers=1 if tiny else os.cpu_count(),
                 quiet=True)
    return out


def loop_row(args):
    """`python train.py` on the 1B shape (tiny: configs/tiny.toml): data, a held-out eval half
    way, the checkpoint at the end; its own metrics.jsonl and the times its lines came out."""
    import statistics
    work = Path(args.work)
    folder = loop_data(work, args.tiny)
    info = json.loads((folder / "prepare.json").read_text())
    run_dir = work / "loop-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run would resume, not train
    steps = 4 if args.tiny else 20
    shape = [] if args.tiny else ["--data.global_batch=4", "--train.micro_batch=1"]
    config = "configs/tiny.toml" if args.tiny else "configs/olmo2-1b.toml"
    cmd = [sys.executable, "train.py", config, *shape, f"--data.path={folder}",
           f"--model.eos_token_id={info['eos_token_id']}",
           f"--model.pad_token_id={info['pad_token_id']}", f"--train.run_dir={run_dir}",
           f"--train.steps={steps}", "--train.log_every=1", f"--eval.every={steps // 2}",
           "--eval.batches=1", f"--train.checkpoint_every={steps}", "--eval.prompt="]
    print(" ".join(cmd), flush=True)
    log = work / "logs" / "loop-train.log"
    t0, stamps = time.perf_counter(), {}  # step -> when its log line came out
    try:
        with open(log, "w") as err:
            # unbuffered: each line comes out when train.py writes it, so its time is the step's
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            for line in p.stdout:
                print(line, end="", flush=True)
                if line.startswith("step ") and "|" in line:
                    stamps[int(line.split("|")[0].split()[1])] = time.perf_counter()
        end = time.perf_counter()
        if p.wait():
            raise RuntimeError(f"train.py exit {p.returncode}: {last_line(log)}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:  # (18 GB at 1B: the disk is the next rows' and the next check's too)
        shutil.rmtree(run_dir, ignore_errors=True)
    rows = [r for r in rows if "tokens_per_s" in r]
    per_step = rows[-1]["tokens"] // rows[-1]["step"]  # tokens a step
    steady = statistics.median(r["tokens_per_s"] for r in rows if r["step"] >= 2)
    mfus = [r["mfu"] for r in rows if r["step"] >= 2 and r["mfu"] is not None]
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
    half = steps // 2
    eval_s = stamps[half] - stamps[half - 1] - per_step / steady
    what = (f"`train.py {config}` {' '.join(shape)} {steps} steps of {per_step:,} tokens, "
            f"{info['tokenizer']} data").replace("  ", " ")
    emit("loop", [what, f"{steady:,.0f}", mfu, f"{stamps[1] - t0:.0f} s", f"{eval_s:.1f} s",
                  f"{end - stamps[steps]:.0f} s", f"{end - t0:.0f} s"])


def child(args):
    """Run one unit (the parent's --row); NANOLMO_DEVICE_CHECK_FAIL's failures on purpose."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))  # (bench.py)
    forced = dict((f.split(":kill")[0], f.endswith(":kill"))
                  for f in os.environ.get(FAIL, "").split(",") if f)
    if forced.get(args.row) is False:
        raise RuntimeError(f"{FAIL} asked row {args.row} to fail")
    if args.row != "loop":  # (the loop's train.py takes the GPU: this process stays off it)
        emit_environment()
    if args.row == "dots":
        dots_row(args)
    elif args.row == "attention:jax":
        jax_attention_rows(args)
    elif args.row == "attention:torch":
        torch_attention_rows(args)
    elif args.row == "loop":
        loop_row(args)
    else:
        training_rows(args, args.row)
    if forced.get(args.row):  # as the OOM killer would: no stderr, no exit status of its own
        os.kill(os.getpid(), signal.SIGKILL)


# --- the parent: runs each unit in a process, writes what comes back at once --------------------

class Report:
    """The rows so far: appended to OUT's .jsonl, and OUT rewritten whole (a rename: a reader
    never sees half a file), after each one."""

    def __init__(self, out, command):
        self.out, self.jsonl = out, out.with_suffix(".jsonl")
        self.command, self.env, self.rows = command, None, []
        self.t0, self.lock = time.perf_counter(), threading.Lock()
        out.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")

    def add(self, unit, record):
        with self.lock:
            record = dict(unit=unit, seconds=round(time.perf_counter() - self.t0, 1), **record)
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
            if record["section"] == "env":
                self.env = self.env or record["text"]
            else:
                self.rows.append(record)
            self.write(done=False)

    def failed(self, unit, section, why):
        width = len(SECTIONS[section][1])
        self.add(unit, dict(section=section, cells=[unit, why] + [""] * (width - 2)))

    def write(self, done):
        order = [name for name, _, _ in UNITS]
        seconds = time.perf_counter() - self.t0
        env = self.env or "no row has said which devices"
        lines = [f"`{self.command}`: {env}; {seconds:.0f} s "
                 f"{'in all' if done else 'so far, still running'}; each row in a process of "
                 "its own."]
        for section, (title, header) in SECTIONS.items():
            rows = [r for r in self.rows if r["section"] == section]
            rows.sort(key=lambda r: order.index(r["unit"]))  # (stable: a unit's rows in order)
            if not rows:
                continue
            lines += ["", f"{title}:", "", "| " + " | ".join(header) + " |",
                      "|---" * len(header) + "|"]
            lines += ["| " + " | ".join(r["cells"]) + " |" for r in rows]
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.out)


def last_line(path):
    """The last line of a log with text on it (progress bars' \\r too), without table pipes."""
    lines = [x.strip() for x in path.read_text(errors="replace").replace("\r", "\n").splitlines()]
    lines = [x for x in lines if x]
    return (lines[-1] if lines else "no stderr").replace("|", "/")[:200]


def run_unit(name, section, argv, report, work, timeout):
    """One unit in a child process (its own process group, so a timeout ends its children too);
    its rows are recorded as they come, a failure as one row."""
    log = work / "logs" / (name.replace(":", "-") + ".log")
    env = dict(os.environ)
    # one persistent XLA cache for all rows (unless one is set, as the tests do): train:jax's step
    # is the loop's, compiled once (~60 s of a 15-minute lease); a rerun loads every program
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "xla-cache"))
    if name not in JAX_POOL:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # (else JAX takes 75% of the GPU at start)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", name, "--work", str(work)]
    with open(log, "w") as err:
        p = subprocess.Popen(cmd + argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                             env=env, start_new_session=True)

    def read():
        for line in p.stdout:
            if line.startswith(MARK):
                report.add(name, json.loads(line[len(MARK):]))
            else:
                print(f"  [{name}] {line}", end="", flush=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status, why = p.wait(timeout), None
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        status, why = p.wait(), f"failed: timed out after {timeout:.0f} s"
    except BaseException:  # Ctrl-C: its own session gets no SIGINT, and would hold the GPU on
        os.killpg(p.pid, signal.SIGKILL)
        raise
    reader.join(30)
    if reader.is_alive():  # a process it started still holds its stdout: end the group
        os.killpg(p.pid, signal.SIGKILL)
        reader.join()
    if status < 0 and why is None:
        why = (f"failed: killed by {signal.Signals(-status).name} (out of memory?); "
               f"last: {last_line(log)}")
    elif status > 0:
        why = f"failed: {last_line(log)}"
    if why:
        report.failed(name, section, why)
    print(f"{name}: {why or 'done'} ({log})", flush=True)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes and a few steps (the CPU test)")
    ap.add_argument("--steps", type=int, help="timed train steps a row (default 10; tiny 2)")
    ap.add_argument("--out", help="the markdown, its .jsonl beside it (default "
                    "runs/device_check.md; tiny: runs/device_check-tiny.md, not the GPU's)")
    ap.add_argument("--work", help="data, the loop's run, logs/ (default: OUT's name + -work)")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds: a row whose estimate would end past it is skipped (not tiny)")
    ap.add_argument("--only", help="these rows, comma-separated: "
                    + ", ".join(name for name, _, _ in UNITS))
    ap.add_argument("--row", help=argparse.SUPPRESS)  # (a child: run this one unit)
    args = ap.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 10)
    if args.row:
        return child(args)
    out = Path(args.out or f"runs/device_check{'-tiny' * args.tiny}.md")
    work = Path(args.work or out.with_name(out.stem + "-work")).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    command = "python tests/device_check.py" + " --tiny" * args.tiny
    report = Report(out, command)
    passed = ["--steps", str(args.steps)] + ["--tiny"] * args.tiny
    only = set(args.only.split(",")) if args.only else None
    if only and only - {name for name, _, _ in UNITS}:
        ap.error(f"--only: unknown rows {sorted(only - {n for n, _, _ in UNITS})}")
    for name, section, estimate in UNITS:
        if only and name not in only:
            continue
        left = args.budget - (time.perf_counter() - report.t0)
        if not args.tiny and estimate > left:
            report.failed(name, section, f"skipped: ~{estimate} s, {max(left, 0):.0f} s left of "
                          f"the {args.budget:.0f} s budget")
            continue
        # a hung row ends, the rest still run (tiny: generous, CPUs are shared)
        timeout = 300 if args.tiny else 2 * estimate + 60
        run_unit(name, section, passed, report, work, timeout)
    report.write(done=True)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
