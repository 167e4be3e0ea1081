"""Evaluation: Paloma-style bits per byte, the OLMo paper's eight zero-shot tasks, generation with a KV cache.

    python eval.py bpb CKPT FILE... [--out bpb.json]             # FILE: .jsonl / .jsonl.gz with a "text" field
    python eval.py tasks CKPT --tasks arc_easy,arc_challenge,boolq,hellaswag,openbookqa,piqa,sciq,winogrande \\
        --data ../shared/evaldata [--limit 100] [--norm olmes|catwalk] [--out tasks.json]
    python eval.py logits DIR --tokens IN.npy --out OUT.npy [--backend jax|torch] [--dtype float32|bfloat16]
    python eval.py generate CKPT --prompt TEXT [--max-new 64] [--temperature 0.8 --top-k 50 --top-p 0.95]
                                 [--backend jax|torch] [--no-cache]

CKPT is one of our checkpoint directories (an HF model directory; train.py's step_N/ also holds
nanolmo.json). The tokenizer comes from --tokenizer SPEC ("dolma2" or a .tiktoken ranks file), else
from the dataset named in CKPT/nanolmo.json, else dolma2 when the model's ids are dolma2's. bpb and
tasks also take --backend jax|torch, --dtype float32|bfloat16 and --batch-tokens N.

bpb scores each document on its own in non-overlapping windows of the model's max_seq_len, the first
one starting from EOS (catwalk's rolling windows, which Paloma used), and reports per domain
(`subdomain`/`domain`, else `source`, else the file name) nats summed over bytes, then the macro
average over domains. tasks reads DIR laid out like ../shared/evaldata (hf_validation/<task>.validation.jsonl,
original/<task>/...), renders OLMES's prompt strings (--norm olmes) or the lm-eval v0.3 ones the OLMo
paper's Catwalk used (--norm catwalk), scores every option, and reports accuracy under that paper's
normalisation per task, with every other normalisation in the JSON.

generate is greedy at temperature 0, samples otherwise (top-k, top-p), and stops at EOS; with the KV
cache (model.forward_step) the prompt runs once and each new token is one position through the layers.

logits: IN.npy holds integer token ids (B, T); OUT.npy gets float32 logits (B, T, V), V being the
checkpoint's vocabulary. Both backends compute the same function (tests/test_hf.py holds them to it).
"""

import argparse
import gzip
import json
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

import convert
import data
import model


def logits(d, tokens, backend="jax", dtype="float32", source="tokens"):
    m, params = convert.load_hf(d)
    tokens = model.check_tokens(tokens, m, source)
    if backend == "jax":
        import jax
        import jax.numpy as jnp
        run = jax.jit(lambda p, t: model.forward(p, t, m, jnp.dtype(dtype)))
        return np.asarray(run(params, jnp.asarray(tokens)).astype(jnp.float32))
    import torch
    with torch.no_grad():
        out = model.torch_model(m, params)(torch.from_numpy(tokens.astype(np.int64)), getattr(torch, dtype))
    return out.float().numpy()


def token_bytes(tok):
    """UTF-8 bytes each token id stands for; special tokens (EOS, PAD) stand for none. Bits per byte
    divide a loss by these, so models with different tokenizers compare (Paloma's measure)."""
    special = set(tok.enc.special_tokens_set)
    out = np.zeros(tok.vocab_size, np.int64)
    for i in range(tok.vocab_size):
        piece = tok.enc.decode_single_token_bytes(i)
        out[i] = 0 if piece.decode("utf-8", "replace") in special else len(piece)
    return out


def bits_per_byte(nats, n_bytes):
    return nats / (np.log(2) * n_bytes) if n_bytes else float("nan")


# --- checkpoints and tokenizers -------------------------------------------------------------------

DOLMA2_EOS, DOLMA2_IDS = 100257, 100278


def checkpoint_tokenizer(ckpt, m, spec=None):
    """--tokenizer SPEC, else the dataset named in CKPT/nanolmo.json, else dolma2 when the model's ids are
    dolma2's. The tokenizer must fit the model's vocabulary and share its EOS (the empty-context token)."""
    meta = Path(ckpt) / "nanolmo.json"
    dataset = json.loads(meta.read_text())["config"]["data"]["path"] if meta.is_file() else None
    if spec:
        tok = data.load_tokenizer(spec)
    elif dataset and (Path(dataset) / "prepare.json").is_file():
        tok = data.dataset_tokenizer(dataset)
    elif m.eos_token_id == DOLMA2_EOS and m.vocab_size >= DOLMA2_IDS:
        tok = data.load_tokenizer("dolma2")
    else:
        why = (f"{meta} names data.path={dataset!r}, which is not a prepared folder from here" if dataset
               else f"{ckpt} has no nanolmo.json")
        raise FileNotFoundError(f"no tokenizer for {ckpt}: {why}, and its ids are not dolma2's "
                                f"(eos_token_id={m.eos_token_id}, vocab_size={m.vocab_size}); pass --tokenizer SPEC")
    if tok.vocab_size > m.vocab_size or tok.eos_id != m.eos_token_id:
        raise ValueError(f"tokenizer {tok.name} ({tok.vocab_size} ids, EOS {tok.eos_id}) does not fit {ckpt} "
                         f"(vocab_size={m.vocab_size}, eos_token_id={m.eos_token_id})")
    return tok


def encode(tok, text):
    # No EOS and no BOS: OLMo adds neither to eval text. Special-token strings in the text become their
    # ids, as HF's tokenizer (and data.py) does.
    return tok.enc.encode(text, allowed_special="all")


