"""Evaluation. For now: the logits of an HF-format model directory, from either backend.

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
