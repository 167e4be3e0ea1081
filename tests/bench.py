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
    raise NotImplementedError  # moved here from model.py


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

def generate_bench(argv):
    raise NotImplementedError  # moved here from eval.py


COMMANDS = {"train": train_bench, "attention": attention_bench, "data": data_bench,
            "generate": generate_bench}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    COMMANDS[sys.argv[1]](sys.argv[2:])
