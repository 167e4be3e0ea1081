"""DPO and GRPO against a reference nobody here wrote: Hugging Face transformers' log-probs of a checkpoint that
convert.save_hf writes, put through the losses as open-instruct's dpo_loss / _get_batch_logps and TRL's "sigmoid" /
"sigmoid_norm" compute them (reference/longctx-posttrain-facts.md §2.7), with torch autograd for the gradients.
Ours: the JAX step (JaxBackend.step), jax.grad of model.forward + train.step_loss, the torch backend, the reference
pass (score); and GRPO's clipped loss against REINFORCE and PPO's clip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import convert
import model
import train
from common import VARIANTS, random_params
from configs import build
from teach import compare, mistake

tf = pytest.importorskip("transformers")
P, T, BETA = 4, 24, {"dpo": 0.1, "dpo_norm": 5.0}  # 4 pairs = 8 rows of 24 tokens
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5  # each gradient against HF's autograd; atol relative to the tensor's largest entry
MODEL = dict(VARIANTS["olmo3"], n_layers=2, layer_pattern="SF")  # sliding (window 5 < T) then full with YaRN


def config(loss, micro=0):
    return build(dict(model=MODEL, data=dict(seq_len=T, global_batch=P),
                      train=dict(loss=loss, dpo_beta=BETA[loss], micro_batch=micro, steps=1,
                                 loss_chunks=5)))  # JAX: the head in 5 passes over 24 positions, one padded


def pairs(m, seed=1):
    """P pairs: a shared prompt, then two answers of different lengths ending in EOS, right-padded; the mask on
    the answers' tokens only. Rows chosen_0, rejected_0, chosen_1, ..."""
    rng = np.random.default_rng(seed)
    tokens, mask = np.full((2 * P, T), m.pad_token_id, np.int32), np.zeros((2 * P, T), bool)
    for i in range(P):
        prompt = rng.integers(3, m.vocab_size, rng.integers(3, 9))
        for j, n in enumerate(rng.choice(np.arange(2, T - len(prompt) + 1), 2, replace=False)):
            answer = np.append(rng.integers(3, m.vocab_size, n - 1), m.eos_token_id)
            tokens[2 * i + j, :len(prompt) + n] = np.concatenate([prompt, answer])
            mask[2 * i + j, len(prompt):len(prompt) + n] = True
    return dict(tokens=tokens, mask=mask)


def hf_logps(net, batch):
    """Each row's summed answer log-prob and answer length: logits[:, :-1].log_softmax at ids[:, 1:] × mask[:, 1:]."""
    ids, keep = torch.from_numpy(batch["tokens"]).long(), torch.from_numpy(batch["mask"][:, 1:])
    logits = net(ids, attention_mask=(ids != net.config.pad_token_id).long()).logits.float()
    per = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (per * keep).sum(-1), keep.sum(-1)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: on a busy 2-core machine two torch threads waiting on each other make backward ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The policy and a different reference model as HF loads them, their params, and the pairs."""
    m = config("dpo").model
    out = {}
    for name, seed in (("policy", 1), ("reference", 2)):
        params = random_params(m, seed=seed, std=0.15)
        convert.save_hf(path := tmp_path_factory.mktemp(name), m, params)
        net = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        out[name] = params, net
    batch = pairs(m)
    with torch.no_grad():
        batch["ref"] = hf_logps(out["reference"][1], batch)[0].numpy().astype(np.float32)
    return m, out, batch


def direct(loss, hf_state):
    """HF's loss, margins and gradients (HF names), as open-instruct / TRL compute them."""
    _, nets, batch = hf_state
    net = nets["policy"][1]
    net.zero_grad()
    s, n = hf_logps(net, batch)
    ref = torch.from_numpy(batch["ref"])
    if loss == "dpo_norm":  # each side by its own answer's length, policy and reference alike
        s, ref = s / n, ref / n
    margin = BETA[loss] * ((s[0::2] - ref[0::2]) - (s[1::2] - ref[1::2]))
    value = -F.logsigmoid(margin).mean()
    value.backward()
    return value.item(), margin.detach().numpy(), {k: p.grad.numpy().copy() for k, p in net.named_parameters()}


