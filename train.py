"""Train an OLMo in JAX or PyTorch: config -> devices -> data -> params -> train step -> loop.

    python train.py configs/tiny.toml  # the main job's run (JAX); rerun it: it resumes
    python train.py configs/tiny.toml --train.backend=torch  # model.py's nn.Module; torchrun: FSDP2
    python train.py configs/tiny.toml configs/tiny-midtrain.toml  # a later stage: its file on top
    python train.py configs/tiny.toml configs/tiny-stage3.toml configs/tiny-sft.toml  # -dpo, -grpo
    python train.py plan configs/olmo3-32b.toml  # fits on its target?

Both backends have the same methods: the loop has no `if backend`. A run directory holds
config.json (the resolved config), metrics.jsonl (a line per logged step), final.json, loss.png
and the checkpoints step_N/, whose format convert.py's "our checkpoint format" section describes.
"""

import argparse
import functools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from configs import (CLEANUPS, ConfigError, build, describe, exit_on_signals, load_config,
                     parse_config_args, read_json, run_cli, save_json, to_dict, write_text_atomic)

if __name__ == "__main__":  # first, so that Ctrl-C during the slow imports below is one line
    exit_on_signals("train.py")

import jax  # noqa: E402 (after the signal handlers)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import convert  # noqa: E402
import data  # noqa: E402
# eval.py (named evaluate: `eval` is Python's builtin), used here for: the samplers
# (sample: GRPO's rollouts; generate: the end's sample), checkpoint_tokenizer (GRPO's policy),
# held-out bits per byte (token_bytes, bits_per_byte, unigram_bpb), the in-loop tasks
# (prepare_tasks, Scorer, score_tasks, STYLES), the run's metrics and plot (read_metrics, plot)
import eval as evaluate  # noqa: E402
import model  # noqa: E402
import shard  # noqa: E402

# OLMo-core SkipStepAdamW defaults
SKIP_WINDOW = 128
SKIP_MIN = 64
SKIP_SIGMA = 6.0
POSTTRAIN_METRICS = ("margin", "accuracy", "reward", "eval_accuracy")
# A mixture of experts' (model.router_losses, expert_metrics), OLMo-core's names; also logged:
# "block NN/load imbalance" per layer
MOE_METRICS = ("load balancing loss", "router Z loss", "load imbalance")


# --- learning rate and AdamW (pure functions) ---

# exercise: lr_schedule
def lr_at(step, tc, tokens_per_step, total_steps):
    """OLMo's schedules (OLMo-core scheduler.py).
    `step` counts from 1, as OLMo-core's global_step."""
    unit = tokens_per_step if tc.units == "tokens" else 1
    t, T = step * unit, tc.t_max or total_steps * unit
    W = tc.warmup
    lr = tc.lr
    floor = tc.alpha_f * tc.lr
    if tc.schedule == "wsds":  # (its own periods; t_max unused)
        return wsds_lr(t, tc, floor)
    # half_cosine (HalfCosWithWarmup) warms up to where its half cosine starts, the midpoint
    # between lr and the floor, not to lr (that would drop by half at the warmup's end)
    peak = floor + (lr - floor) / 2 if tc.schedule == "half_cosine" else lr
    if t < W:
        return tc.warmup_min_lr + (peak - tc.warmup_min_lr) * t / W
    if tc.schedule == "constant":
        return lr
    if t >= T:
        return floor
    if tc.schedule == "linear":
        return lr - (lr - floor) * (t - W) / (T - W)
    if tc.schedule == "cosine":
        return floor + (lr - floor) * (1 + math.cos(math.pi * (t - W) / (T - W))) / 2
    if tc.schedule == "wsd":  # OLMo-core's WSD: stable at lr, then linear to the floor at T
        D = tc.decay or round(T * tc.decay_fraction)
        return lr if t < T - D else floor + (lr - floor) * (T - t) / D
    # half_cosine (OLMo 3 pretraining part 2): a cosine twice as long, from its midpoint
    return floor + (lr - floor) * (1 + math.cos(math.pi * (t - W + (T - W)) / (2 * (T - W)))) / 2


def wsds_lr(t, tc, floor):
    """OLMo-core's WSDS (optim/scheduler.py, WSDS.get_lr): a warmup to the first period's peak,
    then per period a stable stretch at its peak (lr x its multiplier) and a linear decay to the
    floor over its last `decay` (or decay_fraction of it); t past the last period: the floor."""
    peaks = [tc.lr * x for x in tc.period_lr_multipliers or [1] * len(tc.periods)]
    W = tc.warmup
    if t < W:
        return tc.warmup_min_lr + (peaks[0] - tc.warmup_min_lr) * t / W
    x, start = t - W, 0  # the first period's length counts the warmup; the others do not
    lengths = [tc.periods[0] - W, *tc.periods[1:]]
    if x >= sum(lengths):
        return floor
    for i, L in enumerate(lengths):
        if x <= start + L:  # (a period's last position is in it: its decay ends there at floor)
            D = tc.decay or round(tc.decay_fraction * tc.periods[i])
            pos = x - start
            if pos < L - D:
                return peaks[i]
            return floor + (peaks[i] - floor) * (D - (pos - (L - D))) / D
        start += L


# exercise: adamw
def adamw(params, grads, opt, lr, tc, decay):
    """Decoupled AdamW in the same operation order as torch.optim.AdamW: decay, then the
    bias-corrected step."""
    count = opt["count"] + 1
    bc1, bc2 = 1 - tc.beta1 ** count, 1 - tc.beta2 ** count
    new_p = {}
    new_m = {}
    new_v = {}
    for k, p in params.items():
        g = grads[k]
        m = tc.beta1 * opt["m"][k] + (1 - tc.beta1) * g
        v = tc.beta2 * opt["v"][k] + (1 - tc.beta2) * g * g
        p = p * (1 - lr * tc.weight_decay) if decay[k] else p
        new_p[k] = p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + tc.eps)
        new_m[k], new_v[k] = m, v
    return new_p, dict(m=new_m, v=new_v, count=count)


def new_optimizer(params):
    def zeros():  # two sets: both are donated
        return {k: jnp.zeros_like(v) for k, v in params.items()}
    return dict(m=zeros(), v=zeros(), count=jnp.zeros((), jnp.int32))


def new_history():
    window = functools.partial(jnp.zeros, SKIP_WINDOW, jnp.float32)
    return dict(loss=window(), grad_norm=window(), n=jnp.zeros((), jnp.int32))


# exercise: skip_step
def is_outlier(history, loss, grad_norm):
    """OLMo-core SkipStepAdamW: a 6σ outlier in loss or grad norm over the history (the previous
    <= 128 steps), from the step whose window, this step counted, holds 64 values: the 64th step
    (get_step_factor: `len(self._losses) < max(2, 128 // 2)` with this step's loss appended
    first). jnp, so the JAX step runs it inside jit and the torch step calls it on the host."""
    n = jnp.minimum(history["n"], SKIP_WINDOW)
    valid = jnp.arange(SKIP_WINDOW) < n

    def outlier(x, xs):
        mean = jnp.sum(jnp.where(valid, xs, 0)) / jnp.maximum(n, 1)
        std = jnp.sqrt(jnp.sum(jnp.where(valid, (xs - mean) ** 2, 0)) / jnp.maximum(n - 1, 1))
        return x - mean > SKIP_SIGMA * std

    either = outlier(loss, history["loss"]) | outlier(grad_norm, history["grad_norm"])
    return (n + 1 >= SKIP_MIN) & either  # (n: the previous steps; + 1: this one)


