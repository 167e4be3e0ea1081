"""Olmo 3 stage 3: OLMo-core's packed instances, the recipe configs, and the bad input each refuses.
(Context-parallel training against one device is in test_shard.py; resuming across context meshes in
test_train.py::test_elastic_resume_on_other_meshes.)"""
import random
import shutil
from collections import defaultdict, deque

import numpy as np
import pytest

import data
import model
import shard
from configs import ConfigError, build, load_config
from teach import fail



# --- the packed order ---

class SegmentTree:
    """The facts' packer (reference/longctx-posttrain-facts.md §1.2), written from the description, not from
    data.py: a max-tree over capacities 1..L (L a power of 2); a leaf holds its capacity while some bin has that
    much free, and the leaf for L always does (it stands for a new bin). The best fit is the leftmost leaf >= n."""

    def __init__(self, L):
        self.L, self.w = L, [0] * (2 * L)
        self.set(L, L)

    def set(self, capacity, weight):
        i = self.L + capacity - 1
        self.w[i] = weight
        while i > 1:
            i //= 2
            self.w[i] = max(self.w[2 * i], self.w[2 * i + 1])

    def query(self, n):
        i = 1
        while i < self.L:
            i = 2 * i if self.w[2 * i] >= n else 2 * i + 1
        return i - self.L + 1


def reference_pack(files, L, eos, pad, group_size, seed):
    """Instances as the facts describe NumpyPackedFSLDataset: files shuffled by random.Random(seed), groups of
    group_size, documents found at EOS and cut to L, argsort(-len), best fit, FIFO among equal capacities."""
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    files, out = [files[i] for i in order], []
    for g in range(0, len(files), group_size):
        docs = []
        for f in files[g:g + group_size]:
            start = 0
            for end in np.flatnonzero(f == eos) + 1:
                docs.append(f[start:min(end, start + L)])
                start = end
        ranked = [docs[i] for i in np.argsort(-np.array([len(d) for d in docs], np.int64))]
        tree, free, bins = SegmentTree(L), defaultdict(deque), []
        for d in ranked:
            c = tree.query(len(d))
            if c == L:
                bins.append([])
                b = len(bins) - 1
            else:
                b = free[c].popleft()
                if not free[c]:
                    tree.set(c, 0)
            bins[b].append(d)
            if c > len(d):
                free[c - len(d)].append(b)
                tree.set(c - len(d), c - len(d))
        out += [np.concatenate(b + [np.full(L - sum(map(len, b)), pad, f.dtype)]) for b in bins]
    return out


def token_files(tmp_path, n_files=11, seed=1, lengths=(1, 90)):
    """Random token files of EOS-terminated documents, many lengths repeated (ties), some longer than L."""
    rng, paths = np.random.default_rng(seed), []
    for i in range(n_files):
        ids = []
        for n in rng.choice([5, 8, 8, 16, 16, 16, *range(*lengths)], rng.integers(3, 40)):
            ids += [*rng.integers(2, 500, n - 1), 0]
        paths.append(tmp_path / f"f{i:02d}.npy")
        np.array(ids, np.uint16).tofile(paths[-1])
    return paths


PACKING = ("OLMo-core's best fit decreasing: order = np.argsort(-lengths) (longest first; "
           "numpy's default sort, whose order among equal lengths is part of the result); each "
           "document goes into the open instance with the least room that still fits it (among "
           "equal rooms, the one that got that room first), else into a new one. bins hold ranks "
           "(positions in order).")


def doc_lengths(instance, eos=0, pad=1):
    """The lengths of the documents in a packed instance: each ends at EOS, or at L when cut."""
    ends = (np.flatnonzero(instance == eos) + 1).tolist()
    used = int(np.flatnonzero(instance != pad).max(initial=-1)) + 1
    return np.diff([0, *ends, *([used] if not ends or ends[-1] < used else [])]).tolist()


def test_facts_example():
    lengths = np.array([5, 3, 8, 2, 6, 1, 4, 4, 7])
    order, bins = data.pack_documents(lengths.tolist(), 8)
    want = [[8], [7, 1], [6, 2], [5, 3], [4, 4]]
    if sorted(np.asarray(order).tolist()) != list(range(9)):
        fail(f"data.pack_documents: order = {np.asarray(order).tolist()} is no permutation of the "
             "9 documents", PACKING)
    got = [np.asarray(lengths)[np.asarray(order)][b].tolist() for b in bins]
    if got != want:
        fail(f"data.pack_documents({lengths.tolist()}, L = 8): your instances hold lengths {got}; "
             f"the facts' (reference/longctx-posttrain-facts.md §1.2) {want}", PACKING)