def check_dpo_loss(loss, hf_state, xp):
    """model.dpo_loss itself, on transformers' summed log-probs (per-token means for dpo_norm):
    its losses and margins against open-instruct's formula, and the usual mistake behind a
    difference."""
    _, nets, batch = hf_state
    with torch.no_grad():
        s, n = hf_logps(nets["policy"][1], batch)
    ref = torch.from_numpy(batch["ref"])
    if loss == "dpo_norm":
        s, ref = s / n, ref / n
    beta, ratio, policy = BETA[loss], (s - ref).double().numpy(), s.double().numpy()
    margin = beta * (ratio[0::2] - ratio[1::2])
    inputs = (s, ref) if xp is torch else (jnp.asarray(s.numpy()), jnp.asarray(ref.numpy()))
    losses, margins = (np.asarray(a.detach() if xp is torch else a, np.float64)
                       for a in model.dpo_loss(*inputs, beta, xp))
    pair = ("pair",)
    compare(f"model.dpo_loss's margins ({loss}, xp = {xp.__name__})", margins, margin, pair, 1e-5, [
        mistake("rejected minus chosen", -margin, "the margin is the chosen row's log-ratio minus "
                "the rejected row's: rows 0, 2, 4, ... are chosen."),
        mistake("taking the two halves as chosen and rejected", beta * (ratio[:P] - ratio[P:]),
                "pairs sit side by side: chosen_0, rejected_0, chosen_1, ...; take [0::2] and "
                "[1::2]."),
        mistake("leaving out β", margin / beta,
                "margin = β · ((π_c − ref_c) − (π_r − ref_r))."),
        mistake("leaving out the reference", beta * (policy[0::2] - policy[1::2]),
                "each row's log-ratio is log π − log π_ref.")])
    want = -F.logsigmoid(torch.from_numpy(margin)).numpy()
    compare(f"model.dpo_loss's losses ({loss}, xp = {xp.__name__})", losses, want, pair, 1e-5, [
        mistake("log σ(margin), the sign flipped,", -want, "the loss is −log σ(margin)."),
        mistake("−log σ(−margin)", -F.logsigmoid(-torch.from_numpy(margin)).numpy(),
                "−log σ(margin) = logaddexp(0, −margin)."),
        mistake("1 − σ(margin) as the loss", 1 - torch.sigmoid(torch.from_numpy(margin)).numpy(),
                "the loss is −log σ(margin).")],
        hint="One loss per pair: −log σ(margin), written xp.logaddexp(0, −margin), which JAX and "
             "torch both have.")


def check_grads(ours, grads):
    """ours: unstacked names ("layers.3.mlp.up_proj.weight") -> array; grads: HF names."""
    assert sorted(convert.hf_name(k) for k in ours) == sorted(grads)
    for k, g in ours.items():
        h = grads[convert.hf_name(k)]
        np.testing.assert_allclose(np.asarray(g), h, rtol=GRAD_RTOL, atol=GRAD_ATOL * np.abs(h).max(), err_msg=k)


def check_metrics(out, value, margin, grads):
    """A step's metrics: the mean loss and margin, the preference accuracy, the gradient's norm before clipping."""
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
    assert float(out["loss"]) == pytest.approx(value, rel=1e-5) and float(out["accuracy"]) == (margin > 0).mean()
    assert float(out["margin"]) == pytest.approx(margin.mean(), rel=1e-5, abs=1e-6)
    assert float(out["grad_norm"]) == pytest.approx(norm, rel=1e-4)


@pytest.mark.parametrize("loss", ["dpo", "dpo_norm"])
def test_jax_dpo_equals_hf(loss, hf):
    """JAX: the step's loss, margin, accuracy and grad norm, and jax.grad of forward + step_loss, equal HF's."""
    m, nets, batch = hf
    value, margin, grads = direct(loss, hf)
    assert 0 < (margin > 0).mean() < 1 and value > 0.1  # both signs among the pairs: accuracy says something
    check_dpo_loss(loss, hf, jnp)
    cfg = config(loss, micro=2)  # 2 micro-batches of 2 pairs
    backend = train.JaxBackend(cfg)
    backend.load(model.unstack_layers(nets["policy"][0], m), None)
    check_metrics(jax.device_get(backend.step(batch, 1e-3)), value, margin, grads)

    tokens, ref = jnp.asarray(batch["tokens"]), dict(ref=jnp.asarray(batch["ref"]))
    labels = jnp.asarray(model.shift_labels(batch["tokens"], m.pad_token_id, batch["mask"]))
    assert (total := train.global_count(cfg, labels)) == P

    def loss(p):  # model.token_logps as the step runs it
        x, terms = model.forward(p, tokens, m, head=False)
        logp, lse = model.token_logps(p, x, labels, m, cfg.train.loss_chunks)
        return train.step_loss(cfg, jnp, logp, lse, labels, terms, ref, total)[0]
    ours = jax.jit(jax.grad(loss))(jax.tree.map(jnp.asarray, nets["policy"][0]))
    check_grads(model.unstack_layers(ours, m), grads)