def push_history(history, loss, grad_norm):
    h, slot = history, history["n"] % SKIP_WINDOW
    return dict(loss=h["loss"].at[slot].set(loss), grad_norm=h["grad_norm"].at[slot].set(grad_norm),
                n=h["n"] + 1)


# --- the loss a step minimises (both backends) ---
# model.py holds the maths (cross_entropy_of, dpo_of, grpo_loss); what a step divides by is the
# training policy here. A step's loss is the mean over the global batch: each micro-batch's loss
# is its sum divided by the global batch's count (global_count), so the shares of all micro-batches
# on all ranks add up to that mean, however the batch is split. xp: jnp (the JAX step, inside jit)
# or torch (the torch step): one definition for both, as GRPO samples with JAX and steps in either.

def global_count(cfg, labels, batch=None):
    """What the step's loss divides by, for labels (..., T) of the global batch (torch: of this
    rank's rows, then summed over the ranks): ce and grpo its targets (labels != IGNORE_INDEX),
    dpo and dpo_norm its pairs. batch: its "filtered" rows, if the loader filtered any."""
    if cfg.train.loss.startswith("dpo"):
        return math.prod(labels.shape[:-1]) // 2  # rows chosen_0, rejected_0, ...: two a pair
    targets = (labels != model.IGNORE_INDEX).sum()
    if batch is None or "filtered" not in batch:
        return targets
    # OLMo-core (train_module.py, train_batch: "we count those tokens for the loss anyways") keeps
    # a filtered instance's T label positions in the denominator, as zero-loss tokens: each rank
    # then divides by a count it knows without a collective
    return targets + batch["filtered"].sum() * labels.shape[-1]


def ce_share(cfg, xp, logp, lse, labels, total):
    """Cross-entropy plus z-loss (model.cross_entropy_of); total: the global batch's targets."""
    loss, ce, _ = model.cross_entropy_of(logp, lse, labels, total, cfg.train.z_loss, xp)
    return loss, dict(ce=ce)


def dpo_share(cfg, xp, logp, labels, batch, total):
    """DPO (model.dpo_of) on rows chosen_0, rejected_0, ..., batch["ref"] (2P,) the reference
    model's scores; total: the global batch's pairs, which margin and accuracy are means over."""
    lengths = (labels != model.IGNORE_INDEX).sum(-1)  # (2P,) each answer's tokens
    losses, margins = model.dpo_of(logp.sum(-1), batch["ref"], lengths, cfg.train, xp)
    accuracy = (margins > 0).sum() / total
    return losses.sum() / total, dict(margin=margins.sum() / total, accuracy=accuracy)


def grpo_share(cfg, xp, logp, labels, batch, total):
    """GRPO (model.grpo_loss) with π_old = π under a stop-gradient (one update per batch of
    rollouts), batch["advantage"] (B,); total: the global batch's completion tokens. The logged
    reward is the mean of batch["reward"] over the global batch's rollouts."""
    stop_gradient = jax.lax.stop_gradient if xp is jnp else torch.Tensor.detach
    per = model.grpo_loss(logp, stop_gradient(logp), batch["advantage"][:, None], xp=xp)
    reward = batch["reward"].sum() / cfg.data.global_batch
    return xp.where(labels != model.IGNORE_INDEX, per, 0.0).sum() / total, dict(reward=reward)


def step_loss(cfg, xp, logp, lse, labels, terms, batch, total):
    """This micro-batch's share of the step's loss for train.loss, and the shares of its metrics:
    summed over the micro-batches and ranks, they are the loss and metrics of the global batch.
    logp, lse (B, T): what model.token_logps returns (torch: the net called with labels); labels
    (B, T); terms: the feed-forward's auxiliary loss terms summed over the layers (model.mlp:
    none for a dense MLP); batch: this micro-batch's rows (DPO's ref, GRPO's advantage and
    reward); total: global_count of the global batch."""
    kind = cfg.train.loss
    if kind == "ce":
        share, metrics = ce_share(cfg, xp, logp, lse, labels, total)
    elif kind in ("dpo", "dpo_norm"):
        share, metrics = dpo_share(cfg, xp, logp, labels, batch, total)
    else:  # grpo
        share, metrics = grpo_share(cfg, xp, logp, labels, batch, total)
    # Each auxiliary term is a sum over this micro-batch's positions, divided as the loss's own
    # sums are, and logged under its name; a dense MLP has none, so nothing is added. The experts'
    # load (L, E) is a count for expert_metrics, summed over micro-batches and ranks, not a loss
    for name, term in terms.items():
        if name == model.LOAD:
            metrics[name] = term
            continue
        share = share + term / total
        metrics[name] = term / total
    return share, metrics


def expert_metrics(load):
    """OLMo-core's load imbalance (MoERouter.compute_metrics), of the whole batch of the step: per
    layer, the pairs of the busiest expert over those of the mean expert, 1 when perfectly
    even and E/k when every token goes to the same k experts; "load imbalance" the largest over
    the layers. load (L, E): the pairs each expert took (jnp or torch). OLMo-core logs these under
    the same names, each rank's own maximum (here the whole batch's: equal on one device)."""
    per_layer = load.max(-1) / load.mean(-1) if isinstance(load, jax.Array) else (
        load.amax(-1) / load.mean(-1))  # (L,) (torch's max(dim) returns values and indices)
    out = {f"block {i:02d}/load imbalance": per_layer[i] for i in range(load.shape[0])}
    return dict(out, **{"load imbalance": per_layer.max()})


# --- the JAX backend: one jitted step over a mesh ---

def documents(cfg, tokens):  # model.segment_ids if data.doc_mask, else None
    return model.segment_ids(tokens, cfg.model.eos_token_id) if cfg.data.doc_mask else None


def token_stats(cfg, mesh, params, batch, remat="none"):
    """(log p(label), logsumexp, labels), each (B, T), and the auxiliary loss terms that
    model.forward returns: the forward of step, eval and score."""
    m, tokens = cfg.model, batch["tokens"]
    dtype, docs = jnp.dtype(cfg.train.compute_dtype), documents(cfg, tokens)
    x, terms = model.forward(params, tokens, m, dtype, remat, shard.residual_constraint(mesh),
                             docs, attend_fn=shard.attention(mesh, m, dtype, docs is not None),
                             head=False, scan_layers=cfg.train.scan_layers,
                             experts_fn=shard.experts(mesh, m))
    labels = model.shift_labels(tokens, m.pad_token_id, batch.get("mask"))
    stats = model.token_logps(params, x, labels, m, cfg.train.loss_chunks, temperature(cfg.train))
    return (*stats, labels, terms)


def temperature(tc):  # the loss's logit divisor: GRPO's sampling temperature, else 1
    return tc.grpo_temperature if tc.loss == "grpo" else 1.0


