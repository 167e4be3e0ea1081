"""data.py: tokenizers against their references, prepare's outputs and errors, and OLMo-core's order."""
import gzip
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import data
from teach import fail

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LICENSE = (ROOT / "LICENSE").read_text()  # real English text, fixed bytes
PARAGRAPHS = [p.strip() for p in LICENSE.split("\n\n") if len(p.split()) > 5]


@pytest.fixture(scope="module")
def dolma2():
    return data.load_tokenizer("dolma2")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "bpe.tiktoken"
    data.save_ranks(data.train_bpe([LICENSE], 512), path)
    return path


def write_docs(folder, n=60):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(f"Document {i}.\n" + PARAGRAPHS[i % len(PARAGRAPHS)] * (1 + i % 3))
    return folder


# --- tokenizers ---

def test_dolma2_reference_ids(dolma2):
    assert dolma2.enc.encode("Hello world", allowed_special="all") == [9906, 1917]
    assert dolma2.enc.encode("<|endoftext|>", allowed_special="all") == [100257]
    assert dolma2.encode_document("Hello world") == [9906, 1917, 100257]
    assert (dolma2.eos_id, dolma2.pad_id, dolma2.vocab_size) == (100257, 100277, 100278)
    assert dolma2.enc.encode("|||PHONE_NUMBER|||<|pad|>", allowed_special="all") == [100261, 100277]


def test_dolma2_matches_hf_tokenizer_file(dolma2):
    tokenizers = pytest.importorskip("tokenizers")
    path = SHARED / "reference/tokenizers/allenai_dolma2.json"
    if not path.is_file():
        pytest.skip("../shared is absent")
    hf = tokenizers.Tokenizer.from_file(str(path))
    texts = PARAGRAPHS + ["  two  spaces\n\n\nand\ttabs \n ", "naïve café 日本語 🙂 don't I'll 12345", "a\r\nb\r\n\r\n c",
                          "x<|endoftext|>y |||EMAIL_ADDRESS||| <|im_start|>", "    indented\n        code()"]
    for t in texts:
        assert dolma2.enc.encode(t, allowed_special="all") == hf.encode(t, add_special_tokens=False).ids, t


def test_round_trip_arbitrary_unicode(dolma2, bpe):
    rng = np.random.default_rng(0)
    small = data.load_tokenizer(str(bpe))
    for _ in range(50):
        cps = rng.integers(1, 0x10FFFF, 40)
        s = "".join(chr(c) for c in cps if not 0xD800 <= c < 0xE000)
        for tok in (dolma2, small):
            assert tok.decode(tok.encode_document(s)[:-1]) == s


def test_lone_surrogates_are_replaced_and_counted(tmp_path, dolma2):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "text": "ok \\ud800 lone, \\ud83d\\ude00 pair"}\n{"id": "b", "text": "fine"}\n')
    report = data.prepare([src], tmp_path / "out", "dolma2", workers=1, quiet=True)
    assert report["surrogates_replaced"] == 1 and report["splits"]["train"]["documents"] == 2
    tf = data.dataset_files(tmp_path / "out")[0]
    text = dolma2.decode(tf.array()[: tf.docs[1, 0]])
    assert text == "ok \ufffd lone, \U0001F600 pair<|endoftext|>"


def test_bpe_matches_tiktoken_educational_trainer():
    from tiktoken._educational import bpe_train
    ref = bpe_train(LICENSE, 277, data.PATTERN, visualise=None)  # the first 21 merges have no ties
    assert data.train_bpe([LICENSE], 277 + len(data.BPE_SPECIALS)) == ref


