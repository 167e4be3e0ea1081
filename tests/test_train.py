"""train.py: AdamW and the schedules against references, exact resume, accumulation, devices, bad input."""
import contextlib
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import convert
import model
import shard
import train
from common import once_per_session
from configs import ConfigError, build, load_config, run_cli
from teach import fail

ROOT = Path(__file__).resolve().parents[1]

def run(toml, run_dir, *extra, env=None, check=True):
    cmd = [sys.executable, "train.py", str(toml), f"--train.run_dir={run_dir}", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if check and r.returncode:
        raise AssertionError(r.stdout[-3000:] + r.stderr[-3000:])
    return r


def run_here(toml, run_dir, *extra):
    """run, in this process: train.py's main as `python train.py` calls it (run_cli(train.cli)),
    for a run that needs no process of its own (1 device, no signal from outside). The same
    program on the same device, without the seconds a fresh interpreter takes to import jax and
    torch and to load the compiled step. Its stdout, as run's result has it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_cli(train.cli, [str(toml), f"--train.run_dir={run_dir}", *extra])
    return SimpleNamespace(stdout=out.getvalue())


def devices(n):
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


def final_params(run_dir, step):  # our names -> numpy, from one file or every process's pieces
    return {k: np.asarray(v) for k, v in convert.open_hf(Path(run_dir) / f"step_{step}")[1].items()}


# --- AdamW and schedules ---

def test_adamw_equals_torch():
    rng = np.random.default_rng(0)
    shapes = {"embed_tokens.weight": (5, 3), "layers.mlp.up_proj.weight": (2, 4, 3), "norm.weight": (3,)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    decay = {"embed_tokens.weight": False, "layers.mlp.up_proj.weight": True, "norm.weight": True}
    tc = build({"train": dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)}).train
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    opt_t = torch.optim.AdamW([{"params": [tp[k] for k in tp if decay[k]], "weight_decay": 0.1},
                               {"params": [tp[k] for k in tp if not decay[k]], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    p, opt = {k: jnp.asarray(v) for k, v in params.items()}, train.new_optimizer(params)
    for step in range(6):
        lr = [1e-2, 5e-3, 2e-2, 1e-3, 1e-2, 7e-3][step]
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        for g in opt_t.param_groups:
            g["lr"] = lr
        for k in tp:
            tp[k].grad = torch.from_numpy(grads[k])
        opt_t.step()
        p, opt = train.adamw(p, {k: jnp.asarray(v) for k, v in grads.items()}, opt, lr, tc, decay)
        off = {k: np.abs(np.asarray(p[k]) - tp[k].detach().numpy()) for k in tp}
        wrong = [k for k in tp if (off[k] > 1e-7 + 2e-6 * np.abs(tp[k].detach().numpy())).any()]
        if wrong:
            fail(f"train.adamw, step {step + 1} (lr {lr:g}): {', '.join(wrong)} "
                 f"{'differs' if len(wrong) == 1 else 'differ'} from "
                 f"torch.optim.AdamW's, by up to "
                 + ", ".join(f"{off[k].max():.3g}" for k in wrong)
                 + (" (earlier steps matched)" if step else ""),
                 adamw_hint(step, wrong, decay))


def adamw_hint(step, wrong, decay):
    """The usual mistake behind which parameters differ, at which step."""
    decayed, kept = {k for k in decay if decay[k]}, {k for k in decay if not decay[k]}
    if set(wrong) == kept:
        return (f"Only {', '.join(sorted(kept))} differs, the parameter with decay False: it takes "
                "no weight decay (OLMo-core's override for the embedding).")
    if set(wrong) == decayed:
        return ("Only the decayed parameters differ: decoupled weight decay, p ← p · (1 − lr · "
                "weight_decay), on the parameter before the Adam step, not added to the gradient.")
    if step == 0:
        return ("Every parameter differs at the first step: the Adam step itself. m ← β1·m + (1 − "
                "β1)·g; v ← β2·v + (1 − β2)·g²; p ← p − lr · (m / (1 − β1^t)) / (sqrt(v) / "
                "sqrt(1 − β2^t) + eps), t = 1 at the first step, eps outside the root.")
    return (f"Every parameter matched until step {step + 1}: what changes from step to step is t "
            "(opt['count'] + 1, in both bias corrections), the moments carried in the returned "
            "state, and the learning rate passed in.")


def tcfg(**kw):
    return build({"train": kw}).train


WARMUP = ("linear from warmup_min_lr to lr over `warmup` steps, steps counted from 1 (OLMo-core's "
          "global_step)")
COSINE = "cosine from lr down to alpha_f·lr over the t_max − warmup steps after the warmup"
LINEAR = "linear from lr to alpha_f·lr over the t_max − warmup steps after the warmup"
HALF = ("half_cosine is the second half of a cosine twice as long: c = t − W + (T − W) over "
        "2(T − W), so it starts at the midpoint, 1.65e-4")


def test_schedules_match_the_reference_numbers():
    wrong = []

    def expect_lr(what, args, want, hint, rel=1e-12):
        got = train.lr_at(*args)
        if got != pytest.approx(want, rel=rel):
            wrong.append(f"  {what}: lr_at(step {args[0]:,}) = {got:.10g}, want {want:.10g}: "
                         f"{hint}")
    # OLMo 3 7B stage 1 part 1: lr 3e-4, warmup 2000, cosine to 0.1·lr over t_max = 1,192,093 steps.
    part1 = tcfg(lr=3e-4, warmup=2000, t_max=1_192_093, schedule="cosine", alpha_f=0.1)
    hand = 3e-5 + (3e-4 - 3e-5) * (1 + math.cos(math.pi * (597_046 - 2000) / (1_192_093 - 2000))) / 2
    assert hand == pytest.approx(1.65e-4, rel=1e-5)  # the reference's "≈ 1.6500e-4"
    expect_lr("OLMo 3 part 1, mid-cosine", (597_046, part1, 1, 0), hand, COSINE)
    expect_lr("OLMo 3 part 1, half-way up the warmup from 0", (1000, part1, 1, 0), 1.5e-4, WARMUP,
              1e-9)
    expect_lr("OLMo 3 part 1, at t_max", (1_192_093, part1, 1, 0), 3e-5,
              "from t_max on, alpha_f·lr", 1e-9)
    # Part 2: HalfCosWithWarmup(warmup=597,046) over 1,668,931 steps continues at the midpoint and ends
    # stage 1 (step 1,413,814) at ~3.93e-5 (reference/olmo-facts.md §5.3).
    part2 = tcfg(lr=3e-4, warmup=597_046, t_max=1_668_931, schedule="half_cosine", alpha_f=0.1)
    W, T = 597_046, 1_668_931
    hand = lambda s: 3e-5 + 2.7e-4 * (1 + math.cos(math.pi * (s - W + (T - W)) / (2 * (T - W)))) / 2  # noqa: E731
    assert hand(W) == pytest.approx(1.65e-4) and hand(1_413_814) == pytest.approx(3.93e-5, rel=2e-3)
    expect_lr("OLMo 3 part 2, its start", (W, part2, 1, 0), hand(W), HALF)
    # Its warmup climbs to that midpoint, max_lr = eta_min + (lr - eta_min) / 2 (OLMo-core
    # optim/scheduler.py, HalfCosWithWarmup.get_lr), not to lr: with lr 1e-2, alpha_f 0.1 and
    # warmup 10, step 1 is 0.1 x 5.5e-3 (lr 1e-2 would give 1e-3).
    short = tcfg(lr=1e-2, warmup=10, t_max=100, schedule="half_cosine", alpha_f=0.1)
    expect_lr("half_cosine's warmup, step 1", (1, short, 1, 0), 5.5e-4,
              "warms up to eta_min + (lr - eta_min) / 2", 1e-9)
    expect_lr("half_cosine's warmup, half way", (W // 2, part2, 1, 0), 1.65e-4 / 2,
              "warms up to eta_min + (lr - eta_min) / 2", 1e-3)
    expect_lr("OLMo 3 part 2, stage 1's end", (1_413_814, part2, 1, 0), hand(1_413_814), HALF)
    # OLMo 2 1B, counted in tokens: warmup 8,388,608,000 tokens, cosine to 0.1 over 5e12; at the stage-1
    # end (step 1,907,359 of 512 x 4096 tokens) the LR was the stage-2 starting LR 7.4487e-5.
    olmo2 = tcfg(lr=4e-4, units="tokens", warmup=8_388_608_000, t_max=5_000_000_000_000, alpha_f=0.1)
    expect_lr("OLMo 2 1B at stage 1's end, in tokens", (1_907_359, olmo2, 512 * 4096, 0), 7.4487e-5,
              "units = tokens: t = step · tokens_per_step; warmup and t_max count tokens", 1e-4)
    # OLMo 1 (Feb 2024): warmup from 0.1·lr; linear decay (7B) to 0.1·lr.
    olmo1 = tcfg(lr=3e-4, warmup=5000, warmup_min_lr=3e-5, schedule="linear", t_max=476_837, alpha_f=0.1)
    expect_lr("OLMo 1, half-way up a warmup from 0.1·lr", (2500, olmo1, 1, 0),
              3e-4 * (0.1 + 0.9 * 0.5), WARMUP, 1e-9)
    mid = 5000 + (476_837 - 5000) / 2
    expect_lr("OLMo 1, half-way down the linear decay", (mid, olmo1, 1, 0), 3e-4 - 2.7e-4 / 2,
              LINEAR, 1e-9)
    # OLMo 2 stage 2: linear from lr to 0 without warmup; constant holds after warmup.
    anneal = tcfg(lr=6.1499e-5, warmup=0, schedule="linear", alpha_f=0.0)
    expect_lr("OLMo 2 stage 2, half-way (no warmup, no t_max)", (11931 // 2, anneal, 1, 11931),
              6.1499e-5 * (1 - (11931 // 2) / 11931),
              "without t_max the run's own length (total_steps) is T", 1e-9)
    constant = tcfg(lr=1e-3, warmup=10, schedule="constant")
    expect_lr("constant after the warmup", (50, constant, 1, 100), 1e-3,
              "constant holds lr after the warmup", 0)
    if wrong:
        shifted = train.lr_at(1001, part1, 1, 0) == pytest.approx(1.5e-4, rel=1e-9)
        fail("train.lr_at differs from OLMo-core's schedules (reference/olmo-facts.md §5.3):",
             *wrong, "Your lr_at(s) is OLMo-core's LR at step s − 1 (lr_at(1001) is half-way up a "
             "2000-step warmup): OLMo-core's global_step is 1 at the first batch, and t = step."
             if shifted else "")


# --- the step: accumulation ---

def small_cfg(setup, *extra):
    return load_config([str(setup[1]), *extra])


def test_accumulation_equals_one_batch(setup):
    results = []
    for micro in (0, 4, 2):
        cfg = small_cfg(setup, f"--train.micro_batch={micro}")
        mesh = shard.make_mesh(cfg.mesh)
        step = train.make_train_step(cfg, mesh)
        params = model.init_params(cfg.model, jax.random.PRNGKey(0))
        tokens = np.random.default_rng(1).integers(0, 382, (8, 32)).astype(np.int32)
        A = 8 // (micro or 8)
        batch = dict(tokens=tokens.reshape(A, 8 // A, 32))
        p, _, _, out = step(params, train.new_optimizer(params), train.new_history(), batch, jnp.float32(1e-3))
        results.append((float(out["loss"]), float(out["grad_norm"]), jax.device_get(p)))
    for loss, gnorm, p in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-6) and gnorm == pytest.approx(results[0][1], rel=1e-5)
        for k in p:
            np.testing.assert_allclose(p[k], results[0][2][k], rtol=0, atol=1e-6, err_msg=k)


def olmo_core_wsd(lr, current, t_max, warmup, decay, warmup_min_lr=0.0, decay_min_lr=0.0):
    """OLMo-core optim/scheduler.py, WSD.get_lr (with _linear_warmup and _linear_decay)."""
    if current <= warmup:
        return warmup_min_lr + (lr - warmup_min_lr) * min(current, warmup) / warmup
    if current >= t_max - decay:
        return decay_min_lr + (lr - decay_min_lr) * min(t_max - current, decay) / decay
    return lr


def olmo_core_wsds(lr, current, periods, multipliers, warmup, decay_fraction, decay_min_lr):
    """OLMo-core optim/scheduler.py, WSDS.get_lr and its __post_init__'s adjusted periods."""
    adjusted = [periods[0] - warmup] + periods[1:]
    ends = np.cumsum(adjusted).tolist()
    if current < warmup:
        return lr * multipliers[0] * min(current, warmup) / warmup
    x = current - warmup
    if x >= ends[-1]:
        return decay_min_lr
    i = next((k for k, end in enumerate(ends) if x <= end), len(ends) - 1)
    start, L = (0 if i == 0 else ends[i - 1]), adjusted[i]
    pos = min(max(x - start, 0), L)
    D = int(round(decay_fraction * periods[i]))
    peak = lr * multipliers[i]
    if pos < L - D:
        return peak
    return decay_min_lr + (peak - decay_min_lr) * min(D - (pos - (L - D)), D) / D


def test_wsd_and_wsds_are_olmo_cores():
    """Every step of a WSD and a WSDS schedule against transcriptions of OLMo-core's classes;
    OLMo-core's decay_min_lr is alpha_f·lr here."""
    wsd = tcfg(lr=1e-3, schedule="wsd", warmup=20, t_max=200, decay=50, alpha_f=0.1)
    for step in range(1, 201):
        want = olmo_core_wsd(1e-3, step, 200, 20, 50, decay_min_lr=1e-4)
        assert train.lr_at(step, wsd, 1, 200) == pytest.approx(want, rel=1e-12), step
    by_fraction = tcfg(lr=1e-3, schedule="wsd", warmup=0, t_max=1000, alpha_f=0.0)
    assert train.lr_at(899, by_fraction, 1, 1000) == 1e-3  # decay_fraction 0.1: the last 100
    assert train.lr_at(950, by_fraction, 1, 1000) == pytest.approx(5e-4)
    periods, mult = [300, 200, 100], [1.0, 0.5, 0.25]
    wsds = tcfg(lr=2e-3, schedule="wsds", warmup=30, periods=periods, period_lr_multipliers=mult,
                decay_fraction=0.2, alpha_f=0.0)
    for step in range(1, 620):
        want = olmo_core_wsds(2e-3, step, periods, mult, 30, 0.2, 0.0)
        assert train.lr_at(step, wsds, 1, 600) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    with pytest.raises(ConfigError, match="periods=.*a wsds schedule needs them"):
        tcfg(schedule="wsds")
    with pytest.raises(ConfigError, match="period 0 .300. is shorter than its warmup"):
        tcfg(schedule="wsds", periods=[300], warmup=250, decay_fraction=0.2)
    with pytest.raises(ConfigError, match="period 0 .100. is shorter than its warmup"):
        tcfg(schedule="wsds", periods=[100], warmup=50, decay=60)  # (a decay in steps too)


def test_skip_step_skips_outliers(setup):
    cfg = small_cfg(setup, "--train.skip_step=true", "--train.z_loss=1e-2")  # (loss = ce + z)
    step = train.make_train_step(cfg, shard.make_mesh(cfg.mesh))
    params = model.init_params(cfg.model, jax.random.PRNGKey(0))
    def history(n):  # a fresh one each call: the step donates its inputs
        return dict(loss=jnp.full(128, 1.0).at[::2].set(1.1), grad_norm=jnp.full(128, 1.0), n=jnp.asarray(n, jnp.int32))

    tokens = np.random.default_rng(1).integers(0, 382, (1, 8, 32)).astype(np.int32)
    p, _, h, out = step(jax.tree.map(jnp.copy, params), train.new_optimizer(params), history(64), dict(tokens=tokens), jnp.float32(1e-3))
    assert bool(out["skipped"])  # loss ≈ 6 is far above a history of 1.0-1.1
    assert all(np.array_equal(np.asarray(p[k]), np.asarray(params[k])) for k in params)
    assert int(h["n"]) == 65
    # 63 before it: this step is the window's 64th value, and OLMo-core's SkipStepAdamW may skip
    # it (get_step_factor counts the step's own loss); 62 before it: never.
    _, _, _, out = step(jax.tree.map(jnp.copy, params), train.new_optimizer(params), history(63), dict(tokens=tokens), jnp.float32(1e-3))
    assert bool(out["skipped"])
    _, _, h, out = step(jax.tree.map(jnp.copy, params), train.new_optimizer(params), history(62), dict(tokens=tokens), jnp.float32(1e-3))
    assert not bool(out["skipped"])
    # The history keeps the cross-entropy without z-loss (OLMo-core: optim.latest_loss = ce_batch_loss)
    assert float(h["loss"][62]) == pytest.approx(float(out["ce"])) and float(out["ce"]) != float(out["loss"])


# --- whole runs ---

def test_exact_resume_after_sigterm(setup, tmp_path):
    """A train.py process SIGTERMed mid-run saves and exits 143; the rerun resumes there and ends
    bit for bit where an uninterrupted run does. The signal goes to a process of its own; the
    uninterrupted run and the resume run in this one (run_here)."""
    root, toml = setup
    straight = tmp_path / "straight"
    run_here(toml, straight, "--train.steps=60")
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "train.py", str(toml), f"--train.run_dir={cut}", "--train.steps=60"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = cut / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate()[0]
    assert proc.returncode == 128 + signal.SIGTERM and "SIGTERM: saved" in out, out[-2000:]
    stopped = convert.step_number(cut / (cut / "latest").read_text().strip())
    assert 4 <= stopped < 60
    r = run_here(toml, cut, "--train.steps=60")
    assert f"resuming {cut}/step_{stopped} at step {stopped}" in r.stdout
    assert losses(cut) == losses(straight)  # every step, bit for bit
    a, b = final_params(straight, 60), final_params(cut, 60)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # The checkpoint is a Hugging Face model directory.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(straight / "step_60")
    assert type(hf).__name__ == "Olmo3ForCausalLM"


def test_sigkill_during_checkpoints_leaves_a_resumable_run(setup, tmp_path):
    """A train.py process SIGKILLed while it checkpoints every step leaves a latest checkpoint that
    resumes, past a half-written .tmp folder, keeping train.keep of them. The kill needs a process
    of its own; the resume runs in this one (run_here)."""
    root, toml = setup
    d = tmp_path / "run"
    args = [sys.executable, "train.py", str(toml), f"--train.run_dir={d}", "--train.steps=400",
            "--train.checkpoint_every=1", "--train.keep=3"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (d / "step_6").exists() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.37)  # somewhere in the save-every-step loop
    proc.kill()
    proc.wait()
    latest = convert.latest_checkpoint(d)
    assert latest is not None and (latest / "optimizer.safetensors").is_file()
    # A crash inside a write leaves a .tmp folder; simulate one that died half-way, then resume.
    (d / "step_999.tmp").mkdir(exist_ok=True)
    (d / "step_999.tmp" / "model.safetensors").write_bytes(b"\0" * 10)
    step = convert.step_number(latest)
    r = run_here(toml, d, f"--train.steps={step + 2}", "--train.checkpoint_every=1", "--train.keep=3")
    assert f"at step {step}" in r.stdout and (d / f"step_{step + 2}").is_dir()
    assert len(list(d.glob("step_*[0-9]"))) == 3


def test_batch_that_does_not_divide_the_devices(setup, tmp_path):
    # (Training on 8 devices against 1 is in test_shard.py, in process; across processes below.)
    root, toml = setup
    r = run(toml, tmp_path / "bad", "--train.steps=4", "--data.global_batch=12", env=devices(8), check=False)
    assert r.returncode != 0 and "data.global_batch=12 does not divide over the 8 data-parallel ranks" in r.stderr


def test_stage_from_a_checkpoint(setup, tmp_path):
    """train.init_from starts a new stage from exactly a checkpoint's weights (lr 0: nothing moves),
    its steps counted from 1 again and AdamW's own count continued. Both runs in this process
    (run_here)."""
    root, toml = setup
    first = tmp_path / "first"
    run_here(toml, first, "--train.steps=3")
    r = run_here(toml, tmp_path / "second", "--train.steps=1", f"--train.init_from={first}/step_3",
                 "--train.schedule=constant", "--train.warmup=0", "--train.lr=0.0")
    assert "new stage from" in r.stdout
    a, b = final_params(first, 3), final_params(tmp_path / "second", 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # lr 0: the stage starts from exactly those params
    moments = convert.read_safetensors(tmp_path / "second/step_1/optimizer.safetensors")[0]
    assert int(moments["step"]) == 4  # AdamW's own count continues; the stage's step restarted at 1


TWO_BY_FOUR = ["--mesh.data=2", "--mesh.fsdp=4", "--train.steps=4"]


@pytest.fixture(scope="module")
def one_process(setup, tmp_path_factory):
    """The 1 process x 8 devices run that the multi-process and elastic runs must match (run once
    for both test workers: once_per_session)."""
    return once_per_session(tmp_path_factory, "one_process",
                            lambda d: run(setup[1], d, *TWO_BY_FOUR, env=devices(8)))


def test_elastic_resume_on_other_meshes(setup, one_process, tmp_path):
    """2 steps on 8 devices as fsdp=2 x context=4, resumed at step 2 on 4 devices as a 2 x 2 (fsdp x
    tensor) mesh, then at step 3 on fsdp=2 x context=4 again: the same step and data position, losses
    as the uninterrupted 8-device (data=2 x fsdp=4) run. The checkpoint holds whole tensors: the mesh
    is a launch setting, context parallelism included, both ways."""
    root, toml = setup
    context = ["--mesh.data=1", "--mesh.fsdp=2", "--mesh.context=4"]
    mixed = ["--mesh.data=1", "--mesh.fsdp=2", "--mesh.tensor=2"]
    d = tmp_path / "elastic"
    t_max = "--train.t_max=4"  # one_process's 4 steps: every leg on the same schedule
    run(toml, d, "--train.steps=2", t_max, *context, env=devices(8))
    at = 2
    for steps, n, mesh in [(3, 4, mixed), (4, 8, context)]:
        r = run(toml, d, f"--train.steps={steps}", t_max, *mesh, env=devices(n))
        assert f"resuming {d}/step_{at} at step {at}" in r.stdout and f"over {n} device(s)" in r.stdout
        at = steps
    a, b = losses(one_process), losses(d)
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a), (a, b)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(toml, run_dir, launcher, flags=lambda i: [], check=True):
    """Outputs of train.py as 2 processes x 4 CPU devices; launcher(i): process i's variables,
    flags(i) its own command-line flags."""
    cmd = [sys.executable, "train.py", str(toml), f"--train.run_dir={run_dir}", *TWO_BY_FOUR]
    envs = [dict(devices(4), JAX_PLATFORMS="cpu", **launcher(i)) for i in range(2)]
    procs = [subprocess.Popen(cmd + flags(i), cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i, env in enumerate(envs)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert not check or all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    return outs


def test_two_processes_train_like_one(setup, one_process, tmp_path):
    """jax.distributed over gloo on loopback: 2 processes x 4 CPU devices = 1 process x 8."""
    root, toml = setup
    port = free_port()
    outs = two_processes(toml, tmp_path / "two", lambda i: dict(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
    assert "over 8 device(s)" in outs[0] and "2 process(es)" in outs[0]
    a, b = losses(one_process), losses(tmp_path / "two")
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)
    # Each process wrote its own shards into the one checkpoint: it reads back whole on one process.
    x, y = final_params(one_process, 4), final_params(tmp_path / "two", 4)
    assert all(np.allclose(x[k], y[k], rtol=1e-5, atol=1e-6) for k in x)


# One process of a 2-host save, each host writing into its own copy of the run folder: what it
# wrote stays apart from what the other wrote, for the test to merge as a network file system would.
SAVE_APART = """
import os, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
import convert, train
from configs import load_config
toml, out = sys.argv[1:]
rank = int(os.environ["JAX_PROCESS_ID"])
cfg = load_config([toml, "--mesh.data=1", "--mesh.fsdp=8", f"--train.run_dir={out}/host{rank}"])
backend = train.JaxBackend(cfg)
backend.init(0)
p = backend.params  # moments of their own: every tensor of the checkpoint differs
backend.opt = dict(backend.opt, m=jax.tree.map(lambda x: x * 2, p),
                   v=jax.tree.map(jnp.square, p), count=backend.opt["count"] + 3)
Path(f"{out}/host{rank}/step_3.tmp").mkdir(parents=True)  # (the lead makes it for all)
convert.save_step(3, backend, cfg, {"step": 3}, [], {})
want = {f"{k}.{n}": multihost_utils.process_allgather(a, tiled=True)
        for k, tree in (("param", p), ("m", backend.opt["m"]), ("v", backend.opt["v"]))
        for n, a in tree.items()}
if rank == 0:
    np.savez(f"{out}/want.npz", **want)
"""


def network_merge(copies, into, page=4096):
    """What a network file system keeps of the files several hosts wrote: page by page, the last
    host to write a page back wins (an NFS client flushes a dirty page whole). Each host's
    step_N.tmp is the lead's step_N: the lead renamed the one shared folder."""
    writers = {}
    for host in copies:  # in the order they flush
        for f in sorted(p for p in host.rglob("*") if p.is_file()):
            rel = Path(*[part.removesuffix(".tmp") if part.startswith("step_") else part
                         for part in f.relative_to(host).parts])
            writers.setdefault(rel, []).append(host.name)
            dst, mine = into / rel, f.read_bytes()
            dst.parent.mkdir(parents=True, exist_ok=True)
            theirs = bytearray(dst.read_bytes() if dst.exists() else b"")
            theirs.extend(bytes(max(0, len(mine) - len(theirs))))
            for at in range(0, len(mine), page):  # every page this host wrote replaces the old
                theirs[at:at + page] = mine[at:at + page]
            dst.write_bytes(bytes(theirs))
    return writers


def test_hosts_write_checkpoints_a_network_file_system_keeps(setup, tmp_path):
    """2 processes x 4 devices, every tensor split over all 8 (fsdp=8): each host writes its share
    into its own file, so merged page by page, last writer wins, the checkpoint is exact; it reads
    back in pieces, and one `convert.py` call makes a folder transformers loads."""
    port = free_port()
    envs = [dict(devices(4), JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)]
    cmd = [sys.executable, "-c", SAVE_APART, str(setup[1]), str(tmp_path)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for env in envs]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    merged = tmp_path / "merged"
    writers = network_merge([tmp_path / "host0", tmp_path / "host1"], merged)
    assert all(len(w) == 1 for w in writers.values()), writers  # no file has two writers
    step = merged / "step_3"
    assert {"model.process1-of-2.safetensors", "optimizer.process1-of-2.safetensors"} <= {
        f.name for f in (tmp_path / "host1" / "step_3.tmp").iterdir()}
    want = np.load(tmp_path / "want.npz", allow_pickle=False)
    m = train.load_config([str(setup[1])]).model
    state, opt, meta = convert.open_checkpoint(step, m)
    assert meta["step"] == 3 and int(np.asarray(opt["step"])) == 3
    for key in want.files:
        kind, name = key.split(".", 1)
        store, prefix = (state, "") if kind == "param" else (opt, dict(m="exp_avg.", v="exp_avg_sq.")[kind])
        stored = [prefix + model.layer_name(name, i) for i in range(m.n_layers)] if name.startswith("layers.") else [prefix + name]
        got = np.stack([np.asarray(store[n]) for n in stored]) if name.startswith("layers.") else np.asarray(store[stored[0]])
        assert np.array_equal(got, want[key]), key  # bit for bit
    assert any(isinstance(v, convert.Pieced) for v in state.values())  # (pieces, read in place)
    convert.convert(step, tmp_path / "hf")
    assert not list((tmp_path / "hf").glob("*process*"))
    hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    emb = hf.model.embed_tokens.weight.detach().numpy()
    assert np.array_equal(emb, want["param.embed_tokens.weight"])


def test_a_pieced_tensor_reads_only_the_pieces_a_slice_needs():
    class Untouchable:  # another host's piece: reading it fails the test
        dtype, size = np.dtype(np.float32), 8

        def __getitem__(self, idx):
            raise AssertionError("read a piece the slice does not overlap")
    top = np.arange(8, dtype=np.float32).reshape(2, 4)
    t = convert.Pieced("w", [((slice(0, 2), slice(0, 4)), top), ((slice(2, 4), slice(0, 4)), Untouchable())])
    assert t.shape == (4, 4) and np.array_equal(t[0:2, 1:3], top[:, 1:3]) and np.array_equal(t[1], top[1])
    with pytest.raises(AssertionError, match="does not overlap"):
        t[1:3]
    with pytest.raises(ValueError, match="hold 8 of its 16 numbers"):
        convert.Pieced("w", [((slice(0, 2), slice(0, 4)), top)] * 1 + [((slice(0, 4), slice(4, 4)), np.zeros((4, 0)))])


def test_two_slurm_tasks_train_like_one(setup, one_process, tmp_path):
    """SLURM sets no JAX_COORDINATOR_ADDRESS: its 2 tasks still join one world and split batches."""
    port = str(free_port())  # JAX's own port, from the job id, could be taken
    outs = two_processes(setup[1], tmp_path / "two", lambda i: dict(
        SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID=str(i),
        SLURM_LOCALID=str(i), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2", JAX_COORDINATOR_PORT=port))
    assert "over 8 device(s)" in outs[0] and "2 process(es)" in outs[0], outs[0][-2000:]
    assert "distributed: slurm: process 1 of 2, waiting for all 2 to join" in outs[1], outs[1][-2000:]
    a, b = losses(one_process), losses(tmp_path / "two")
    assert a.keys() == b.keys() and all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)


def test_start_distributed_only_for_several_processes(monkeypatch, capsys):
    """No cluster, a one-task srun step, or a stray SLURM environment (issue 43: an sbatch
    script's shell, salloc's interactive step: the allocation's SLURM_NTASKS=8, which JAX's
    SlurmCluster counts) start alone; an srun step of two tasks joins both, saying so."""
    from jax._src.clusters import SlurmCluster
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n1", SLURM_PROCID="1", SLURM_LOCALID="1")
    batch = dict(slurm, SLURM_NTASKS="8")  # no step: sbatch's script running python itself
    interactive = dict(batch, SLURM_STEP_ID="4294967290", SLURM_STEP_NUM_TASKS="1")
    srun = dict(slurm, SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2")
    joined = [((None, 2, 1), dict(cluster_detection_method="slurm"))]
    cases = [({}, [], ""), (dict(slurm, SLURM_NTASKS="1", SLURM_STEP_ID="0"), [], ""),
             (batch, [], "SLURM_NTASKS=8, but no srun step"),
             (interactive, [], "SLURM_NTASKS=8, but no srun step"),
             (srun, joined, "distributed: slurm: process 1 of 2, waiting for all 2 to join")]
    for env, want, said in cases:
        calls.clear()
        with mock.patch.dict(os.environ, env, clear=True):
            # what JAX alone would have done: wait for 8 processes
            assert env is not interactive or SlurmCluster.get_process_count() == 8
            shard.start_distributed()
        out = capsys.readouterr()
        assert calls == want and said in out.out + out.err, env


def test_hosts_must_share_the_run_folder_and_the_data(setup, tmp_path):
    """Every host writes its pieces of each checkpoint into the one run folder and reads its
    instances from the same data: a host given another folder, or data that differs, stops every
    process at the start, saying so."""
    root, toml = setup
    coordinator = lambda i, port=free_port(): dict(  # noqa: E731
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    outs = two_processes(toml, tmp_path / "a", coordinator,
                         flags=lambda i: [f"--train.run_dir={tmp_path / 'ab'[i]}"], check=False)
    for i, out in enumerate(outs):  # (each names its own folder)
        said = (f"train.run_dir={tmp_path / 'ab'[i]} is not one folder for every host: "
                "process(es) [1] do not see ")
        assert said in out, out[-2000:]
    other = tmp_path / "data"
    shutil.copytree(root / "data", other)
    (other / "stray.txt").write_text("a file only this host has\n")
    coordinator = lambda i, port=free_port(): dict(  # noqa: E731
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    outs = two_processes(toml, tmp_path / "c", coordinator,
                         flags=lambda i: [f"--data.path={[root / 'data', other][i]}"], check=False)
    for i, out in enumerate(outs):
        said = (f"data.path={[root / 'data', other][i]} is not the same files on every host: "
                "process(es) [1]")
        assert said in out, out[-2000:]