def make_train_step(cfg, mesh):
    m, tc = cfg.model, cfg.train
    decay = {k: p.decay and tc.weight_decay > 0 for k, p in model.param_table(m).items()}

    def step(params, opt, history, batch, lr):
        """batch: tokens (A, B, T) (A micro-batches of B rows, B split over the data axis), and per
        loss its mask (A, B, T), ref or advantage (A, B)."""
        labels = model.shift_labels(batch["tokens"], m.pad_token_id, batch.get("mask"))
        total = jnp.maximum(global_count(cfg, labels, batch), 1)

        def accumulate(grads, micro):
            def loss_fn(p):
                stats = token_stats(cfg, mesh, p, micro, tc.remat)
                return step_loss(cfg, jnp, *stats, micro, total)
            (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return jax.tree.map(jnp.add, grads, g), (loss, aux)

        grads, (losses, aux) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
        loss, aux = losses.sum(), jax.tree.map(lambda a: a.sum(0), aux)  # over the micro-batches
        if model.LOAD in aux:
            aux.update(expert_metrics(aux.pop(model.LOAD).astype(jnp.float32)))
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        if tc.clip:  # torch.nn.utils.clip_grad_norm_: scale by min(1, clip / (norm + 1e-6))
            scale = jnp.minimum(1.0, tc.clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        new_params, new_opt = adamw(params, grads, opt, lr, tc, decay)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # the history holds the cross-entropy without z-loss (OLMo-core: optim.latest_loss =
        # ce_batch_loss); a loss without a "ce" (DPO, GRPO) is itself
        tracked = aux.get("ce", loss)
        if tc.skip_step:
            ok &= ~is_outlier(history, tracked, grad_norm)
        kept = jax.tree.map(lambda a, b: jnp.where(ok, a, b), (new_params, new_opt), (params, opt))
        metrics = dict(loss=loss, grad_norm=grad_norm, skipped=~ok, **aux)
        return *kept, push_history(history, tracked, grad_norm), metrics

    # the state's shardings; the batch gets none here: JaxBackend.step lays it out
    p, o, h = shard.state_shardings(mesh, model.param_table(m))
    return jax.jit(step, in_shardings=(p, o, h, None, None),
                   out_shardings=(p, o, h, shard.replicated(mesh)), donate_argnums=(0, 1, 2),
                   compiler_options=shard.compiler_options(mesh, tc.compute_dtype, m))


def peak_flops(kind):  # of a device_kind (shard.DEVICES); None: MFU n/a
    return getattr(shard.device_named(kind), "peak", None)


class JaxBackend:
    """Global jax.Arrays over the mesh, one jitted step; any process count."""

    def __init__(self, cfg):
        shard.start_distributed()
        # a GPU/TPU config on the CPU (an old driver, no plugin) stops here, not at CPU speed
        seen = f"jax.devices(): {jax.device_count()} x {jax.devices()[0].device_kind}"
        shard.check_platform(cfg.mesh, jax.default_backend(), seen)
        m, dc, tc = cfg.model, cfg.data, cfg.train
        self.cfg = cfg
        self.rank, self.processes = jax.process_index(), jax.process_count()
        self.lead = self.rank == 0
        self.mesh = mesh = shard.make_mesh(cfg.mesh)
        self.n_devices, self.world = mesh.devices.size, shard.dp_size(mesh)
        self.ranks = shard.local_ranks(mesh)
        _, self.micro, self.accum = shard.check_batch(
            dc.global_batch, tc.micro_batch, self.world, shard.mesh_where(mesh))
        shard.check_mesh(mesh.shape, m, dc.seq_len)
        table = model.param_table(m)
        self.param_sh, self.opt_sh, hist_sh = shard.state_shardings(mesh, table)
        # every split, and the attention kernel, checked now, not after compiling
        attention = shard.attention_impl(mesh, m, tc.compute_dtype, dc.doc_mask)
        self.layout = shard.jax_layout(mesh, table)
        self.layout.append(f"{shard.describe(mesh)}; attention {attention}")
        if warning := shard.unseen_accelerator(jax.default_backend()):
            print(warning, file=sys.stderr)
        self.peak = peak_flops(jax.devices()[0].device_kind)
        self.history = jax.device_put(new_history(), hist_sh)
        self.train_step = make_train_step(cfg, mesh)

        # eval and score: micro-batches (A, B, T) one after another, as the step's (olmo2-1b: 2
        # rows a GPU, not all 64 at once: a head chunk's logits alone were 6 GiB bf16 + 12 fp32)
        def nats(params, batch):  # summed nats, and the targets they cover
            def one(micro):
                logp, _, labels, _ = token_stats(cfg, mesh, params, micro)
                return -logp.sum(), (labels != model.IGNORE_INDEX).sum()
            return jax.tree.map(jnp.sum, jax.lax.map(one, batch))
        self.eval_step = jax.jit(nats)
        self.score_step = jax.jit(lambda p, batch: jax.lax.map(
            lambda micro: token_stats(cfg, mesh, p, micro)[0].sum(-1), batch))  # (A, B)
        self.new_optimizer = jax.jit(new_optimizer, out_shardings=self.opt_sh)

    barrier, allgather = staticmethod(shard.jax_barrier), staticmethod(shard.jax_allgather)

    def init(self, seed):
        """Initialised where it lives: each device draws only its own shard."""
        m = self.cfg.model
        init = jax.jit(lambda key: model.init_params(m, key), out_shardings=self.param_sh)
        self.params = init(jax.random.PRNGKey(seed))
        self.opt = self.new_optimizer(self.params)

    def load(self, state, views):
        table = model.param_table(self.cfg.model)
        read = functools.partial(shard.jax_read, table=table, shardings=self.param_sh)
        self.params = read(state, "")
        if views is None:
            self.opt = self.new_optimizer(self.params)
        else:
            count = jax.device_put(jnp.asarray(int(views["step"]), jnp.int32), self.opt_sh["count"])
            self.opt = dict(m=read(views, "exp_avg."), v=read(views, "exp_avg_sq."), count=count)

    def step(self, batch, lr):
        """batch: {tokens (B_local, T), ...}: this process's ranks' rows, rank-major."""
        batch = self._lay_out(batch, self.accum)
        state = self.params, self.opt, self.history
        self.params, self.opt, self.history, out = self.train_step(*state, batch, jnp.float32(lr))
        return out  # still computing: the loop reads it when it must

    def _lay_out(self, batch, accum):
        """{k: (B_local, ...)} -> {k: (A, B, ...)}: micro-batch a of all ranks, B: data x fsdp."""
        def lay_out(x):
            per = x.reshape(len(self.ranks), accum, -1, *x.shape[1:]).swapaxes(0, 1)
            return jax.make_array_from_process_local_data(
                shard.batch_sharding(self.mesh, x.ndim), per.reshape(accum, -1, *x.shape[1:]))
        return {k: lay_out(v) for k, v in batch.items()}

    def _eval_accum(self, batch):
        """Micro-batches of train.micro_batch rows a rank (or fewer that divide them) in `batch`."""
        per = len(batch["tokens"]) // len(self.ranks)
        return per // math.gcd(per, self.micro)

    def eval(self, batch):
        """Summed nats and target count of all processes' rows {tokens (B_local, T), mask?}."""
        s, n = self.eval_step(self.params, self._lay_out(batch, self._eval_accum(batch)))
        return float(s), int(n)

    def score(self, batch):
        """Each row's summed log-prob of its targets (B,), numpy (one process)."""
        accum = self._eval_accum(batch)
        out = np.asarray(self.score_step(self.params, self._lay_out(batch, accum)))  # (A, B)
        return out.reshape(accum, len(self.ranks), -1).swapaxes(0, 1).ravel()  # rank-major rows

    def pieces(self, kind):
        o = self.opt
        opt = [("exp_avg.", o["m"]), ("exp_avg_sq.", o["v"]), ("", {"step": o["count"]})]
        table = model.param_table(self.cfg.model)
        return shard.jax_pieces([("model.", self.params)] if kind == "model" else opt, table)

    def host_params(self):
        return jax.device_get(self.params)


# --- the PyTorch backend: model.py's nn.Module, FSDP2 under torchrun ---

def stacked_name(n):
    """HF's name -> the param_table name, the index after each stacked axis dropped (the reverse
    of model.layer_name): "layers.3.mlp.up_proj.weight" -> "layers.mlp.up_proj.weight"."""
    for axis in model.STACKED_AXES:
        n = re.sub(rf"\b{axis}\.\d+\.", f"{axis}.", n)
    return n


def stacked_index(n, table):
    """HF's name -> its row on the stacked axes of its param in table:
    "layers.3.mlp.experts.5.up_proj.weight" -> (3, 5); () for a name outside the layers. An OLMo
    Hybrid kind's own weights count their own layers (Param.layers): "layers.7.self_attn..." is
    row 1 of the attention layers 3, 7, ..."""
    indices = []
    for axis in model.STACKED_AXES:
        indices += [int(i) for i in re.findall(rf"\b{axis}\.(\d+)\.", n)]
    numbers = table[stacked_name(n)].layers
    return (numbers.index(indices[0]), *indices[1:]) if numbers else tuple(indices)


class TorchBackend:
    """A process per device; fp32 master weights, cast by model.py to the compute dtype."""

    def __init__(self, cfg):
        m, tc = cfg.model, cfg.train
        # JAX only draws the initial weights: keep it off the GPUs
        jax.config.update("jax_platforms", "cpu")
        self.rank, self.processes, self.device = shard.torch_start()
        seen = (f"torch.cuda.is_available()={torch.cuda.is_available()}, torch {torch.__version__}"
                f" built for CUDA {torch.version.cuda}")
        shard.check_platform(cfg.mesh, self.device.type, seen, backend="torch")
        self.cfg = cfg
        self.lead, self.ranks = self.rank == 0, [self.rank]
        self.n_devices = self.world = self.processes  # a device, a data rank per process
        _, self.micro, self.accum = shard.check_batch(
            cfg.data.global_batch, tc.micro_batch, self.world, f"{self.world} torch process(es)")
        with torch.device("meta"):  # no memory until sharded: each rank allocates its piece
            net = model.OLMo(m)
        table = model.param_table(m)
        self.layout = shard.torch_layout(cfg.mesh, self.processes, table)  # checks the mesh
        if warning := shard.unseen_accelerator(self.device.type):
            print(warning, file=sys.stderr)
        self.dtype = getattr(torch, tc.compute_dtype)
        self.net = net = shard.torch_shard(net, cfg.mesh, self.processes, self.device, self.dtype)
        net.to_empty(device=self.device)
        with torch.no_grad():
            net.reset_buffers()
        if tc.compile:
            for block in net.layers:
                block.compile()  # in place: parameter names stay the HF ones (no _orig_mod.)
        self.named = dict(net.named_parameters())  # "layers.3.mlp.up_proj.weight"
        groups = [dict(params=[], weight_decay=tc.weight_decay), dict(params=[], weight_decay=0.0)]
        for n, p in self.named.items():
            groups[not table[stacked_name(n)].decay]["params"].append(p)  # decayed: groups[0]
        # fused on a GPU: one kernel for all tensors (the default, foreach, launches several per
        # group); the CPU keeps foreach, which tests/test_train.py checks against JAX's AdamW
        self.optim = torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                                       fused=self.device.type == "cuda")
        self.history = new_history()  # on the host
        kind = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak = peak_flops(kind)
        self.layout[-1] += f" on {kind}" + (", torch.compile" if tc.compile else "")

    barrier = staticmethod(shard.torch_barrier)

    def allgather(self, values):
        return shard.torch_allgather(values, self.device)

    def _fill(self, tensors, source):
        """Copy into each tensor its piece here: source(unstacked name, index)."""
        with torch.no_grad():
            for n, t in tensors.items():
                local, idx, _ = shard.torch_local(t)
                piece = np.array(source(n, idx), np.float32)  # a copy: memmaps are read-only
                local.copy_(torch.from_numpy(piece))

    def init(self, seed):
        """JAX's init_params, drawn on the host a tensor at a time: a JAX run's weights."""
        m, key = self.cfg.model, jax.random.PRNGKey(seed)
        table = model.param_table(m)

        @functools.lru_cache(maxsize=1)  # one stacked tensor on the host at a time
        def drawn(name):
            return np.asarray(model.init_params(m, key, [name])[name])  # (L, ...) if stacked

        def draw(n, idx):
            return drawn(stacked_name(n))[stacked_index(n, table)][idx]
        # by stacked name, layers.0.X, layers.1.X, ...: X is drawn once for all L layers, not
        # once per layer (minutes at 1B)
        self._fill(dict(sorted(self.named.items(), key=lambda t: stacked_name(t[0]))), draw)

    def load(self, state, views):
        self._fill(self.named, lambda n, idx: state[n][idx])
        if views is None:
            return
        # AdamW's state, set before its first step: it keeps ours
        for key in ("exp_avg", "exp_avg_sq"):
            moments = {n: torch.zeros_like(p) for n, p in self.named.items()}  # sharded as p
            self._fill(moments, lambda n, idx: views[f"{key}.{n}"][idx])
            for n, p in self.named.items():
                step = torch.tensor(float(views["step"]))  # one per tensor: AdamW adds 1 in place
                self.optim.state[p].update({key: moments[n], "step": step})

    def step(self, batch, lr):
        """batch: {tokens (B_rank, T), ...}: this rank's rows; sums as in JAX."""
        tc = self.cfg.train
        x, y, docs, rows = self._inputs(batch)  # rows: ref, advantage
        mine = torch.as_tensor(global_count(self.cfg, y, rows), device=self.device)
        total = shard.torch_sum(mine).clamp(min=1)
        per, sums = len(x) // self.accum, {}  # rows per micro-batch (DPO: a pair's two together)
        load = 0  # the experts' (L, E) load over the micro-batches (expert_metrics)
        for a in range(self.accum):
            at = slice(a * per, (a + 1) * per)
            if self.processes > 1:  # reduce-scatter once, after the last
                self.net.set_requires_gradient_sync(a == self.accum - 1)
            segments = None if docs is None else docs[at]
            # the head in train.loss_chunks passes, each recomputed in the backward (JAX's too)
            logp, lse, terms = self.net(x[at], self.dtype, tc.remat, segments, labels=y[at],
                                        chunks=tc.loss_chunks, temperature=temperature(tc))
            micro = {k: v[at] for k, v in rows.items()}
            share, aux = step_loss(self.cfg, torch, logp, lse, y[at], terms, micro, total)
            # FSDP2 averages over ranks; each loss is a share of the global mean: x world, summed
            (share * self.world).backward()
            load = load + aux.pop(model.LOAD, 0)
            for k, v in dict(loss=share, **aux).items():
                sums[k] = sums.get(k, 0.0) + v.detach().double()
        sums = dict(zip(sums, shard.torch_sum(torch.stack(list(sums.values()))).tolist()))
        if torch.is_tensor(load):  # a mixture of experts: the load of the whole batch, all ranks
            imbalance = expert_metrics(shard.torch_sum(load).double())
            sums.update({k: float(v) for k, v in imbalance.items()})
        grads = [p.grad for p in self.named.values()]
        norm = shard.torch_full(torch.nn.utils.get_total_norm(grads))
        loss, grad_norm = sums["loss"], float(norm)
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        if ok and tc.skip_step:
            ok = not bool(is_outlier(self.history, sums.get("ce", loss), grad_norm))
        if ok:
            if tc.clip:  # min(1, clip / (norm + 1e-6)), as in JAX
                torch.nn.utils.clip_grads_with_norm_(self.named.values(), tc.clip, norm)
            for group in self.optim.param_groups:
                group["lr"] = lr
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.history = push_history(self.history, sums.get("ce", loss), grad_norm)  # (JAX's too)
        return dict(sums, grad_norm=grad_norm, skipped=not ok)

    def _inputs(self, batch):
        """[tokens, labels, document ids or None] (int64, on the device) + the rest."""
        def on(a):
            return torch.from_numpy(a).to(self.device)
        tokens = batch["tokens"]
        labels = model.shift_labels(tokens, self.cfg.model.pad_token_id, batch.get("mask"))
        ids = tokens, labels, documents(self.cfg, tokens)
        rows = {k: on(v) for k, v in batch.items() if k not in ("tokens", "mask")}
        return [None if a is None else on(a.astype(np.int64)) for a in ids] + [rows]

    def _logps(self, batch):
        """(log p(label) (B, T) fp32, labels) of this rank's rows: train.micro_batch rows at a
        time, the head in train.loss_chunks passes, as JAX's eval. Whole, the 1B's 64 rows x
        4,096 x 100,352 logits were 49 GiB in bf16 and 98 GiB more in fp32, on each GPU."""
        x, y, docs, _ = self._inputs(batch)
        logps = []
        for at in range(0, len(x), self.micro):
            rows = slice(at, at + self.micro)
            segments = None if docs is None else docs[rows]
            logps.append(self.net(x[rows], self.dtype, segments=segments, labels=y[rows],
                                  chunks=self.cfg.train.loss_chunks)[0])
        return torch.cat(logps), y

    @torch.no_grad()
    def score(self, batch):
        return self._logps(batch)[0].sum(-1).double().cpu().numpy()

    @torch.no_grad()
    def eval(self, batch):
        logp, y = self._logps(batch)
        nats, n = -logp.double().sum(), (y != model.IGNORE_INDEX).sum()
        s, n = shard.torch_sum(torch.stack([nats, n.double()])).tolist()
        return s, int(n)

    def pieces(self, kind):
        zero = torch.zeros_like  # (no AdamW state before its first step)
        for n, p in self.named.items():
            st = self.optim.state.get(p) or dict(exp_avg=zero(p), exp_avg_sq=zero(p), step=0)
            moments = {f"{k}.{n}": st[k] for k in ("exp_avg", "exp_avg_sq")}
            for fname, t in ({convert.hf_name(n): p} if kind == "model" else moments).items():
                local, idx, writes = shard.torch_local(t)
                if writes:  # read when written: one piece on the host at a time
                    yield fname, idx, lambda local=local: local.detach().cpu().numpy()
        if kind != "model" and self.lead:
            yield "step", (), lambda: np.int32(int(st["step"]))

    def host_params(self):
        """Stacked numpy params, gathered whole on every process."""
        full = {n: shard.torch_full(p).detach().cpu().numpy() for n, p in self.named.items()}
        return model.stack_layers(full, self.cfg.model)


# --- post-training: DPO's reference, GRPO's rollouts ---

def pair_scores(backend, pairs, rows):
    """(N, 2) summed log-probs of each pair's answers, and their target counts."""
    sums, counts = np.zeros((pairs.n, 2)), np.zeros((pairs.n, 2))
    for start in data.Progress(range(0, pairs.n, rows), desc="log-probs of pairs", leave=False):
        ids = np.arange(start, start + rows) % pairs.n  # the last wraps round (same values twice)
        batch = {k: v for k, v in pairs.batch(ids).items() if k != "ref"}
        sums[ids] = backend.score(batch).reshape(-1, 2)
        counts[ids] = batch["mask"][:, 1:].sum(-1).reshape(-1, 2)
    return sums, counts


def reference_logps(backend, cfg, splits):
    """Set each split's `ref`: DPO's reference log-probs, cached in DATA/reference_logps.npz."""
    dc, tc = cfg.data, cfg.train
    splits = {k: p for k, p in splits.items() if p is not None}
    sha = [data.sha256(f) for f in sorted(Path(tc.init_from).glob("model*.safetensors"))]
    path = Path(dc.path) / "reference_logps.npz"
    if not path.is_file():
        if backend.processes > 1:
            raise ConfigError(f"{path} is made in one process: start on one host, then resume")
        refs = {k: pair_scores(backend, pairs, dc.global_batch)[0].astype(np.float32)
                for k, pairs in splits.items()}
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, checkpoint=str(tc.init_from), sha256=sha, seq_len=dc.seq_len, **refs)
        convert.replace(tmp, path)
        n = ", ".join(f"{p.n} {k}" for k, p in splits.items())
        print(f"reference log-probs of {tc.init_from} for {n} pairs: {path}")
    with np.load(path, allow_pickle=False) as f:  # strings as unicode arrays, never pickles
        have = {k: f[k].tolist() for k in f.files}
    checks = {"its weights (sha256)": have.get("sha256") != sha,
              "seq_len": have.get("seq_len") != dc.seq_len,
              "the pairs": any(len(have.get(k, ())) != p.n for k, p in splits.items())}
    if why := [what for what, differs in checks.items() if differs]:
        raise ValueError(f"{path}: reference log-probs of {have.get('checkpoint')} at seq_len "
                         f"{have.get('seq_len')} ({', '.join(why)} differ): delete it to recompute")
    for k, pairs in splits.items():
        pairs.ref = np.asarray(have[k], np.float32)


