"""Generation: the KV cache against the plain forward, both backends' decoding, the sampler, the command line."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import convert
import data
import eval as evaluate
import model
from common import random_params, variant
from configs import load_config, run_cli
from teach import compare


@pytest.mark.parametrize("name", ["olmo1", "olmo2", "olmo3"])
def test_forward_step_equals_forward(name):
    """A 7-token prompt, then one token at a time to 30: the same logits as one forward over all 30.
    olmo3's sliding layers (window 5) keep 5 slots, and the prompt is longer than that."""
    m = variant(name)
    params = random_params(m, seed=1)
    toks = np.random.default_rng(0).integers(0, m.vocab_size, (2, 30))
    want = np.asarray(model.forward({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(toks), m))
    cache = model.new_cache(m, 2, 30)
    assert [c["k"].shape[1] for c in cache] == ([5, 5, 5, 30] if name == "olmo3" else [30, 30])
    step = jax.jit(lambda p, t, pos, c: model.forward_step(p, t, pos, c, m))
    got = []
    for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, 30)]:
        logits, cache = step(params, jnp.asarray(toks[:, start:stop]), start, cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, 1)
    bad = np.flatnonzero((np.abs(got - want) > 1e-5 * np.abs(want).max()).any((0, 2)))
    if not len(bad):
        return
    if bad[0] < 7:
        hint = ("The prompt's own call (7 tokens at pos 0, an empty cache) already differs: the "
                "new keys attend among themselves, causally; a slot whose position is < 0 is "
                "empty.")
    elif name == "olmo3":
        hint = (f"The prompt matches, then from position {bad[0]} on: the ring. Position p lives "
                f"in slot p % C (C = 5 on the sliding layers, the window); the mask compares "
                f"positions (the position each slot holds), not slots; and only the last C new "
                f"keys are kept.")
    else:
        hint = ("The prompt matches and the tokens after it do not: each call writes its new keys "
                "and values into their slots (position p in slot p % C) and returns the new cache; "
                "the next call reads them back with their positions.")
    compare(f"model.forward_step ({name}: a 7-token prompt, then one token a call)", got, want,
            ("batch", "position", "vocab id"), 1e-5, hint=hint)


def test_greedy_with_cache_equals_without():
    """Far past the sliding window (5): the same tokens with and without the cache, in both backends."""
    m = variant("olmo3")
    params = random_params(m, seed=2)
    runs = {(backend, cache): evaluate.generate(params, m, [3, 1, 4], 40, backend, cache=cache)[0]
            for backend in ("jax", "torch") for cache in (True, False)}
    assert len(set(map(tuple, runs.values()))) == 1 and len(runs["jax", True]) == 40, runs
    # Stop at EOS: make the 10th greedy token the end of text.
    eos = runs["jax", True][9]
    first = runs["jax", True].index(eos)
    assert evaluate.generate(params, m, [3, 1, 4], 40, "torch", eos=eos)[0] == runs["jax", True][:first + 1]


def test_sampler():
    logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    rng = np.random.default_rng(0)
    assert evaluate.pick(logits) == 1 and evaluate.pick(logits, 1.0, top_k=1, rng=rng) == 1
    assert evaluate.pick(logits, 1.0, top_p=0.3, rng=rng) == 1  # the top token alone reaches 0.3
    draws = np.array([evaluate.pick(logits, 1.0, top_k=3, rng=rng) for _ in range(4000)])
    assert set(draws) == {1, 3, 4}  # top-k keeps 0.4, 0.3, 0.15, renormalised by 0.85
    assert np.allclose(np.bincount(draws, minlength=5)[[1, 3, 4]] / 4000, np.array([0.4, 0.3, 0.15]) / 0.85, atol=0.03)
    draws = np.array([evaluate.pick(logits, 1.0, top_p=0.75, rng=rng) for _ in range(2000)])
    assert set(draws) == {1, 3, 4}  # 0.4 + 0.3 < 0.75, so the third (0.15) is still needed
    draws = np.array([evaluate.pick(logits, 0.05, rng=rng) for _ in range(200)])
    assert (draws == 1).mean() > 0.99  # a low temperature is nearly greedy


