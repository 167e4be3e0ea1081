"""Tests run from the repository root (`make test`); make the top-level scripts importable. The `setup`
fixture (a small prepared dataset and a config file for it) serves test_train.py and test_torch.py."""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One XLA compilation cache for the session, shared by this process, both pytest-xdist workers (they
# inherit the controller's environment and find it there) and every script a test starts (set before
# anything imports jax): most tests compile the same small step functions again, and compiling is half
# of a short run's time. Entries are keyed by the program, the flags and the jax version, so a hit runs
# exactly what a fresh compile would. A size limit (never reached) turns on jax's file lock around each
# read and write: without it, a process could read an entry another is still writing.
CACHE = os.environ.get("NANOLMO_TEST_XLA_CACHE")
if CACHE is None:  # the controller (or a run without xdist): it makes the folder and removes it
    CACHE = os.environ["NANOLMO_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="nanolmo-xla-")
    atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
                  JAX_COMPILATION_CACHE_MAX_SIZE=str(16 * 2**30))
sys.path.insert(0, str(ROOT))

import data  # noqa: E402  (after the path is set)

SMALL = """
[model]
family = "olmo3"
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
mlp_hidden = 64
vocab_size = 384
eos_token_id = 382
pad_token_id = 383
max_seq_len = 32
sliding_window = 8
layer_pattern = "SF"
[data]
seq_len = 32
global_batch = 8
[train]
lr = 3e-3
warmup = 2
log_every = 1
checkpoint_every = 100
[eval]
every = 0
prompt = ""
"""


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """A prepared dataset (384-id BPE on real text) and a config file pointing at it."""
    root = tmp_path_factory.mktemp("small")
    docs = root / "docs"
    docs.mkdir()
    paras = [p for p in (ROOT / "LICENSE").read_text().split("\n\n") if p.strip()]
    for i, p in enumerate(paras):
        (docs / f"{i:03d}.txt").write_text(p * 3)
    data.save_ranks(data.train_bpe([(ROOT / "LICENSE").read_text()], 384), root / "bpe.tiktoken")
    # Held out by a hash of the text: 0.2 holds out 5 of these 33 documents (0.1 would hold out none),
    # so the training tests run their held-out eval too.
    report = data.prepare([docs], root / "data", str(root / "bpe.tiktoken"), heldout=0.2, workers=1, quiet=True)
    assert report["splits"]["heldout"]["documents"] > 0
    toml = root / "small.toml"
    toml.write_text(SMALL.replace("[data]\n", f'[data]\npath = "{root / "data"}"\n'))
    return root, toml


def pytest_configure(config):
    # model.py filters this warning at import; pytest resets filters per test, so say it here too
    config.addinivalue_line("filterwarnings", "ignore:flex_attention called without torch.compile")
