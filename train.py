"""Train an OLMo in JAX: config -> mesh -> data -> params -> optimizer -> train step -> loop.

    python train.py configs/tiny.toml                                    # the main job's run
    python train.py configs/tiny.toml --train.steps=50 --train.run_dir=runs/x   # rerun the same command to resume
    python train.py configs/tiny.toml --bench                            # tokens/s and MFU, next to transformers
    python train.py plot runs/a runs/b                                   # overlay loss curves -> runs/a/loss.png

A run directory holds config.json (the resolved config), metrics.jsonl (one line per logged step),
loss.png, and checkpoints step_N/: Hugging Face model directories (config.json, model.safetensors)
plus optimizer.safetensors (AdamW moments, same names) and nanolmo.json (config, step, data
position, skip-step history). `latest` names the newest complete one; a rerun continues from it.
"""

import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import convert
import data
import eval as evaluate
import model
import shard
from configs import ConfigError, Config, build, describe, load_config, save_json, to_dict

# Dense bf16 peak FLOP/s per device, from the vendors' spec sheets. Unknown devices (CPUs) get no MFU.
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
    "TPU v6e": 918e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA GH200 480GB": 989e12,
}
SKIP_WINDOW, SKIP_MIN, SKIP_SIGMA = 128, 64, 6.0  # OLMo-core SkipStepAdamW defaults


# --- learning rate and AdamW (pure functions) ---------------------------------------------------

def lr_at(step, tc, tokens_per_step, total_steps):
    """OLMo's schedules (OLMo-core scheduler.py). `step` counts from 1, as OLMo-core's global_step."""
    t = step * (tokens_per_step if tc.units == "tokens" else 1)
    T = tc.t_max or total_steps * (tokens_per_step if tc.units == "tokens" else 1)
    W, lr, floor = tc.warmup, tc.lr, tc.alpha_f * tc.lr
    if t < W:
        return tc.warmup_min_lr + (lr - tc.warmup_min_lr) * t / W
    if tc.schedule == "constant":
        return lr
    if t >= T:
        return floor
    if tc.schedule == "linear":
        return lr - (lr - floor) * (t - W) / (T - W)
    if tc.schedule == "cosine":
        return floor + (lr - floor) * (1 + math.cos(math.pi * (t - W) / (T - W))) / 2
    # half_cosine (OLMo 3 pretraining part 2): the second half of a cosine twice as long, from its midpoint.
    return floor + (lr - floor) * (1 + math.cos(math.pi * (t - W + (T - W)) / (2 * (T - W)))) / 2


def adamw(params, grads, opt, lr, tc, decay):
    """Decoupled AdamW in the same operation order as torch.optim.AdamW: decay, then the bias-corrected step."""
    count = opt["count"] + 1
    bc1, bc2 = 1 - tc.beta1 ** count, 1 - tc.beta2 ** count
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = tc.beta1 * opt["m"][k] + (1 - tc.beta1) * g
        v = tc.beta2 * opt["v"][k] + (1 - tc.beta2) * g * g
        p = p * (1 - lr * tc.weight_decay) if decay[k] else p
        new_p[k] = p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + tc.eps)
        new_m[k], new_v[k] = m, v
    return new_p, dict(m=new_m, v=new_v, count=count)


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def new_optimizer(params):
    zeros = lambda: {k: jnp.zeros_like(v) for k, v in params.items()}  # noqa: E731  (two sets: both are donated)
    return dict(m=zeros(), v=zeros(), count=jnp.zeros((), jnp.int32))


def new_history():
    """The last SKIP_WINDOW losses and grad norms, for OLMo 3's skip-step rule."""
    return dict(loss=jnp.zeros(SKIP_WINDOW, jnp.float32), grad_norm=jnp.zeros(SKIP_WINDOW, jnp.float32),
                n=jnp.zeros((), jnp.int32))


# --- the train step -----------------------------------------------------------------------------

def state_shardings(mesh, m):
    """Params (by the table's logical axes), AdamW state (the same), skip-step history (replicated)."""
    p = shard.param_shardings(mesh, model.param_table(m))
    return p, dict(m=p, v=p, count=shard.replicated(mesh)), shard.replicated(mesh)


