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

def train_bench(argv):
    raise NotImplementedError  # moved here from train.py


# --- attention: sliding-window vs full layers ---------------------------------------------------

def attention_bench(argv):
    """Forward + backward time of sliding against full layers on this device's default attention:
    what a window saves. D 256, 4 heads of 64, 2 layers, W 512, B 1."""
    import time
    from functools import partial

    import jax
    import jax.numpy as jnp

    from configs import ModelConfig
    from model import init_params, loss_fn, pick_attention

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
            step = jax.jit(jax.grad(partial(loss_fn, m=m)))
            jax.block_until_ready(step(params, toks, toks))  # compile
            t0 = time.perf_counter()
            for _ in range(3):
                jax.block_until_ready(step(params, toks, toks))
            times[kind] = (time.perf_counter() - t0) / 3 * 1e3
        ideal = W / (T / 2)  # keys per query: W against T/2 on average under the causal mask
        impl = pick_attention(m, jnp.float32)
        ratio = times["S"] / times["F"]
        print(f"{T:>6} {impl:>6} {times['F']:>9.0f} {times['S']:>11.0f} {ratio:>6.2f} "
              f"{ideal:>6.3f}")


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