# --- scoring: log p(continuation | context) for many requests --------------------------------------
# A request is (context ids, continuation ids). Its model input is the row (ctx + cont)[:-1], left-
# truncated to max_seq_len as OLMo does, and its score the sum of log p over the continuation positions.
#
# Shared contexts, computed once. The forward is causal, so a row that is a prefix of another row
# gets exactly the same logits inside the longer row's forward. We sort the distinct rows; a row's
# extensions then follow it directly, so one backward pass over the sorted list finds for each row
# the longest row it is a prefix of (its "host"). What this buys: options of one token (BoolQ's
# " yes"/" no", many unconditional "Answer:" requests) all read off the one forward of their context,
# and identical requests are computed once. Multi-token options that differ in their first token
# still each run their context again: sharing those needs a KV cache (prefill once, extend each
# option), which this file does not use for scoring.
#
# The only target a hosted request needs that its host row does not itself predict is its last
# continuation token (at its last position the host predicts its own next token). So each row
# carries up to J extra (position, token) queries; a host with more is simply run again.

J = 8  # extra (position, token) queries per row


def _bucket(n, cap):
    """Padded length: the next power of two (at least 16), capped at max_seq_len, so jit compiles a
    handful of shapes instead of one per length."""
    return min(max(16, 1 << (n - 1).bit_length()), cap)


def _score_jax(params, tokens, qpos, qtok, m, dtype):
    """tokens (B, T); qpos, qtok (B, J) -> own (B, T): log p(tokens[:, t+1] | <= t) (the last column is
    meaningless), extra (B, J): log p(qtok | <= qpos). fp32 log-softmax, whatever the compute dtype."""
    import jax
    import jax.numpy as jnp
    logits = model.forward(params, tokens, m, dtype).astype(jnp.float32)         # (B, T, V)
    lse = jax.nn.logsumexp(logits, axis=-1)                                     # (B, T)
    nxt = jnp.roll(tokens, -1, axis=1)                                          # (B, T)
    own = jnp.take_along_axis(logits, nxt[..., None], axis=-1)[..., 0] - lse    # (B, T)
    b = jnp.arange(tokens.shape[0])[:, None]
    return own, logits[b, qpos, qtok] - lse[b, qpos]                           # (B, T), (B, J)


def _score_torch(net, tokens, qpos, qtok, dtype):
    import torch
    with torch.no_grad():
        t = torch.from_numpy(tokens.astype(np.int64))
        logits = net(t, dtype).float()                                          # (B, T, V)
        lse = torch.logsumexp(logits, dim=-1)                                   # (B, T)
        own = logits.gather(-1, torch.roll(t, -1, dims=1)[..., None])[..., 0] - lse
        b = torch.arange(t.shape[0])[:, None]
        qp, qt = torch.from_numpy(qpos.astype(np.int64)), torch.from_numpy(qtok.astype(np.int64))
        return own.numpy(), (logits[b, qp, qt] - lse[b, qp]).numpy()