def make_train_step(cfg, mesh):
    m, tc = cfg.model, cfg.train
    dtype = jnp.dtype(tc.compute_dtype)
    decay = {k: p.decay and tc.weight_decay > 0 for k, p in model.param_table(m).items()}

    constrain = shard.residual_constraint(mesh)

    def micro_loss(params, tokens, labels, n_total):
        logits = model.forward(params, tokens, m, dtype, tc.remat, constrain)
        loss, ce, z = model.cross_entropy(logits, labels, tc.z_loss)
        # OLMo-core normalises by the non-ignored tokens of the whole global batch, not per micro-batch.
        share = (labels != model.IGNORE_INDEX).sum() / n_total
        return loss * share, ce * share

    def step(params, opt, history, tokens, lr):
        """tokens (A, B, T): A micro-batches of B instances (B split over the data axis)."""
        labels = model.shift_labels(tokens)
        n_total = jnp.maximum((labels != model.IGNORE_INDEX).sum(), 1)

        def accumulate(grads, xs):
            (loss, ce), g = jax.value_and_grad(micro_loss, has_aux=True)(params, *xs, n_total)
            return jax.tree.map(jnp.add, grads, g), (loss, ce)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, ces) = jax.lax.scan(accumulate, zeros, (tokens, labels))
        loss, ce = losses.sum(), ces.sum()
        grad_norm = global_norm(grads)
        if tc.clip:  # torch.nn.utils.clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, tc.clip / (grad_norm + 1e-6)), grads)
        new_params, new_opt = adamw(params, grads, opt, lr, tc, decay)

        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if tc.skip_step:  # OLMo-core SkipStepAdamW: skip a 6σ outlier once 64 steps of history exist
            n = jnp.minimum(history["n"], SKIP_WINDOW)
            valid = jnp.arange(SKIP_WINDOW) < n

            def outlier(x, xs):
                mean = jnp.sum(jnp.where(valid, xs, 0)) / jnp.maximum(n, 1)
                std = jnp.sqrt(jnp.sum(jnp.where(valid, (xs - mean) ** 2, 0)) / jnp.maximum(n - 1, 1))
                return x - mean > SKIP_SIGMA * std

            ok &= ~((n >= SKIP_MIN) & (outlier(loss, history["loss"]) | outlier(grad_norm, history["grad_norm"])))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        slot = history["n"] % SKIP_WINDOW
        history = dict(loss=history["loss"].at[slot].set(loss), grad_norm=history["grad_norm"].at[slot].set(grad_norm),
                       n=history["n"] + 1)
        metrics = dict(loss=loss, ce=ce, grad_norm=grad_norm, skipped=~ok)
        return keep(new_params, params), keep(new_opt, opt), history, metrics

    p, o, h = state_shardings(mesh, m)
    return jax.jit(step, in_shardings=(p, o, h, shard.batch_sharding(mesh), None),
                   out_shardings=(p, o, h, shard.replicated(mesh)), donate_argnums=(0, 1, 2))


def make_eval_step(cfg, mesh):
    """Summed cross-entropy (nats) and the tokens it covers, for one batch (B, T)."""
    m = cfg.model

    def step(params, tokens):
        labels = model.shift_labels(tokens)
        logits = model.forward(params, tokens, m, jnp.dtype(cfg.train.compute_dtype), constrain=shard.residual_constraint(mesh))
        n = (labels != model.IGNORE_INDEX).sum()
        return model.cross_entropy(logits, labels)[1] * n, n

    return jax.jit(step, in_shardings=(state_shardings(mesh, m)[0], shard.instance_sharding(mesh)))


# --- checkpoints ---------------------------------------------------------------------------------
# Stored in the HF layout (one tensor per layer, HF names), whatever the mesh: each process writes the
# shards it holds into the shared files, and a restore reads only the slices its devices need, so a
# checkpoint written on one mesh resumes on another and no host ever holds a whole sharded array.