def test_bpe_every_merge_is_a_most_frequent_pair():
    import regex
    ranks = data.train_bpe([LICENSE], 256 + 120 + 2)
    by_rank = sorted(ranks, key=ranks.get)
    words = [[bytes([b]) for b in w.encode()] for w in regex.findall(data.PATTERN, LICENSE)]
    for tok in by_rank[256:]:
        counts = {}
        for w in words:
            for p in zip(w, w[1:]):
                counts[p] = counts.get(p, 0) + 1
        chosen = [p for p in counts if p[0] + p[1] == tok]
        assert chosen and max(counts[p] for p in chosen) == max(counts.values()), tok
        pair = max(chosen, key=counts.get)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == pair:
                    w[i:i + 2] = [tok]
                i += 1


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not 'dolma2' and no such ranks file"):
        data.load_tokenizer(str(tmp_path / "nope.tiktoken"))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken:1: not a tiktoken ranks line"):
        data.load_tokenizer(str(bad))
    with pytest.raises(ValueError, match="below 256 bytes"):
        data.train_bpe(["x"], 100)


def test_a_retrained_tokenizer_is_read_again(tmp_path, monkeypatch):
    """tiktoken's loader caches every file under a hash of its path string:
    two tokenizers trained on different text at the same relative path, in two folders,
    must each encode with their own merges."""
    texts = {"one": "the cat sat on the mat " * 50, "two": "zebras quietly queue " * 50}
    encoded = {}
    for name, text in texts.items():
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        # 256 bytes, 2 merges, EOS, PAD
        data.save_ranks(data.train_bpe([text], 260), "tok.tiktoken")
        tok = data.load_tokenizer("tok.tiktoken")
        assert tok.sha256 == data.sha256("tok.tiktoken")
        encoded[name] = tok.enc.encode(text[:40])
        assert len(encoded[name]) < 40  # its own merges shorten its own text
    assert encoded["one"] != encoded["two"]


# --- prepare ---

def test_prepare_outputs_metadata_and_index(tmp_path, bpe):
    docs = write_docs(tmp_path / "docs")
    r = data.prepare([docs], tmp_path / "out", str(bpe), heldout=0.2, workers=1, quiet=True)
    tok = data.load_tokenizer(str(bpe))
    train, held = data.dataset_files(tmp_path / "out"), data.dataset_files(tmp_path / "out", "heldout")
    assert r["splits"]["train"]["documents"] + r["splits"]["heldout"]["documents"] == 60
    assert 3 <= r["splits"]["heldout"]["documents"] <= 25  # 20% of 60 by hash
    assert train[0].dtype == np.uint16 and r["dtype"] == "uint16"
    # Held out exactly the documents whose text hash falls below the fraction.
    names = {f"doc{i:03d}.txt" for i in range(60)}
    want_held = {n for n in names if data.heldout_score((docs / n).read_text()) < 0.2}
    got_held = {Path(held[0].sources[s]).name for s in held[0].docs[:, 1]}
    assert got_held == want_held
    # Every document decodes back to its source text followed by EOS.
    tf = train[0]
    starts = list(tf.docs[:, 0]) + [tf.tokens]
    for j, (start, src, _) in enumerate(tf.docs):
        ids = tf.array()[start:starts[j + 1]]
        assert ids[-1] == tok.eos_id
        assert tok.decode(ids[:-1]) == Path(tf.sources[src]).read_text()
    assert json.loads((tmp_path / "out/prepare.json").read_text())["sources"][0]["sha256"] == data.sha256(docs / "doc000.txt")


def test_prepare_parallel_equals_serial(tmp_path, bpe):
    docs = write_docs(tmp_path / "docs", 40)
    data.prepare([docs], tmp_path / "a", str(bpe), heldout=0.1, workers=1, quiet=True)
    data.prepare([docs], tmp_path / "b", str(bpe), heldout=0.1, workers=2, quiet=True)
    for split in ("train", "heldout"):
        a = (tmp_path / "a" / split / "part-00000.bin").read_bytes()
        assert a == (tmp_path / "b" / split / "part-00000.bin").read_bytes()


def test_prepare_rolls_parts(tmp_path, bpe):
    docs = write_docs(tmp_path / "docs", 30)
    data.prepare([docs], tmp_path / "out", str(bpe), workers=1, quiet=True, max_part_tokens=2000)
    files = data.dataset_files(tmp_path / "out")
    assert len(files) > 2 and sum(f.docs.shape[0] for f in files) == 30


