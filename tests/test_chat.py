"""Chat rendering against the reference nobody here wrote: Hugging Face transformers' apply_chat_template, with
open-instruct's two OLMo templates (reference/longctx-posttrain-facts.md §2.5) written as Jinja below, on the
dolma2 tokenizer that convert.hf_tokenizer_files builds. Pinned down: render_chat's ids (with and without the
generation prompt), its label mask against open-instruct's prefix-length masking (§2.6) in both train_turns
modes, prepare(chat=...)'s token and labels_mask files, and the bad input prepare refuses (naming file:line)."""
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import convert
import data

tf = pytest.importorskip("transformers")

EVALDATA = Path(__file__).resolve().parents[2] / "shared" / "evaldata" / "hf_validation"

# open-instruct CHAT_TEMPLATES["tulu"], with get_tokenizer_tulu_v2_2's {{ bos_token }} in front (OLMo 2's add_bos).
TULU = ("{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
        "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
        "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
        "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
        "{% else %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")
# open-instruct CHAT_TEMPLATES["olmo"] (Olmo 3, ChatML; functions and environment turns left out: data.py has none).
OLMO = ("{% if not messages|selectattr('role', 'equalto', 'system')|list %}"
        "{{ '<|im_start|>system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff"
        " is November 2024, and your model weights are available at https://huggingface.co/allenai. You do not "
        "currently have access to any functions. <functions></functions><|im_end|>\n' }}{% endif %}"
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|im_start|>system\n' + "
        "message['content'] + ' You do not currently have access to any functions. <functions></functions>"
        "<|im_end|>\n' }}{% elif message['role'] == 'user' %}{{ '<|im_start|>user\n' + message['content'] + "
        "'<|im_end|>\n' }}{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + "
        "message['content'] }}{% if not loop.last %}{{ '<|im_end|>\n' }}{% else %}{{ eos_token }}{% endif %}"
        "{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        "{% endfor %}")
TEMPLATES = dict(tulu=TULU, olmo=OLMO)
SYSTEMS = ["You are a careful science tutor. Answer briefly, then explain.",
           "Réponds en anglais, sans détour : la réponse d'abord, l'explication ensuite.",
           "  You grade multiple-choice questions.\n"]


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer("dolma2")


@pytest.fixture(scope="module", params=list(TEMPLATES))
def hf(request, tok, tmp_path_factory):
    """(template name, an AutoTokenizer of dolma2 whose tokenizer_config.json carries that chat_template)."""
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    for name, text in convert.hf_tokenizer_files(tok, 65536).items():
        if name == "tokenizer_config.json":
            text = json.dumps(dict(json.loads(text), chat_template=TEMPLATES[request.param]), indent=2)
        (d / name).write_text(text)
    return request.param, tf.AutoTokenizer.from_pretrained(d)


def qa_pairs():
    """(question, answer) pairs from the real eval tasks: the first records of each and the first non-ASCII ones."""
    if not EVALDATA.is_dir():
        pytest.skip(f"{EVALDATA} is absent: no real conversations to render")

    def rows(name):
        lines = (EVALDATA / f"{name}.validation.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(x) for x in lines[:8] + [x for x in lines if not x.isascii()][:3]]
    out = [(r["question"], r["correct_answer"] + (f". {r['support']}" if r["support"] else ".")) for r in rows("sciq")]
    for r in rows("arc_easy"):
        opts = dict(zip(r["choices"]["label"], r["choices"]["text"]))
        out.append((r["question"] + "".join(f"\n{k}. {v}" for k, v in opts.items()),
                    f"{r['answerKey']}. {opts[r['answerKey']]}"))
    out += [(f"{r['passage']}\n\nQuestion: {r['question']}?", "Yes." if r["answer"] else "No.") for r in rows("boolq")]
    out += [(f"Goal: {r['goal']}\nWhich is right?\n1. {r['sol1']}\n2. {r['sol2']}", r[f"sol{r['label'] + 1}"])
            for r in rows("piqa")]
    return out[::3] + out[1::3] + out[2::3]  # interleave the tasks


def conversations():
    """24 conversations: one to three exchanges, with or without a system turn, a third ending in a user turn."""
    pairs, convs, k = qa_pairs(), [], 0
    shapes = [(0, 1, False), (1, 1, False), (0, 2, False), (1, 3, False), (0, 2, True), (1, 1, True)]
    for c in range(24):
        system, exchanges, ask = shapes[c % len(shapes)]
        msgs = [dict(role="system", content=SYSTEMS[c % len(SYSTEMS)])] if system else []
        for q, a in (pairs[(k + j) % len(pairs)] for j in range(exchanges)):
            msgs += [dict(role="user", content=q), dict(role="assistant", content=a)]
        k += exchanges
        if ask:
            msgs.append(dict(role="user", content=pairs[k % len(pairs)][0]))
            k += 1
        convs.append(msgs)
    assert any(not m["content"].isascii() for msgs in convs for m in msgs)
    return convs


def hf_ids(hf_tok, msgs, add_generation_prompt=False):
    out = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)  # transformers 5 returns a BatchEncoding


def open_instruct_mask(hf_tok, msgs, last_only=False):
    """sft_tulu_tokenize_and_truncate_v1: every non-assistant message i is masked over [len(tmpl(msgs[:i])),
    len(tmpl(msgs[:i + 1], add_generation_prompt=next is assistant))); last_only: all before the last reply too."""
    mask = np.ones(len(hf_ids(hf_tok, msgs)), bool)
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            nxt = i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant"
            mask[len(hf_ids(hf_tok, msgs[:i])) if i else 0:len(hf_ids(hf_tok, msgs[:i + 1], nxt))] = False
    if last_only:
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        mask[:len(hf_ids(hf_tok, msgs[:last], True))] = False
    return mask


def render_ids(tok, msgs, template, generation_prompt=False):
    return list(data.render_chat(tok, msgs, template, generation_prompt)[0])


def test_render_chat_ids_match_apply_chat_template(tok, hf):
    """render_chat's ids are apply_chat_template's, for 24 real conversations; with the generation prompt too."""
    template, hf_tok = hf
    for msgs in conversations():
        assert render_ids(tok, msgs, template) == hf_ids(hf_tok, msgs), msgs
        if msgs[-1]["role"] == "user":
            assert render_ids(tok, msgs, template, True) == hf_ids(hf_tok, msgs, True), msgs


@pytest.mark.parametrize("train_turns", ["all", "last"])
def test_label_mask_matches_open_instruct(tok, hf, train_turns):
    """The label mask is open-instruct's (every assistant turn, or only the last: preference pairs)."""
    template, hf_tok = hf
    for msgs in conversations():
        ids, mask = data.render_chat(tok, msgs, template, train_turns=train_turns)
        ref = open_instruct_mask(hf_tok, msgs, last_only=train_turns == "last")
        assert mask.dtype == np.bool_ and len(mask) == len(ids)
        diff = np.flatnonzero(mask != ref)
        assert not len(diff), (f"{template}/{train_turns} {[m['role'] for m in msgs]}: render_chat's mask differs "
                               f"at tokens {diff.tolist()} of {len(ids)}: render_chat {mask[diff].tolist()} on "
                               f"{[(tok.decode([ids[i]]), tok.decode(ids[i - 2:i + 2])) for i in diff]}")


def test_prepare_chat_files_are_render_chat(tok, tmp_path):
    """prepare(chat="olmo") writes the concatenated render_chat ids and masks, in record order."""
    convs = conversations()[:8]
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(dict(messages=m), ensure_ascii=False) + "\n" for m in convs), encoding="utf-8")
    report = data.prepare([src], tmp_path / "out", chat="olmo", workers=1, quiet=True)
    assert report["kind"] == "chat" and report["splits"]["train"]["documents"] == len(convs)
    (part,) = data.dataset_files(tmp_path / "out")
    rendered = [data.render_chat(tok, m, "olmo") for m in convs]
    assert part.has_mask
    np.testing.assert_array_equal(part.array(), np.concatenate([ids for ids, _ in rendered]).astype(np.uint32))
    np.testing.assert_array_equal(part.mask(), np.concatenate([m for _, m in rendered]))
    assert (part.path.with_suffix(".labels_mask").read_bytes()
            == np.concatenate([m for _, m in rendered]).astype(np.uint8).tobytes())


