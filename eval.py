"""Evaluation: logits of a checkpoint in either backend, bits per byte, and generation with a KV cache.

    python eval.py logits DIR --tokens IN.npy --out OUT.npy [--backend jax|torch] [--dtype float32|bfloat16]
    python eval.py generate CKPT --prompt TEXT [--max-new 64] [--temperature 0.8 --top-k 50 --top-p 0.95]
                                 [--backend jax|torch] [--no-cache]

IN.npy holds integer token ids (B, T); OUT.npy gets float32 logits (B, T, V), V being the checkpoint's
vocabulary. Both backends compute the same function (tests/test_hf.py holds them to it). `generate` is
greedy at temperature 0 and stops at EOS; the tokenizer is the one the checkpoint's data was prepared
with (or --tokenizer).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import convert
import data
import model


def logits(d, tokens, backend="jax", dtype="float32", source="tokens"):
    m, params = convert.load_hf(d)
    tokens = model.check_tokens(tokens, m, source)
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        run = jax.jit(lambda p, t: model.forward(p, t, m, jnp.dtype(dtype)))
        return np.asarray(run(params, jnp.asarray(tokens)).astype(jnp.float32))
    import torch
    with torch.no_grad():
        out = model.torch_model(m, params)(torch.from_numpy(tokens.astype(np.int64)), getattr(torch, dtype))
    return out.float().numpy()


def token_bytes(tok):
    """UTF-8 bytes each token id stands for; special tokens (EOS, PAD) stand for none. Bits per byte
    divide a loss by these, so models with different tokenizers compare (Paloma's measure)."""
    special = set(tok.enc.special_tokens_set)
    out = np.zeros(tok.vocab_size, np.int64)
    for i in range(tok.vocab_size):
        piece = tok.enc.decode_single_token_bytes(i)
        out[i] = 0 if piece.decode("utf-8", "replace") in special else len(piece)
    return out


def bits_per_byte(nats, n_bytes):
    return nats / (np.log(2) * n_bytes) if n_bytes else float("nan")


# --- generation ---------------------------------------------------------------------------------

def pick(logits, temperature=0.0, top_k=0, top_p=1.0, rng=None):
    """The next token from logits (V,): the argmax at temperature 0 (ties: the lowest id); otherwise a
    draw from softmax(logits / temperature) over the top_k most likely (0 = all), cut to the smallest
    set whose probability reaches top_p. On the host in float64, so both backends draw alike."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")[: top_k or None]
    p = np.exp((logits[order] - logits[order[0]]) / temperature)
    p /= p.sum()
    keep = np.cumsum(p) - p < top_p  # a token stays if the ones above it have not reached top_p yet
    p = p[keep] / p[keep].sum()
    return int(order[:len(p)][rng.choice(len(p), p=p)])


def generate(params, m, prompt_ids, n_new, backend="jax", dtype="float32", temperature=0.0, top_k=0, top_p=1.0,
             eos=None, seed=0, cache=True):
    """Up to n_new tokens after prompt_ids (stopping after `eos`), and timings. With the cache, the prompt
    runs once (prefill) and each new token is one position through every layer; without it, every token
    re-reads the whole sequence (the reference the cache is tested against)."""
    prompt = [int(t) for t in prompt_ids] or [m.eos_token_id]  # an empty prompt starts from EOS
    if len(prompt) >= m.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; max_seq_len={m.max_seq_len} leaves no room to generate")
    if len(prompt) + n_new > m.max_seq_len:
        print(f"warning: stopping at max_seq_len={m.max_seq_len}: {m.max_seq_len - len(prompt)} new tokens, not {n_new}",
              file=sys.stderr)
    S = min(len(prompt) + n_new, m.max_seq_len)
    model.check_tokens(np.asarray([prompt]), m, "prompt")
    rng = np.random.default_rng(seed)
    run = (_jax_steps if backend == "jax" else _torch_steps)(params, m, S, dtype, cache)
    ids, t0 = list(prompt), time.perf_counter()
    logits = run(ids, 0)  # (V,) after the prompt
    times = [time.perf_counter() - t0]
    for _ in range(n_new):
        ids.append(pick(logits, temperature, top_k, top_p, rng))
        if ids[-1] == eos or len(ids) == S:
            break
        t0 = time.perf_counter()
        logits = run(ids, len(ids) - 1)
        times.append(time.perf_counter() - t0)
    # The median step, so that compiling (the first call of each shape in JAX) does not count.
    return ids[len(prompt):], dict(prompt=len(prompt), prefill_s=times[0], step_s=float(np.median(times[1:] or [np.nan])))


def _jax_steps(params, m, S, dtype, cache):
    """run(ids, n): the logits (V,) that follow ids, given that ids[:n] were seen by earlier calls."""
    import jax
    import jax.numpy as jnp
    params = {k: jnp.asarray(v) for k, v in params.items()}
    if not cache:  # one compiled forward over a fixed (1, S) buffer, read at the last filled position
        full = jax.jit(lambda p, t, n: model.forward(p, t, m, jnp.dtype(dtype))[0, n - 1].astype(jnp.float32))
        return lambda ids, _: np.asarray(full(params, jnp.asarray([ids + [0] * (S - len(ids))], jnp.int32), len(ids)))
    # Compiled twice: once for the prompt's length, once for one token. The cache is donated, so XLA
    # updates it in place rather than copying every layer's keys each token.
    step = jax.jit(lambda p, t, pos, c: model.forward_step(p, t, pos, c, m, jnp.dtype(dtype)), donate_argnums=3)
    state = {"cache": model.new_cache(m, 1, S, jnp.dtype(dtype))}

    def run(ids, n):
        logits, state["cache"] = step(params, jnp.asarray([ids[n:]], jnp.int32), jnp.int32(n), state["cache"])
        return np.asarray(logits[0, -1].astype(jnp.float32))

    return run


def _torch_steps(params, m, S, dtype, cache):
    import torch
    net, dt = model.torch_model(m, params).eval(), getattr(torch, dtype)
    kv = net.new_cache(1, S, dt)

    @torch.no_grad()
    def run(ids, n):
        if not cache:
            return net(torch.tensor([ids]), dt)[0, -1].float().numpy()
        return net.forward_step(torch.tensor([ids[n:]]), n, kv, dt)[0, -1].float().numpy()

    return run


def checkpoint_tokenizer(ckpt, m, spec=None):
    """The tokenizer for a checkpoint: `spec` if given ('dolma2' or a ranks file); else the one its training
    data was prepared with (nanolmo.json names the data); else dolma2 when the model has dolma2's ids."""
    if spec:
        return data.load_tokenizer(spec)
    meta = Path(ckpt) / "nanolmo.json"
    if meta.is_file():
        path = json.loads(meta.read_text())["config"]["data"]["path"]
        if (Path(path) / "prepare.json").is_file():
            return data.dataset_tokenizer(path)
    if m.eos_token_id == 100257 and m.vocab_size >= 100278:
        return data.load_tokenizer("dolma2")
    raise ValueError(f"{ckpt}: cannot tell its tokenizer (no nanolmo.json naming prepared data, not dolma2's ids): "
                     "pass --tokenizer")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    lg = sub.add_parser("logits", help="logits of an HF-format model directory on given tokens")
    lg.add_argument("dir")
    lg.add_argument("--tokens", required=True, help=".npy of int token ids, shape (B, T)")
    lg.add_argument("--out", required=True, help=".npy to write float32 logits (B, T, V) to")
    lg.add_argument("--backend", choices=["jax", "torch"], default="jax")
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen = sub.add_parser("generate", help="continue a prompt, with a KV cache")
    gen.add_argument("ckpt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no cut")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--backend", choices=["jax", "torch"], default="jax")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--tokenizer", default=None, help="'dolma2' or a ranks file; default: the checkpoint's")
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    args = ap.parse_args(argv)
    if args.command == "generate":
        m, params = convert.load_hf(args.ckpt)
        tok = checkpoint_tokenizer(args.ckpt, m, args.tokenizer)
        new, t = generate(params, m, tok.enc.encode(args.prompt, allowed_special="all"), args.max_new, args.backend,
                          args.dtype, args.temperature, args.top_k, args.top_p, m.eos_token_id, args.seed, not args.no_cache)
        print(args.prompt + tok.decode(new))
        print(f"({t['prompt']} prompt tokens, then {len(new)} new ones at {1 / t['step_s']:,.1f} tokens/s (the median "
              f"step); {args.backend}, {args.dtype}, {'no cache' if args.no_cache else 'KV cache'})", file=sys.stderr)
        return
    tokens = np.load(args.tokens, allow_pickle=False)
    out = logits(args.dir, tokens, args.backend, args.dtype, args.tokens)
    np.save(args.out, out.astype(np.float32))
    print(f"wrote {args.out}: {out.shape} float32 ({args.backend}, {args.dtype} compute)")


if __name__ == "__main__":
    main(sys.argv[1:])