def rollouts(backend, cfg, batch, step, tok):
    """GRPO's rows from a step's prompts (data.Prompts' batch): train.grpo_group completions of
    each, sampled from the current policy with the KV cache, rewarded by data.reward; the mask
    trains the completion's tokens only; advantages normalised within the prompt's group,
    (r - mean) / (std + 1e-8), as open-instruct's grpo_fast. A seed per step: a resumed run
    samples what the first would have."""
    tc, T, G = cfg.train, cfg.data.seq_len, cfg.train.grpo_group
    tokens = np.full((len(batch["prompts"]) * G, T), cfg.model.pad_token_id, np.int32)
    mask, reward = np.zeros_like(tokens, bool), np.zeros(len(tokens), np.float32)
    for j, (prompt, answer) in enumerate(zip(batch["prompts"], batch["answers"])):
        seed = np.random.SeedSequence([tc.init_seed, step, backend.ranks[0], j]).generate_state(1)
        new = evaluate.sample(backend.params, cfg.model, np.tile(prompt, (G, 1)), tc.grpo_max_new,
                              tc.grpo_temperature, int(seed[0]), tok.vocab_size, tok.eos_id)
        for r, done in enumerate(new, j * G):
            P, N = len(prompt), len(done)
            tokens[r, :P + N] = prompt + done
            mask[r, P:P + N] = True
            reward[r] = data.reward(tok, done, answer)
    groups = reward.reshape(-1, G)
    advantage = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-8)
    return dict(tokens=tokens, mask=mask, advantage=advantage.ravel().astype(np.float32),
                reward=reward)