def test_packing_is_olmo_cores_order(tmp_path):
    paths = token_files(tmp_path)
    arrays = [np.fromfile(p, np.uint16) for p in paths]
    for L, group in ((64, 8), (32, 1), (128, 4)):
        ours = data.PackedInstances([data.open_token_file(p, np.uint16) for p in paths], L, eos=0, pad=1,
                                    group_size=group, permutation_seed=123)
        ref = reference_pack(arrays, L, 0, 1, group, 123)
        where = f"{len(paths)} files of documents, L = {L}, groups of {group} files"
        if ours.n != len(ref):
            fail(f"{where}: data.pack_documents makes {ours.n} instances, the reference packer "
                 f"{len(ref)}", PACKING)
        for i, want in enumerate(ref):  # instance by instance, ties included
            got = ours.read(i)
            if not np.array_equal(got, want):
                mine, theirs = doc_lengths(got), doc_lengths(want)
                fail(f"{where}: instance {i} differs (the earlier ones match). Its documents' "
                     f"lengths: yours {mine}, the reference's {theirs}"
                     + (" (the same lengths: a tie between equal lengths went the other way)"
                        if sorted(mine) == sorted(theirs) else ""), PACKING)


def test_packing_equals_olmo_core_itself(tmp_path):
    """Against OLMo-core's own NumpyPackedFSLDataset where it is installed (pip install ai2-olmo-core==3.0.0: it
    and its ~200 MB of dependencies are not in the test extra); the test above checks the same order without it."""
    numpy_dataset = pytest.importorskip("olmo_core.data.numpy_dataset")
    from olmo_core.data.types import LongDocStrategy
    paths = [str(p) for p in token_files(tmp_path)]
    for L, strategy in ((64, "truncate"), (32, "fragment")):
        order = list(range(len(paths)))
        random.Random(123).shuffle(order)  # NumpyDatasetConfig does this (source_permutation_seed) before the dataset
        ds = numpy_dataset.NumpyPackedFSLDataset(
            *[paths[i] for i in order], sequence_length=L, pad_token_id=1, eos_token_id=0, vocab_size=512,
            generate_doc_lengths=True, source_group_size=8, long_doc_strategy=LongDocStrategy[strategy])
        ds.work_dir = tmp_path / f"work-{L}"
        ds.prepare()
        ours = data.PackedInstances([data.open_token_file(p, np.uint16) for p in paths], L, eos=0, pad=1,
                                    long_docs=strategy)
        assert len(ds) == ours.n
        for i in range(ours.n):
            np.testing.assert_array_equal(ours.read(i), ds[i]["input_ids"].numpy())
            np.testing.assert_array_equal(np.bincount(model.segment_ids(ours.read(i)[None], 0)[0]),
                                          ds[i]["doc_lens"].numpy())


def test_padding_is_never_a_target(tmp_path):
    ids = np.array([7, 8, 0, 9, 0, 1, 1, 1])[None]  # two documents, then PAD (1)
    labels = model.shift_labels(ids, pad=1)
    assert labels.tolist() == [[8, 0, 9, 0, -100, -100, -100, -100]]
    assert model.segment_ids(ids, 0).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]  # padding: a document of its own


def test_verify_and_inspect_packed(setup, tmp_path, capsys):
    root, _ = setup
    d = tmp_path / "data"
    shutil.copytree(root / "data", d)
    packed = data.dataset_packing(d, long_docs="fragment")
    problems, summary = data.verify(d, 32, 4, 0, packed)
    assert not problems and "packed instances of 32 tokens" in summary
    data.main(["inspect", str(d), "--seq-len", "32", "--global-batch", "2", "--seed", "0", "--step", "1", "--packed"])
    assert "piece(s)" in capsys.readouterr().out
    # A PAD id inside a document would be dropped from the loss as if it were padding: verify says so.
    f = next((d / "train").glob("part-*.bin"))
    arr = np.memmap(f, np.uint16, "r+")
    arr[3] = packed["pad"]
    arr.flush()
    del arr
    problems, _ = data.verify(d, 32, 4, 0, packed)
    assert any(f"PAD id {packed['pad']} occurs 1 times inside documents" in p for p in problems)


# --- bad input ---

def test_bad_stage3_settings_are_refused(setup, tmp_path):
    with pytest.raises(ConfigError, match=r"data.doc_mask=False: packing='packed' puts several documents"):
        build({"data": dict(packing="packed")})
    with pytest.raises(ConfigError, match=r"data.long_docs='cut': must be one of"):
        build({"data": dict(long_docs="cut")})
    cfg = load_config([str(setup[1]), "--mesh.context=2", "--train.backend=torch"])
    with pytest.raises(ValueError, match=r"data.seq_len=100 does not divide over mesh.context=8"):
        shard.check_mesh(dict(context=8, tensor=1), cfg.model, 100)
    with pytest.raises(ValueError, match=r"mesh.context=2: the torch backend shards with FSDP2 only"):
        shard.torch_layout(cfg.mesh, 2, model.param_table(cfg.model))
    mix = tmp_path / "mix.txt"
    mix.write_text(f"a,{setup[0] / 'data'},1.0\n")
    with pytest.raises(ValueError, match="mix weights and packed instances do not go together"):
        data.open_instances(mix, 32, packed=dict(eos=382, pad=383))