def _sync(name):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _stored(name, shape, prefix):
    """(file name, layer) per tensor a stacked array is stored as; layer is None for unstacked ones."""
    if name.startswith("layers."):
        return [(f"{prefix}layers.{i}.{name[len('layers.'):]}", i) for i in range(shape[0])]
    return [(prefix + name, None)]


def write_sharded(path, items, metadata):
    """items: (our name, jax.Array, file-name prefix). Every process writes replica 0 of its shards."""
    entries = {}
    for name, a, prefix in items:
        for fname, layer in _stored(name, a.shape, prefix):
            entries[fname] = (a.shape[1:] if layer is not None else a.shape, np.dtype(a.dtype))
    if jax.process_index() == 0:
        convert.allocate_safetensors(path, entries, metadata)
    _sync(f"allocated {path}")
    views, _ = convert.read_safetensors(path, writable=True)
    for name, a, prefix in items:
        for sh in a.addressable_shards:
            if sh.replica_id:
                continue  # another device holds the same values and writes them
            data, idx = np.asarray(sh.data), sh.index
            if name.startswith("layers."):
                for j, layer in enumerate(range(*idx[0].indices(a.shape[0]))):
                    views[f"{prefix}layers.{layer}.{name[len('layers.'):]}"][idx[1:]] = data[j]
            else:
                views[prefix + name][idx] = data
    del views
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # the mapped pages, on disk
    _sync(f"written {path}")


def read_sharded(views, name, prefix, shape, sharding):
    """One array, each device's slice read straight from the stored tensors (fp32 whatever they hold)."""
    rest = name[len("layers."):]

    def read(idx):
        if not name.startswith("layers."):
            return np.asarray(views[prefix + name][idx], np.float32)
        return np.stack([np.asarray(views[f"{prefix}layers.{i}.{rest}"][idx[1:]], np.float32)
                         for i in range(*idx[0].indices(shape[0]))])

    return jax.make_array_from_callback(shape, sharding, read)


def save_checkpoint(run_dir, step, params, opt, history, cfg, loader_state):
    """step_N.tmp/ -> fsync -> rename to step_N/ -> point `latest` at it -> drop the oldest beyond `keep`.
    A crash at any moment leaves the previous complete checkpoint and `latest` as they were."""
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step_{step}", run_dir / f"step_{step}.tmp"
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _sync(f"mkdir {tmp}")
    write_sharded(tmp / "model.safetensors", [(k, v, "" if k == "lm_head.weight" else "model.")
                                              for k, v in params.items()], {"format": "pt"})
    write_sharded(tmp / "optimizer.safetensors", [(k, v, "exp_avg.") for k, v in opt["m"].items()]
                  + [(k, v, "exp_avg_sq.") for k, v in opt["v"].items()] + [("step", opt["count"], "")],
                  {"format": "nanolmo"})
    if jax.process_index() == 0:
        (tmp / "config.json").write_text(json.dumps(convert.config_to_hf(cfg.model), indent=2) + "\n")
        meta = dict(step=step, config=to_dict(cfg), data=loader_state,
                    history={k: np.asarray(v).tolist() for k, v in history.items()})
        (tmp / "nanolmo.json").write_text(json.dumps(meta, indent=1) + "\n")
        for f in ("config.json", "nanolmo.json"):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # left by a run that crashed before updating `latest`: same step, redo it
            shutil.rmtree(final)
        os.replace(tmp, final)
        (run_dir / "latest.tmp").write_text(final.name + "\n")
        os.replace(run_dir / "latest.tmp", run_dir / "latest")
        steps = sorted(int(p.name[5:]) for p in run_dir.glob("step_*") if p.name[5:].isdigit())
        for old in steps[:-cfg.train.keep]:
            shutil.rmtree(run_dir / f"step_{old}")
    _sync(f"saved {final}")
    return final