GOOD = dict(messages=[dict(role="user", content="Hi"), dict(role="assistant", content="Hello.")])
PAIR = dict(chosen=GOOD["messages"], rejected=[GOOD["messages"][0], dict(role="assistant", content="Go away.")])
BAD = {
    "no role": (GOOD, dict(messages=[dict(content="Hi")]), r"messages\[0\] has no 'role'"),
    "robot": (GOOD, dict(messages=[GOOD["messages"][0], dict(role="robot", content="beep")]),
              r"messages\[1\]\.role='robot' is not one of system, user, assistant"),
    "no assistant": (GOOD, dict(messages=[GOOD["messages"][0]]), r"no assistant turn"),
    "prompts differ": (PAIR, dict(PAIR, rejected=[dict(role="user", content="Hey"), PAIR["rejected"][1]]),
                       r"'chosen' and 'rejected' must share every message but a last assistant turn"),
    "invalid JSON": (GOOD, '{"messages": [', r"invalid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_prepare_refuses_bad_chat_input(tmp_path, case):
    """Bad conversations stop prepare with file:line and the field, leaving no output folder (nor OUT.tmp)."""
    first, bad, match = BAD[case]
    src, out = tmp_path / "bad.jsonl", tmp_path / "out"
    src.write_text(json.dumps(first) + "\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: {match}"):
        data.prepare([src], out, chat="olmo", workers=1, quiet=True)
    assert not out.exists() and not out.with_name("out.tmp").exists()


def test_trl_explicit_pairs_equal_open_instruct_ones(tok):
    """TRL's explicit pair ({"prompt", "chosen", "rejected"}, answers alone) renders as open-instruct's full lists."""
    user = [dict(role="system", content="Be brief."), dict(role="user", content="What is 17 + 25?")]
    answers = [[dict(role="assistant", content=a)] for a in ("42", "32")]
    full = data.chat_record(dict(chosen=user + answers[0], rejected=user + answers[1]), tok, "olmo", "x:1")
    explicit = data.chat_record(dict(prompt=user, chosen=answers[0], rejected=answers[1]), tok, "olmo", "x:1")
    for (ids, mask), (ids2, mask2), answer in zip(full, explicit, ("42", "32")):
        assert ids == ids2 and np.array_equal(mask, mask2)
        assert tok.decode(np.asarray(ids)[mask]) == answer + "<|endoftext|>"  # only the last answer is trained