class Scorer:
    """Sums of log p(continuation | context), batched into rows of bucketed lengths. `params` may be
    replaced between calls (train.py does, each in-loop eval); the jitted function stays compiled."""

    def __init__(self, m, params, backend="jax", dtype="float32", batch_tokens=8192):
        if backend not in ("jax", "torch") or dtype not in ("float32", "bfloat16"):
            raise ValueError(f"backend {backend!r} / dtype {dtype!r}: expected jax|torch and float32|bfloat16")
        self.m, self.params, self.backend, self.dtype, self.batch_tokens = m, params, backend, dtype, batch_tokens
        self.tokens = self.padded = 0      # real and padded positions run, for tokens/s
        self.requests = self.rows = 0      # requests asked for, rows run (fewer: shared prefixes)
        self.seconds = 0.0
        if backend == "jax":
            import jax
            import jax.numpy as jnp
            self._jit = jax.jit(lambda p, t, qp, qt: _score_jax(p, t, qp, qt, m, jnp.dtype(dtype)))
        self._net = self._net_for = None

    def _run(self, tokens, qpos, qtok):
        if self._net_for is not self.params:  # params moved to the device (or into a module) once per set
            if self.backend == "jax":
                import jax
                self._net = jax.device_put(self.params)
            else:
                self._net = model.torch_model(self.m, self.params).eval()
            self._net_for = self.params
        if self.backend == "jax":
            own, extra = self._jit(self._net, tokens, qpos, qtok)
            return np.asarray(own), np.asarray(extra)
        import torch
        return _score_torch(self._net, tokens, qpos, qtok, getattr(torch, self.dtype))

    def loglikelihoods(self, requests, desc="score"):
        """[(context ids, continuation ids)] -> (log-likelihoods float64 (R,), scored tokens int64 (R,)).
        An empty context becomes [EOS] (catwalk); a continuation longer than max_seq_len keeps its last
        max_seq_len tokens scored (the first ones would have no context left)."""
        L, eos, V = self.m.max_seq_len, self.m.eos_token_id, self.m.vocab_size
        rows_in, finals, n_pred = [], [], []
        for i, (ctx, cont) in enumerate(requests):
            if len(cont) == 0:
                raise ValueError(f"request {i}: empty continuation, nothing to score")
            keep = ([*ctx] or [eos]) + [*cont]
            keep = keep[-(L + 1):]                    # (ctx + cont[:-1])[-L:] as the input, like OLMo
            rows_in.append(tuple(keep[:-1]))
            finals.append(keep[-1])
            n_pred.append(min(len(cont), len(keep) - 1))
        if requests:
            hi = max(max(max(r, default=0) for r in rows_in), max(finals))
            lo = min(min(min(r, default=0) for r in rows_in), min(finals))
            if hi >= V or lo < 0:
                raise ValueError(f"token id {hi if hi >= V else lo} is out of range for vocab_size={V}")

        # hosts: for each distinct row, the longest row it is a prefix of
        order = sorted(set(rows_in))
        host = {}
        for i in range(len(order) - 1, -1, -1):
            r, nxt = order[i], order[i + 1] if i + 1 < len(order) else None
            host[r] = host[nxt] if nxt is not None and nxt[:len(r)] == r else r
        rows, slot, open_row, where = [], {}, {}, []  # rows: [host tokens, [(pos, tok), ...]]
        for r, tok in zip(rows_in, finals):
            h = host[r]
            key = (h, len(r) - 1, tok)
            if key not in slot:
                k = open_row.get(h)
                if k is None or len(rows[k][1]) == J:
                    k = open_row[h] = len(rows)
                    rows.append((h, []))
                slot[key] = (k, len(rows[k][1]))
                rows[k][1].append(key[1:])
            where.append(slot[key])
        self.requests, self.rows = self.requests + len(requests), self.rows + len(rows)

        # batches of equal bucketed length, longest first; B fixed per length so each shape compiles once
        own_cs, extra = [None] * len(rows), [None] * len(rows)
        by_len = sorted(range(len(rows)), key=lambda k: -len(rows[k][0]))
        batches, i = [], 0
        while i < len(by_len):
            T = _bucket(len(rows[by_len[i]][0]), L)
            B = max(1, self.batch_tokens // T)
            batch = [k for k in by_len[i:i + B] if _bucket(len(rows[k][0]), L) == T]
            batches.append((T, B, batch))
            i += len(batch)
        t0 = time.perf_counter()
        for T, B, batch in tqdm(batches, desc=desc, leave=False, disable=True if len(batches) < 4 else None):
            tokens = np.full((B, T), eos, np.int32)
            qpos, qtok = np.zeros((B, J), np.int32), np.zeros((B, J), np.int32)
            for b, k in enumerate(batch):
                tokens[b, :len(rows[k][0])] = rows[k][0]
                for j, (p, t) in enumerate(rows[k][1]):
                    qpos[b, j], qtok[b, j] = p, t
            own, ex = self._run(tokens, qpos, qtok)
            for b, k in enumerate(batch):
                own_cs[k] = np.concatenate([[0.0], np.cumsum(own[b, :len(rows[k][0])], dtype=np.float64)])
                extra[k] = ex[b].astype(np.float64)
                self.tokens += len(rows[k][0])
            self.padded += B * T
        self.seconds += time.perf_counter() - t0

        ll = np.zeros(len(requests), np.float64)
        for i, (r, (k, j)) in enumerate(zip(rows_in, where)):
            # positions len(r)-n .. len(r)-2 read the host's own next tokens; the last one is an extra query
            ll[i] = own_cs[k][len(r) - 1] - own_cs[k][len(r) - n_pred[i]] + extra[k][j]
        return ll, np.asarray(n_pred, np.int64)


def load_model(ckpt, backend, dtype, batch_tokens, tokenizer=None):
    m, params = convert.load_hf(ckpt)
    return Scorer(m, params, backend, dtype, batch_tokens), checkpoint_tokenizer(ckpt, m, tokenizer)


# --- bits per byte, as Paloma -------------------------------------------------------------------

def rolling_windows(t, L, prefix):
    """lm-eval's get_rolling_token_windows(context_len=1) followed by make_disjoint_window, which catwalk
    uses for Paloma: [(context, continuation)] predicting every token of t exactly once. The first window
    predicts t[0:L] from [prefix] + t[0:L-1]; each later full window predicts the next L tokens from one
    carried-over token; the last, shorter window takes as many earlier tokens as fit in L as context
    (they are not scored again)."""
    if not t:
        return []
    first = min(L, len(t))
    out, done = [([prefix], t[:first])], first
    while done < len(t):
        end = done + min(len(t) - done, L)
        out.append((t[end - L - 1:done], t[done:end]))
        done = end
    return out


def read_documents(paths, limit=0):
    """(domain, source, text) per document of .jsonl / .jsonl.gz files; the domain is the record's
    `subdomain` or `domain`, else its `source`, else the file's name. Empty texts are skipped, counted."""
    docs, empty = [], 0
    for path in map(Path, paths):
        if not path.is_file() or not path.name.endswith((".jsonl", ".jsonl.gz")):
            raise FileNotFoundError(f"{path}: expected a .jsonl or .jsonl.gz file of documents")
        stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
        for lineno, raw in data.read_records(path):
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f"{path}:{lineno}: no string 'text' field")
            text = data.fix_surrogates(rec["text"])[0]
            if not text:
                empty += 1
                continue
            source = str(rec.get("source") or stem)
            docs.append((str(rec.get("subdomain") or rec.get("domain") or source), source, text))
            if limit and len(docs) == limit:
                return docs, empty
    return docs, empty


def bpb(scorer, tok, docs):
    """Per domain: documents, tokens, bytes, nats (summed: a micro-average over bytes within the domain,
    catwalk's PerplexityMetrics), bits per byte and per-token perplexity; then the macro average over
    domains (Paloma's headline), per source when there are several."""
    L, eos = scorer.m.max_seq_len, scorer.m.eos_token_id
    requests, owner = [], []
    for d, (_, _, text) in enumerate(docs):
        windows = rolling_windows(encode(tok, text), L, eos)
        requests += windows
        owner += [d] * len(windows)
    ll, n = scorer.loglikelihoods(requests, "bpb windows")
    stats = defaultdict(lambda: dict(docs=0, tokens=0, bytes=0, nats=0.0))
    per_doc = np.zeros(len(docs))
    np.add.at(per_doc, np.asarray(owner, np.int64), ll)
    tokens = np.zeros(len(docs), np.int64)
    np.add.at(tokens, np.asarray(owner, np.int64), n)
    for d, (domain, source, text) in enumerate(docs):
        s = stats[(source, domain)]
        s["docs"] += 1
        s["tokens"] += int(tokens[d])
        s["bytes"] += len(text.encode("utf-8"))
        s["nats"] -= float(per_doc[d])
    domains = {}
    for (source, domain), s in sorted(stats.items()):
        s.update(source=source, bpb=bits_per_byte(s["nats"], s["bytes"]), ppl_token=math.exp(s["nats"] / s["tokens"]))
        domains[domain if domain == source else f"{source}/{domain}"] = s
    sources = sorted({s["source"] for s in domains.values()})
    macro = {src: float(np.mean([s["bpb"] for s in domains.values() if s["source"] == src])) for src in sources}
    total = {k: sum(s[k] for s in domains.values()) for k in ("docs", "tokens", "bytes", "nats")}
    return dict(domains=domains, macro_bpb=float(np.mean([s["bpb"] for s in domains.values()])),
                macro_bpb_per_source=macro, micro_bpb=bits_per_byte(total["nats"], total["bytes"]), **total)


