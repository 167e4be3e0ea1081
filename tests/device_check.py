"""The check to run the day a GPU is lent (minutes, not hours): attention kernels against the XLA
and SDPA paths, then short training runs of an OLMo-2-1B-shaped model in JAX, torch and
transformers; one markdown table at the end, which `python tests/tables.py gpu` places in
docs/backends.md.

    # on the GPU machine, from the repo root:
    python tests/device_check.py --out runs/device_check.md
    # the same code on a CPU, tiny shapes (a test):
    python tests/device_check.py --tiny

On a fresh GPU machine with PyPI, `make test ACCEL=cuda` installs jax's CUDA plugin beside torch's
CUDA wheel first; where JAX sees no GPU this says so and checks only what runs. Every part is
timed; the whole is sized to take under 8 minutes on one H100.
"""
import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

# JAX and torch share the GPU, one at a time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import model  # noqa: E402
import shard  # noqa: E402
from bench import bench_rows  # noqa: E402
from configs import load_config  # noqa: E402


def dense(q, k, v, window, segments):
    """Attention written out in fp32: every score, the mask by its definition, GQA by repeating kv
    heads."""
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
    return max(float(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)).max()
                     / jnp.abs(jnp.asarray(y, jnp.float32)).max()) for x, y in zip(a, b))


def jax_attention(shape, rows):
    """Each JAX implementation this device runs, bf16, against the fp32 reference: output and
    gradients."""
    B, T, N, K, H = shape
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
                    model.pick_attention(dataclasses.replace(m, attention=impl), jnp.bfloat16,
                                         docs is not None)
                except ValueError as e:
                    rows.append(("JAX", impl, window, docs is not None, "refused",
                                 str(e).split(": ")[1], ""))
                    continue
                if impl == "splash" and jax.default_backend() != "tpu":
                    continue  # (interpreted off a TPU: tests/test_attention.py covers it)
                extra = () if docs is None else (docs,)
                fn = jax.jit(lambda q, k, v, w=window, e=extra, i=impl:
                             model.ATTEND[i](q, k, v, w, H ** -0.5, *e))
                ours, vjp = jax.vjp(fn, q, k, v)
                ref, ref_vjp = jax.vjp(lambda q, k, v, w=window, d=docs: dense(q, k, v, w, d),
                                       q, k, v)
                jax.block_until_ready(vjp(dy))
                t0 = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(vjp(dy))
                ms = (time.perf_counter() - t0) / 3 * 1e3
                rows.append(("JAX", impl, window, docs is not None, f"{worst((ours,), (ref,)):.1e}",
                             f"{worst(vjp(dy), ref_vjp(dy.astype(jnp.float32))):.1e}",
                             f"{ms:.2f} ms"))