def test_batched_sample_cuts_like_pick():
    """eval.sample (GRPO's batched sampler) draws by pick's rule, eval.cut, on the device: top_k=1 or a
    tiny top_p is greedy; with top_k=2 every token is one of its position's two most likely."""
    m = variant("olmo3")
    params = random_params(m, seed=5)
    prompts = np.tile([3, 1, 4], (4, 1))
    greedy = evaluate.sample(params, m, prompts, 12, 0.0, 0, m.vocab_size, -1)
    assert evaluate.sample(params, m, prompts, 12, 1.0, 0, m.vocab_size, -1, top_k=1) == greedy
    assert evaluate.sample(params, m, prompts, 12, 1.0, 0, m.vocab_size, -1, top_p=1e-6) == greedy
    drawn = np.array(evaluate.sample(params, m, prompts, 12, 3.0, 0, m.vocab_size, -1, top_k=2))
    assert (drawn != greedy).any()  # at temperature 3, some second choices
    tokens = jnp.asarray(np.concatenate([prompts, drawn], 1))
    logits = np.asarray(model.forward({k: jnp.asarray(v) for k, v in params.items()}, tokens, m))
    logits = logits[:, 2:-1]  # those that predict the drawn tokens
    second = np.sort(logits, -1)[..., -2]
    assert (np.take_along_axis(logits, drawn[..., None], -1)[..., 0] >= second - 1e-4).all()


def test_generate_command(setup, tmp_path, capsys, monkeypatch):
    """`eval.py generate` as its command line runs it (run_cli(main), in this process)."""
    monkeypatch.delenv("NANOLMO_TRACEBACK", raising=False)  # (with it, run_cli raises instead)
    root, toml = setup
    m = load_config([str(toml)]).model
    convert.save_hf(tmp_path / "ckpt", m, random_params(m, seed=3))
    argv = ["generate", str(tmp_path / "ckpt"), "--prompt", "Licensed under", "--max-new", "12",
            "--tokenizer", str(root / "bpe.tiktoken")]
    outs = []
    for extra in ([], ["--backend", "torch"]):
        run_cli(evaluate.main, argv + extra)
        outs.append(capsys.readouterr())
    for r in outs:
        assert r.out.startswith("Licensed under") and "tokens/s" in r.err
    assert outs[0].out == outs[1].out  # greedy: the same text from both backends
    with pytest.raises(SystemExit) as exited:
        run_cli(evaluate.main, argv[:2] + ["--prompt", "x" * 400, "--tokenizer", str(root / "bpe.tiktoken")])
    assert exited.value.code and "max_seq_len=32 leaves no room" in capsys.readouterr().err


def test_padding_ids_are_never_generated(setup, tmp_path, capsys):
    """A padded vocabulary (OLMo's embedding has 100352 rows, its tokenizer 100278 ids): the head's padding
    rows are +-10 times the real rows, so a padding id beats every real one at every step. Greedy and
    sampled, in both backends and from the command line, only ids the tokenizer can decode come out."""
    root, toml = setup
    tok = data.load_tokenizer(str(root / "bpe.tiktoken"))
    n = tok.vocab_size
    m = dataclasses.replace(load_config([str(toml)]).model, vocab_size=3 * n)
    params = random_params(m, seed=4)
    head = params["lm_head.weight"]
    head[n:] = np.concatenate([10 * head[:n], -10 * head[:n]])
    ids = tok.enc.encode("Licensed under")
    for backend in ("jax", "torch"):
        assert max(evaluate.generate(params, m, ids, 12, backend)[0]) >= n  # without the tokenizer's size
        for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.0, 5, 0.9)]:
            new, _ = evaluate.generate(params, m, ids, 12, backend, temperature=temperature, top_k=top_k, top_p=top_p,
                                       tokenizer_size=n)
            assert len(new) == 12 and max(new) < n, (backend, temperature, new)
            tok.decode(new)
    convert.save_hf(tmp_path / "ckpt", m, params)
    evaluate.main(["generate", str(tmp_path / "ckpt"), "--prompt", "Licensed under", "--max-new", "12",
                   "--tokenizer", str(root / "bpe.tiktoken"), "--temperature", "1.0"])
    assert capsys.readouterr().out.startswith("Licensed under")