def latest_checkpoint(run_dir):
    pointer = Path(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = Path(run_dir) / pointer.read_text().strip()
    if not (path / "nanolmo.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint (no nanolmo.json)")
    return path


def load_checkpoint(path, m, param_sh, opt_sh, with_optimizer=True):
    """(params, opt or None, meta), laid out as the given shardings. The model must be the configured one."""
    path = Path(path)
    saved_m, state = convert.open_hf(path)
    meta = json.loads((path / "nanolmo.json").read_text()) if (path / "nanolmo.json").is_file() else {}
    theirs = build({"model": meta["config"]["model"]}).model if meta else saved_m
    diff = [f"{k}: {getattr(theirs, k)!r} there, {getattr(m, k)!r} here" for k in to_dict(Config(model=m))["model"]
            if k not in ("init", "init_std") and getattr(theirs, k) != getattr(m, k)]
    if diff:
        raise ConfigError(f"{path} holds a different model ({'; '.join(diff)})")
    table = model.param_table(m)
    params = {k: read_sharded(state, k, "", p.shape, param_sh[k]) for k, p in table.items()}
    opt = None
    if with_optimizer and (path / "optimizer.safetensors").is_file():
        views, _ = convert.read_safetensors(path / "optimizer.safetensors")
        for prefix in ("exp_avg.", "exp_avg_sq."):
            missing = [f for k, p in table.items() for f, _ in _stored(k, p.shape, prefix) if f not in views]
            if missing:
                raise ValueError(f"{path / 'optimizer.safetensors'}: no moment {missing[0]}")
        opt = dict(m={k: read_sharded(views, k, "exp_avg.", p.shape, param_sh[k]) for k, p in table.items()},
                   v={k: read_sharded(views, k, "exp_avg_sq.", p.shape, param_sh[k]) for k, p in table.items()},
                   count=jax.device_put(jnp.asarray(int(views["step"]), jnp.int32), opt_sh["count"]))
    return params, opt, meta


# --- main ---------------------------------------------------------------------------------------

def main(argv):
    # --- config
    cfg = load_config(argv)
    m, dc, tc, ec = cfg.model, cfg.data, cfg.train, cfg.eval
    run_dir = Path(tc.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    # --- mesh
    shard.start_distributed()
    lead = jax.process_index() == 0  # the one process that prints and writes files other than checkpoints
    if not lead:
        sys.stdout = open(os.devnull, "w")
    mesh = shard.make_mesh(cfg.mesh)
    n_dev = mesh.devices.size
    per_rank, micro, accum = shard.check_batch(dc.global_batch, tc.micro_batch, mesh)
    table = model.param_table(m)
    param_sh, opt_sh, hist_sh = state_shardings(mesh, m)  # checks every split divides before anything compiles

    # --- data
    instances = data.open_instances(dc.path, dc.seq_len, dc.seed)
    tok, heldout = None, None
    if Path(dc.path).is_dir():
        info = data.load_dataset_info(dc.path)
        if info["vocab_size"] > m.vocab_size:
            raise ConfigError(f"{dc.path} was tokenized with {info['vocab_size']} ids but model.vocab_size={m.vocab_size}")
        tok = data.dataset_tokenizer(dc.path)
        held_files = data.dataset_files(dc.path, "heldout")
        if held_files and sum(f.tokens for f in held_files) >= dc.seq_len:
            heldout = data.Instances([("heldout", held_files, None)], dc.seq_len)
    tokens_per_step = dc.global_batch * dc.seq_len

    # --- params: resume this run, or start a stage from another checkpoint, or initialise
    ckpt, start, history, loader_pos = latest_checkpoint(run_dir), 0, new_history(), 0
    if ckpt:
        params, opt, meta = load_checkpoint(ckpt, m, param_sh, opt_sh)
        start, loader_pos = meta["step"], meta["data"]["step"]
        history = {k: jnp.asarray(v, jnp.int32 if k == "n" else jnp.float32) for k, v in meta["history"].items()}
        if opt is None:
            raise ValueError(f"{ckpt}: no optimizer.safetensors, cannot resume")
        was = {k: meta["config"]["data"][k] for k in ("path", "seq_len", "global_batch", "seed")}
        if was != {k: getattr(dc, k) for k in was}:
            raise ConfigError(f"{ckpt} was trained with data {was}; resuming needs the same data settings "
                              "(to change them, start a new stage: train.init_from)")
        print(f"resuming {ckpt} at step {start}")
    elif tc.init_from:
        params, opt, _ = load_checkpoint(tc.init_from, m, param_sh, opt_sh, tc.load_optimizer)
        opt = opt or jax.jit(new_optimizer, out_shardings=opt_sh)(params)
        print(f"new stage from {tc.init_from}: its params{' and AdamW moments' if tc.load_optimizer else ''}, step 0")
    else:  # initialised where it lives: each device draws only its own shard
        params = jax.jit(lambda key: model.init_params(m, key), out_shardings=param_sh)(jax.random.PRNGKey(tc.init_seed))
        opt = jax.jit(new_optimizer, out_shardings=opt_sh)(params)
    history = jax.device_put(history, hist_sh)
    loader = data.Loader(instances, dc.global_batch, dc.seed, world=shard.dp_size(mesh), ranks=shard.local_ranks(mesh),
                         start_step=loader_pos, vocab_size=m.vocab_size)
    if lead:
        save_json(cfg, run_dir / "config.json")

    # --- what this run is
    groups = {}
    for name, p in table.items():
        group = name.split(".")[0] if not name.startswith("layers.") else name.split(".")[1]
        groups[group] = groups.get(group, 0) + math.prod(p.shape)
    flops = model.flops_per_token(m, dc.seq_len)
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    print(describe(cfg))
    print(f"params {model.count_params(m):,}: " + ", ".join(f"{g} {n:,}" for g, n in groups.items()))
    print(f"tokens/step {tokens_per_step:,} = global_batch {dc.global_batch} x seq_len {dc.seq_len}; "
          f"{shard.dp_size(mesh)} data-parallel rank(s) x {accum} micro-batch(es) of {micro}; FLOPs/token {flops / 1e6:,.1f}M")
    print("\n".join(shard.layout_table(mesh, table)))
    print(f"{shard.describe(mesh)}; peak {'%.0f TFLOP/s per device' % (peak / 1e12) if peak else 'unknown: MFU n/a'}")
    print(f"data: {instances.n:,} instances of {dc.seq_len}, {loader.batches_per_epoch:,} steps per epoch"
          + (f"; held-out {heldout.n:,} instances" if heldout else "; no held-out split"))

    # --- the compiled steps
    train_step = make_train_step(cfg, mesh)
    eval_step = make_eval_step(cfg, mesh)
    local = shard.local_ranks(mesh)
    batch_sharding = shard.batch_sharding(mesh)

    def device_batch(tokens):  # (B_local, T) rank-major -> (A, B_local, T): micro-batch a of every rank
        per = tokens.reshape(len(local), accum, micro, dc.seq_len).transpose(1, 0, 2, 3)
        return jax.make_array_from_process_local_data(batch_sharding, per.reshape(accum, -1, dc.seq_len))

    token_bytes = evaluate.token_bytes(tok) if tok else None

    def held_out_eval(batches):
        """Loss (nats/token) and bits per byte on the held-out split, first `batches` batches (0 = all)."""
        if heldout is None:
            return None
        n_batches = heldout.n // dc.global_batch
        n_batches = min(n_batches, batches) if batches else n_batches
        rows = np.concatenate([np.arange(r * per_rank, (r + 1) * per_rank) for r in local])  # this process's
        nats = count = n_bytes = 0
        for b in range(n_batches):
            tokens = np.stack([heldout.read(b * dc.global_batch + i) for i in range(dc.global_batch)]).astype(np.int32)
            s, n = eval_step(params, jax.make_array_from_process_local_data(shard.instance_sharding(mesh), tokens[rows]))
            nats, count = nats + float(s), count + int(n)
            if token_bytes is not None:
                n_bytes += int(token_bytes[tokens[:, 1:]].sum())
        return dict(eval_loss=nats / count, eval_bpb=evaluate.bits_per_byte(nats, n_bytes) if n_bytes else None)

    # --- stop cleanly on SIGTERM / Ctrl-C: finish the step, save, exit
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # --- the loop
    metrics_path = run_dir / "metrics.jsonl"
    if lead and metrics_path.exists():  # drop lines a crashed run logged after its last checkpoint
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= start]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    last_saved = ckpt
    batches = iter(loader)
    bar = tqdm(range(start + 1, tc.steps + 1), initial=start, total=tc.steps, desc="train", dynamic_ncols=True,
               disable=not lead)
    t_last, window = time.perf_counter(), []  # window: losses since the last log line, averaged into it
    for step in bar:
        _, tokens = next(batches)
        lr = lr_at(step, tc, tokens_per_step, tc.steps)
        params, opt, history, out = train_step(params, opt, history, device_batch(tokens), jnp.float32(lr))
        loss, skipped = float(out["loss"]), bool(out["skipped"])
        window.append(loss)
        if not math.isfinite(loss) and not tc.skip_step:
            raise FloatingPointError(f"loss is {loss} at step {step}; last good checkpoint: {last_saved or 'none'} "
                                     "(the update was not applied; lower train.lr or set train.skip_step=true)")
        record = None
        if step % tc.log_every == 0 or step == tc.steps:
            tps = len(window) * tokens_per_step / (time.perf_counter() - t_last)
            record = dict(step=step, loss=sum(window) / len(window), ce=float(out["ce"]), lr=lr,
                          grad_norm=float(out["grad_norm"]), tokens_per_s=tps, skipped=skipped,
                          mfu=flops * tps / (peak * n_dev) if peak else None, tokens=step * tokens_per_step)
            t_last, window = time.perf_counter(), []
        if ec.every and step % ec.every == 0 and step != tc.steps:
            record = {**(record or dict(step=step)), **(held_out_eval(ec.batches) or {})}
            t_last = time.perf_counter()  # tokens/s measures training only
        if record and lead:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if "loss" in record:
                mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
                line = (f"step {step:>6} | loss {record['loss']:.4f} | lr {lr:.2e} | grad norm {record['grad_norm']:.3f} | "
                        f"{record['tokens_per_s']:,.0f} tok/s | MFU {mfu}" + (" | SKIPPED" if skipped else ""))
                bar.write(line + (f" | held-out bpb {record['eval_bpb']:.3f}" if record.get("eval_bpb") else ""))
        if step % tc.checkpoint_every == 0 or step == tc.steps or stop["signal"]:  # every process writes its shards
            last_saved = save_checkpoint(run_dir, step, params, opt, history, cfg, loader.state())
        if stop["signal"]:
            bar.close()
            print(f"{stop['signal']}: saved {last_saved}; rerun the same command to continue")
            return
    bar.close()

    # --- the end: held-out bits per byte against a unigram model, the plot, a sample
    final = held_out_eval(0)
    if final and lead:
        line = f"held-out loss {final['eval_loss']:.4f} nats/token"
        if final["eval_bpb"] is not None:
            uni = unigram_bpb(instances, heldout, token_bytes, m.vocab_size)
            line += f", {final['eval_bpb']:.4f} bits/byte (a unigram model of the training tokens: {uni:.4f})"
            final["unigram_bpb"] = uni
        print(line)
        (run_dir / "final.json").write_text(json.dumps(dict(step=tc.steps, **final), indent=1) + "\n")
    if lead:
        plot([run_dir], run_dir / "loss.png")
    print(f"checkpoint {last_saved}; metrics {metrics_path}; plot {run_dir / 'loss.png'}")
    if ec.prompt and tok is not None and jax.process_count() == 1:  # (the sampler wants every weight on one host)
        ids = tok.enc.encode(ec.prompt, allowed_special="all")
        new = evaluate.sample(jax.device_get(params), m, ids, ec.sample_tokens, ec.temperature, seed=tc.init_seed)
        print(f"sample: {ec.prompt}{tok.decode(new)!r}")


def unigram_bpb(instances, heldout, token_bytes, V):
    """Bits per byte of the best context-free model: training-token frequencies (add-one smoothed)."""
    counts = np.ones(V, np.float64)
    for f in instances.files:
        counts += np.bincount(np.asarray(f.array()[: f.tokens // instances.seq_len * instances.seq_len]), minlength=V)[:V]
    logp = np.log(counts / counts.sum())
    nats = n_bytes = 0.0
    for f in heldout.files:
        a = np.asarray(f.array()[: f.tokens // heldout.seq_len * heldout.seq_len]).reshape(-1, heldout.seq_len)[:, 1:]
        nats -= logp[a].sum()
        n_bytes += token_bytes[a].sum()
    return evaluate.bits_per_byte(nats, n_bytes)


# --- plot ---------------------------------------------------------------------------------------

def plot(run_dirs, out):
    """Training loss (and held-out loss, dashed) against tokens, one colour per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, d in enumerate(run_dirs):
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        final = Path(d) / "final.json"
        if final.is_file():
            held.append((json.loads(final.read_text())["step"], json.loads(final.read_text())["eval_loss"]))
        color = f"C{i}"
        if train:
            ax.plot(*zip(*train), color=color, label=f"{Path(d).name} train")
        if held:
            ax.plot(*zip(*held), "--o", color=color, markersize=3, label=f"{Path(d).name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


# --- bench --------------------------------------------------------------------------------------

def bench(argv, steps=10):
    """A few train steps of the configured model in JAX, then the same model, batch and optimizer in
    transformers (torch, this machine's CPU), in one process. Each side runs 2 steps before the clock."""
    cfg = load_config(argv)
    m, dc, tc = cfg.model, cfg.data, cfg.train
    B, T = dc.global_batch, dc.seq_len
    mesh = shard.make_mesh(cfg.mesh)
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (B, T)).astype(np.int32)
    param_sh, opt_sh, hist_sh = state_shardings(mesh, m)
    params = jax.device_put(model.init_params(m, jax.random.PRNGKey(0)), param_sh)
    opt, history = jax.device_put(new_optimizer(params), opt_sh), jax.device_put(new_history(), hist_sh)
    step = make_train_step(cfg, mesh)
    batch = jax.device_put(tokens[None], shard.batch_sharding(mesh))
    for _ in range(2):  # compile, warm up
        params, opt, history, out = step(params, opt, history, batch, jnp.float32(tc.lr))
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt, history, out = step(params, opt, history, batch, jnp.float32(tc.lr))
    jax.block_until_ready(out)
    ours = steps * B * T / (time.perf_counter() - t0)

    import torch  # imported only now, so its thread pools do not share the cores with XLA's above
    import transformers
    hf_cfg = convert.config_to_hf(m)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**{
        k: v for k, v in hf_cfg.items() if k != "architectures"}))
    hf.train()
    optim = torch.optim.AdamW(hf.parameters(), lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=tc.weight_decay)
    ids = torch.from_numpy(tokens.astype(np.int64))

    def torch_step():
        loss = hf(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), tc.clip or 1e9)
        optim.step()
        optim.zero_grad()

    torch_step()
    torch_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        torch_step()
    theirs = steps * B * T / (time.perf_counter() - t0)
    flops = model.flops_per_token(m, T)
    peak = PEAK_FLOPS.get(jax.devices()[0].device_kind)
    mfu = lambda tps: f"{100 * flops * tps / (peak * mesh.devices.size):.1f}%" if peak else "n/a"  # noqa: E731
    print(f"{'':<34} {'tokens/s':>10} {'MFU':>6} {'GFLOP/s':>9}")
    print(f"{'nanolmo JAX (' + jax.devices()[0].platform + ', ' + tc.compute_dtype + ')':<34} {ours:>10,.0f} {mfu(ours):>6} {flops * ours / 1e9:>9.1f}")
    print(f"{'transformers ' + transformers.__version__ + ' (torch CPU)':<34} {theirs:>10,.0f} {mfu(theirs):>6} {flops * theirs / 1e9:>9.1f}")
    print(f"ratio nanolmo / transformers: {ours / theirs:.2f}x  (B={B}, T={T}, {model.count_params(m):,} params, {steps} steps each)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["plot"]:
        plot(args[1:], Path(args[1]) / "loss.png")
        print(f"wrote {Path(args[1]) / 'loss.png'}")
    elif "--bench" in args:
        bench([a for a in args if a != "--bench"])
    else:
        main(args)