def print_bpb(res):
    w = max([len(k) for k in res["domains"]] + [12])
    print(f"{'domain':<{w}} {'docs':>6} {'tokens':>9} {'bytes':>10} {'bits/byte':>9} {'ppl/token':>10}")
    for name, s in res["domains"].items():
        print(f"{name:<{w}} {s['docs']:>6} {s['tokens']:>9,} {s['bytes']:>10,} {s['bpb']:>9.4f} {s['ppl_token']:>10.2f}")
    if len(res["macro_bpb_per_source"]) > 1:
        for src, v in res["macro_bpb_per_source"].items():
            print(f"{'macro ' + src:<{w}} {'':>6} {'':>9} {'':>10} {v:>9.4f}")
    print(f"{'macro (domains)':<{w}} {res['docs']:>6} {res['tokens']:>9,} {res['bytes']:>10,} {res['macro_bpb']:>9.4f}")
    print(f"{'micro (bytes)':<{w}} {'':>6} {'':>9} {'':>10} {res['micro_bpb']:>9.4f}")


# --- the eight tasks: reading their files ----------------------------------------------------------
# Every reader turns one record into a task's plain fields; `rec` is a dict, `at` says "file:line".

def _field(rec, name, kind, at):
    v = rec.get(name) if isinstance(rec, dict) else None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ValueError(f"{at}: field {name!r} is {v!r}; expected {getattr(kind, '__name__', kind)}")
    return v


def _index(label, n, at, name="label"):
    """An option index from an int or a numeric string (HellaSwag's label is a string in HF files, an int
    in the original jsonl)."""
    try:
        i = int(label)
    except (TypeError, ValueError):
        i = -1
    if isinstance(label, bool) or not 0 <= i < n:
        raise ValueError(f"{at}: {name} {label!r} is not an option index 0..{n - 1}")
    return i


def read_choice(rec, at):
    """ARC and OpenBookQA. HF: question (str, OBQA: question_stem), choices {text, label}, answerKey; original:
    question {stem, choices [{text, label}]}, answerKey. ARC's keys are letters or, in some rows, digits."""
    q = rec.get("question") if isinstance(rec, dict) else None
    if isinstance(q, dict):
        stem, choices = _field(q, "stem", str, at), _field(q, "choices", list, at)
        texts = [_field(c, "text", str, at) for c in choices]
        labels = [str(_field(c, "label", (str, int), at)) for c in choices]
    else:
        stem = _field(rec, "question" if "question" in rec else "question_stem", str, at)
        choices = _field(rec, "choices", dict, at)
        texts, labels = _field(choices, "text", list, at), [str(x) for x in _field(choices, "label", list, at)]
    key = str(_field(rec, "answerKey", (str, int), at)).strip()
    if key not in labels and key in ("1", "2", "3", "4", "5"):  # a digit key over letter labels: 1 = A
        key = "ABCDE"[int(key) - 1]
    if key not in labels or len(texts) != len(labels):
        raise ValueError(f"{at}: answerKey {key!r} is not one of the labels {labels}")
    return dict(question=stem, choices=texts, gold=labels.index(key))


def read_boolq(rec, at):
    """HF boolq (question, passage, answer; no title) or the original dev.jsonl (the same plus title)."""
    title = rec.get("title")
    return dict(question=_field(rec, "question", str, at), passage=_field(rec, "passage", str, at),
                title=title if isinstance(title, str) and title else None, answer=_field(rec, "answer", bool, at))


def read_hellaswag(rec, at):
    """The original jsonl or HF rows (activity_label, ctx_a, ctx_b, endings, label), or an OLMES request
    dump's doc (query and choices already preprocessed, gold)."""
    if "query" in rec:
        choices = _field(rec, "choices", list, at)
        return dict(query=_field(rec, "query", str, at), choices=choices, gold=_index(rec.get("gold"), len(choices), at, "gold"))
    endings = _field(rec, "endings", list, at)
    return dict(activity_label=_field(rec, "activity_label", str, at), ctx_a=_field(rec, "ctx_a", str, at),
                ctx_b=_field(rec, "ctx_b", str, at), endings=endings, gold=_index(rec.get("label"), len(endings), at))


def read_piqa(rec, at):
    return dict(goal=_field(rec, "goal", str, at), sol1=_field(rec, "sol1", str, at), sol2=_field(rec, "sol2", str, at),
                gold=_index(rec.get("label"), 2, at))


def read_sciq(rec, at):
    support = rec.get("support") or ""  # empty in 113 of the 1000 validation rows
    return dict(question=_field(rec, "question", str, at), support=support, options=[
        _field(rec, k, str, at) for k in ("distractor1", "distractor2", "distractor3", "correct_answer")])


def read_winogrande(rec, at):
    sentence = _field(rec, "sentence", str, at)
    if sentence.count("_") != 1:
        raise ValueError(f"{at}: sentence has {sentence.count('_')} blanks ('_'); expected exactly one")
    answer = rec.get("answer")
    if str(answer) not in ("1", "2") or isinstance(answer, bool):
        raise ValueError(f"{at}: answer {answer!r}; expected '1' or '2'")
    return dict(sentence=sentence, option1=_field(rec, "option1", str, at), option2=_field(rec, "option2", str, at),
                gold=int(answer) - 1)