# --- main: one run ---

def open_data(cfg):
    """(train, held-out or None, tokenizer or None) of text, chat or pairs (prepared folders) or
    prompts (.jsonl), as train.loss fits."""
    dc, m, tc = cfg.data, cfg.model, cfg.train
    info = data.load_dataset_info(dc.path) if Path(dc.path).is_dir() else None
    kind = "prompts" if dc.path.endswith(".jsonl") else (info or {}).get("kind", "text")
    # the dataset kinds each loss trains on
    trains_on = dict(ce=["text", "chat"], dpo=["pairs"], dpo_norm=["pairs"], grpo=["prompts"])
    fits = trains_on[tc.loss]
    if kind not in fits:
        raise ConfigError(f"train.loss={tc.loss!r} does not train on {kind} (data.path="
                          f"{dc.path!r}): it takes {' or '.join(fits)}")
    if dc.instance_filter and tc.loss != "ce":  # OLMo-core filters pretraining instances only
        raise ConfigError(f"data.instance_filter=true is for train.loss='ce', not {tc.loss!r}")
    if tc.loss != "ce" and not tc.init_from:
        raise ConfigError(f"train.loss={tc.loss!r} needs train.init_from: the fine-tuned model")
    if kind == "prompts":  # the fine-tuned policy's tokenizer and template
        if tc.backend != "jax":
            raise ConfigError("train.loss='grpo' samples with JAX: set train.backend='jax'")
        if dc.global_batch % tc.grpo_group:
            raise ConfigError(f"data.global_batch={dc.global_batch} counts completions: a multiple "
                              f"of train.grpo_group={tc.grpo_group}")
        tok = evaluate.checkpoint_tokenizer(tc.init_from, m)
        prompts = data.Prompts(dc.path, tok, dc.chat_template)
        if (P := max(len(p) for p, _ in prompts.items)) + tc.grpo_max_new > dc.seq_len:
            raise ConfigError(f"data.seq_len={dc.seq_len} cannot hold {dc.path}'s longest prompt "
                              f"({P} tokens) and train.grpo_max_new={tc.grpo_max_new} more")
        return prompts, None, tok
    packed = dict(eos=m.eos_token_id, pad=m.pad_token_id, group_size=dc.source_group_size,
                  permutation_seed=dc.source_permutation_seed,
                  long_docs=dc.long_docs) if dc.packing == "packed" else None
    instances = data.open_instances(dc.path, dc.seq_len, dc.seed, packed)
    # the held-out split and the tokenizer: from eval.data, else from data.path (a mix or a bare
    # token file has neither: the run then logs no held-out loss and its checkpoints no tokenizer)
    held_path = cfg.eval.data or (dc.path if info else None)
    if held_path is None:
        return instances, None, None
    if cfg.eval.data:
        if tc.loss != "ce":
            raise ConfigError(f"eval.data={held_path!r} is for train.loss='ce', not {tc.loss!r}")
        own, info = info, data.load_dataset_info(held_path)
        if own and own["tokenizer_sha256"] != info["tokenizer_sha256"]:  # bits per byte would lie
            raise ConfigError(f"eval.data={held_path!r} was tokenized with another tokenizer than "
                              f"data.path={dc.path!r}")
    if (V := info["vocab_size"]) > m.vocab_size:
        raise ConfigError(f"{held_path} was tokenized with {V} ids; model.vocab_size="
                          f"{m.vocab_size}")
    held = data.dataset_files(held_path, "heldout")
    enough = held and sum(f.tokens for f in held) >= dc.seq_len  # one instance at least
    heldout = data.open_instances(held_path, dc.seq_len, split="heldout") if enough else None
    return instances, heldout, data.dataset_tokenizer(held_path)


