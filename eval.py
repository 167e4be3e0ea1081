"""Evaluation. For now: the logits of an HF-format model directory from either backend, bits per byte,
and a plain sampler (train.py uses the last two).

    python eval.py logits DIR --tokens IN.npy --out OUT.npy [--backend jax|torch] [--dtype float32|bfloat16]

IN.npy holds integer token ids (B, T); OUT.npy gets float32 logits (B, T, V), V being the checkpoint's
vocabulary. Both backends compute the same function (tests/test_parity.py holds them to it).
"""

import argparse
import sys

import numpy as np

import convert
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


def sample(params, m, prompt_ids, n_new, temperature=0.8, seed=0):
    """Plain autoregressive sampling: one jitted forward over a fixed window, reading the logits at the
    last filled position (a KV cache would avoid recomputing the prefix; this is the simple version)."""
    import jax
    import jax.numpy as jnp
    T = min(m.max_seq_len, len(prompt_ids) + n_new)
    buf = np.zeros((1, T), np.int32)
    ids = list(prompt_ids)[-(T - 1):]
    step = jax.jit(lambda p, t, n, key: jax.random.categorical(
        key, model.forward(p, t, m)[0, n - 1].astype(jnp.float32) / temperature))
    key = jax.random.PRNGKey(seed)
    for _ in range(n_new):
        window = ids[-T:]
        buf[0, :len(window)] = window
        key, sub = jax.random.split(key)
        ids.append(int(step(params, jnp.asarray(buf), len(window), sub)))
    return ids[len(prompt_ids[-(T - 1):]):]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    lg = sub.add_parser("logits", help="logits of an HF-format model directory on given tokens")
    lg.add_argument("dir")
    lg.add_argument("--tokens", required=True, help=".npy of int token ids, shape (B, T)")
    lg.add_argument("--out", required=True, help=".npy to write float32 logits (B, T, V) to")
    lg.add_argument("--backend", choices=["jax", "torch"], default="jax")
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)
    tokens = np.load(args.tokens, allow_pickle=False)
    out = logits(args.dir, tokens, args.backend, args.dtype, args.tokens)
    np.save(args.out, out.astype(np.float32))
    print(f"wrote {args.out}: {out.shape} float32 ({args.backend}, {args.dtype} compute)")


if __name__ == "__main__":
    main(sys.argv[1:])