@pytest.mark.parametrize("loss", ["dpo", "dpo_norm"])
def test_torch_dpo_equals_hf(loss, hf):
    """Torch: torch_model + step_loss(…, torch, …) and its autograd, and TorchBackend.step's metrics, equal HF's."""
    m, nets, batch = hf
    value, margin, grads = direct(loss, hf)
    check_dpo_loss(loss, hf, torch)
    cfg = config(loss, micro=1)  # 4 micro-batches of 1 pair
    net = model.torch_model(m, nets["policy"][0])
    labels = torch.from_numpy(model.shift_labels(batch["tokens"], m.pad_token_id, batch["mask"]).astype(np.int64))
    logits = net(torch.from_numpy(batch["tokens"]).long())
    share, aux = train.step_loss(cfg, torch, *model.label_logps_torch(logits, labels), labels, {},
                                 dict(ref=torch.from_numpy(batch["ref"])), train.global_count(cfg, labels))
    share.backward()
    assert share.item() == pytest.approx(value, rel=1e-5)
    assert aux["margin"].item() == pytest.approx(margin.mean(), rel=1e-5)
    check_grads({k: p.grad.numpy() for k, p in net.named_parameters()}, grads)

    backend = train.TorchBackend(cfg)
    backend.load(model.unstack_layers(nets["policy"][0], m), None)
    check_metrics(backend.step(batch, 1e-3), value, margin, grads)


def test_reference_pass_equals_hf(hf):
    """score (the reference pass) in both backends: each row's summed answer log-prob as HF computes it."""
    m, nets, batch = hf
    cfg = config("dpo")
    for backend in (train.JaxBackend(cfg), train.TorchBackend(cfg)):
        backend.load(model.unstack_layers(nets["reference"][0], m), None)
        got = backend.score(dict(tokens=batch["tokens"], mask=batch["mask"]))
        np.testing.assert_allclose(got, batch["ref"], rtol=1e-5, atol=1e-5, err_msg=type(backend).__name__)


def grad_of(xp):
    """grad(f, x) for f: array -> scalar, in jax or torch; stop-gradient and the array constructor to match."""
    if xp == "jax":
        return lambda f, x: np.asarray(jax.grad(f)(jnp.asarray(x))), jax.lax.stop_gradient, jnp.asarray, jnp

    def grad(f, x):
        x = torch.tensor(x, requires_grad=True)
        f(x).backward()
        return x.grad.numpy()
    return grad, torch.Tensor.detach, torch.from_numpy, torch


@pytest.mark.parametrize("xp", ["jax", "torch"])
def test_grpo_is_reinforce_then_ppo_clip(xp):
    """grpo_loss: old = stop_gradient(new) gives −A·∇log π; old ≠ new clips as PPO (zero gradient past the clip
    in the direction the advantage pushes, the unclipped −ρ·A elsewhere)."""
    grad, stop, X, ops = grad_of(xp)
    rng = np.random.default_rng(0)
    logits, labels = rng.standard_normal((2, 5, 7)).astype(np.float32), rng.integers(0, 7, (2, 5))
    labels[1, 3:] = model.IGNORE_INDEX
    A = np.array([[1.5], [-0.7]], np.float32)
    lps = lambda x: (model.label_logps if xp == "jax" else model.label_logps_torch)(x, X(labels))[0]  # noqa: E731
    got = grad(lambda x: model.grpo_loss(lps(x), stop(lps(x)), X(A), xp=ops).sum(), logits)
    want = grad(lambda x: -(X(A) * lps(x)).sum(), logits)  # REINFORCE
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.abs(want).max() > 0.1 and not want[1, 3:].any()  # ignored targets get no gradient
    # d loss / d log π = −ρ·A, except 0 where the clip binds: ρ > 1.2 with A > 0, ρ < 0.8 with A < 0
    ratio = np.array([[0.5, 0.9, 1.0, 1.1, 1.5]] * 2, np.float32)  # π/π_old per token
    clip = grad(lambda lp: model.grpo_loss(lp, X(-np.log(ratio)), X(A), xp=ops).sum(), np.zeros_like(ratio))
    np.testing.assert_allclose(clip, np.where((A > 0) & (ratio > 1.2) | (A < 0) & (ratio < 0.8), 0.0, -ratio * A),
                               rtol=1e-6, atol=1e-7)
    assert (clip == 0).sum() == 2  # ρ = 1.5 with A > 0, ρ = 0.5 with A < 0
    if xp == "jax":  # and as the step takes it: train.step_loss's grpo, over the batch's completion tokens
        cfg = build(dict(model=MODEL, data=dict(seq_len=5, global_batch=2), train=dict(loss="grpo")))
        rows = dict(advantage=A[:, 0], reward=np.ones(2, np.float32))
        total = train.global_count(cfg, labels)
        step = grad(lambda x: train.step_loss(cfg, jnp, lps(x), jax.nn.logsumexp(x, -1), labels, {}, rows, total)[0],
                    logits)
        np.testing.assert_allclose(step, want / (labels != model.IGNORE_INDEX).sum(), rtol=1e-6, atol=1e-8)