def torch_attention(shape, rows, device):
    """flex_attention against SDPA (bool masks), bf16: output and gradients (flex has no backward
    on a CPU)."""
    B, T, N, K, H = shape
    g = torch.Generator().manual_seed(0)
    grads = device == "cuda"
    q, k, v = (torch.randn(B, n, T, H, generator=g).to(device, torch.bfloat16)
               .requires_grad_(grads)
               for n in (N, K, K))
    segments = torch.cumsum(torch.rand(B, T, generator=g) < 4 / T, dim=1).to(device)
    for window in (0, T // 4):
        for docs in (None, segments):
            if window == 0 and docs is None:
                # (model.Attention runs SDPA's causal path there, whatever model.attention says)
                continue
            out = {}
            for impl in ("sdpa", "flex"):
                m = model.ModelConfig(d_model=N * H, n_heads=N, n_kv_heads=K, head_dim=H,
                                      vocab_size=256, eos_token_id=0, pad_token_id=1,
                                      max_seq_len=T, attention=impl)
                masks = model.attention_masks_torch(m, [window], T, docs, torch.device(device))
                mask = masks[window]
                for x in (q, k, v):
                    x.grad = None
                if impl == "sdpa":
                    y = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                else:
                    y = model.flex_attention(q, k, v, mask, H ** -0.5)
                if grads:
                    y.float().square().sum().backward()
                out[impl] = [t.detach().float() for t in (y, q.grad, k.grad, v.grad)
                             if t is not None]
            diff = [float((a - b).abs().max() / b.abs().max())
                    for a, b in zip(out["flex"], out["sdpa"])]
            rows.append(("torch", "flex vs sdpa", window, docs is not None, f"{diff[0]:.1e}",
                         f"{max(diff[1:]):.1e}" if grads else "n/a", ""))


def training(cfg, steps, rows):
    """`steps` train steps of each backend on random tokens: tokens/s (after 2 warm-up steps) and
    MFU."""
    B, T = cfg.data.global_batch, cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
    flops = model.flops_per_token(cfg.model, T)
    cuda = torch.cuda.is_available()
    for label, dtype, _, make in bench_rows(cfg, jax.default_backend(), cuda):
        # (a cold compile: ~40 s on a CPU)
        torch_row = "torch sdpa compiled" if cuda else "torch sdpa eager"
        if dtype != "bfloat16" and not label.startswith("transformers (cpu"):
            # the rows a real run would use: bf16 compute (transformers on a CPU: fp32 only)
            continue
        if "torch" in label and torch_row not in label:
            continue
        t0 = time.perf_counter()
        step, peak, devices = make(tokens)
        for _ in range(2):
            jax.block_until_ready(step())
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
        tps = steps * B * T / (time.perf_counter() - t0)
        mfu = f"{100 * flops * tps / (peak * devices):.1f}%" if peak else "n/a"
        rows.append((label, f"{tps:,.0f}", mfu, f"{warm:.0f} s"))
        del step, out
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def table(header, rows):
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes and a few steps (the CPU test)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = jax.devices()[0]
    env = (f"jax {jax.__version__} on {jax.default_backend()} ({device.device_kind}); "
           f"torch {torch.__version__} on "
           + (torch.cuda.get_device_name() if cuda else "cpu"))
    print(env, flush=True)
    if warning := shard.unseen_accelerator(jax.default_backend()):
        print(warning, flush=True)
    shape = (1, 256, 4, 2, 32) if args.tiny else (2, 4096, 16, 4, 128)  # (B, T, N, K, H)
    attention = []
    jax_attention(shape, attention)
    torch_attention(shape, attention, "cuda" if cuda else "cpu")
    header = ["backend", "implementation", "window", "documents", "output vs fp32", "gradients",
              "fwd+bwd"]
    print(table(header, attention), flush=True)
    tiny = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4",
            "--model.mlp_hidden=128", "--model.vocab_size=512", "--model.eos_token_id=0",
            "--model.pad_token_id=1", "--data.seq_len=128", "--model.max_seq_len=128",
            "--data.global_batch=4"]
    flags = tiny if args.tiny else ["--data.global_batch=4"]
    # As shipped (FSDP over whatever devices there are), 4 instances a step of 1 each (memory: one
    # H100 holds the whole 24 GB of weights, gradients and AdamW state)
    cfg = load_config(["configs/olmo2-1b.toml", "--train.micro_batch=1"] + flags)
    runs = []
    training(cfg, 2 if args.tiny else args.steps, runs)
    seconds = time.perf_counter() - t_start
    lines = [f"`python tests/device_check.py`: {env}; {seconds:.0f} s in all.", "",
             table(header, attention), "",
             f"OLMo-2-1B's shape ({model.count_params(cfg.model):,} params), "
             f"{cfg.data.global_batch} x {cfg.data.seq_len} tokens a step, "
             f"{2 if args.tiny else args.steps} steps after 2 warm-up steps:", "",
             table(["row", "tokens/s", "MFU", "build + compile"], runs)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
