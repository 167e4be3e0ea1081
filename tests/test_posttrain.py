"""Post-training as runs: SFT, DPO and GRPO are train.py runs on the arithmetic task (docs/posttrain.md), each from
the one before; DPO's reference file is written once, reused, and refused for another checkpoint; the wrong loss for
the data is refused; eval.py chat keeps the conversation. The maths is pinned down in test_dpo.py and test_chat.py."""
import json
import shutil

import numpy as np
import pytest

import data
import eval as evaluate
import train
from configs import ConfigError, load_config


@pytest.fixture(scope="module")
def arith(setup, tmp_path_factory):
    """The arithmetic task prepared with the small fixture's 384-id tokenizer: SFT conversations, pairs, prompts."""
    root, _ = setup
    d = tmp_path_factory.mktemp("arith")
    counts = data.arithmetic(d / "task")
    assert counts["heldout"] > 0.05 * 10000 and counts["sft"] + counts["heldout"] == 10000
    held = {json.loads(line)["messages"][0]["content"] for line in (d / "task/heldout.jsonl").read_text().splitlines()}
    trained = {json.loads(line)["messages"][0]["content"] for line in (d / "task/sft.jsonl").read_text().splitlines()}
    assert not held & trained  # split by the numbers: a held-out sum is never trained on
    for name, src in (("sft", "sft"), ("dpo", "pref")):
        data.prepare([d / f"task/{src}.jsonl"], d / name, str(root / "bpe.tiktoken"), heldout=0.05, workers=1,
                     quiet=True, chat="tulu")
    return d


def args(setup, run_dir, *extra):
    return [str(setup[1]), "--model.max_seq_len=64", "--data.seq_len=64", "--data.global_batch=8",
            f"--train.run_dir={run_dir}", "--train.steps=3", "--train.log_every=1", "--train.z_loss=0", *extra]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_dpo_grpo_chain(setup, arith, tmp_path):
    """Each stage trains from the last one's checkpoint and logs its own metrics; the SFT loss covers the answers
    only (the label mask), DPO's reference log-probs are computed once and reused, GRPO logs rewards."""
    sft, dpo, grpo = tmp_path / "sft", tmp_path / "dpo", tmp_path / "grpo"
    train.main(args(setup, sft, f"--data.path={arith / 'sft'}", "--data.packing=packed", "--data.doc_mask=true",
                    "--data.source_group_size=1"))
    assert all(np.isfinite(r["loss"]) for r in metrics(sft) if "loss" in r)
    pairs = [f"--data.path={arith / 'dpo'}", "--data.seq_len=48", f"--train.init_from={sft / 'step_3'}",
             "--train.loss=dpo_norm", "--train.dpo_beta=5"]
    train.main(args(setup, dpo, *pairs))
    first = [r for r in metrics(dpo) if "loss" in r][0]
    assert first["margin"] == pytest.approx(0, abs=1e-5)  # the policy starts at the reference
    assert first["loss"] == pytest.approx(np.log(2), rel=1e-5)
    final = json.loads((dpo / "final.json").read_text())
    assert 0 <= final["eval_accuracy"] <= 1 and "eval_margin" in final
    ref = arith / "dpo/reference_logps.npz"
    before = ref.stat().st_mtime_ns
    train.main(args(setup, tmp_path / "dpo-again", *pairs))
    assert ref.stat().st_mtime_ns == before  # reused, not recomputed
    train.main(args(setup, grpo, f"--data.path={arith / 'task/rl.jsonl'}", "--data.seq_len=64",
                    f"--train.init_from={dpo / 'step_3'}", "--train.loss=grpo", "--train.grpo_group=4",
                    "--train.grpo_max_new=4"))
    rows = [r for r in metrics(grpo) if "loss" in r]
    assert len(rows) == 3 and all(0 <= r["reward"] <= 1 for r in rows)
    # GRPO's prompts name no tokenizer: it is the starting checkpoint's, and its checkpoints carry it on
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (grpo / "step_3" / name).read_bytes() == (sft / "step_3" / name).read_bytes(), name


def test_reference_file_of_another_checkpoint_is_refused(setup, arith, tmp_path):
    """A reference_logps.npz written for other weights stops the run before any step, and names the fix."""
    sft, pairs = tmp_path / "sft", tmp_path / "pairs"
    train.main(args(setup, sft, f"--data.path={arith / 'sft'}", "--data.packing=packed", "--data.doc_mask=true",
                    "--data.source_group_size=1", "--train.steps=1"))
    shutil.copytree(arith / "dpo", pairs, ignore=shutil.ignore_patterns("reference_logps.*"))
    np.savez(pairs / "reference_logps.npz", checkpoint="elsewhere", sha256=["0" * 64], seq_len=48, train=np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"reference_logps\.npz: reference log-probs of elsewhere .* delete"):
        train.main(args(setup, tmp_path / "dpo", f"--data.path={pairs}", "--data.seq_len=48",
                        f"--train.init_from={sft / 'step_1'}", "--train.loss=dpo"))
    assert not (tmp_path / "dpo" / "step_1").exists()
    assert np.load(pairs / "reference_logps.npz")["checkpoint"] == "elsewhere"  # left as it was


@pytest.mark.parametrize("loss, data_kind", [("dpo", "sft"), ("ce", "dpo"), ("grpo", "sft")])
def test_loss_that_does_not_fit_the_data_is_refused(setup, arith, tmp_path, loss, data_kind):
    with pytest.raises(ConfigError, match=rf"train.loss='{loss}' does not train on"):
        train.main(args(setup, tmp_path / "run", f"--data.path={arith / data_kind}", f"--train.loss={loss}",
                        "--data.packing=packed", "--data.doc_mask=true"))


