"""Released checkpoints at their size: a bf16 checkpoint is read once, stays bf16, and both backends use those
arrays in place; greedy tokens equal transformers' in fp32 and bf16; a damaged file is one clean line."""
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

import convert
import eval as evaluate
import model
from common import random_params, variant
from configs import run_cli

tf = pytest.importorskip("transformers")


def bf16_checkpoint(d, name="olmo2", **changes):
    m = variant(name, **changes)
    convert.save_hf(d, m, random_params(m, std=0.15), dtype=ml_dtypes.bfloat16)
    return m


def test_bf16_checkpoint_is_held_once_in_bf16(tmp_path):
    m = bf16_checkpoint(tmp_path, d_model=256, mlp_hidden=1024, vocab_size=4096, n_heads=4)
    stored = (tmp_path / "model.safetensors").stat().st_size
    tracemalloc.start()
    m, params = convert.load_hf(tmp_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = sum(a.nbytes for a in params.values())
    assert {a.dtype for a in params.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert held <= stored and peak < 1.05 * stored, (peak, held, stored)  # no float32 copy, no second copy
    on_device = jax.device_put(params)  # a CPU device takes the host arrays as they are
    for k, a in params.items():
        assert on_device[k].dtype == a.dtype and on_device[k].unsafe_buffer_pointer() == a.ctypes.data, k
    # JAX's CPU decode: the bf16 matrices as uint16, each layer in place
    bits = evaluate.cpu_bits(params)
    up = params["layers.mlp.up_proj.weight"]
    assert [b.dtype for b in bits["layers.mlp.up_proj.weight"]] == [np.uint16] * m.n_layers
    assert ([b.unsafe_buffer_pointer() for b in bits["layers.mlp.up_proj.weight"]]
            == [u.ctypes.data for u in up])
    net = model.torch_model(m, params)
    w = net.layers[1].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and w.data_ptr() == params["layers.mlp.up_proj.weight"][1].ctypes.data
    assert convert.load_hf(tmp_path, "float32")[1]["lm_head.weight"].dtype == np.float32  # --dtype float32


# blocks of 32 rows (96's largest power-of-2 divisor), of 512
@pytest.mark.parametrize("out", [96, 1536])
def test_bits_linear_is_the_bf16_linear(out):
    """bf16 weights as their bits, widened block by block:
    the products of the bf16 matmul, fp32 sums."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((out, 64)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = model.linear(jax.numpy.asarray(x), jax.numpy.asarray(w.view(np.uint16)))
    assert got.dtype == np.float32 and got.shape == (2, 3, out)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, dtype", [("olmo3", "float32"), ("olmo2", "bfloat16"), ("olmo3", "bfloat16"),
                                         ("olmoe", "float32"), ("olmo_hybrid", "float32")])
def test_greedy_tokens_equal_transformers(tmp_path, name, dtype):
    """transformers writes the checkpoint (in `dtype`) and generates; both our backends, with their KV caches,
    choose the same 24 tokens from its weights in that dtype. bf16 JAX sums in another order than torch, so
    it need only agree up to a near tie (transformers' top two within 0.03, bf16's step at these logits)."""
    from test_hf import hf_model
    net = hf_model(name).to(getattr(torch, dtype))
    net.save_pretrained(tmp_path)
    prompt = [5, 17, 3, 99, 42]
    with torch.no_grad():
        out = net.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                           pad_token_id=1, output_scores=True, return_dict_in_generate=True)
    want = out.sequences[0, len(prompt):].tolist()
    tie = next((i for i, s in enumerate(out.scores) if -torch.topk(s[0].float(), 2).values.diff() < 0.03), 24)
    m, params = convert.load_hf(tmp_path)
    assert params["embed_tokens.weight"].dtype.name == dtype
    assert evaluate.generate(params, m, prompt, 24, "torch", dtype)[0] == want
    upto = 24 if dtype == "float32" else tie
    assert evaluate.generate(params, m, prompt, 24, "jax", dtype)[0][:upto] == want[:upto]


def test_a_damaged_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    """`eval.py generate` of a truncated checkpoint: one line naming the file, exit 1; run as the script
    runs it (run_cli: anything but that line would be an exception here), in this process."""
    monkeypatch.delenv("NANOLMO_TRACEBACK", raising=False)  # (with it, run_cli raises instead)
    bf16_checkpoint(tmp_path)
    st = tmp_path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-64])
    with pytest.raises(SystemExit) as exited:
        run_cli(evaluate.main, ["generate", str(tmp_path), "--prompt", "hi", "--tokenizer", "dolma2"])
    err = capsys.readouterr().err
    assert exited.value.code != 0 and "Traceback" not in err, err
    assert f"{st}: tensor" in err and "the file is truncated or corrupt" in err
