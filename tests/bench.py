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