def test_grpo_loss_takes_the_sampling_temperature():
    """Rollouts are drawn from softmax(logits / t) (eval.sample);
    the loss's log-probs are that policy's in both backends,
    as open-instruct's grpo_fast and TRL divide the training logits by the same t.
    At t = 0.7 the JAX step's log-probs equal log_softmax(logits / 0.7) at the drawn tokens,
    and each backend's step has the gradient norm of −A·∇log π for that π, not for t = 1."""
    import eval as evaluate
    G = 8
    cfg = build(dict(model=MODEL, data=dict(seq_len=T, global_batch=G),
                     train=dict(loss="grpo", grpo_temperature=0.7, grpo_group=4, steps=1)))
    m, rng = cfg.model, np.random.default_rng(0)
    params = random_params(m)
    prompts = np.tile(rng.integers(3, m.vocab_size, 6), (G, 1))
    drawn = evaluate.sample(params, m, prompts, 10, 0.7, 0, m.vocab_size, m.eos_token_id)
    tokens, mask = np.full((G, T), m.pad_token_id, np.int32), np.zeros((G, T), bool)
    for r, d in enumerate(drawn):
        tokens[r, :6 + len(d)] = [*prompts[r], *d]
        mask[r, 6:6 + len(d)] = True
    A = rng.standard_normal(G).astype(np.float32)
    batch = dict(tokens=tokens, mask=mask, advantage=A, reward=np.ones(G, np.float32))
    labels = model.shift_labels(tokens, m.pad_token_id, mask)
    valid, n = labels != model.IGNORE_INDEX, int((labels != model.IGNORE_INDEX).sum())

    # The references jitted, t an argument: one compile each serves both temperatures (op by op,
    # the forward and its gradient at two temperatures were 150 small compiles, half the test)
    @jax.jit
    def policy(p, t):  # log π(drawn token) under categorical(logits / t), the sampler's draw
        logits = model.forward(p, jnp.asarray(tokens), m).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits / t, axis=-1)
        index = jnp.asarray(np.maximum(labels, 0))[..., None]
        return jnp.where(valid, jnp.take_along_axis(lp, index, -1)[..., 0], 0)

    # the REINFORCE gradient (GRPO's, with old = new), over the batch's completion tokens
    reinforce = jax.jit(jax.grad(lambda p, t: -(A[:, None] * policy(p, t)).sum() / n))

    def norm_at(t):
        g = reinforce(jax.tree.map(jnp.asarray, params), jnp.float32(t))
        squares = sum((np.asarray(v, np.float64) ** 2).sum() for v in jax.tree.leaves(g))
        return float(np.sqrt(squares))
    want, untempered = norm_at(0.7), norm_at(1.0)
    assert abs(untempered / want - 1) > 0.02  # the temperature matters at these logits
    jb = train.JaxBackend(cfg)
    jb.load(model.unstack_layers(params, m), None)
    logp = jax.jit(lambda p, b: train.token_stats(cfg, jb.mesh, p, b)[0])(params, batch)  # (as the step runs it)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(policy(params, jnp.float32(0.7))),
                               rtol=1e-5, atol=1e-5)
    tb = train.TorchBackend(cfg)
    tb.load(model.unstack_layers(params, m), None)
    for backend in (jb, tb):
        grad_norm = float(jax.device_get(backend.step(batch, 1e-3))["grad_norm"])
        assert grad_norm == pytest.approx(want, rel=1e-4)
