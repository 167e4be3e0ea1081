"""The PyTorch backend against the JAX one: same steps, checkpoints that cross between them, FSDP2 under
torchrun equal to one process. (torch.compile is left to `tests/bench.py train`: a cold compile takes ~40 s here.)"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

import convert
import data
import model
import train
from common import once_per_session, random_params, variant
from configs import ConfigError, load_config
from test_train import losses

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-5  # per-step loss, relative: measured ≤ 3e-7 between the backends on this config


def test_torch_steps_equal_jax_steps(setup):
    """Same init, same batches, 2 micro-batches per step, skip-step on: every loss and grad norm agrees,
    and so do the weights after 25 AdamW steps."""
    root, toml = setup
    cfg = load_config([str(toml), "--train.micro_batch=4", "--train.skip_step=true", "--train.steps=25"])
    backends = [train.JaxBackend(cfg), train.TorchBackend(cfg)]
    for b in backends:
        b.init(cfg.train.init_seed)
    loader = data.Loader(data.open_instances(cfg.data.path, cfg.data.seq_len, 0), cfg.data.global_batch, 0)
    batches = iter(loader)
    for step in range(1, 26):
        batch = next(batches)[1]
        lr = train.lr_at(step, cfg.train, 256, 25)
        j, t = (jax.device_get(b.step(batch, lr)) for b in backends)  # (JAX returns them on the device)
        assert t["loss"] == pytest.approx(j["loss"], rel=REL) and t["ce"] == pytest.approx(j["ce"], rel=REL), (step, j, t)
        assert t["grad_norm"] == pytest.approx(j["grad_norm"], rel=1e-4) and t["skipped"] == j["skipped"], (step, j, t)
    pj, pt = (b.host_params() for b in backends)
    assert max(float(np.abs(pj[k] - pt[k]).max()) for k in pj) < 1e-4
    heldout = np.stack([loader.inst.read(i) for i in range(8)]).astype(np.int32)
    (nj, cj), (nt, ct) = (b.eval(dict(tokens=heldout)) for b in backends)
    assert cj == ct and nt == pytest.approx(nj, rel=REL)


def test_eval_and_score_in_micro_batches_equal_the_whole_batch(setup, monkeypatch):
    """Held-out eval and DPO's score take train.micro_batch rows at a time, the head in
    train.loss_chunks passes (a rank's whole logits, 1B: 64 x 4,096 x 100,352, ran out of
    memory): both backends equal the whole batch in one pass, and no logits larger than
    micro x ⌈T/chunks⌉ x V are made (torch's as label_logps_torch sees them, JAX's in its
    lowered eval)."""
    root, toml = setup
    # 8 rows: 4 micro-batches; 32 positions: chunks of 11, 11 and 10
    cfg = load_config([str(toml), "--train.micro_batch=2", "--train.loss_chunks=3",
                       "--data.doc_mask=true"])
    m, rng = cfg.model, np.random.default_rng(0)
    params = random_params(m, std=0.1)
    tokens = rng.integers(0, m.vocab_size - 2, (8, 32)).astype(np.int32)
    tokens[::3, 9] = m.eos_token_id  # documents in some rows
    batch = dict(tokens=tokens, mask=rng.random((8, 32)) < 0.8)  # (chat: the answers' tokens)
    labels = model.shift_labels(tokens, m.pad_token_id, batch["mask"])
    with torch.no_grad():  # the whole batch: (8, 32, V) logits at once
        logits = model.torch_model(m, params)(torch.from_numpy(tokens).long(),
                                              segments=torch.from_numpy(model.segment_ids(
                                                  tokens, m.eos_token_id)).long())
    want = model.label_logps_torch(logits, torch.from_numpy(labels).long())[0].double().numpy()
    seen = []
    label_logps = model.label_logps_torch
    monkeypatch.setattr(model, "label_logps_torch", lambda x, *a: seen.append(x.shape) or
                        label_logps(x, *a))
    backends = train.TorchBackend(cfg), train.JaxBackend(cfg)
    for backend in backends:
        backend.load(model.unstack_layers(params, m), None)
        nats, count = backend.eval(batch)
        assert count == (labels != model.IGNORE_INDEX).sum()
        assert nats == pytest.approx(-want.sum(), rel=1e-6), type(backend).__name__
        np.testing.assert_allclose(backend.score(batch), want.sum(-1), rtol=1e-5, atol=1e-5)
    assert max(seen, key=np.prod) == (2, 11, m.vocab_size)
    jb = backends[1]
    text = jb.eval_step.lower(jb.params, jb._lay_out(batch, 4)).as_text()
    logit_shapes = re.findall(rf"tensor<((?:\d+x)+){m.vocab_size}x(?:f32|bf16)>", text)
    assert max(np.prod([int(d) for d in s[:-1].split("x")]) for s in logit_shapes) == 2 * 11


def test_a_masked_instance_trains_nothing(setup, tmp_path):
    """data.instance_filter in both backends: instance 0 made one token 32 times is masked;
    what its tokens are then changes nothing in the step (loss, grad norm, weights),
    while unmasked it would. The loss divides by OLMo-core's count: every unmasked target plus T
    for each masked instance (olmo_core/train/train_module/transformer/train_module.py,
    train_batch: batch_num_tokens_for_loss += (~instance_mask).sum() * labels.shape[1])."""
    root, toml = setup
    cfg = load_config([str(toml)])
    src = data.dataset_files(cfg.data.path)[0]
    batches = []
    for fill, check in ((9, data.INSTANCE_FILTER), (11, data.INSTANCE_FILTER), (11, None)):
        arr = src.array().copy()
        arr[:cfg.data.seq_len] = fill
        arr.tofile(tmp_path / f"{fill}.bin")
        part = data.open_token_file(tmp_path / f"{fill}.bin", src.dtype)
        inst = data.Instances([("a", [part], None)], 32)
        loader = data.Loader(inst, cfg.data.global_batch, 0, instance_filter=check)
        step = next(s for s in range(loader.batches_per_epoch) if 0 in loader.global_ids(s))
        batch = loader.batch(step)
        assert batch.pop("masked", 0) == (check is not None)
        batches.append(dict(batch, mask=batch.get("mask", np.ones(batch["tokens"].shape, bool))))
    first = batches[0]
    assert first["filtered"].sum() == 1 and first["tokens"].shape[1] == cfg.data.seq_len
    labels = model.shift_labels(first["tokens"], cfg.model.pad_token_id, first["mask"])
    olmo_core = (labels != model.IGNORE_INDEX).sum() + 1 * cfg.data.seq_len
    # each backend's starting weights' log p(label), jitted: one compile serves both backends
    # (op by op, the forward was a few seconds of each)
    reference = jax.jit(lambda p: model.label_logps(
        model.forward(p, jax.numpy.asarray(first["tokens"]), cfg.model), jax.numpy.asarray(labels))[0])
    for backend in (train.JaxBackend, train.TorchBackend):
        outs = []
        for batch in batches:
            b = backend(cfg)
            b.init(cfg.train.init_seed)
            start = {k: np.array(v) for k, v in b.host_params().items()}  # (torch's: live memory)
            outs.append((jax.device_get(b.step(dict(batch), 1e-3)), b.host_params()))
        logp = np.asarray(reference(start))
        assert outs[0][0]["ce"] == pytest.approx(-logp.sum() / olmo_core, rel=1e-5), backend
        (a, pa), (b, pb), (c, pc) = outs
        assert (a["loss"] == pytest.approx(b["loss"], rel=1e-6)
                and a["grad_norm"] == pytest.approx(b["grad_norm"]))
        assert max(float(np.abs(pa[k] - pb[k]).max()) for k in pa) < 1e-7, backend
        # the same instance, unmasked, does train: another loss, and an update 1e-3 (the lr) wide
        assert c["loss"] != pytest.approx(a["loss"], rel=1e-5), backend
        assert max(float(np.abs(pa[k] - pc[k]).max()) for k in pa) > 1e-4, backend


def test_torch_remat_and_windows():
    """Activation checkpointing changes memory, not gradients; sliding-window layers (SDPA with a band
    mask) equal the JAX forward past the window."""
    m = variant("olmo3")
    params = random_params(m, seed=1)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, m.vocab_size, (2, 48)))
    grads = {}
    for remat in ("none", "block", "mlp", "dots"):
        net = model.torch_model(m, params)
        logits = net(tokens, remat=remat)
        logits.square().mean().backward()
        grads[remat] = {n: p.grad.clone() for n, p in net.named_parameters()}
    for remat in ("block", "mlp", "dots"):
        assert all(torch.allclose(grads[remat][n], grads["none"][n], rtol=1e-5, atol=1e-7) for n in grads["none"])
    import jax.numpy as jnp
    want = np.asarray(model.forward({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(tokens.numpy()), m))
    assert np.abs(want - logits.detach().numpy()).max() < 1e-4


def test_remat_dots_reruns_no_matmul_in_either_backend():
    """remat="dots" keeps the projections' outputs: the backward reruns no matmul (block reruns
    them all), counted in torch's dispatched ops and in JAX's differentiated program."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            self.n += op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return op(*args, **(kwargs or {}))
    m = variant("olmo2")
    params = random_params(m, seed=1)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, m.vocab_size, (2, 16)))
    backward = {}
    for remat in ("none", "block", "dots"):
        loss = model.torch_model(m, params)(tokens, remat=remat).square().mean()
        with CountMatmuls() as count:
            loss.backward()
        backward[remat] = count.n
    assert backward["dots"] == backward["none"] < backward["block"], backward
    import jax
    import jax.numpy as jnp
    p, t = {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(tokens.numpy())
    # (batch dims, unbatched): the projections are unbatched dots, attention's have batch dims
    batching = r"dot_general\[\s*dimension_numbers=\(\(\[[^\]]*\], \[[^\]]*\]\), \((\[[^\]]*\])"
    for dtype in (jnp.float32, jnp.bfloat16):  # (bf16's linear is a custom_vjp)
        dots = {}
        for remat in ("none", "block", "dots"):
            loss = lambda p, r=remat: model.forward(p, t, m, dtype, remat=r).astype(jnp.float32).sum()  # noqa: E731
            dims = re.findall(batching, str(jax.make_jaxpr(jax.grad(loss))(p)))
            dots[remat] = (sum(d != "[]" for d in dims), dims.count("[]"))
        # dots reruns attention's batched dots, no projection; block reruns the projections too
        assert dots["dots"][1] == dots["none"][1] < dots["block"][1], (dtype, dots)
        assert dots["none"][0] < dots["dots"][0] == dots["block"][0], (dtype, dots)


def run_together(*runs):
    """Several train.py runs at once (their imports and start-up overlap): each (run_dir, args) or a full command."""
    procs = []
    for r in runs:
        cmd = r if isinstance(r[0], str) else [sys.executable, "train.py", str(r[2]), f"--train.run_dir={r[0]}", *r[1]]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    return [out for out, _ in outs]


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    """12 steps in each backend, checkpointed at 6 and 12 (run once for both test workers:
    once_per_session)."""
    root, toml = setup
    args = ["--train.steps=12", "--train.checkpoint_every=6", "--train.keep=2"]

    def both(out):
        run_together(*[(out / b, [*args, f"--train.backend={b}"], toml) for b in ("jax", "torch")])
    return once_per_session(tmp_path_factory, "backends", both)


def cut(run_dir, to, step):
    """A copy of run_dir as if it had stopped after `step` (its checkpoint step_<step> the latest)."""
    shutil.copytree(run_dir, to)
    for d in to.glob("step_*"):
        if d.name != f"step_{step}":
            shutil.rmtree(d)
    (to / "latest").write_text(f"step_{step}\n")
    return to


def test_a_run_changes_backend_mid_way(setup, straight, tmp_path):
    """JAX for 6 steps, then torch to 12, equals torch all the way (and the reverse); `plot` says so too."""
    root, toml = setup
    pairs = (("jax", "torch"), ("torch", "jax"))
    dirs = [cut(straight / first, tmp_path / f"{first}-{then}", 6) for first, then in pairs]
    outs = run_together(*[(d, ["--train.steps=12", f"--train.backend={then}"], toml) for d, (_, then) in zip(dirs, pairs)])
    for (first, then), d, out in zip(pairs, dirs, outs):
        assert f"resuming {d}/step_6 at step 6 (written by the {first} backend)" in out
        a, b = losses(straight / then), losses(d)
        assert a.keys() == b.keys() == set(range(1, 13))
        assert all(b[s] == pytest.approx(a[s], rel=REL) for s in a), (first, then, a, b)
        (diff,) = train.evaluate.plot([straight / then, d], tmp_path / "both.png")
        assert diff["steps"] == 12 and diff["rel"] < REL
    x, y = (convert.read_safetensors(straight / b / "step_12" / "model.safetensors")[0] for b in ("jax", "torch"))
    assert max(float(np.abs(x[k] - y[k]).max()) for k in x) < 1e-4


def test_torchrun_fsdp2_equals_one_process(setup, straight, tmp_path):
    """2 processes (gloo, FSDP2 over fsdp=2, 2 micro-batches each) for 6 steps equal one process; the
    checkpoint they wrote together resumes in one torch process and in JAX; and 2 processes resume a
    JAX checkpoint (each rank reads its rows of the weights and moments) as one process does."""
    root, toml = setup
    d, cont = tmp_path / "two", cut(straight / "jax", tmp_path / "two-from-jax", 6)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", str(toml),
                "--train.backend=torch", "--mesh.data=1", "--mesh.fsdp=2", "--train.micro_batch=2"]
    (out,) = run_together(torchrun + [f"--train.run_dir={d}", "--train.steps=6", "--train.t_max=12"])
    assert "2 process(es), mesh data=1 x fsdp=2 (FSDP2) on cpu" in out
    run_together(torchrun + [f"--train.run_dir={cont}", "--train.steps=12"])
    one = losses(straight / "torch")
    assert all(losses(cont)[s] == pytest.approx(one[s], rel=REL) for s in range(7, 13))
    one = losses(straight / "torch")
    assert all(losses(d)[s] == pytest.approx(one[s], rel=REL) for s in range(1, 7))
    # each rank wrote its own file: model.process0-of-2.safetensors, model.process1-of-2...
    written = convert.open_hf(d / "step_6")[1]
    ref = convert.open_hf(straight / "torch" / "step_6")[1]
    assert written.keys() == ref.keys() and max(float(np.abs(np.asarray(written[k]) - ref[k]).max()) for k in ref) < 1e-5
    moments = convert.read_weights(d / "step_6", ["optimizer.process*-of-*.safetensors"])
    assert int(np.asarray(moments["step"])) == 6
    assert not any(np.all(np.asarray(moments[k]) == 0) for k in moments if k.startswith("exp_avg_sq."))
    thens = ("torch", "jax")
    resumed = [cut(d, tmp_path / f"two-{then}", 6) for then in thens]
    run_together(*[(r, ["--train.steps=12", f"--train.backend={then}"], toml) for r, then in zip(resumed, thens)])
    for then, r in zip(thens, resumed):
        a, b = losses(straight / then), losses(r)
        assert all(b[s] == pytest.approx(a[s], rel=REL) for s in range(7, 13)), (then, a, b)


