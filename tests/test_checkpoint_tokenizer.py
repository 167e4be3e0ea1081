"""Checkpoints carry their tokenizer: train.py writes convert.hf_tokenizer_files into every step_N, transformers'
AutoTokenizer loads it there with ids equal to data.py's on real text, and eval.py reads it back first, so a
checkpoint copied away from its data still chats; a damaged tokenizer.json is an error naming the file."""
import gzip
import json
import shutil
from pathlib import Path

import pytest

import convert
import data
import eval as evaluate
import train

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DOLMA2_JSON = SHARED / "reference/tokenizers/allenai_dolma2.json"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def real_texts():
    """The README's paragraphs, and web text from Paloma's sample when ../shared is here."""
    texts = [p for p in (ROOT / "README.md").read_text().split("\n\n") if p.strip()]
    for path in sorted((SHARED / "evaldata/paloma_sample").glob("*.jsonl.gz"))[:1]:
        with gzip.open(path, "rt") as f:
            texts += [json.loads(line)["text"] for _, line in zip(range(50), f)]
    return texts + ["<|endoftext|>between<|pad|>"]


@pytest.fixture(scope="module")
def run(setup, tmp_path_factory):
    """Two steps of the small fixture's run (its 384-id BPE tokenizer), saved at each step."""
    d = tmp_path_factory.mktemp("run")
    train.main([str(setup[1]), f"--train.run_dir={d}", "--train.steps=2", "--train.checkpoint_every=1",
                "--model.max_seq_len=512"])  # (room for chat's template)
    return d, data.load_tokenizer(str(setup[0] / "bpe.tiktoken"))


def test_training_checkpoints_load_in_autotokenizer(run, tmp_path):
    d, tok = run
    for step in (1, 2):
        assert all((d / f"step_{step}" / name).is_file() for name in TOKENIZER_FILES)
    hf = tf.AutoTokenizer.from_pretrained(d / "step_2")
    for text in real_texts():
        assert hf.encode(text) == tok.enc.encode(text, allowed_special="all"), text[:60]
    assert (hf.eos_token_id, hf.pad_token_id) == (tok.eos_id, tok.pad_id)
    # read back into data.py's Tokenizer: the same encoding, and written again the same files
    back = convert.read_hf_tokenizer(d / "step_2")
    assert (back.enc._mergeable_ranks, back.enc._special_tokens, back.enc._pat_str) == (
        tok.enc._mergeable_ranks, tok.enc._special_tokens, tok.enc._pat_str)
    assert (back.eos_id, back.pad_id, back.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size)
    assert convert.hf_tokenizer_files(back, 32) == convert.hf_tokenizer_files(tok, 32)
    # convert.py --to-hf carries the checkpoint's own tokenizer files, no --tokenizer needed
    convert.convert(d / "step_2", tmp_path / "rel", to_hf=True)
    assert all((tmp_path / "rel" / n).read_bytes() == (d / "step_2" / n).read_bytes() for n in TOKENIZER_FILES)


def moved(run, tmp_path):
    """step_2 copied elsewhere, its nanolmo.json naming a data folder that is not here (another machine)."""
    d, _ = run
    ckpt = tmp_path / "elsewhere/step_2"
    shutil.copytree(d / "step_2", ckpt)
    meta = json.loads((ckpt / "nanolmo.json").read_text())
    meta["config"]["data"]["path"] = "data/not-here"
    (ckpt / "nanolmo.json").write_text(json.dumps(meta))
    return ckpt


def test_chat_on_a_moved_checkpoint(run, tmp_path, capsys):
    ckpt, (_, tok) = moved(run, tmp_path), run
    evaluate.main(["chat", str(ckpt), "--prompt", "What is 1 + 2?", "--max-new", "4"])
    assert capsys.readouterr().out.strip()  # an answer, with no --tokenizer
    m = convert.open_hf(ckpt)[0]
    got = evaluate.checkpoint_tokenizer(ckpt, m)
    assert got.name == str(ckpt / "tokenizer.json") and got.enc._mergeable_ranks == tok.enc._mergeable_ranks
    # Without its files it has none (as before this change): the error names the way out.
    for name in TOKENIZER_FILES:
        (ckpt / name).unlink()
    with pytest.raises(FileNotFoundError, match="it has no tokenizer.json; .*data/not-here.*pass --tokenizer"):
        evaluate.checkpoint_tokenizer(ckpt, m)