def read_rows(path):
    """(where, record) per row of .jsonl/.jsonl.gz, a JSON array (.json, SciQ's original files), or an
    OLMES request dump (one doc per doc_id below 1000000). Labels kept in a sibling NAME-labels.lst
    (PIQA, WinoGrande originals) are joined in as `label`/`answer`."""
    path = Path(path)
    if path.name.endswith(".json"):
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON array of rows")
        out = [(f"{path}[{i}]", r) for i, r in enumerate(rows)]
    else:
        out = _read_lines(path)
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


def _read_lines(path):
    out, seen = [], set()
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if path.name.endswith(".requests.jsonl.gz"):  # a dump: one line per option; keep each doc once
                if rec.get("doc_id", 0) >= 1_000_000 or rec.get("doc_id") in seen:
                    continue
                seen.add(rec.get("doc_id"))
                rec = rec.get("doc")
            out.append((f"{path}:{lineno}", rec))
    return out


# Where each task's rows are found under --data DIR: the first file that exists wins. BoolQ prefers the
# original file because it has the titles OLMES prompts with; HellaSwag falls back to OLMES's dump,
# the only HellaSwag rows in ../shared (a Random(1234) sample of 1000 validation docs).
TASKS = {  # name: (reader, files, Catwalk's normalisation (the OLMo paper), OLMES v0.1's)
    "arc_easy": (read_choice, ["hf_validation/arc_easy.validation.jsonl", "original/arc_easy/ARC-Easy-Dev.jsonl"], "pmi", "per_char"),
    "arc_challenge": (read_choice, ["hf_validation/arc_challenge.validation.jsonl", "original/arc_challenge/ARC-Challenge-Dev.jsonl"], "pmi", "pmi"),
    "boolq": (read_boolq, ["original/boolq/dev.jsonl", "hf_validation/boolq.validation.jsonl"], "raw", "raw"),
    "hellaswag": (read_hellaswag, ["hf_validation/hellaswag.validation.jsonl", "original/hellaswag/hellaswag_val.jsonl",
                                   "olmes_requests/hellaswag_rc_0shot.requests.jsonl.gz",
                                   "olmes_requests/hellaswag_rc_5shot.requests.jsonl.gz"], "per_token", "per_char"),
    "openbookqa": (read_choice, ["hf_validation/openbookqa.validation.jsonl", "original/openbookqa/Main/dev.jsonl"], "pmi", "pmi"),
    "piqa": (read_piqa, ["hf_validation/piqa.validation.jsonl", "original/piqa/valid.jsonl"], "per_token", "per_char"),
    # SciQ is not in OLMES v0.1; oe-eval's rc dump and the OLMo paper both score it raw, so we do too.
    "sciq": (read_sciq, ["hf_validation/sciq.validation.jsonl", "original/sciq/valid.json"], "raw", "raw"),
    # WinoGrande: both options share one continuation, so every normalisation gives the same answer.
    "winogrande": (read_winogrande, ["hf_validation/winogrande.validation.jsonl", "original/winogrande/dev.jsonl"], "per_token", "raw"),
}
NORMS = ("raw", "per_token", "per_char", "pmi")


def load_task(name, root, limit=0):
    """(docs, path): the first `limit` (0 = all) rows of a task under `root`, read into plain fields."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    reader, files = TASKS[name][:2]
    found = [Path(root) / f for f in files if (Path(root) / f).is_file()]
    if not found:
        raise FileNotFoundError(f"{name}: none of {', '.join(str(Path(root) / f) for f in files)} exists")
    rows = read_rows(found[0])
    return [reader(rec, at) for at, rec in rows[:limit or None]], found[0]


# --- the eight tasks: prompts (OLMES, and the lm-eval v0.3 ones Catwalk used) ------------------------

def preprocess(text, style="olmes"):
    """HellaSwag's cleaner: WikiHow rows carry [title]/[header]/[step] marks. OLMES also turns the ".. " that
    " [title]" -> ". " leaves after a full stop into ". " (none of the 1000 docs in its dump has one, nor its
    5-shot context); lm-eval v0.3 (Catwalk) and OLMo's in-loop code do not."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text).replace("  ", " ")
    return re.sub(r"\.\. ", ". ", text) if style == "olmes" else text


# OLMES's fixed HellaSwag shots (FEWSHOT_SOURCES["OLMES:hellaswag"], HellaSwag train rows 12, 39, 9, 47, 38):
# (activity_label, ctx_a, ctx_b, gold ending), raw, so `preprocess` runs on them as on any row.
HELLASWAG_SHOTS = [
    ("Health", "[header] How to cope with suicidal thoughts [title] Put off any plans. [step] Promise yourself that "
     "you'll wait 48 hours before doing anything. Remember, thoughts don't have the power to force you to act.", "",
     "Sometimes extreme pain can distort our perception. Waiting before taking action will give your mind time to clear."),
    ("Education and Communications", "[header] How to make a liquid into a solid [title] Place a small open container "
     "of water in the freezer compartment of a class or home refrigerator. [title] Leave the water there for several "
     "hours or overnight. [title] Remove from the freezer and note what has occurred.", "",
     "[step] Water changes state from liquid to solid when it reaches a temperature of 0 degrees celsius, or 32 "
     "degrees fahrenheit. This is a simple example of changing from liquid to solid, or freezing."),
    ("Baking cookies", "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting them. "
     "The pans are filled with pastries and loaded into the oven.", "a knife", "is used to cut cylinder shaped dough into rounds."),
    ("Starting a campfire", "He takes his lighter and lights the newspaper in several places to start the fire. The "
     "bonfire starts burning and continues to burn.", "he", "adds a few more twigs to keep the flames burning."),
    ("Finance and Business", "[header] How to write a method statement [title] Prepare to write by conducting a risk "
     "assessment--an in-depth examination of the task or process. [substeps] Identify the work hazards (those that "
     "could potentially cause poor health or personal harm) that are inherent in the task. Analyze what has been done "
     "about these hazards and if these measures are enough to reduce the harm potential to an acceptable level.", "",
     "Decide what additional measures need to be taken to reduce harm if an acceptable level has not been met. "
     "[title] Begin to write your method statement, starting at the header."),
]