def test_bad_documents_are_counted_and_located(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/empty.txt").write_text("")
    (tmp_path / "in/latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "in/good.txt").write_text("a real document")
    with gzip.open(tmp_path / "in/d.jsonl.gz", "wt") as f:
        f.write('{"id": 1, "text": "fine"}\n{"id": 2, "body": "no text"}\n{not json\n\n{"text": 5}\n')
    r = data.prepare([tmp_path / "in"], tmp_path / "out", "dolma2", workers=1, quiet=True)
    assert r["splits"]["train"]["documents"] == 2
    assert r["skipped"] == {"empty text": 1, "not UTF-8": 1, "no string 'text' field": 2, "invalid JSON": 1}
    ex = "\n".join(r["skipped_examples"])
    assert "d.jsonl.gz:2: no string 'text' field" in ex and "d.jsonl.gz:3: invalid JSON" in ex
    assert "latin1.txt:0: not UTF-8 (byte 3)" in ex


def test_empty_corpus_and_bad_inputs(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no training documents in .*1 skipped"):
        data.prepare([tmp_path / "in"], tmp_path / "out", "dolma2", workers=1, quiet=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        data.prepare([tmp_path / "missing"], tmp_path / "out", "dolma2", workers=1, quiet=True)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="x.csv: unsupported input"):
        data.prepare([tmp_path / "x.csv"], tmp_path / "out", "dolma2", workers=1, quiet=True)
    (tmp_path / "done").mkdir()
    with pytest.raises(FileExistsError, match="never overwrites"):
        data.prepare([tmp_path / "in"], tmp_path / "done", "dolma2", workers=1, quiet=True)


def test_failed_prepare_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    docs = write_docs(tmp_path / "docs", 10)
    calls = []

    def boom(self, ids, src, lineno):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(self, ids, src, lineno)

    real = data.PartWriter.add
    monkeypatch.setattr(data.PartWriter, "add", boom)
    with pytest.raises(OSError, match="disk full"):
        data.prepare([docs], tmp_path / "out", "dolma2", workers=1, quiet=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_decontamination(tmp_path):
    evalf = tmp_path / "eval.jsonl"
    eval_text = "The quick brown fox jumps over the lazy dog near the quiet river bank today.\nShort line."
    evalf.write_text(json.dumps({"text": eval_text}) + "\n")
    (tmp_path / "in").mkdir()
    (tmp_path / "in/para.txt").write_text("Intro.\nthe QUICK brown fox, jumps over the lazy dog near the quiet river bank today!\n")
    (tmp_path / "in/gram.txt").write_text("x y z brown fox jumps over the lazy dog near the quiet river bank today and more")
    (tmp_path / "in/short.txt").write_text("Short line.\nUnrelated words entirely.")
    (tmp_path / "in/clean.txt").write_text("Nothing in common here at all.")
    r = data.prepare([tmp_path / "in"], tmp_path / "out", "dolma2", decontaminate=[evalf], workers=1, quiet=True)
    assert r["decontamination"]["dropped"] == 2 and r["splits"]["train"]["documents"] == 2
    assert any("para.txt:0: decontaminated (shares a paragraph" in e for e in r["skipped_examples"])
    assert any("gram.txt:0: decontaminated (shares a 13-gram" in e for e in r["skipped_examples"])


def test_decontaminate_against_paloma_sample(tmp_path):
    paloma = sorted((SHARED / "evaldata/paloma_sample").glob("*.jsonl.gz"))
    if not paloma:
        pytest.skip("../shared is absent")
    with gzip.open(paloma[0], "rt") as f:
        eval_docs = [json.loads(line)["text"] for line in f]
    write_docs(tmp_path / "in", 5)
    (tmp_path / "in/leak.txt").write_text("Some preamble.\n" + eval_docs[3].split("\n")[0] + "\nmore")
    r = data.prepare([tmp_path / "in"], tmp_path / "out", "dolma2", decontaminate=paloma, workers=1, quiet=True)
    assert r["decontamination"]["dropped"] == 1 and r["decontamination"]["eval_documents"] == len(eval_docs)
    assert r["splits"]["train"]["documents"] == 5


# --- token files ---

def test_truncated_and_mismatched_token_files(tmp_path, bpe):
    data.prepare([write_docs(tmp_path / "docs", 5)], tmp_path / "out", str(bpe), workers=1, quiet=True)
    part = tmp_path / "out/train/part-00000.bin"
    blob = part.read_bytes()
    part.write_bytes(blob[:-3])
    with pytest.raises(ValueError, match=r"part-00000.bin: \d+ bytes, but part-00000.json says \d+ uint16 tokens"):
        data.dataset_files(tmp_path / "out")
    part.write_bytes(blob)
    meta = json.loads(part.with_suffix(".json").read_text())
    part.with_suffix(".json").write_text(json.dumps({**meta, "tokens": meta["tokens"] + 1}))
    with pytest.raises(ValueError, match="does not belong to this metadata"):
        data.dataset_files(tmp_path / "out")
    part.with_suffix(".json").write_text("{broken")
    with pytest.raises(ValueError, match="part-00000.json: unreadable metadata"):
        data.dataset_files(tmp_path / "out")
    raw = tmp_path / "raw.npy"
    raw.write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match="raw.npy: 7 bytes is not a whole number of uint32 tokens"):
        data.open_token_file(raw)


def test_out_of_range_token_ids_are_caught(tmp_path, bpe):
    data.prepare([write_docs(tmp_path / "docs", 8)], tmp_path / "out", str(bpe), workers=1, quiet=True)
    part = tmp_path / "out/train/part-00000.bin"
    a = np.fromfile(part, np.uint16)
    a[100] = 60000
    a.tofile(part)
    meta = json.loads(part.with_suffix(".json").read_text())
    problems, _ = data.verify(tmp_path / "out", 16, 4, 0)
    assert any("token id 60000" in p and ">= vocab_size 512" in p for p in problems)
    assert any("sha256 differs" in p for p in problems)
    loader = data.Loader(data.open_instances(tmp_path / "out", 16), 4, 0, vocab_size=meta["vocab_size"])
    with pytest.raises(ValueError, match=r"part-00000.bin: instance 6 holds token id 60000, out of range for vocab_size=512"):
        for step in range(loader.batches_per_epoch):
            loader.batch(step)


# --- the order ---

def ids_file(path, first_id, n, T):
    """A token file whose instance k holds the global id first_id + k in every position."""
    np.repeat(np.arange(first_id, first_id + n, dtype=np.uint32), T).tofile(path)
    return data.open_token_file(path)


def order_hint(step, r, got, seed, G, world, n=103):
    """Which usual mistake in epoch_permutation gives the ids this rank got at this step."""
    epoch, row = divmod(step, n // G)
    pcg = lambda s: np.random.Generator(np.random.PCG64(s))  # noqa: E731
    tries = {"seed + epoch with epochs counted from 0": pcg(seed + epoch),
             "the seed alone, the same order every epoch": pcg(seed),
             "numpy's legacy RandomState(seed + epoch)": np.random.RandomState(seed + epoch)}
    for name, rng in tries.items():
        perm = np.arange(n, dtype=np.uint32)
        rng.shuffle(perm)
        if np.array_equal(got, perm[row * G:(row + 1) * G][r::world]):
            return (f"That is exactly {name}: epoch e (from 1) shuffles arange(N, uint32) with "
                    "np.random.Generator(np.random.PCG64(seed + e)).shuffle.")
    return ("epoch_permutation(n, seed, epoch) is OLMo-core's: ids = arange(n, dtype=uint32), "
            "shuffled in place by np.random.Generator(np.random.PCG64(seed + epoch)), epochs "
            "from 1.")


def test_order_is_olmo_core(tmp_path):
    T, G, world, seed = 4, 8, 2, 7
    files = [ids_file(tmp_path / "a.npy", 0, 60, T), ids_file(tmp_path / "b.npy", 60, 43, T)]
    inst = data.Instances([("a", files[:1], None), ("b", files[1:], None)], T)
    assert inst.n == 103
    # OLMo-core's definition, written out with numpy alone.
    expected = {}
    for epoch in (1, 2):
        perm = np.arange(103, dtype=np.uint32)
        np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(perm)
        for b in range(103 // G):
            for r in range(world):
                expected[(epoch - 1) * 12 + b, r] = perm[b * G:(b + 1) * G][r::world]
    assert 103 // G == 12
    for r in range(world):
        loader = data.Loader(inst, G, seed, world, ranks=(r,))
        for step, batch in loader:
            tokens = batch["tokens"]
            if step == 24:
                break
            if not np.array_equal(tokens[:, 0], expected[step, r]):
                fail(f"step {step} (epoch {step // 12 + 1}, its row {step % 12}), rank {r} of "
                     f"{world}: the loader reads instances {tokens[:, 0].tolist()}; OLMo-core's "
                     f"order gives {expected[step, r].tolist()}",
                     order_hint(step, r, tokens[:, 0], seed, G, world))
            assert np.all(tokens == tokens[:, :1])  # whole instances, not slices across them
    # Hand-checked against the first row: PCG64(8) shuffling 103 ids.
    assert list(expected[0, 0]) + list(expected[0, 1]) != list(range(8))


def test_resume_and_rank_partition(tmp_path):
    T, G, world, seed = 3, 12, 4, 11
    inst = data.Instances([("a", [ids_file(tmp_path / "a.npy", 0, 100, T)], None)], T)
    full = data.Loader(inst, G, seed, world, ranks=range(world))
    batches = [full.batch(s)["tokens"] for s in range(20)]
    resumed = data.Loader(inst, G, seed, world, ranks=range(world), start_step=13)
    for step, batch in resumed:
        assert np.array_equal(batch["tokens"], batches[step])
        if step == 19:
            break
    assert resumed.state()["step"] == 20
    for s in range(20):
        parts = [data.Loader(inst, G, seed, world, ranks=(r,)).batch(s)["tokens"][:, 0] for r in range(world)]
        union = np.concatenate(parts)
        assert len(set(union)) == G and set(union) == set(full.global_ids(s))


def test_the_loader_reads_the_next_batch_while_a_step_runs(tmp_path):
    """Iterating, the batch of step s + 1 is read on the loader's thread while the caller holds
    step s (the step runs meanwhile); the batches and state() are those of reading in order."""
    T, G = 3, 4
    inst = data.Instances([("a", [ids_file(tmp_path / "a.npy", 0, 40, T)], None)], T)
    loader, reads = data.Loader(inst, G, 5), []
    plain = loader.batch

    def batch(step):  # each read says which thread made it
        reads.append((step, threading.current_thread().name))
        return plain(step)
    loader.batch = batch
    for step, got in loader:
        assert np.array_equal(got["tokens"], plain(step)["tokens"])
        time.sleep(0.05)  # "the step": the next read finishes meanwhile
        assert step + 1 in [s for s, _ in reads], reads  # already read
        assert loader.state()["step"] == step + 1  # what a checkpoint saved now resumes from
        if step == 2:
            break
    assert [s for s, _ in reads] == [0, 1, 2, 3]
    assert all(name.startswith("loader") for _, name in reads)


def test_loader_errors(tmp_path):
    inst = data.Instances([("a", [ids_file(tmp_path / "a.npy", 0, 10, 4)], None)], 4)
    with pytest.raises(ValueError, match="global batch 6 does not divide over 4"):
        data.Loader(inst, 6, 0, world=4)
    with pytest.raises(ValueError, match="fewer than one global batch of 16"):
        data.Loader(inst, 16, 0)
    with pytest.raises(ValueError, match="no instance of 100 tokens"):
        data.Instances([("a", inst.files, None)], 100)


def test_weighted_mix(tmp_path):
    T = 2
    ids_file(tmp_path / "a.npy", 0, 30, T)
    ids_file(tmp_path / "b.npy", 30, 10, T)
    mix = tmp_path / "mix.txt"
    mix.write_text("# label,path,weight\nweb,a.npy,1\nbooks,b.npy,1\n")
    inst = data.open_instances(mix, T, seed=3)
    assert inst.n == 40 and inst.repeats == {"web": 20 / 30, "books": 2.0}
    seen = [int(inst.read(i)[0]) for i in range(inst.n)]
    assert sorted(seen[20:]) == sorted(list(range(30, 40)) * 2)  # books: every instance twice
    assert len(set(seen[:20])) == 20 and all(s < 30 for s in seen[:20])  # web: 20 distinct of 30
    mix.write_text("web,a.npy,1\nbooks,b.npy\n")
    with pytest.raises(ValueError, match="weight on every line or on none"):
        data.open_instances(mix, T)
    mix.write_text("web,nothing*.npy\n")
    with pytest.raises(FileNotFoundError, match=r"mix.txt:1: nothing\*.npy matches no token files"):
        data.open_instances(mix, T)


def test_cli_inspect_and_verify(tmp_path, bpe, capsys):
    data.prepare([write_docs(tmp_path / "docs", 12)], tmp_path / "out", str(bpe), heldout=0.2, workers=1, quiet=True)
    data.main(["inspect", str(tmp_path / "out"), "--seq-len", "32", "--global-batch", "4", "--seed", "1",
               "--step", "2", "--world", "2"])
    out = capsys.readouterr().out
    assert "step 2: epoch 1" in out and "rank 1:" in out and "in doc [" in out and ".txt" in out
    data.main(["verify", str(tmp_path / "out"), "--seq-len", "32", "--global-batch", "4", "--seed", "1"])
    assert capsys.readouterr().out.startswith("ok: ")
    # A held-out document copied into training is a violation verify must report.
    out = tmp_path / "out"
    assert len(data.dataset_files(out, "heldout")[0].docs)
    for suffix in (".bin", ".json", ".docs.npy"):
        shutil.copy(out / f"heldout/part-00000{suffix}", out / f"train/part-00001{suffix}")
    with pytest.raises(SystemExit, match=r"verify failed: .*identical copy in training, e\.g\. .*doc\d+\.txt:0"):
        data.main(["verify", str(out), "--seq-len", "32", "--global-batch", "4", "--seed", "1"])


def test_duplicates_under_different_ids_verify(tmp_path, bpe, capsys):
    # BoolQ-like data: one passage under several ids, and a .txt copy under a third id; held out by id hash,
    # the copies landed on both sides and prepare's own output failed verify.
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in/qa.jsonl", "w") as f:
        for i in range(60):
            for q in range(3):
                f.write(json.dumps({"id": f"q{i}-{q}", "text": PARAGRAPHS[i % len(PARAGRAPHS)] + f" {i}"}) + "\n")
    for i in range(20):
        (tmp_path / f"in/copy{i}.txt").write_text(PARAGRAPHS[i % len(PARAGRAPHS)] + f" {i}")
    r = data.prepare([tmp_path / "in"], tmp_path / "out", str(bpe), heldout=0.3, workers=1, quiet=True)
    assert r["splits"]["train"]["documents"] + r["splits"]["heldout"]["documents"] == 200
    assert r["splits"]["heldout"]["documents"] >= 20
    data.main(["verify", str(tmp_path / "out"), "--seq-len", "32", "--global-batch", "4", "--seed", "1"])
    assert capsys.readouterr().out.startswith("ok: ")


# --- the instance filter (OLMo-core's InstanceFilterConfig: periods 1..13, 32 times) ---

def repeated(period, times, extra=0, before=5, after=5):
    """Distinct background ids around `times` back-to-back copies of a `period`-token pattern
    (then `extra` tokens of one more copy):
    no pattern of fewer tokens fits it, so its period is exactly `period`."""
    pattern = np.arange(1000, 1000 + period)
    run = np.concatenate([np.tile(pattern, times), pattern[:extra]])
    return np.concatenate([np.arange(before), run, np.arange(2000, 2000 + after)])


@pytest.mark.parametrize("period", range(1, 14))
def test_instance_filter_counts_whole_copies(period):
    """OLMo-core masks at repetition_max_count = 32 copies or more;
    a partial copy after the last does not count."""
    for times, masked in ((31, False), (32, True), (33, True)):
        hit = data.filtered(repeated(period, times), **data.INSTANCE_FILTER)
        assert (hit is not None) == masked, (period, times)
    if period > 1:
        assert data.filtered(repeated(period, 31, extra=period - 1), **data.INSTANCE_FILTER) is None
    assert data.filtered(repeated(period, 32), **data.INSTANCE_FILTER) == (period, 32)
    run = data.periodic_runs(repeated(period, 5, extra=period - 1))
    # where it starts, ends, and how many whole copies
    assert run[0] == (5, 5 + 6 * period - 1, period, 5)


def test_instance_filter_bounds():
    # a 14-token pattern is past max_period: 100 copies are not masked;
    # 2 copies are too few to be a run at all
    assert data.filtered(repeated(14, 100), **data.INSTANCE_FILTER) is None
    assert data.periodic_runs(repeated(4, 2)) == []
    # "abab..." is also "abababab" repeated:
    # the first that reaches 32 is the shortest period (OLMo-core's order)
    assert data.filtered(repeated(2, 64), **data.INSTANCE_FILTER) == (2, 64)
    assert data.filtered(repeated(2, 64), max_period=13, min_period=4, max_count=32) == (4, 32)


def test_instance_filter_spares_real_text(dolma2):
    """English prose (the LICENSE, tokenized by dolma2 in 512-token instances)
    repeats nothing 32 times."""
    ids = np.asarray(dolma2.encode_document(LICENSE))
    for k in range(len(ids) // 512):
        assert data.filtered(ids[k * 512:(k + 1) * 512], **data.INSTANCE_FILTER) is None, k


def test_instance_filter_in_the_loader(tmp_path):
    """Each instance is checked alone:
    40 copies that straddle two instances (20 in each) mask neither; 40 inside one mask it.
    A masked instance keeps its place and its tokens; its mask row is all False."""
    T = 64
    rest = np.arange(10_000, 10_000 + 4 * T)
    tokens = rest.copy()
    tokens[T - 20:T + 20] = 7        # instances 0 and 1: 20 copies each
    tokens[2 * T + 5:2 * T + 45] = 8  # instance 2: 40 copies
    tokens.astype(np.uint32).tofile(tmp_path / "a.npy")
    inst = data.Instances([("a", [data.open_token_file(tmp_path / "a.npy")], None)], T)
    plain = data.Loader(inst, 4, 0).batch(0)
    out = data.Loader(inst, 4, 0, instance_filter=data.INSTANCE_FILTER).batch(0)
    assert np.array_equal(out["tokens"], plain["tokens"]) and "mask" not in plain
    ids = data.Loader(inst, 4, 0).global_ids(0).tolist()
    assert out["masked"] == 1 and ([not out["mask"][ids.index(i)].any() for i in range(4)]
                                   == [False, False, True, False])
    assert out["mask"].all(axis=1).sum() == 3


def test_instance_filter_cli(tmp_path, bpe, capsys):
    """inspect puts `masked` and why on the id line;
    verify counts the epoch's masked instances (none in prose)."""
    d = tmp_path / "out"
    data.prepare([write_docs(tmp_path / "docs", 12)], d, str(bpe),
                 heldout=0.2, workers=1, quiet=True)
    common = [str(d), "--seq-len", "32", "--global-batch", "4", "--seed", "1", "--instance-filter"]
    data.main(["verify", *common])
    assert "the instance filter masks 0 of the epoch's" in capsys.readouterr().out
    part = data.dataset_files(d)[0]
    arr = np.memmap(part.path, part.dtype, "r+")
    arr[:] = 9  # every instance is now one token 32 times
    arr.flush()
    data.main(["inspect", *common, "--step", "0"])
    out = capsys.readouterr().out
    assert out.count("masked: a 1-token pattern 32 times") == 4, out


def test_progress_into_a_log_is_plain_lines():
    """Into a file (not a terminal) a bar is one plain line per state, no carriage returns; tqdm.write's
    lines come out between them, not wiped and redrawn."""
    import io
    out = io.StringIO()
    bar = data.Progress(range(4), desc="work", file=out, mininterval=0)
    for i in bar:
        if i == 1:
            bar.write("a log line", file=out)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "a log line" in lines, lines
    assert lines[0].startswith("work:   0%") and lines[-1].startswith("work: 100%") and "4/4" in lines[-1], lines