def test_fsdp2_bf16_saves_no_weight_copies():
    """bf16 compute under FSDP2 (2 gloo processes): without a mixed precision policy, each Linear's
    .to(bf16) is a copy autograd keeps until the backward, every block weight in bf16 on every rank;
    with OLMo-core's policy (bf16 gathers, fp32 reductions) nothing of that stays. The loss and the
    gradients still match one process within bf16's own error (2% of the largest, against fp32)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/fsdp_saved.py"]
    out = json.loads(run_together(cmd)[0].splitlines()[-1])
    assert out["no_policy"]["saved_bytes"] == [out["bf16_block_matrices"]] * 2  # 147,456 bytes here
    assert out["policy"]["saved_bytes"] == [0, 0]
    assert out["no_policy"]["loss_rel"] < 1e-6 and out["no_policy"]["grad_rel"] < 1e-6
    # Measured 1.6e-5 and 0.025: the norm weights are rounded to bf16 now, as in OLMo-core.
    assert out["policy"]["loss_rel"] < 1e-3 and out["policy"]["grad_rel"] < 0.05


def test_torch_bad_config(setup):
    root, toml = setup
    with pytest.raises(ValueError, match=r"mesh.tensor=2: the torch backend shards with FSDP2 only"):
        train.TorchBackend(load_config([str(toml), "--train.backend=torch", "--mesh.tensor=2"]))
    with pytest.raises(ConfigError, match=r"train.backend='pytorch': must be one of \['jax', 'torch'\]"):
        load_config([str(toml), "--train.backend=pytorch"])
