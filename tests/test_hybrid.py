"""OLMo Hybrid's gated delta rule (model.delta_rule_recurrent, delta_rule_chunked) against
transformers' torch references (olmo_hybrid's torch_recurrent_gated_delta_rule and
torch_chunk_gated_delta_rule), and the two forms against each other, gradients included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import model

hybrid = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")


def inputs(B=2, T=150, K=2, N=4, Hk=16, Hv=24, seed=0, negative=True):
    """q, k L2-normalised (B, T, K, Hk); v (B, T, N, Hv); g <= 0 and beta (B, T, N), beta in (0, 2)
    where negative eigenvalues are allowed (OLMo Hybrid doubles the sigmoid), else (0, 1); an
    initial state (B, N, Hk, Hv). T = 150: two whole chunks of 64 and a padded one."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)
    q, k = unit(rng.standard_normal((B, T, K, Hk))), unit(rng.standard_normal((B, T, K, Hk)))
    v = rng.standard_normal((B, T, N, Hv)).astype(np.float32)
    g = (-0.3 * np.exp(0.5 * rng.standard_normal((B, T, N)))).astype(np.float32)
    beta = ((2 if negative else 1) / (1 + np.exp(-rng.standard_normal((B, T, N))))).astype(np.float32)
    state = (0.1 * rng.standard_normal((B, N, Hk, Hv))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("negative", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
def test_both_forms_equal_transformers(negative, grouped):
    q, k, v, g, beta, state = inputs(K=2 if grouped else 4, negative=negative)
    ref, ref_state = hybrid.torch_recurrent_gated_delta_rule(
        *map(torch.from_numpy, (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
        output_final_state=True)
    scale = np.abs(ref.numpy()).max()
    for form in (model.delta_rule_recurrent, model.delta_rule_chunked):
        o, s = form(*map(jnp.asarray, (q, k, v, g, beta)), state=jnp.asarray(state))
        np.testing.assert_allclose(np.asarray(o), ref.numpy(), rtol=0, atol=1e-5 * scale,
                                   err_msg=form.__name__)
        np.testing.assert_allclose(np.asarray(s), ref_state.numpy(), rtol=0, atol=1e-5,
                                   err_msg=form.__name__)
    # transformers' own chunked form agrees with its recurrent one to the same rounding
    chunked, _ = hybrid.torch_chunk_gated_delta_rule(*map(torch.from_numpy, (q, k, v, g, beta)),
                                                     initial_state=torch.from_numpy(state))
    np.testing.assert_allclose(chunked.numpy(), ref.numpy(), rtol=0, atol=1e-5 * scale)


def test_chunked_gradients_equal_the_recurrent_forms():
    """The chunked form, which training uses, has the recurrent form's gradients (every input,
    the initial state too), and no chunk size changes the output."""
    args = [jnp.asarray(a) for a in inputs(T=70)]
    r = jnp.asarray(np.random.default_rng(1).standard_normal((2, 70, 4, 24)), jnp.float32)

    def loss(form, *a):
        o, s = form(*a[:5], state=a[5])
        return (o * r).sum() + s.sum()
    want = jax.grad(lambda *a: loss(model.delta_rule_recurrent, *a), range(6))(*args)
    got = jax.grad(lambda *a: loss(model.delta_rule_chunked, *a), range(6))(*args)
    for name, a, b in zip("q k v g beta state".split(), want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5, err_msg=name)
    o64 = model.delta_rule_chunked(*args[:5], state=args[5])[0]
    o16 = model.delta_rule_chunked(*args[:5], chunk=16, state=args[5])[0]
    np.testing.assert_allclose(np.asarray(o16), np.asarray(o64), rtol=0, atol=1e-5)