def test_chat_keeps_the_conversation(setup, monkeypatch, capsys):
    """eval.chat renders the whole conversation each turn, the answers so far included, and stops at an empty line."""
    from common import random_params
    root, _ = setup
    tok = data.load_tokenizer(str(root / "bpe.tiktoken"))
    m = load_config([str(setup[1]), "--model.max_seq_len=128"]).model
    seen, turns = [], iter(["What is 1 + 2?", "And 3 + 4?", ""])
    render = data.render_chat
    monkeypatch.setattr(data, "render_chat", lambda tok, msgs, *a, **k: seen.append(list(msgs)) or render(tok, msgs, *a, **k))
    monkeypatch.setattr("builtins.input", lambda _: next(turns))
    evaluate.chat(random_params(m), m, tok, "tulu", max_new=4)
    assert [len(s) for s in seen] == [1, 3] and seen[1][1]["role"] == "assistant" and seen[1][0] == seen[0][0]
    assert capsys.readouterr().out.count("olmo> ") == 2


def test_pairs_cut_to_nothing_are_refused(arith):
    """A seq_len that leaves an answer without a target would make dpo_norm divide by zero: refused up front."""
    with pytest.raises(ValueError, match=r"preference pair \d+ .*no token left within seq_len=8.*raise data\.seq_len"):
        data.open_instances(arith / "dpo", 8)
    assert data.open_instances(arith / "dpo", 48).n > 0


def test_midtraining_mix_two_seeds_and_their_soup(setup, arith, tmp_path, capsys):
    """Stage 2 as `make midtrain` runs it, small: a mix of a text dataset and chat conversations
    (each keeps its own label mask), two runs from one checkpoint with two data seeds, held-out bits
    per byte from eval.data (a mix has no held-out split), then their soup and eval.py's table."""
    root, _ = setup
    mix = tmp_path / "mix.txt"
    mix.write_text(f"books,{root / 'data'},3\narith,{arith / 'sft'},1\n")
    inst = data.open_instances(mix, 32, seed=1)
    rows = inst.batch(np.linspace(0, inst.n - 1, 64).astype(int))  # both sources'
    books = rows["mask"].all(1)  # a plain-text instance: every token a target
    assert books.any() and not books.all() and rows["mask"][~books].any()
    held = data.open_instances(root / "data", 32, split="heldout")
    B = next(b for b in (8, 4, 2, 1) if held.n % b == 0)  # whole batches: eval covers them all
    base = tmp_path / "base"
    train.main([str(setup[1]), f"--train.run_dir={base}", "--train.steps=2", "--train.z_loss=0"])
    runs = [tmp_path / f"mid{seed}" for seed in (1, 2)]
    for seed, run in zip((1, 2), runs):
        train.main([str(setup[1]), f"--data.path={mix}", f"--data.seed={seed}",
                    f"--data.global_batch={B}", f"--eval.data={root / 'data'}",
                    f"--train.init_from={base / 'step_2'}", "--train.schedule=linear",
                    "--train.warmup=0", "--train.alpha_f=0", f"--train.run_dir={run}",
                    "--train.steps=3", "--train.z_loss=0"])
    finals = [json.loads((run / "final.json").read_text()) for run in runs]
    assert all(f["eval_bpb"] > 0 for f in finals)  # eval.data's held-out split
    for run in runs:  # and its tokenizer, which the mix does not name
        assert ((run / "step_3/tokenizer.json").read_bytes()
                == (base / "step_2/tokenizer.json").read_bytes())
    first, second = (train.convert.load_hf(run / "step_3")[1] for run in runs)
    assert any(not np.array_equal(first[k], second[k]) for k in first)  # two samples, two models
    soup = tmp_path / "soup"
    train.convert.soup([run / "step_3" for run in runs], soup)
    prompts = tmp_path / "prompts.jsonl"  # 50 of the held-out sums: enough for the table's shape
    prompts.write_text("".join((arith / "task/heldout.jsonl").read_text().splitlines(True)[:50]))
    capsys.readouterr()
    evaluate.main(["exact", str(base / "step_2"), *(str(r / "step_3") for r in runs), str(soup),
                   "--prompts", str(prompts), "--template", "tulu",
                   "--heldout", str(root / "data")])
    table = capsys.readouterr().out.splitlines()[2:]
    assert [line.split()[0] for line in table] == [str(base / "step_2"),
                                                   *(str(r / "step_3") for r in runs), str(soup)]
    bpb = [float(line.split()[2]) for line in table]
    # eval.py's bits per byte are train.py's final eval's, from another code path
    assert bpb[1:3] == pytest.approx([f["eval_bpb"] for f in finals], abs=1e-4)


def test_eval_data_of_another_tokenizer_is_refused(setup, tmp_path):
    """Bits per byte of held-out text tokenized otherwise would be a wrong figure, not an error."""
    root, _ = setup
    other = tmp_path / "other"
    shutil.copytree(root / "data", other)
    info = json.loads((other / "prepare.json").read_text())
    (other / "prepare.json").write_text(json.dumps({**info, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="eval.data=.*other.* another tokenizer than data.path"):
        train.main([str(setup[1]), f"--eval.data={other}", f"--train.run_dir={tmp_path / 'run'}",
                    "--train.steps=1"])
    assert not (tmp_path / "run" / "step_1").exists()