def restore(backend, cfg):
    """Resume, start a stage or initialise -> (checkpoint, step, loader step, log window)."""
    tc = cfg.train
    ckpt = convert.latest_checkpoint(tc.run_dir)
    if ckpt:
        state, views, meta = convert.open_checkpoint(ckpt, cfg.model)
        if views is None:
            raise ValueError(f"{ckpt}: no optimizer.safetensors, cannot resume")
        was = {k: meta["config"]["data"].get(k, "fsl")  # (before data.packing: fsl)
               for k in ("path", "seq_len", "global_batch", "seed", "packing")}
        if was != {k: getattr(cfg.data, k) for k in was}:
            raise ConfigError(f"{ckpt} was trained with data {was}: keep them, or start a new "
                              "stage (train.init_from)")
        backend.load(state, views)
        saved = {k: jnp.asarray(v, backend.history[k].dtype) for k, v in meta["history"].items()}
        backend.history = jax.device_put(saved, jax.tree.map(lambda a: a.sharding, backend.history))
        by = meta["config"]["train"].get("backend", "jax")
        print(f"resuming {ckpt} at step {meta['step']} (written by the {by} backend)")
        return ckpt, meta["step"], meta["data"]["step"], meta.get("log_window", [])
    if tc.init_from:
        start = convert.open_checkpoint(tc.init_from, cfg.model, tc.load_optimizer,
                                        new_stage=True)
        backend.load(*start[:2])
        moments = " and AdamW moments" if tc.load_optimizer else ""
        print(f"new stage from {tc.init_from}: its params{moments}, step 0")
    else:
        backend.init(tc.init_seed)
    return None, 0, 0, []


def held_out_eval(backend, heldout, cfg, token_bytes, batches):
    """Loss (nats/token) and bits per byte of the first `batches` held-out batches (0: all); DPO:
    loss, accuracy, mean margin."""
    if heldout is None:
        return {}
    if cfg.train.loss.startswith("dpo"):
        sums, counts = (a.ravel() for a in pair_scores(backend, heldout, cfg.data.global_batch))
        losses, margins = model.dpo_of(sums, heldout.ref.ravel(), counts, cfg.train, np)
        return dict(eval_loss=float(losses.mean()), eval_accuracy=float((margins > 0).mean()),
                    eval_margin=float(margins.mean()))
    B = cfg.data.global_batch
    rows = np.arange(B).reshape(backend.world, -1)[backend.ranks].ravel()  # this process's ranks'
    nats = count = n_bytes = 0
    for b in range(min(heldout.n // B, batches or heldout.n)):
        batch = heldout.batch(b * B + np.arange(B))
        s, n = backend.eval({k: v[rows] for k, v in batch.items()})
        nats, count = nats + s, count + n
        if token_bytes is not None:  # chat: the assistant's tokens only, as in the loss
            keep = batch["mask"][:, 1:] if "mask" in batch else True
            n_bytes += int(token_bytes[batch["tokens"][:, 1:]][keep].sum())
    bpb = evaluate.bits_per_byte(nats, n_bytes) if n_bytes else None
    return dict(eval_loss=nats / count, eval_bpb=bpb)


def in_loop_tasks(cfg, tok, backend):
    """task_eval() -> eval.py's tasks' metrics by logged name (tokenized and compiled once); {}
    without eval.tasks or in several processes."""
    ec = cfg.eval
    if not ec.tasks:
        return dict
    if tok is None:
        raise ConfigError(f"eval.tasks needs a tokenizer: data.path={cfg.data.path!r} is not a "
                          "prepared folder")
    if backend.processes > 1:
        print("eval.tasks: skipped with several processes (use `eval.py tasks` on a checkpoint)")
        return dict
    names = ec.tasks.replace(",", " ").split()
    tasks = evaluate.prepare_tasks(names, ec.tasks_data, tok, ec.tasks_norm, ec.tasks_limit)
    scorer = evaluate.Scorer(cfg.model, None, "jax", cfg.train.compute_dtype)  # params: per eval
    docs = ", ".join(f"{n} ({len(t['items'])} docs)" for n, t in tasks["tasks"].items())
    print(f"in-loop tasks: {docs}")
    if any(name in evaluate.TASKS for name in tasks["tasks"]):  # (labels have their own)
        print(f"  the paper's tasks as {ec.tasks_norm}: {evaluate.STYLES[ec.tasks_norm]}")

    def task_eval():
        scorer.params = backend.host_params()
        scores = evaluate.score_tasks(scorer, tasks)
        logged = {}
        for r in scores.values():
            logged.update(r["logged"])
        return logged
    return task_eval


def log(r, metrics_path, write):
    """One metrics.jsonl line, and its aligned line on the screen."""
    if "loss" in r:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "n/a"
        parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
                 f"grad norm {r['grad_norm']:.3f}", f"{tps} tok/s", f"MFU {mfu}",
                 f"first step {r['compile_s']:.1f} s (compile)" if "compile_s" in r else "",
                 "SKIPPED" if r["skipped"] else "",
                 f"held-out bpb {r['eval_bpb']:.3f}" if r.get("eval_bpb") else "",
                 f"masked {r['masked']:.1%}" if "masked" in r else "",
                 *(f"{k.replace('_', ' ')} {r[k]:.3f}" for k in POSTTRAIN_METRICS if k in r),
                 *(f"{k} {r[k]:.3f}" for k in MOE_METRICS if k in r)]
        write(" | ".join(p for p in parts if p))
    accs = [f"{k.removeprefix('eval/downstream/').removesuffix('_acc')} {100 * v:.1f}%"
            for k, v in r.items() if k.endswith(("_acc", "accuracy)"))]  # "accuracy v2": the same
    if accs:
        write(f"step {r['step']:>6} | " + " | ".join(accs))
    if metrics_path is not None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(r) + "\n")


