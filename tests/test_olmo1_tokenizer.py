"""OLMo 1's tokenizer (allenai_gpt-neox-olmo-dolma-v1_5.json: NFC, GPT-2's ByteLevel split, added tokens for runs
of 2..24 spaces found before the BPE) read by data.py with the ids of transformers on the same file. In CI: a
synthetic tokenizer.json of its layout; with `make evaldata`: the real one, on the eval requests' texts."""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import convert
import data

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
OLMO1_JSON = ROOT / "data/evaldata/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
TASKS = ROOT / "data/evaldata/oe_eval_tasks"

# Where a tokenizer that skipped a step of HF's encode would go wrong: space runs (OLMo 1's added tokens, which
# the BPE never sees), NFC, specials in text and beside combining marks, the pre-tokenizer's edges.
HARD = [
    *(" " * n for n in range(1, 31)), *(f"a{' ' * n}b" for n in range(2, 31)),
    "  leading", "trailing  ", "   both   ", " x", "x ",
    "\t  \n   \t x", "a \t\tb", "  \n\n  \n", "\r\n  \r\n", "line\n    indented\n        code()\n",
    "e\u0301", "\u00e9", "caf\u00e9 cafe\u0301", "e\u0301\u0302\u0323", "\u212b \u0041\u030a", "\ufb01 \u2126",
    "don't I'll we've they're she'd it's I'M YOU'RE", "'s 's", "12345 3.14159 1,000,000 \u0663\u0664",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
    "\u041f\u0440\u0438\u0432\u0435\u0442", "\U0001f600\U0001f600 \U0001f469\u200d\U0001f469\u200d\U0001f467",
    "\u00a0\u3000\u2028\u0085 x \u00a0 y", "naïve  café",
    "<|endoftext|>", "a<|endoftext|>b", "<|padding|>  <|endoftext|>", "  <|endoftext|>  ",
    "<|endoftext|>\u0301", "|||IP_ADDRESS|||1.2.3.4", "|||EMAIL_ADDRESS||||||IP_ADDRESS|||", "|||PHONE_NUMBER|||",
    "<|endoftext|", "|||IP_ADDRESS||", "",
    "<caf\u00e9>", "<cafe\u0301>", "x<caf\u00e9>y", "[e\u0301]", "[\u00e9]",
]
SPACE_RUNS = range(6, 1, -1)  # the synthetic tokenizer's added tokens: runs of 6 down to 2 spaces


def hf_ids(path, texts):
    """transformers' ids of each text on the tokenizer.json at path, no special tokens added."""
    hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(path))
    return [hf.encode(t, add_special_tokens=False) for t in texts]


def olmo1_layout(tmp_path):
    """A small tokenizer.json laid out as OLMo 1's: a BPE trained on the README, its ids from 2 (0: a normalized
    |||IP_ADDRESS|||, 1: <|padding|>), then added tokens for space runs, |||EMAIL_ADDRESS|||, <|endoftext|> and
    two with combining marks."""
    ranks = data.train_bpe([(ROOT / "README.md").read_text()], 700)
    enc = tiktoken.Encoding("small", pat_str=data.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    small = data.Tokenizer(enc, "small", 0, 0, len(ranks), "")
    ours = json.loads(convert.hf_tokenizer_files(small, 64)["tokenizer.json"])["model"]  # its merges
    vocab = {text: i + 2 for text, i in ours["vocab"].items()}
    added = [("|||IP_ADDRESS|||", True, False), ("<|padding|>", False, True)]
    added += [(" " * n, True, False) for n in SPACE_RUNS]
    added += [("|||EMAIL_ADDRESS|||", True, False), ("<|endoftext|>", False, True)]
    # not in OLMo 1's: a normalized token not in NFC (HF matches its NFC), a non-normalized one (matched as is)
    added += [("<cafe\u0301>", True, False), ("[e\u0301]", False, False)]
    ids = [0, 1, *range(len(vocab) + 2, len(vocab) + len(added))]
    tokens = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=n, special=sp)
              for i, (s, n, sp) in zip(ids, added)]
    vocab.update((t["content"], t["id"]) for t in tokens)  # (allenai's vocab lists them too)
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    model = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None, end_of_word_suffix=None,
                 fuse_unk=False, byte_fallback=False, vocab=vocab, merges=ours["merges"])
    tj = dict(version="1.0", truncation=None, padding=None, added_tokens=tokens, normalizer={"type": "NFC"},
              pre_tokenizer=byte_level, post_processor=byte_level, decoder=byte_level, model=model)
    path = tmp_path / "olmo1-layout.json"
    path.write_text(json.dumps(tj, ensure_ascii=False))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return olmo1_layout(tmp_path_factory.mktemp("olmo1"))


def test_synthetic_olmo1_layout_encodes_as_transformers(synthetic):
    tok = data.load_tokenizer(str(synthetic))
    want = hf_ids(synthetic, HARD)
    assert [tok.encode(t) for t in HARD] == want
    assert [tok.encode_document(t) for t in HARD] == [w + [tok.eos_id] for w in want]
    # the strings do tell: tiktoken alone (no added-token split before the BPE, no NFC) misses some of them
    naive = [tok.enc.encode(t, allowed_special="all") for t in HARD]
    assert sum(a != b for a, b in zip(naive, want)) > 20
    hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(synthetic))
    assert tok.eos_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad_id == hf.convert_tokens_to_ids("<|padding|>") == 1
    assert tok.vocab_size == len(hf.get_vocab())


