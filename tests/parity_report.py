"""Parity figures for the README and closing notes: max abs and relative logit differences per family,
JAX vs torch vs Hugging Face transformers, fp32 and bf16, on the test variants (tests/common.py).

    .venv/bin/python tests/parity_report.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import convert  # noqa: E402
import model  # noqa: E402
from common import VARIANTS, tokens  # noqa: E402
from test_hf import hf_model  # noqa: E402


def main():
    print(f"{'family':<7} {'dtype':<9} {'pair':<13} {'max |diff|':>11} {'relative':>10}   (logit scale)")
    for name in sorted(VARIANTS):
        net = hf_model(name)
        with tempfile.TemporaryDirectory() as d:
            net.save_pretrained(d)
            m, params = convert.load_hf(d)
        toks = tokens(m, B=4, T=64)
        for dtype in ("float32", "bfloat16"):
            with torch.no_grad():
                hf = net.to(getattr(torch, dtype))(torch.from_numpy(toks)).logits.float().numpy()
                pt = model.torch_model(m, params)(torch.from_numpy(toks), getattr(torch, dtype)).float().numpy()
            jx = np.asarray(model.forward(params, jnp.asarray(toks), m, jnp.dtype(dtype)).astype(jnp.float32))
            for pair, a, b in [("jax-torch", jx, pt), ("jax-hf", jx, hf), ("torch-hf", pt, hf)]:
                diff = np.abs(a - b).max()
                print(f"{name:<7} {dtype:<9} {pair:<13} {diff:>11.2e} {diff / np.abs(b).max():>10.2e}   ({np.abs(b).max():.2f})")


if __name__ == "__main__":
    main()