@dataclass
class Item:
    contexts: list        # one per option (WinoGrande's differ; elsewhere all the same)
    continuations: list   # one per option (WinoGrande's are all the same)
    gold: int
    uncond: bool = True   # also score each continuation after "Answer:" (for PMI)


UNCOND = "Answer:"  # catwalk's MultipleChoiceTask.unconditioned_prompt(); oe-eval's doc_id >= 1000000 requests


def render(task, doc, style="olmes", shots=0):
    """One document -> its Item. style: "olmes" (the strings of AI2's OLMES request dumps) or "catwalk"
    (lm-eval v0.3, as vendored by Catwalk for the OLMo paper). shots: HellaSwag only, 0 or 5 (OLMES's)."""
    if shots and (task != "hellaswag" or shots > len(HELLASWAG_SHOTS)):
        raise ValueError(f"{task}: only hellaswag has few-shot examples here (up to {len(HELLASWAG_SHOTS)})")
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        raw_stem = task == "openbookqa" and style == "catwalk"  # lm-eval's OBQA prompt is the bare stem
        ctx = doc["question"] if raw_stem else f"Question: {doc['question']}\nAnswer:"
        return Item([ctx] * len(doc["choices"]), [" " + c for c in doc["choices"]], doc["gold"])
    if task == "boolq":
        # The original/super_glue passage is "Title -- text"; HF's boolq has no title, and we do not invent one.
        passage = f"{doc['title']} -- {doc['passage']}" if doc["title"] else doc["passage"]
        ctx = f"{passage}\nQuestion: {doc['question']}?\nAnswer:"
        if style == "catwalk":  # super_glue's label order: 0 = no (matters only for ties)
            return Item([ctx] * 2, [" no", " yes"], int(doc["answer"]))
        return Item([ctx] * 2, [" yes", " no"], 0 if doc["answer"] else 1)
    if task == "hellaswag":
        if "query" in doc:
            query, choices = doc["query"], doc["choices"]
        else:
            query = preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize(), style)
            choices = [preprocess(e, style) for e in doc["endings"]]
        if shots:  # each shot is its query and gold ending; "\n\n" between shots and before the question
            query = "\n\n".join(preprocess(f"{a}: {x} {b.capitalize()}", style) + " " + preprocess(e, style)
                                for a, x, b, e in HELLASWAG_SHOTS[:shots]) + "\n\n" + query
        return Item([query] * len(choices), [" " + c for c in choices], doc["gold"])
    if task == "piqa":
        ctx = f"{'Question' if style == 'catwalk' else 'Goal'}: {doc['goal']}\nAnswer:"
        return Item([ctx] * 2, [" " + doc["sol1"], " " + doc["sol2"]], doc["gold"])
    if task == "sciq":
        # The whole string is stripped, so an empty support leaves no leading "\n" (OLMo's in-loop one does).
        ctx = f"{doc['support']}\nQuestion: {doc['question']}\nAnswer:".strip()
        return Item([ctx] * 4, [" " + o for o in doc["options"]], 3)
    if task == "winogrande":
        # Partial scoring (Trinh & Le): each option completes the text before the blank; the shared rest is scored.
        s = doc["sentence"]
        i = s.index("_")
        return Item([s[:i] + doc["option1"], s[:i] + doc["option2"]], [" " + s[i + 1:].strip()] * 2, doc["gold"], uncond=False)
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def requests_of(item):
    """The (context, continuation) strings of one Item: its options, then each option after "Answer:"."""
    cond = list(zip(item.contexts, item.continuations))
    return cond + ([(UNCOND, c) for c in item.continuations] if item.uncond else [])


# --- the eight tasks: scoring and the normalisations ------------------------------------------------

def prepare_tasks(names, root, tok, style="olmes", limit=0):
    """Load, render and tokenize once (train.py scores the same requests at every in-loop eval). Context
    and continuation are tokenized separately, as OLMo and catwalk do: " yes" stays one token."""
    if style not in ("olmes", "catwalk"):
        raise ValueError(f"norm {style!r}: expected olmes or catwalk")
    tasks, pairs, index, cache = {}, [], {}, {}

    def tokenized(text):  # each distinct string is tokenized once
        if text not in cache:
            cache[text] = encode(tok, text)
        return cache[text]

    for name in names:
        docs, path = load_task(name, root, limit)
        items = [render(name, d, style) for d in docs]
        refs = []
        for item in items:
            ids = []
            for pair in requests_of(item):
                if pair not in index:
                    index[pair] = len(pairs)
                    pairs.append(pair)
                ids.append(index[pair])
            refs.append(ids)
        tasks[name] = dict(items=items, refs=refs, path=str(path))
    return dict(tasks=tasks, pairs=pairs, ids=[(tokenized(c), tokenized(x)) for c, x in pairs], style=style)