def test_synthetic_olmo1_layout_through_checkpoint_files(synthetic, tmp_path):
    """A checkpoint folder holding it reads the same; the files --to-hf writes from it tokenize as it does."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt/tokenizer.json").write_bytes(synthetic.read_bytes())
    tok = convert.read_hf_tokenizer(tmp_path / "ckpt")
    assert [tok.encode(t) for t in HARD] == hf_ids(synthetic, HARD)
    for name, text in convert.hf_tokenizer_files(tok, 64).items():
        (tmp_path / "out" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "out" / name).write_text(text)
    hf = tf.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert [hf.encode(t) for t in HARD] == hf_ids(synthetic, HARD)
    assert (hf.eos_token_id, hf.pad_token_id) == (tok.eos_id, tok.pad_id)


def test_prepare_with_a_tokenizer_json(synthetic, tmp_path):
    """prepare keeps the tokenizer.json with the data; its token file holds transformers' ids, each text's EOS."""
    texts = ["Some  text\twith   runs  of spaces", "cafe\u0301 <|endoftext|> |||IP_ADDRESS|||"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(dict(text=t)) + "\n" for t in texts))
    data.prepare([src], tmp_path / "out", str(synthetic), workers=1, quiet=True)
    assert (tmp_path / "out" / synthetic.name).read_bytes() == synthetic.read_bytes()
    hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(synthetic))
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    [part] = data.dataset_files(tmp_path / "out")
    got = np.fromfile(part.path, part.dtype).tolist()
    assert got == [i for ids in hf_ids(synthetic, texts) for i in ids + [eos]]
    tok = data.dataset_tokenizer(tmp_path / "out")  # read from the copy
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (eos, hf.convert_tokens_to_ids("<|padding|>"), len(hf))


@pytest.mark.parametrize("field,value,says", [
    ("normalizer", {"type": "NFKC"}, 'its normalizer {"type": "NFKC"} is neither null nor NFC'),
    ("normalizer", {"type": "Lowercase"}, 'its normalizer {"type": "Lowercase"}'),
    ("pre_tokenizer", {"type": "Whitespace"}, 'its pre_tokenizer {"type": "Whitespace"} is neither'),
    ("pre_tokenizer", {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
     'its pre_tokenizer {"type": "ByteLevel", "add_prefix_space": true'),
    ("lstrip", True, "added token '<|padding|>' has single_word, lstrip or rstrip"),
    ("dropout", 0.1, 'its model {"type": "BPE", "dropout": 0.1'),
])
def test_what_we_do_not_implement_is_refused(synthetic, tmp_path, field, value, says):
    """A layout whose ids we would not reproduce is a ValueError naming the file and what it has."""
    tj = json.loads(synthetic.read_text())
    if field == "lstrip":
        tj["added_tokens"][1]["lstrip"] = value
    elif field == "dropout":
        tj["model"]["dropout"] = value
    else:
        tj[field] = value
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tj))
    with pytest.raises(ValueError) as e:
        data.load_tokenizer(str(path))
    assert str(e.value).startswith(f"{path}: not a tokenizer.json we read") and says in str(e.value)


def test_olmo1_absent_says_make_evaldata(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "OLMO1_JSON", tmp_path / "absent.json")
    with pytest.raises(FileNotFoundError, match=f"no {tmp_path / 'absent.json'}; `make evaldata` fetches it"):
        data.load_tokenizer("olmo1")


def request_texts(per_file=200, files=12):
    """Contexts and continuations of the first requests of some eval tasks (every few request files, sorted)."""
    paths = sorted(TASKS.glob("*/*/requests.jsonl.gz"))
    texts = []
    for path in paths[::max(1, len(paths) // files)]:
        with gzip.open(path, "rt") as f:
            for _, line in zip(range(per_file), f):
                request = json.loads(line)["request"]
                texts += [s for s in (request.get("context"), request.get("continuation")) if isinstance(s, str)]
    return texts


@pytest.mark.skipif(not OLMO1_JSON.is_file(), reason="no OLMo 1 tokenizer (make evaldata)")
def test_olmo1_encodes_as_transformers():
    tok = data.load_tokenizer("olmo1")
    texts = HARD + request_texts()
    assert len(texts) > 2000
    want = hf_ids(OLMO1_JSON, texts)
    mismatched = [t for t, w in zip(texts, want) if tok.encode(t) != w]
    assert not mismatched, f"{len(mismatched)} of {len(texts)} differ, e.g. {mismatched[0][:200]!r}"
    hf = tf.PreTrainedTokenizerFast(tokenizer_file=str(OLMO1_JSON))
    # OLMo-core's TokenizerConfig.gpt_neox_olmo_dolma_v1_5(): 50280 ids, EOS 50279, PAD 1, no BOS
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (50280, 50279, 1)
    assert len(hf) == tok.vocab_size and hf.convert_tokens_to_ids(["<|endoftext|>", "<|padding|>"]) == [50279, 1]
    assert tok.name == str(OLMO1_JSON) and tok.sha256 == data.sha256(OLMO1_JSON)