@pytest.mark.parametrize("damage,says", [
    ("{", "tokenizer.json: not valid JSON"),
    ("prefix-space", "tokenizer.json: not a tokenizer.json we read .*its pre_tokenizer .*\"add_prefix_space\": true"),
    ("merge", "tokenizer.json: not a tokenizer.json we read .*merge .* out of rank order"),
    ("byte", "tokenizer.json: not a tokenizer.json we read .*KeyError: ' '")])
def test_damaged_tokenizer_json_is_named(damage, says, run, tmp_path, capsys):
    ckpt = moved(run, tmp_path)
    path = ckpt / "tokenizer.json"
    tj = json.loads(path.read_text())
    if damage == "prefix-space":  # a layout we do not read: ByteLevel adding a space before the text
        tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    elif damage == "merge":
        tj["model"]["merges"][:2] = tj["model"]["merges"][1::-1]
    elif damage == "byte":  # a vocabulary in plain characters, not byte-level ones
        tj["model"]["vocab"][" "] = tj["model"]["vocab"].pop("Ġ")
    path.write_text("{" if damage == "{" else json.dumps(tj))
    m = convert.open_hf(ckpt)[0]
    with pytest.raises(FileNotFoundError, match=f"no tokenizer for .*{says}"):
        evaluate.checkpoint_tokenizer(ckpt, m)
    with pytest.raises(ValueError, match=f"^{path}: " if damage != "{" else str(path)):
        convert.read_hf_tokenizer(ckpt)
    # beside a reachable dataset, the run's own tokenizer serves, and the note says why
    shutil.copy(run[0] / "step_2/nanolmo.json", ckpt / "nanolmo.json")
    assert evaluate.checkpoint_tokenizer(ckpt, m).enc._mergeable_ranks == run[1].enc._mergeable_ranks
    assert "note: " in capsys.readouterr().err


def test_dolma2_files_read_back():
    """dolma2's files as we write them, and allenai's own allenai_dolma2.json, read as data.py's dolma2."""
    import tempfile
    tok = data.load_tokenizer("dolma2")
    layouts = {"ours": convert.hf_tokenizer_files(tok, 4096)}
    if DOLMA2_JSON.is_file():
        layouts["allenai"] = {"tokenizer.json": DOLMA2_JSON.read_text(),
                              "tokenizer_config.json": layouts["ours"]["tokenizer_config.json"]}
    for name, files in layouts.items():
        with tempfile.TemporaryDirectory() as d:
            for f, text in files.items():
                (Path(d) / f).write_text(text)
            back = convert.read_hf_tokenizer(d)
            hf = tf.AutoTokenizer.from_pretrained(d)
            for text in real_texts()[:20]:
                assert back.enc.encode(text, allowed_special="all") == hf.encode(text), (name, text[:60])
        assert back.enc._mergeable_ranks == tok.enc._mergeable_ranks, name
        assert back.enc._special_tokens == tok.enc._special_tokens, name
        assert (back.eos_id, back.pad_id, back.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size), name


def test_run_without_a_tokenizer_says_so(setup, tmp_path, capsys):
    """A bare token file names no tokenizer: the run says so once, and its checkpoints carry none."""
    part = setup[0] / "data/train/part-00000.bin"
    train.main([str(setup[1]), f"--train.run_dir={tmp_path}", "--train.steps=1", f"--data.path={part}"])
    assert capsys.readouterr().out.count("names no tokenizer (not a prepared folder): checkpoints carry none") == 1
    assert (tmp_path / "step_1/model.safetensors").is_file() and not (tmp_path / "step_1/tokenizer.json").exists()