def tidy(run_dir, start):
    """Clear what killed runs leave: saves (.tmp) and deletes (.trash) cut short, metrics.jsonl
    lines past `start` (via a temporary file and a rename: a kill loses nothing)."""
    for pattern in ("step_*.tmp", "step_*.trash", "*.jsonl.tmp"):
        for p in run_dir.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            print(f"removed {p}, left by a run that was killed")
    path = run_dir / "metrics.jsonl"
    rows, torn = evaluate.read_metrics(path)
    kept = [r for r in rows if r["step"] <= start]
    if torn or len(kept) < len(rows):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        convert.replace(tmp, path)


def read_pending(pending, window, tc, last_saved):
    """The last pending step's metrics off the device (the host waits here only), each loss into
    `window`; a non-finite one stops the run unless train.skip_step."""
    for s, out in pending:
        out = {k: np.asarray(v).item() for k, v in jax.device_get(out).items()}
        window.append(out["loss"])
        if not math.isfinite(out["loss"]) and not tc.skip_step:
            raise FloatingPointError(
                f"loss is {out['loss']} at step {s} (not applied); last good checkpoint: "
                f"{last_saved or 'none'}: lower train.lr or set train.skip_step=true")
    return out


def main(argv):
    # --- config and devices ---
    cfg = parse_config_args(argv, "train.py", __doc__)
    m, dc, tc, ec = cfg.model, cfg.data, cfg.train, cfg.eval
    if dc.seq_len > m.max_seq_len:  # RoPE past what the model (and HF config) declares
        raise ConfigError(f"data.seq_len={dc.seq_len} is longer than model.max_seq_len="
                          f"{m.max_seq_len}: raise model.max_seq_len or shorten data.seq_len")
    run_dir = Path(tc.run_dir)
    if not run_dir.exists():  # made by this start: removed again if it fails or is interrupted
        CLEANUPS.append(functools.partial(shutil.rmtree, run_dir, ignore_errors=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    if tc.backend == "jax" and (var := shard.set_accelerator_flags(cfg.mesh.device)):
        print(f"{var}={os.environ[var]}")  # (shard.GPU_FLAGS / TPU_FLAGS: why each)
    backend = (TorchBackend if tc.backend == "torch" else JaxBackend)(cfg)
    if backend.processes > 1:  # the other processes share the folder: none of them removes it
        CLEANUPS.clear()
    lead = backend.lead  # prints, and writes all but checkpoints
    shard.check_hosts_agree(backend, run_dir, dc.path)  # several hosts: one folder, same data
    if not lead:
        sys.stdout = open(os.devnull, "w")

    # --- data ---
    instances, heldout, tok = open_data(cfg)
    token_bytes = evaluate.token_bytes(tok) if tok else None
    # each checkpoint carries it, for eval.py and AutoTokenizer
    tok_files = convert.hf_tokenizer_files(tok, m.max_seq_len) if tok and lead else {}
    if not tok:
        print(f"note: {dc.path} names no tokenizer (not a prepared folder): checkpoints carry "
              "none; pass eval.py --tokenizer SPEC")
    tokens_per_step, flops = dc.global_batch * dc.seq_len, model.flops_per_token(m, dc.seq_len)

    # --- params: resume, start a stage, or initialise ---
    last_saved, start, loader_pos, window = restore(backend, cfg)
    if tc.loss.startswith("dpo"):  # the start is the reference
        reference_logps(backend, cfg, dict(train=instances, heldout=heldout))
    per_item = tc.grpo_group if tc.loss == "grpo" else 1  # GRPO: global_batch counts completions
    check = {k: getattr(dc, f"repetition_{k}") for k in ("max_period", "min_period", "max_count")}
    loader = data.Loader(instances, dc.global_batch // per_item, dc.seed, world=backend.world,
                         ranks=backend.ranks, start_step=loader_pos, vocab_size=m.vocab_size,
                         instance_filter=check if dc.instance_filter else None)
    if tc.epochs:  # resolved before anything reads them (saved so in config.json)
        tc.steps = tc.epochs * loader.batches_per_epoch
    if tc.warmup_fraction:
        unit = tokens_per_step if tc.units == "tokens" else 1
        tc.warmup = round(tc.warmup_fraction * tc.steps * unit)

    metrics_path = run_dir / "metrics.jsonl"
    if lead:
        save_json(cfg, run_dir / "config.json")
        tidy(run_dir, start)
    print(describe(cfg))
    print(f"params {model.count_params(m):,} (by tensor: python model.py CONFIG)")
    print(f"tokens/step {tokens_per_step:,} = global_batch {dc.global_batch} x seq_len "
          f"{dc.seq_len}; {backend.world} data-parallel rank(s) x {backend.accum} micro-batch(es) "
          f"of {backend.micro}; FLOPs/token {flops / 1e6:,.1f}M")
    print("\n".join(backend.layout))
    peak = f"{backend.peak / 1e12:.0f} TFLOP/s per device" if backend.peak else "unknown: MFU n/a"
    print(f"backend {tc.backend}; peak {peak}")
    split = f"held-out {heldout.n:,} instances" if heldout else "no held-out split"
    print(f"data: {instances.n:,} instances of {dc.seq_len}, {loader.batches_per_epoch:,} steps "
          f"per epoch; {split}")
    task_eval = in_loop_tasks(cfg, tok, backend)

    # --- stop cleanly on SIGTERM / Ctrl-C: finish the step, save, exit 143 / 130 ---
    # From here on the run folder is the run's (its first step will be saved): no cleanup.
    CLEANUPS.clear()
    stop = {"signal": None}
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in before:
        signal.signal(sig, lambda signum, _frame: stop.update(signal=signal.Signals(signum)))

    # --- the loop: step -> log? -> eval? -> save? -> stop? ---
    bar = data.Progress(range(start + 1, tc.steps + 1), initial=start, total=tc.steps,
                        desc="train", dynamic_ncols=True, disable=not lead)
    t_last = time.perf_counter()
    pending = []  # (step, metrics on device)
    masked = []
    timed, compile_s = 0, None  # steps since t_last; the first step's seconds (see below)
    batches = iter(loader)  # (closed after the loop: its read-ahead thread ends there)
    for step, (_, batch) in zip(bar, batches):
        if "masked" in batch:  # data.instance_filter: the share of rows it masked
            masked.append(batch.pop("masked") / len(batch["tokens"]))
        if tc.loss == "grpo":  # prompts -> completions
            batch = rollouts(backend, cfg, batch, step, tok)
        lr = lr_at(step, tc, tokens_per_step, tc.steps)
        pending.append((step, backend.step(batch, lr)))  # JAX returns at once: it runs meanwhile
        if step == start + 1:  # it compiles (minutes at 7B): in tokens/s it hid the real speed
            jax.block_until_ready(pending[-1][1])
            compile_s, t_last = time.perf_counter() - t_last, time.perf_counter()
        else:
            timed += 1
        logging = step % tc.log_every == 0 or step == tc.steps
        evaluating = ec.every and step % ec.every == 0 and step != tc.steps
        stopping = stop["signal"]  # read once: a later signal takes this path after the next step
        saving = step % tc.checkpoint_every == 0 or step == tc.steps or stopping
        if not (logging or evaluating or saving):
            if len(pending) > 1:  # one step ahead, no more: the next batch is read while it runs
                jax.block_until_ready(pending[-2][1])
            continue
        out = read_pending(pending, window, tc, last_saved)
        pending, record = [], {}
        if logging:
            # (a window of the first step alone has no speed yet: None, and its compile_s)
            tps = timed * tokens_per_step / (time.perf_counter() - t_last) if timed else None
            mfu = flops * tps / (backend.peak * backend.n_devices) if backend.peak and tps else None
            record = dict(step=step, loss=sum(window) / len(window), lr=lr,
                          grad_norm=out["grad_norm"], tokens_per_s=tps, skipped=out["skipped"],
                          mfu=mfu, tokens=step * tokens_per_step,
                          **{k: out[k] for k in POSTTRAIN_METRICS + ("ce",) if k in out},
                          **{k: out[k] for k in out if k in MOE_METRICS or k.startswith("block ")})
            if masked:  # over the steps since the last line
                record["masked"] = sum(masked) / len(masked)
            if compile_s is not None:  # this start's first line: its first step (compile + run)
                record["compile_s"], compile_s = compile_s, None
            t_last, timed = time.perf_counter(), 0
            window, masked = [], []
        if evaluating:
            held = held_out_eval(backend, heldout, cfg, token_bytes, ec.batches)
            record = {"step": step, **record, **held, **task_eval()}
            t_last, timed = time.perf_counter(), 0  # tokens/s measures training only
        if record and lead:
            log(record, metrics_path, bar.write)
        if saving:  # every process writes its pieces
            last_saved = convert.save_step(step, backend, cfg, loader.state(), window, tok_files)
            t_last, timed = time.perf_counter(), 0  # (a checkpoint's seconds: in no step)
        if stopping:
            bar.close()
            print(f"{stopping.name}: saved {last_saved}; rerun the same command to continue",
                  flush=True)
            # not 0: `train.py && next` must not go on with a run that stopped half way
            sys.exit(128 + stopping)
    bar.close()
    batches.close()  # no thread reading a batch nobody takes while the run ends
    # Saved: a signal now stops the run at once (exit 130 or 143), as it did before the loop
    # (configs.exit_on_signals in a script; Python's KeyboardInterrupt where none was installed).
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for sig, handler in before.items():
        signal.signal(sig, handler if callable(handler) else defaults[sig])

    # --- the end: held-out eval, tasks, plot, sample ---
    final = held_out_eval(backend, heldout, cfg, token_bytes, 0)
    if lead and "eval_bpb" in final:
        line = f"held-out loss {final['eval_loss']:.4f} nats/token"
        if final["eval_bpb"] is not None and not heldout.files[0].has_mask:  # (chat: no unigram)
            unigram = evaluate.unigram_bpb(instances, heldout, token_bytes, m.vocab_size)
            final["unigram_bpb"] = unigram
            line += (f", {final['eval_bpb']:.4f} bits/byte (a unigram model of the training "
                     f"tokens: {unigram:.4f})")
        print(line)
    if "eval_accuracy" in final:
        print(f"held-out pairs: DPO loss {final['eval_loss']:.4f}, chosen preferred "
              f"{100 * final['eval_accuracy']:.1f}%, mean margin {final['eval_margin']:.3f}")
    final = dict(step=tc.steps, **final, **task_eval())
    if lead:
        log(final, None, print)  # (no "loss": the accuracies only)
        if len(final) > 1:
            write_text_atomic(run_dir / "final.json", json.dumps(final, indent=1) + "\n")
        evaluate.plot([run_dir], run_dir / "loss.png")
    print(f"checkpoint {last_saved}; metrics {metrics_path}; plot {run_dir / 'loss.png'}")
    if backend.processes > 1:  # (each process's pieces: transformers wants them joined)
        print(f"for transformers: python convert.py {last_saved} {last_saved}-hf")
    if ec.prompt and tok is not None and backend.processes == 1:  # (the sampler: all weights here)
        ids = tok.encode(ec.prompt)
        new, _ = evaluate.generate(
            backend.host_params(), m, ids, ec.sample_tokens, temperature=ec.temperature,
            eos=m.eos_token_id, seed=tc.init_seed, tokenizer_size=tok.vocab_size)
        print(f"sample:\n{ec.prompt}{tok.decode(new)}")  # the text as it reads, newlines too


def plan(argv):
    """Compile the train step for the config's target (mesh.device x mesh.devices, or the flags):
    its memory per device against what JAX can use there."""
    ap = argparse.ArgumentParser(prog="train.py plan", description=plan.__doc__)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--mesh", default="", help="data=D,fsdp=F,context=C,tensor=T: these axes")
    sets = dict(device="mesh.device", devices="mesh.devices", batch="data.global_batch",
                seq="data.seq_len")
    ap.add_argument("--device", choices=sorted(shard.DEVICES), help="sets mesh.device")
    for flag in ("devices", "batch", "seq"):
        ap.add_argument(f"--{flag}", type=int, help=f"sets {sets[flag]}")
    ap.add_argument("--topology", help="with libtpu: compile for this TPU topology (v5p:8x8x4)")
    args, extra = ap.parse_known_args(argv)  # extra: --section.key=value config overrides
    flags = [f"--mesh.{axis}" for axis in args.mesh.split(",") if axis]
    flags += [f"--{key}={getattr(args, a)}" for a, key in sets.items() if getattr(args, a)]
    cfg = load_config(args.configs + extra + flags)
    shard.set_accelerator_flags(cfg.mesh.device)  # (libtpu reads them: --topology compiles so)
    shard.plan(cfg, args.configs, args.topology, make_train_step, new_history)


def cli(args):
    plan(args[1:]) if args[:1] == ["plan"] else main(args)


if __name__ == "__main__":
    run_cli(cli)