def score_tasks(scorer, prep):
    """Per task: accuracy under every normalisation (raw, per_token, per_char = LL / len(continuation)
    with its leading space as catwalk and OLMES, pmi = LL(cont | ctx) - LL(cont | "Answer:"), a difference,
    not OLMo's in-loop ratio), the paper's choice as `acc`, the gold continuation's bits per byte (OLMo's
    in-loop bpb), chance and the always-the-same-option majority baseline. Ties go to the first option."""
    ll, ntok = scorer.loglikelihoods(prep["ids"], "tasks")
    out = {}
    for name, t in prep["tasks"].items():
        correct = {k: 0 for k in NORMS}
        golds, chance, gold_bpb = [], [], []
        for item, refs in zip(t["items"], t["refs"]):
            K = len(item.continuations)
            cond, unc = np.asarray(refs[:K]), np.asarray(refs[K:])
            n_chars = np.array([len(c) for c in item.continuations], np.float64)
            score = dict(raw=ll[cond], per_token=ll[cond] / ntok[cond], per_char=ll[cond] / n_chars,
                         pmi=ll[cond] - ll[unc] if len(unc) else ll[cond])
            for k in NORMS:
                correct[k] += int(np.argmax(score[k]) == item.gold)  # np.argmax: the first of equal maxima
            golds.append(item.gold)
            chance.append(1 / K)
            gold_bpb.append(bits_per_byte(-ll[cond[item.gold]], len(item.continuations[item.gold].encode("utf-8"))))
        n = len(t["items"])
        norm = TASKS[name][2 if prep["style"] == "catwalk" else 3]
        accs = {k: correct[k] / n for k in NORMS}
        out[name] = dict(docs=n, norm=norm, acc=accs[norm], accs=accs, bpb=float(np.mean(gold_bpb)),
                         chance=float(np.mean(chance)), majority=float(np.bincount(golds).max() / n), file=t["path"])
    return out


def print_tasks(res, style):
    print(f"{'task':<14} {'docs':>5} {'norm':>9} {'acc':>6} {'chance':>6} {'major.':>6} | "
          + " ".join(f"{k:>9}" for k in NORMS) + f" {'gold bpb':>8}")
    for name, r in res.items():
        print(f"{name:<14} {r['docs']:>5} {r['norm']:>9} {100 * r['acc']:>6.1f} {100 * r['chance']:>6.1f} "
              f"{100 * r['majority']:>6.1f} | " + " ".join(f"{100 * r['accs'][k]:>9.1f}" for k in NORMS) + f" {r['bpb']:>8.3f}")
    if len(res) > 1:
        mean = lambda k: 100 * np.mean([r[k] for r in res.values()])  # noqa: E731
        print(f"{'average':<14} {'':>5} {style:>9} {mean('acc'):>6.1f} {mean('chance'):>6.1f} {mean('majority'):>6.1f}")


# --- generation ---------------------------------------------------------------------------------

def pick(logits, temperature=0.0, top_k=0, top_p=1.0, rng=None):
    """The next token from logits (V,): the argmax at temperature 0 (ties: the lowest id); otherwise a
    draw from softmax(logits / temperature) over the top_k most likely (0 = all), cut to the smallest
    set whose probability reaches top_p. On the host in float64, so both backends draw alike."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")[: top_k or None]
    p = np.exp((logits[order] - logits[order[0]]) / temperature)
    p /= p.sum()
    keep = np.cumsum(p) - p < top_p  # a token stays if the ones above it have not reached top_p yet
    p = p[keep] / p[keep].sum()
    return int(order[:len(p)][rng.choice(len(p), p=p)])


def generate(params, m, prompt_ids, n_new, backend="jax", dtype="float32", temperature=0.0, top_k=0, top_p=1.0,
             eos=None, seed=0, cache=True):
    """Up to n_new tokens after prompt_ids (stopping after `eos`), and timings. With the cache, the prompt
    runs once (prefill) and each new token is one position through every layer; without it, every token
    re-reads the whole sequence (the reference the cache is tested against)."""
    prompt = [int(t) for t in prompt_ids] or [m.eos_token_id]  # an empty prompt starts from EOS
    if len(prompt) >= m.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; max_seq_len={m.max_seq_len} leaves no room to generate")
    if len(prompt) + n_new > m.max_seq_len:
        print(f"warning: stopping at max_seq_len={m.max_seq_len}: {m.max_seq_len - len(prompt)} new tokens, not {n_new}",
              file=sys.stderr)
    S = min(len(prompt) + n_new, m.max_seq_len)
    model.check_tokens(np.asarray([prompt]), m, "prompt")
    rng = np.random.default_rng(seed)
    run = (_jax_steps if backend == "jax" else _torch_steps)(params, m, S, dtype, cache)
    ids, t0 = list(prompt), time.perf_counter()
    logits = run(ids, 0)  # (V,) after the prompt
    times = [time.perf_counter() - t0]
    for _ in range(n_new):
        ids.append(pick(logits, temperature, top_k, top_p, rng))
        if ids[-1] == eos or len(ids) == S:
            break
        t0 = time.perf_counter()
        logits = run(ids, len(ids) - 1)
        times.append(time.perf_counter() - t0)
    # The median step, so that compiling (the first call of each shape in JAX) does not count.
    return ids[len(prompt):], dict(prompt=len(prompt), prefill_s=times[0], step_s=float(np.median(times[1:] or [np.nan])))


def _jax_steps(params, m, S, dtype, cache):
    """run(ids, n): the logits (V,) that follow ids, given that ids[:n] were seen by earlier calls."""
    import jax
    import jax.numpy as jnp
    params = {k: jnp.asarray(v) for k, v in params.items()}
    if not cache:  # one compiled forward over a fixed (1, S) buffer, read at the last filled position
        full = jax.jit(lambda p, t, n: model.forward(p, t, m, jnp.dtype(dtype))[0, n - 1].astype(jnp.float32))
        return lambda ids, _: np.asarray(full(params, jnp.asarray([ids + [0] * (S - len(ids))], jnp.int32), len(ids)))
    # Compiled twice: once for the prompt's length, once for one token. The cache is donated, so XLA
    # updates it in place rather than copying every layer's keys each token.
    step = jax.jit(lambda p, t, pos, c: model.forward_step(p, t, pos, c, m, jnp.dtype(dtype)), donate_argnums=3)
    state = {"cache": model.new_cache(m, 1, S, jnp.dtype(dtype))}

    def run(ids, n):
        logits, state["cache"] = step(params, jnp.asarray([ids[n:]], jnp.int32), jnp.int32(n), state["cache"])
        return np.asarray(logits[0, -1].astype(jnp.float32))

    return run


def _torch_steps(params, m, S, dtype, cache):
    import torch
    net, dt = model.torch_model(m, params).eval(), getattr(torch, dtype)
    kv = net.new_cache(1, S, dt)

    @torch.no_grad()
    def run(ids, n):
        if not cache:
            return net(torch.tensor([ids]), dt)[0, -1].float().numpy()
        return net.forward_step(torch.tensor([ids[n:]]), n, kv, dt)[0, -1].float().numpy()

    return run


# --- command line -------------------------------------------------------------------------------

def _model_args(p):
    p.add_argument("ckpt", help="our checkpoint directory (HF layout: config.json + model.safetensors)")
    p.add_argument("--tokenizer", help="'dolma2' or a .tiktoken ranks file (default: from CKPT/nanolmo.json, else dolma2)")
    p.add_argument("--backend", choices=["jax", "torch"], default="jax")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per forward")
    p.add_argument("--out", help="write the results here as JSON")


def _speed(scorer):
    return (f"{scorer.requests:,} requests in {scorer.rows:,} rows (shared prefixes run once); "
            f"scored {scorer.tokens:,} tokens ({scorer.padded:,} with padding) in {scorer.seconds:.1f}s: "
            f"{scorer.tokens / max(scorer.seconds, 1e-9):,.0f} tokens/s ({scorer.backend}, {scorer.dtype})")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    lg = sub.add_parser("logits", help="logits of an HF-format model directory on given tokens")
    lg.add_argument("dir")
    lg.add_argument("--tokens", required=True, help=".npy of int token ids, shape (B, T)")
    lg.add_argument("--out", required=True, help=".npy to write float32 logits (B, T, V) to")
    lg.add_argument("--backend", choices=["jax", "torch"], default="jax")
    lg.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bp = sub.add_parser("bpb", help="bits per byte per domain of JSON-lines documents, as Paloma")
    _model_args(bp)
    bp.add_argument("files", nargs="+", help=".jsonl / .jsonl.gz, one {'text': ...} per line")
    bp.add_argument("--limit", type=int, default=0, help="first N documents only (0 = all)")
    tk = sub.add_parser("tasks", help="zero-shot multiple-choice accuracy on the OLMo paper's eight tasks")
    _model_args(tk)
    tk.add_argument("--tasks", default=",".join(TASKS), help="comma list of " + ", ".join(TASKS))
    tk.add_argument("--data", default="../shared/evaldata", help="folder with hf_validation/ and/or original/")
    tk.add_argument("--limit", type=int, default=0, help="first N documents of each task (0 = all)")
    tk.add_argument("--norm", choices=["olmes", "catwalk"], default="olmes",
                    help="prompts and per-task normalisation: OLMES v0.1's, or the OLMo paper's (Catwalk)")
    gen = sub.add_parser("generate", help="continue a prompt, with a KV cache")
    gen.add_argument("ckpt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no cut")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--backend", choices=["jax", "torch"], default="jax")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--tokenizer", default=None, help="'dolma2' or a ranks file; default: the checkpoint's")
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole sequence for every token")
    args = ap.parse_args(argv)

    if args.command == "generate":
        m, params = convert.load_hf(args.ckpt)
        tok = checkpoint_tokenizer(args.ckpt, m, args.tokenizer)
        new, t = generate(params, m, encode(tok, args.prompt), args.max_new, args.backend, args.dtype,
                          args.temperature, args.top_k, args.top_p, m.eos_token_id, args.seed, not args.no_cache)
        print(args.prompt + tok.decode(new))
        print(f"({t['prompt']} prompt tokens, then {len(new)} new ones at {1 / t['step_s']:,.1f} tokens/s (the median "
              f"step); {args.backend}, {args.dtype}, {'no cache' if args.no_cache else 'KV cache'})", file=sys.stderr)
        return
    if args.command == "logits":
        tokens = np.load(args.tokens, allow_pickle=False)
        out = logits(args.dir, tokens, args.backend, args.dtype, args.tokens)
        np.save(args.out, out.astype(np.float32))
        print(f"wrote {args.out}: {out.shape} float32 ({args.backend}, {args.dtype} compute)")
        return
    scorer, tok = load_model(args.ckpt, args.backend, args.dtype, args.batch_tokens, args.tokenizer)
    print(f"{args.ckpt}: {scorer.m.family}, max_seq_len {scorer.m.max_seq_len}; tokenizer {tok.name}")
    if args.command == "bpb":
        docs, empty = read_documents(args.files, args.limit)
        if not docs:
            raise ValueError(f"no documents with text in {', '.join(args.files)}")
        res = dict(checkpoint=args.ckpt, files=args.files, max_seq_len=scorer.m.max_seq_len, empty_skipped=empty,
                   **bpb(scorer, tok, docs))
        print_bpb(res)
    else:
        names = [n.strip() for n in args.tasks.split(",") if n.strip()]
        prep = prepare_tasks(names, args.data, tok, args.norm, args.limit)
        res = dict(checkpoint=args.ckpt, norm=args.norm, limit=args.limit, tasks=score_tasks(scorer, prep))
        print_tasks(res["tasks"], args.norm)
    print(_speed(scorer))
    res["tokens_per_s"] = scorer.tokens / max(scorer.seconds, 1e-9)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
