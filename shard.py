"""Device meshes and shardings: how train.py lays out params, optimizer state and batch (GSPMD
inserts the communication; the model sees no mesh). Also: which attention kernel a device runs
(model.py's attention is the plain XLA maths), torchrun + FSDP2, what a process checkpoints, what
each device has, the ahead-of-time plan.

    python shard.py configs/olmo3-7b.toml --mesh.data=1 --mesh.fsdp=-1  # the mesh, param layouts
"""

import dataclasses
import functools
import glob
import hashlib
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax.experimental import multihost_utils, topologies
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash, splash_attention_mask as splash_mask)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import convert
import model
from configs import ConfigError, MeshConfig, load_config, run_cli


# --- the mesh, and how params, optimizer state and batches split over it ---

# The mesh's axes, in order: configs.MeshConfig's mesh_axis fields, ("data", "fsdp", "context",
# "tensor"). What a new axis needs: MeshConfig's comment.
AXES = MeshConfig.axes()
# Axes that split one instance's work: its positions (context parallelism) or its heads (tensor
# parallelism). Every other axis splits the instances themselves: BATCH, ("data", "fsdp").
WITHIN_INSTANCE = ("context", "tensor")
BATCH = tuple(a for a in AXES if a not in WITHIN_INSTANCE)

# A parameter's logical axis -> the mesh axes it splits over: embed FSDP-style (FSDP/ZeRO-3: each
# device keeps 1/fsdp of every weight, gathered for use), the others Megatron-style (tensor
# parallelism), layers not (the scan walks them). embed splits over fsdp only, not also over
# context as OLMo-core shards it: the embedding lookup's output would then be split on D over
# every device, and XLA cannot move that to (instances, positions) without first gathering all of
# it (`train.py plan`: 32 GiB more a device at 64 x 65536 tokens).
# OLMo Hybrid's Gated DeltaNet layers split their key and value heads over tensor alike: a device
# gets key heads i·K/t.. and value heads i·N/t.., the ones those key heads serve (model.value_heads:
# consecutive), so each head's state S never leaves its device; the conv's taps and a head's own
# dim (o_norm's weight, shared by every head) are not split.
RULES = {"embed": ("fsdp",), "heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",),
         "vocab": ("tensor",), "layers": (), "experts": ("expert",), "router": (),
         "key_heads": ("tensor",), "value_heads": ("tensor",), "conv": (), "head_dim": ()}


def mesh_shape(mesh_cfg, n_devices):
    """The device count of each axis, in AXES order, the -1 filled, checked against n_devices."""
    sizes = [getattr(mesh_cfg, a) for a in AXES]
    asked = dict(zip(AXES, sizes))  # before the -1 is filled
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {asked}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"mesh {asked}: {n_devices} devices do not divide by {known}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(f"mesh {asked} needs {math.prod(sizes)} devices, there are {n_devices}")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None):
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_cfg, len(devices))
    # Auto axes (not Explicit): shardings go in through jit's arguments
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


# exercise: fsdp_rules
def spec_for(name, param, mesh_sizes):
    """A parameter's PartitionSpec from its logical axes; each split must divide its dimension."""
    out = []
    for dim, logical in zip(param.shape, param.axes):
        # a mesh axis of size 1 splits nothing
        axes = tuple(a for a in RULES[logical] if mesh_sizes[a] > 1)
        if dim % math.prod(mesh_sizes[a] for a in axes):
            raise ValueError(f"{name}: dimension '{logical}' of size {dim} does not divide over "
                             + " x ".join(f"mesh axis '{a}' of size {mesh_sizes[a]}" for a in axes))
        out.append(axes[0] if len(axes) == 1 else axes or None)  # None: not split
    return P(*out)


def replicated(mesh):
    return NamedSharding(mesh, P())


def state_shardings(mesh, table):
    """(params, AdamW's m, v and count, the skip-step history); moments as params."""
    p = {k: NamedSharding(mesh, spec_for(k, q, dict(mesh.shape))) for k, q in table.items()}
    return p, dict(m=p, v=p, count=replicated(mesh)), replicated(mesh)


def instance_sharding(mesh, ndim=2):
    """Rows (B, T) split over the BATCH axes (data × fsdp) and context; (B,) over BATCH."""
    return NamedSharding(mesh, P(BATCH, "context") if ndim == 2 else P(BATCH))


def batch_sharding(mesh, ndim=2):
    """A step's batch (A micro-batches, B rows, T) or values (A, B); A not split."""
    return NamedSharding(mesh, P(None, *instance_sharding(mesh, ndim).spec))


def residual_constraint(mesh):
    """Pin the residual stream (B, T, D): instances over data x fsdp, positions over context."""
    # Unpinned, GSPMD meets weights split on D over fsdp and may split the activations the same
    # way, keeping whole batches on every device: `train.py plan` found 3 TiB of temporaries a
    # device for olmo3-7b at fsdp=256, 512 x 8192 tokens
    pinned = NamedSharding(mesh, P(BATCH, "context", None))
    return lambda x: jax.lax.with_sharding_constraint(x, pinned)


# --- attention kernels: which one a device runs ---
# model.attention runs the plain XLA maths (model.attend_in_blocks) on any device. A kernel runs
# faster on its own device, and whether one can run depends on the device, the compute dtype, the
# head size, documents and the context axis: so it is picked here, where the device is known.
# `attention` below picks for a mesh; pick_attention and ATTEND pick for one device (eval.py).
# Each kernel takes attend_in_blocks' arguments (cuDNN: no segments or offset) and gives its
# numbers, to rounding.

@functools.lru_cache(maxsize=None)
def splash_kernel(Tq, S, N, window, offset, interpret):
    """Splash attention: q (N, Tq, H) at positions offset.., k, v (K, S, H) at 0..; 128 | Tq, S.
    Query head n reads kv head n // (N/K), and the backward sums each group into its kv head."""
    if window:  # LocalMask's span: (keys to the left, keys to the right) of each query
        mask = splash_mask.LocalMask((Tq, S), (model.keys_before(window), 0), offset=offset)
    else:
        mask = splash_mask.CausalMask((Tq, S), offset=offset)
    # Blocks as large as divide the sequence, up to 2048, and the fused backward (dq, dk, dv in
    # one pass over the blocks): MaxText's tuned Llama-3.1-8B at T=8192 takes these
    # (benchmarks/maxtext_trillium_model_configs.py: sa_block_* 2048, sa_use_fused_bwd_kernel).
    # 512 everywhere, the kernel's own example, re-reads q and k four times as often. The forward
    # and the backward take the same size. 2048-wide blocks need TPU_FLAGS' scoped VMEM limit.
    b = next(b for b in (2048, 1024, 512, 256, 128) if Tq % b == 0 and S % b == 0)
    names = ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv")
    sizes = splash.BlockSizes(**dict.fromkeys(names, b), use_fused_bwd_kernel=True)
    # Concrete even inside a trace: a cached kernel holding tracers breaks later calls
    with jax.ensure_compile_time_eval():
        heads = splash_mask.MultiHeadMask([mask] * N)
        return splash.make_splash_mha(heads, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)


def splash_attend(q, k, v, window, scale, segments=None, offset=0):
    """attend_in_blocks by Pallas splash attention: the Mosaic kernel on TPUs, else interpreted
    (exact, slow; the tests run it so). Chosen as the step is lowered, not as it is traced
    (lax.platform_dependent): `train.py plan --topology` on a CPU host compiles the TPU kernel."""
    Tq, S = q.shape[1], k.shape[1]
    # Padded to 128 lanes: causality hides the padded keys; padded rows are cut
    Tqp, Sp = -(-Tq // 128) * 128, -(-S // 128) * 128
    q = q * jnp.asarray(scale, q.dtype)  # (the kernel has no scale argument)
    q = model.pad_t(q, Tqp - Tq)
    k = model.pad_t(k, Sp - S)
    v = model.pad_t(v, Sp - S)
    seg = []
    if segments is not None:  # (B, S) the keys' segment ids; q's segment ids: at its positions
        q_seg = jax.lax.dynamic_slice_in_dim(segments, offset, Tq, axis=1)
        seg = [model.pad_t(s.astype(jnp.int32), n - s.shape[1], mode="edge")
               for s, n in ((q_seg, Tqp), (segments, Sp))]
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # (B, T, N, H) <-> (B, N, T, H)
    # A traced offset (the offset of a context shard, under shard_map): one kernel for the offset
    # of each shard, and lax.switch runs the one of this shard
    traced = not isinstance(offset, int)
    offsets = range(0, S, Tq) if traced else [offset]
    # Built here, not in a branch: a cached kernel's masks would hold its tracers
    kernels = [[splash_kernel(Tqp, Sp, q.shape[2], window, o, interpret) for o in offsets]
               for interpret in (False, True)]

    def run(interpret, q, k, v, *seg):
        ids = splash.SegmentIds(q=seg[0], kv=seg[1]) if seg else None
        calls = [functools.partial(jax.vmap(kernel), segment_ids=ids)
                 for kernel in kernels[interpret]]
        return jax.lax.switch(offset // Tq, calls, q, k, v) if traced else calls[0](q, k, v)

    y = jax.lax.platform_dependent(heads_first(q), heads_first(k), heads_first(v), *seg,
                                   tpu=functools.partial(run, False),
                                   default=functools.partial(run, True))
    return heads_first(y)[:, :Tq]  # (B, Tq, N, H)


def cudnn_attend(q, k, v, window, scale):
    """attend_in_blocks by cuDNN's flash kernel (NVIDIA GPUs; no segments or offset)."""
    # local_window_size: (keys to the left, keys to the right) of each query; None: all before it
    span = (model.keys_before(window), 0) if window else None
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation="cudnn", local_window_size=span)


# pick_attention's choice -> the JAX function
ATTEND = {"xla": model.attend_in_blocks, "splash": splash_attend, "cudnn": cudnn_attend}


def accelerator(device=None):
    """(platform, CUDA capability (major, minor) or None) of `device` (or JAX's first). The one
    device query in the choice: tests stub it (tests/lower_check.py, test_accelerators.py), as
    JAX's own tests stub cuDNN's checks, to pick for an H100, an A100 or a TPU from a CPU."""
    d = device or jax.devices()[0]
    capability = getattr(d, "compute_capability", None)
    return d.platform, tuple(int(x) for x in capability.split(".")) if capability else None


def cudnn_refusal(m, dtype, documents, context, platform, capability):
    """Why JAX's cuDNN attention cannot run this case (jax 0.10.2's checks, in
    jax/_src/cudnn/fused_attention_stablehlo.py), or ""."""
    if platform != "gpu" or capability is None:
        return f"cuDNN needs an NVIDIA GPU, and JAX runs on {platform}"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):  # (fp32 raises NotImplementedError)
        return (f"cuDNN takes bfloat16 or float16, not {jnp.dtype(dtype)}: set "
                "train.compute_dtype=bfloat16")
    cc = ".".join(map(str, capability))
    most = 256 if capability >= (9, 0) else 128  # (Hopper on: wider heads)
    if capability < (8, 0):
        return f"cuDNN flash attention needs compute capability >= 8.0, not {cc}"
    if m.head_dim > most or m.head_dim % 8:
        return (f"cuDNN takes head_dim <= {most}, a multiple of 8, on compute capability {cc}; "
                f"not {m.head_dim}")
    if documents or context > 1:
        why = "document ids (data.doc_mask)" if documents else "query offset (mesh.context > 1)"
        return f"JAX's cuDNN call takes no {why}: use xla or splash"
    return ""


def pick_attention(m, dtype, documents=False, device=None, context=1):
    """model.attention -> "xla", "splash" or "cudnn" for this dtype, device (default JAX's first),
    documents, context split. auto: the device's kernel where it runs, else xla; a named one that
    cannot run: refused, before anything compiles."""
    if m.attention in ("sdpa", "flex"):
        raise ValueError(f"model.attention={m.attention!r} is a torch implementation: JAX takes "
                         "auto, xla, splash, cudnn")
    platform, capability = accelerator(device)
    why = cudnn_refusal(m, dtype, documents, context, platform, capability)
    if m.attention == "auto":
        kernel = {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")
        return "xla" if kernel == "cudnn" and why else kernel
    if m.attention == "cudnn" and why:
        raise ValueError(f"model.attention='cudnn' cannot run here: {why}")
    return m.attention  # (splash off a TPU runs interpreted)


# --- attention on a mesh: a kernel or context parallelism under shard_map ---

def attention(mesh, m, dtype, documents):
    """model.forward's attend_fn on this mesh: XLA's attention split by GSPMD; a kernel, or context
    parallelism, under shard_map on each device's own instances and heads (a kernel is a custom
    call the SPMD partitioner cannot split: it would gather every instance onto every device)."""
    context, impl = mesh.shape["context"], attention_impl(mesh, m, dtype, documents)
    attend = ATTEND[impl]
    if context == 1 and (impl == "xla" or mesh.devices.size == 1):
        return attend
    qkv, ids = P(BATCH, "context", "tensor", None), P(BATCH, "context")

    def attend_fn(q, k, v, window, scale, *segments):
        def local(q, k, v, *segments):  # q (B/dp, T/C, N/tp, H), k and v (B/dp, T/C, K/tp, H)
            if context == 1:
                return attend(q, k, v, window, scale, *segments)
            # all T's keys, values, ids (the backward reduce-scatters dK, dV)
            k, v, *segments = [jax.lax.all_gather(x, "context", axis=1, tiled=True)
                               for x in (k, v, *segments)]
            offset = jax.lax.axis_index("context") * q.shape[1]
            return attend(q, k, v, window, scale, *segments, offset=offset)
        specs = (qkv, qkv, qkv) + (ids,) * len(segments)
        # check_vma off: a kernel's custom call has no replication rule
        run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qkv, check_vma=False)
        return run(q, k, v, *segments)
    return attend_fn


def experts(mesh, m):
    """model.moe's experts_fn on this mesh, under shard_map over every axis: each device routes its
    own tokens (GSPMD alone would sort the whole global batch as one and gather every device's
    tokens onto every device: `train.py plan configs/olmoe-1b-7b.toml` counted 2,128 GiB a device).
    mesh.expert = 1: each device runs every expert on its own pairs (model.experts_grouped), the
    expert weights gathered whole for it as FSDP gathers every weight. mesh.expert = n > 1: expert
    parallelism, each device keeping E / n experts (RULES), its pairs sent to their experts' devices
    by an all-to-all and their outputs sent back by another (dispatch_to_experts)."""
    if not m.n_experts or mesh.devices.size == 1:
        return None  # model.moe's own choice
    rows = P(BATCH, "context", None)  # x (B, T, D); weights and chosen experts (B, T, k)
    ep = mesh.shape["expert"]

    def experts_fn(p, x, weights, chosen, m):
        if ep == 1:
            local = functools.partial(model.experts_function(m), m=m)
        else:
            local = functools.partial(dispatch_to_experts, m=m, ep=ep)
        # each device's experts (all of them where mesh.expert = 1), gathered over the other axes
        specs = {k: P("expert" if ep > 1 else None) for k in p}
        run = jax.shard_map(local, mesh=mesh, in_specs=(specs, rows, rows, rows),
                            out_specs=rows, check_vma=False)
        return run(p, x, weights, chosen)
    return experts_fn


def dispatch_to_experts(p, x, weights, chosen, m, ep):
    """Expert parallelism on one device of the "expert" axis (n = ep devices, each holding E/n
    experts, device j experts j·E/n..): x (b, t, D), weights and chosen (b, t, k) this device's
    -> (b, t, D). Its b·t·k (token, expert) pairs go to their expert's device by an all-to-all,
    each device runs its experts on what it received (model.grouped_swiglu), and
    a second all-to-all returns the outputs, which are weighted and added to their tokens here.
    The send buffer holds, for each device, room for all b·t·k pairs (all may choose its experts):
    n times the pairs, mostly zeros, because XLA's CPU backend has no ragged all-to-all
    (jax.lax.ragged_all_to_all: UNIMPLEMENTED there), which sends only the rows."""
    (b, t, D), k = x.shape, m.experts_per_token
    per = m.n_experts // ep  # experts a device holds
    n = b * t * k
    flat = chosen.reshape(-1)  # (n,): pair i is token i // k's choice
    dest = flat // per  # the device holding the pair's expert
    order = jnp.argsort(dest, stable=True)  # the pairs by destination
    counts = jnp.bincount(dest, length=ep)  # (ep,) pairs for each device
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(n) - starts[dest[order]]  # each sorted pair's row in its device's block
    token = order // k
    send = jnp.zeros((ep, n, D), x.dtype).at[dest[order], slot].set(x.reshape(b * t, D)[token])
    ids = jnp.full((ep, n), per, jnp.int32).at[dest[order], slot].set(flat[order] % per)
    # (ep, n, D): block i is what device i sent here; ids: its local expert, `per` for padding
    got = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)
    got_ids = jax.lax.all_to_all(ids, "expert", 0, 0, tiled=True).reshape(-1)
    # this device's experts on the rows received: sorted by local expert, padding last
    within = jnp.argsort(got_ids, stable=True)
    sizes = jnp.bincount(got_ids, length=per + 1)[:per].astype(jnp.int32)  # (padding: no group)
    out = model.grouped_swiglu(p, got.reshape(ep * n, D)[within], sizes)  # (ep·n, D)
    out = jnp.zeros_like(out).at[within].set(out)  # back in received order
    back = jax.lax.all_to_all(out.reshape(ep, n, D), "expert", 0, 0, tiled=True)
    mine = back[dest[order], slot]  # (n, D): each sorted pair's output
    mine = mine * weights.reshape(-1)[order, None].astype(mine.dtype)
    return jnp.zeros((b * t, D), mine.dtype).at[token].add(mine).reshape(b, t, D)


def attention_impl(mesh, m, dtype, documents):
    """What `attention` runs (pick_attention on this mesh)."""
    return pick_attention(m, dtype, documents, mesh.devices.flat[0], mesh.shape["context"])


# --- what a mesh asks of the model and the batch ---

def check_mesh(sizes, m, seq_len):
    """What mesh axis `sizes` need of the model and data, besides params' splits."""
    if seq_len % sizes["context"]:
        raise ValueError(f"data.seq_len={seq_len} does not divide over mesh.context="
                         f"{sizes['context']}: make it a multiple")
    tensor = sizes["tensor"]
    if m.n_heads % tensor or m.n_kv_heads % tensor:  # attention runs per device on whole heads
        fits = [t for t in range(1, m.n_kv_heads + 1) if m.n_kv_heads % t == m.n_heads % t == 0]
        raise ValueError(f"mesh.tensor={tensor} splits the attention heads, and model.n_heads="
                         f"{m.n_heads} / n_kv_heads={m.n_kv_heads} do not divide over it: use "
                         f"mesh.tensor in {fits}")
    if "G" not in m.layer_pattern:
        return
    if m.linear_key_heads % tensor:  # (value heads: a multiple of the key heads)
        raise ValueError(f"mesh.tensor={tensor} splits the Gated DeltaNet heads, and "
                         f"model.linear_key_heads={m.linear_key_heads} does not divide over it")
    if sizes["context"] > 1:
        # A G layer's scan runs over the whole sequence in order; split over devices, each would
        # need the state S its predecessors end with (OLMo-core: Ulysses, an all-to-all that
        # gives each device whole sequences of some heads instead; not here)
        raise ValueError(f"mesh.context={sizes['context']}: OLMo Hybrid's Gated DeltaNet layers "
                         "run over the whole sequence; context parallelism for them is not "
                         "implemented here (set mesh.context=1; docs/hybrid.md)")


def mesh_where(mesh):
    """The data-parallel axes and their sizes, for check_batch's errors ("mesh data=2 x fsdp=4")."""
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in BATCH)
    return f"mesh {sizes}"


def dp_size(mesh):
    """Data-parallel ranks: groups of devices that each read instances of their own."""
    return math.prod(mesh.shape[a] for a in BATCH)


def local_ranks(mesh):
    """Data-parallel ranks (in BATCH order, the first axis major, as the batch's split numbers
    them) with a device in this process."""
    batch_first = [mesh.axis_names.index(a) for a in (*BATCH, *WITHIN_INSTANCE)]
    devs = mesh.devices.transpose(batch_first).reshape(dp_size(mesh), -1)  # (ranks, its devices)
    me = jax.process_index()
    return [r for r, row in enumerate(devs) if any(d.process_index == me for d in row)]


def check_batch(global_batch, micro_batch, dp, where):
    """(instances a rank, micro-batch, micro-batches a step) over `dp` ranks; `where`: the mesh
    the errors name."""
    if global_batch % dp:
        raise ValueError(f"data.global_batch={global_batch} does not divide over the {dp} "
                         f"data-parallel ranks ({where})")
    per_rank = global_batch // dp
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(f"train.micro_batch={micro} does not divide the {per_rank} instances "
                         "each rank gets")
    return per_rank, micro, per_rank // micro


# --- the layout: each param's split and its bytes per device ---

def split_over(spec, sizes):
    """How many devices a PartitionSpec splits a tensor over, given mesh axis `sizes`."""
    count = 1
    for dim in spec:  # per dimension: None (not split), a mesh axis or a tuple of mesh axes
        if dim:
            axes = dim if isinstance(dim, tuple) else (dim,)
            count *= math.prod(sizes[a] for a in axes)
    return count


def state_gib(table, sizes):
    """GiB per device of fp32 params and AdamW's moments, given mesh axis `sizes`."""
    return sum(12 * math.prod(p.shape) / split_over(spec_for(name, p, sizes), sizes)
               for name, p in table.items()) / 2**30


def layout_table(table, splits):
    """A line per param: its split, fp32 bytes per device; splits: {name: (where, fraction)}."""
    lines, total = [], 0
    for name, p in table.items():
        where, fraction = splits[name]
        per_dev = int(math.prod(p.shape) * 4 * fraction)
        total += per_dev
        lines.append(f"{name:<42} {where:<34} {per_dev / 2**20:>10.2f} MiB/device")
    lines.append(f"{'params in all':<42} {'':<34} {total / 2**30:>10.3f} GiB/device "
                 "(+2x for AdamW moments)")
    return lines


def jax_layout(mesh, table):
    """layout_table for a JAX mesh: each parameter's PartitionSpec."""
    specs = {name: spec_for(name, p, dict(mesh.shape)) for name, p in table.items()}
    splits = {k: (str(s), 1 / split_over(s, mesh.shape)) for k, s in specs.items()}
    return layout_table(table, splits)


def describe(mesh):
    kinds = sorted({d.device_kind for d in mesh.devices.flat})
    return (f"mesh {dict(mesh.shape)} over {mesh.devices.size} device(s) ({', '.join(kinds)}), "
            f"{jax.process_count()} process(es)")


# --- several hosts: barriers, gathers, and the check that they share a run folder and data ---

def jax_barrier():
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("barrier")


def jax_allgather(values):
    """Every process's int32 `values` (n,) -> (processes, n) on each."""
    every = multihost_utils.process_allgather(np.asarray(values, np.int32))
    return np.asarray(every).reshape(-1, len(values))


def check_hosts_agree(backend, run_dir, data_path):
    """All hosts see the lead's run folder and the same data, or each process errs now; backend:
    processes, lead, barrier, allgather."""
    if backend.processes == 1:
        return
    if filesystem(run_dir) == "fuse.gcsfuse":
        raise OSError(f"train.run_dir={run_dir} is on GCS FUSE, where renaming a folder is a copy "
                      "then a delete (a kill mid-save leaves half a checkpoint): put it on "
                      "Filestore or NFS")
    # the lead's random token, the same on every host
    token = int(backend.allgather([int.from_bytes(os.urandom(3), "little")])[0, 0])
    stamp = Path(run_dir) / ".hosts"
    if backend.lead:
        stamp.write_text(f"{token}\n")
    backend.barrier()
    seen = stamp.is_file() and stamp.read_text().strip() == str(token)
    rows = backend.allgather([seen, data_fingerprint(data_path)])
    backend.barrier()
    if backend.lead:
        stamp.unlink()
    if blind := [i for i, (ok, _) in enumerate(rows) if not ok]:
        raise OSError(f"train.run_dir={run_dir} is not one folder for every host: process(es) "
                      f"{blind} do not see what process 0 wrote: share it (NFS, Filestore)")
    if other := [i for i, (_, data) in enumerate(rows) if data != rows[0][1]]:
        raise ValueError(f"data.path={data_path} is not the same files on every host: "
                         f"process(es) {other} see other names or sizes than process 0")


def filesystem(path, mounts="/proc/mounts"):
    """The type of the filesystem `path` is on ("nfs4", "fuse.gcsfuse"...); "" if unreadable."""
    path, best = Path(path).resolve(), ("", "")
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return ""
    for fields in map(str.split, lines):  # device, mount point ("\040": " "), type
        point = fields[1].replace("\\040", " ")
        if path.is_relative_to(point) and len(point) > len(best[0]):
            best = (point, fields[2])
    return best[1]


def data_fingerprint(path):
    """31 bits of the files' names and sizes under `path`: same data, same id."""
    path = Path(path)
    if path.is_dir():
        files = {p.relative_to(path): p for p in sorted(path.rglob("*")) if p.is_file()}
    else:
        files = {path.name: path} if path.is_file() else {}
    listing = "".join(f"{name}:{p.stat().st_size}\n" for name, p in files.items())
    return int.from_bytes(hashlib.sha256(listing.encode()).digest()[:4], "little") >> 1


# --- joining the processes of a run (JAX_* variables, SLURM, Open MPI, TPU pods) ---

def srun_tasks():
    """The task count of the srun step that started this process; 1 outside a step. JAX's
    SlurmCluster counts SLURM_NTASKS, which an sbatch script run without srun, or salloc's
    interactive shell (a step of SLURM_STEP_NUM_TASKS=1), export too: there a plain
    `python train.py` waited for the allocation's other tasks, which never come."""
    if "SLURM_STEP_ID" not in os.environ:
        return 1  # no step (an salloc or sbatch shell): srun sets it for each task it starts
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


def start_distributed():
    """Join the processes JAX_* variables name, or the cluster JAX finds (SLURM, Open MPI, TPU
    pods); before any device use. Says in one line what it joins (a wrong count waits forever)."""
    if address := os.environ.get("JAX_COORDINATOR_ADDRESS"):
        n, me = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        args, kw = (address, n, me), {}
        source = f"JAX_COORDINATOR_ADDRESS={address}"
    else:
        # SLURM, Open MPI and TPU pods set no JAX_* variables: without JAX's own detection each
        # node of such a launch would train alone. Its SLURM detection (SlurmCluster) needs only
        # SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID, and
        # counts SLURM_NTASKS: the step's own count (srun_tasks) is passed on instead
        from jax._src import clusters  # JAX's detection; private, but jax is pinned
        env = next((c for c in clusters.ClusterEnv._cluster_types
                    if not c.opt_in_only_method and c.is_env_present()), None)
        if env is None:
            return  # no cluster
        n = srun_tasks() if env.name == "slurm" else env.get_process_count()
        if n == 1 and env.name == "slurm" and env.get_process_count() > 1:  # JAX would wait
            print(f"note: SLURM_NTASKS={env.get_process_count()}, but no srun step of several "
                  "tasks started this process: it trains alone (`srun` starts one per task)",
                  file=sys.stderr)
        if n == 1:
            return  # one host, srun -n1, an salloc shell
        me = env.get_process_id()
        # the count and the cluster passed on: JAX would read SLURM_NTASKS (the allocation's count)
        args, kw = (None, n, me), dict(cluster_detection_method=env.name)
        source = env.name
    print(f"distributed: {source}: process {me} of {n}, waiting for all {n} to join", flush=True)
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU processes talk over gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(*args, **kw)


# --- checkpoints: the piece of each array a process writes (convert.save_step), reads back ---

def stacked_span(name, shape, idx):
    """The index ranges slice idx of a param covers on its stacked axes (layers; experts)."""
    return [range(*s.indices(n)) for s, n in zip(idx, shape[:len(model.stacked_axes(name))])]


def stored_slices(name, p, prefix, idx):
    """[(stored name, index)] slice idx of param p covers, one per layer (and expert) if stacked,
    in row-major order of those axes; prefix "model.": HF's names (convert.hf_name)."""
    rename = convert.hf_name if prefix == "model." else lambda n: prefix + n  # noqa: E731
    span = stacked_span(name, p.shape, idx)
    if not span:
        return [(rename(name), idx)]
    numbers = p.layers or range(p.shape[0])  # row i of the layers axis: HF's layer numbers[i]
    return [(rename(model.layer_name(name, numbers[i[0]], *i[1:])), idx[len(span):])
            for i in itertools.product(*span)]


def jax_pieces(trees, table):
    """(stored name, index, read) of each shard here (replica 0) of [(prefix, {name: array})],
    the names model.param_table's (or others outside the layers: AdamW's step count); read()
    copies it to the host then (a stacked shard once for all its layers)."""
    for prefix, tree in trees:
        for name, a in tree.items():
            n = len(model.stacked_axes(name))  # one stored name per layer (and expert)
            for sh in a.addressable_shards:
                if sh.replica_id:
                    continue  # another device writes the same values

                @functools.cache
                def host(sh=sh):  # stacked: those axes flattened, so piece i is row i
                    a = np.asarray(sh.data)
                    return a.reshape(-1, *a.shape[n:]) if n else a
                p = table.get(name) or model.Param(a.shape, ())  # (step: not stacked)
                for i, (fname, idx) in enumerate(stored_slices(name, p, prefix, sh.index)):
                    yield fname, idx, (lambda i=i, host=host: host()[i]) if n else host


def jax_read(views, prefix, table, shardings):
    """{name: global fp32 array}, each device's slice read from stored tensors."""
    def read(name, idx):
        pieces = stored_slices(name, table[name], prefix, idx)
        parts = [np.asarray(views[f][i], np.float32) for f, i in pieces]
        lead = [len(r) for r in stacked_span(name, table[name].shape, idx)]
        return np.stack(parts).reshape(*lead, *parts[0].shape) if lead else parts[0]

    return {k: jax.make_array_from_callback(p.shape, shardings[k], lambda idx, k=k: read(k, idx))
            for k, p in table.items()}


# --- what each device has, how XLA compiles for it, and the plan for a mesh we lack ---
# A JAX device is a TPU v4/v5p chip (its two TensorCores act as one), one TensorCore of a TPU7x
# (Ironwood: two devices a chip), or one GPU. Peaks and memory per JAX device: Google's TPU pages,
# NVIDIA's data sheets, the chip table in jax/_src/pallas/mosaic/tpu_info.py. A device not here
# (a CPU) has no peak: the log says "MFU n/a" rather than guess.

@dataclass(frozen=True)
class Device:
    kinds: tuple  # device_kind as JAX (and torch, NVIDIA) say it
    peak: float   # dense bf16 FLOP/s
    hbm: float    # GiB


DEVICES = {
    "v4": Device(("TPU v4",), 275e12, 32),
    "v5e": Device(("TPU v5 lite", "TPU v5e"), 197e12, 16),
    "v5p": Device(("TPU v5", "TPU v5p"), 459e12, 95),  # (a v5p chip says "TPU v5")
    "v6e": Device(("TPU v6 lite", "TPU v6e"), 918e12, 32),
    "tpu7x": Device(("TPU7x",), 1153.5e12, 96),  # Ironwood: 2 a chip
    "a100-40gb": Device(("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), 312e12, 40),
    "a100": Device(("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 312e12, 80),
    "h100": Device(("NVIDIA H100 80GB HBM3",), 989e12, 79.6),
    "h100-pcie": Device(("NVIDIA H100 PCIe",), 756e12, 79.6),
    "h100-nvl": Device(("NVIDIA H100 NVL",), 835e12, 93.6),
    "h200": Device(("NVIDIA H200",), 989e12, 140.4),
    "gh200": Device(("NVIDIA GH200 480GB",), 989e12, 95.6),
    "b200": Device(("NVIDIA B200",), 2250e12, 179),
    "gb200": Device(("NVIDIA GB200",), 2500e12, 185),
}


def device_named(kind):
    """The DEVICES entry of a device_kind (as JAX or torch says it), or None (CPUs)."""
    return next((d for d in DEVICES.values() if kind in d.kinds), None)


def usable_gib(name):
    """GiB per device a JAX run may use: all of a TPU, 75% of a GPU, which JAX's allocator takes
    and never exceeds, preallocated or not (unless XLA_*MEM_FRACTION moves it)."""
    device = DEVICES[name]
    if not device.kinds[0].startswith("NVIDIA"):
        return device.hbm
    fraction = (os.environ.get("XLA_CLIENT_MEM_FRACTION")
                or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or 0.75)
    return device.hbm * float(fraction)


def unseen_accelerator(platform):
    """A warning if this machine has an accelerator and `platform` is "cpu" (JAX just logs it)."""
    if platform != "cpu":
        return None
    if glob.glob("/dev/nvidia[0-9]*"):
        found, accel = "an NVIDIA GPU", "cuda"
    elif glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        found, accel = "a TPU", "tpu"
    else:
        return None
    return (f"warning: this machine has {found} and this run uses the CPU: install for it with "
            f"`make demo ACCEL={accel}`")


# CUDA 13's minimum Linux driver (NVIDIA's CUDA 13.0 release notes: >= 580.65.06), for
# jax[cuda13] and torch's CUDA 13 wheel alike. Below it JAX logs a warning and runs on the CPU,
# and torch.cuda.is_available() is just False: a 1B run would go on at CPU speed.
NVIDIA_DRIVER = 580


def nvidia_driver(path="/sys/module/nvidia/version"):
    """The loaded NVIDIA kernel driver's version ("580.65.06"), or "" if none is loaded."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def check_platform(mesh_cfg, platform, sees, backend="jax", driver=None):
    """Refuse a run on the CPU whose config targets a GPU or TPU (mesh.device): `sees` is what
    JAX or torch found, named in the error with the likely cause and its fix."""
    target = DEVICES.get(mesh_cfg.device)
    if target is None or platform != "cpu":
        return  # no target (tiny.toml), or on an accelerator
    driver = nvidia_driver() if driver is None else driver
    if not target.kinds[0].startswith("NVIDIA"):
        why = ("the torch backend runs on NVIDIA GPUs only: use --train.backend=jax"
               if backend == "torch" else
               "likely JAX's TPU plugin (libtpu) is not installed: `make demo ACCEL=tpu`")
    elif not driver:
        why = (f"likely no NVIDIA driver is loaded (/sys/module/nvidia/version): install driver >= "
               f"{NVIDIA_DRIVER}, which CUDA 13 needs")
    elif int(driver.split(".")[0]) < NVIDIA_DRIVER:
        why = (f"likely the NVIDIA driver: {driver}, and CUDA 13 (jax[cuda13], torch's wheel) "
               f"needs >= {NVIDIA_DRIVER}: upgrade it (nvidia-smi shows it)")
    elif backend == "torch":  # (a CPU build says CUDA None; CUDA_VISIBLE_DEVICES may hide all)
        why = "likely a CPU build of torch, or CUDA_VISIBLE_DEVICES hides the GPUs"
    else:
        why = "likely JAX's CUDA plugin is not installed: `make demo ACCEL=cuda`"
    raise ValueError(f"mesh.device={mesh_cfg.device!r} is {target.kinds[0]}, but {backend} sees "
                     f"only the CPU ({sees}); {why}; to train on the CPU anyway pass "
                     "--mesh.device=")


# Compiler flags for a run on GPUs or TPUs, read once, when JAX starts its backend. Each overlaps
# FSDP's traffic with compute: without them every layer's weight gather (forward and backward) and
# gradient reduce-scatter waits on the compute before it, in each micro-batch.
GPU_FLAGS = [  # NVIDIA JAX-Toolbox rosetta/docs/GPU_performance.md; MaxText's H100 scripts
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # collectives scheduled under compute
    "--xla_gpu_enable_highest_priority_async_stream=true",  # ... and not starved by it
    "--xla_gpu_enable_pipelined_all_gather=true",  # layer i+1's weights gathered during layer i
    "--xla_gpu_enable_pipelined_reduce_scatter=true",  # layer i's gradients reduced during i-1
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",  # (the layers are a scan: a while loop)
    "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",  # a layer's gathers as one
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=33554432",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_all_gather_combine_by_dim=false",  # combine across dims too
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
]
TPU_FLAGS = [  # MaxText benchmarks/xla_flags_library.py: CF_FOR_ALL_GATHER, DATA_PARALLEL_OVERLAP
    "--xla_tpu_enable_async_collective_fusion=true",  # gathers fused into the compute that
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",  # runs meanwhile
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",  # data-parallel reductions pipelined
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
    # (DENSE_VMEM_LIMIT_FLAG) scoped VMEM for one op: splash_kernel's 2048-wide blocks need
    # 29 MiB; at the default 16 MiB the v5p compile fails with CompileTimeScopedVmemOom
    "--xla_tpu_scoped_vmem_limit_kib=98304",
]


def set_accelerator_flags(device, environ=os.environ):
    """Put GPU_FLAGS in XLA_FLAGS or TPU_FLAGS in LIBTPU_INIT_ARGS for mesh.device `device`, before
    JAX starts (a flag set later is never read). Yours come after ours: where both set a flag,
    yours wins. None for a CPU."""
    target = DEVICES.get(device)
    if target is None:
        return None
    gpu = target.kinds[0].startswith("NVIDIA")
    var, ours = ("XLA_FLAGS", GPU_FLAGS) if gpu else ("LIBTPU_INIT_ARGS", TPU_FLAGS)
    environ[var] = " ".join([*ours, environ.get(var, "")]).strip()
    return var


def compiler_options(mesh, dtype, m):
    """XLA options for the train step: on one CPU in fp32, YNNPACK's fusions (XLA's transpose
    slowly)."""
    # On one CPU, XLA's own code for an elementwise fusion that also transposes (the MLP's gate
    # gradient, laid out for its weight's matmul) runs ~15x slower than the same fusion
    # untransposed; YNNPACK's elementwise fusions avoid it: fp32 steps ~12% faster. bf16 steps
    # ran slower with them, and on a mesh of CPU devices context parallelism's layouts make XLA
    # refuse them ("unsupported layout in YNN fusion": they are experimental), as do the transposed
    # layouts of OLMo Hybrid's chunked delta rule: one CPU, fp32, no G layers only
    if mesh.devices.size > 1 or mesh.devices.flat[0].platform != "cpu" or dtype != "float32":
        return None
    if "G" in m.layer_pattern:
        return None
    kinds = ("INDIVIDUAL_DOT", "ELTWISE", "REDUCE")  # (XLA's default: first, last)
    fusions = ",".join(f"LIBRARY_FUSION_TYPE_{k}" for k in kinds)
    return {"xla_cpu_experimental_ynn_fusion_type": fusions}


def plan(cfg, names, topology, make_step, new_history):
    """Compile train.py's step for cfg's target (mesh.device x mesh.devices); print a device's
    memory. topology: libtpu's (v5p:8x8x4), or None for fake CPU devices."""
    m, dc, tc, target = cfg.model, cfg.data, cfg.train, cfg.mesh
    if not (target.device and target.devices):
        raise ConfigError(f"{' + '.join(names)} names no target to plan for: set mesh.device and "
                          "mesh.devices, or pass --device and --devices")
    if target.device not in DEVICES:
        raise ConfigError(f"mesh.device={target.device!r}: plan knows {', '.join(DEVICES)}")
    n = target.devices
    if topology:
        devices = topologies.get_topology_desc(topology, "tpu").devices
        caveat = f"TPU compiler for {topology} (libtpu): its own memory figures"
    else:
        jax.config.update("jax_num_cpu_devices", n)  # before anything touches a backend
        devices = jax.devices()
        caveat = ("CPU compiler on fake devices: it lowers gradient reductions as all-reduce, not "
                  "reduce-scatter, so 'temporary' over-states what a TPU/GPU needs; params and "
                  "optimizer state are exact")
    if len(devices) < n:
        raise ValueError(f"--topology {topology} has {len(devices)} devices, the target {n}")
    mesh = make_mesh(target, devices[:n])
    if m.moe_compute == "auto" and not topology:  # the target runs grouped experts (a CPU: dense)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, moe_compute="grouped"))
    _, micro, accum = check_batch(dc.global_batch, tc.micro_batch, dp_size(mesh), mesh_where(mesh))
    check_mesh(mesh.shape, m, dc.seq_len)
    table = model.param_table(m)
    p_sh, o_sh, h_sh = state_shardings(mesh, table)

    def abstract(shape, dtype, sh):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    params = {k: abstract(p.shape, jnp.float32, p_sh[k]) for k, p in table.items()}
    opt = dict(m=params, v=params, count=abstract((), jnp.int32, o_sh["count"]))
    hist = jax.tree.map(lambda x: abstract(x.shape, x.dtype, h_sh), jax.eval_shape(new_history))
    rows = dc.global_batch * (2 if tc.loss.startswith("dpo") else 1)  # (a pair: two rows)
    shape = (accum, rows // accum)
    batch = dict(tokens=abstract(shape + (dc.seq_len,), jnp.int32, batch_sharding(mesh)))
    if tc.loss != "ce":  # the answer's mask, a value per row
        batch["mask"] = abstract(batch["tokens"].shape, jnp.bool_, batch_sharding(mesh))
        for name in {"grpo": ("advantage", "reward")}.get(tc.loss, ("ref",)):
            batch[name] = abstract(shape, jnp.float32, batch_sharding(mesh, 1))
    t0 = time.perf_counter()
    compiled = make_step(cfg, mesh).lower(params, opt, hist, batch, jnp.float32(1e-4)).compile()
    seconds = time.perf_counter() - t0

    def per_dev(tree):  # bytes a device holds
        return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
                   for s in jax.tree.leaves(tree))
    p_bytes, o_bytes = per_dev(params), per_dev(opt)
    temp = compiled.memory_analysis().temp_size_in_bytes
    total, usable = p_bytes + o_bytes + per_dev(batch) + temp, usable_gib(target.device)
    attention = attention_impl(mesh, m, tc.compute_dtype, dc.doc_mask)
    gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
    print(f"{m.family} {model.count_params(m) / 1e9:.2f}B params, mesh {dict(mesh.shape)} ({n} x "
          f"{target.device}), batch {dc.global_batch} x {dc.seq_len} tokens, {accum} "
          f"micro-batch(es) of {micro} per rank, remat={tc.remat}, compute {tc.compute_dtype}, "
          f"attention {attention}; compiled in {seconds:.0f} s")
    print(f"  params            {gib(p_bytes)} per device (fp32)")
    print(f"  optimizer state   {gib(o_bytes)} per device (AdamW m, v)")
    print(f"  gradients + activations + workspace (XLA temporary) {gib(temp)}")
    fits = "fits" if total <= usable * 2**30 else "does NOT fit"
    if not topology and fits != "fits":  # (the CPU compiler's count is an upper bound)
        fits = ("over by the CPU compiler's count, an upper bound (XLA attention keeps (T, T) "
                "scores a kernel does not): `--topology` with libtpu, or the device, decides")
    print(f"  total             {gib(total)} of {usable:.1f} GiB JAX can use on a {target.device} "
          f"({DEVICES[target.device].hbm:g} GiB): {fits}")
    print(f"  ({caveat})")


# --- PyTorch: a process per device (torchrun), FSDP2 over mesh.data x mesh.fsdp ---
# The mesh config means what it means in JAX: data replicas x fsdp shards (HSDP when both are
# > 1); FSDP2 has no tensor or context parallelism here, so those axes must be 1.
TORCH_AXES = ("data", "fsdp")


def torch_start():
    """(rank, processes, device); under torchrun joined (nccl, or gloo on CPU). torchrun starts
    one process per device and names it in RANK, WORLD_SIZE and LOCAL_RANK (its GPU)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    device = torch.device(gpu if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def torch_shard(net, mesh_cfg, world, device, dtype):
    """FSDP2 over a (data, fsdp) mesh; bf16 `dtype`: OLMo-core's mixed precision. fully_shard
    splits each parameter's dim 0 over the fsdp ranks, gathers a block's weights just before it
    runs and reduce-scatters its gradients after."""
    sizes = dict(zip(AXES, mesh_shape(mesh_cfg, world)))
    if world == 1:
        return net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # HSDP: replicas over data, shards over fsdp
    shape = tuple(sizes[a] for a in TORCH_AXES)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=TORCH_AXES)
    policy = {}
    # bf16: gather each block's weights in bf16 (half the bytes), reduce-scatter the gradients in
    # fp32; the sharded weights and AdamW state stay fp32. The norm weights are rounded to bf16
    # too, as OLMo-core's are; RoPE's cos and sin stay fp32 (cast_forward_inputs=False). Without
    # the policy autograd keeps every weight's bf16 copy on each rank (the whole model at 7B)
    if dtype == torch.bfloat16:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    # each block, then the root (the embedding, final norm and head): one gather per block
    for part in [*net.layers, net]:
        fully_shard(part, mesh=mesh, **policy)
    return net


def torch_layout(mesh_cfg, world, table):
    """layout_table for torch: FSDP2 splits each tensor's rows (a layer's rows, if stacked)."""
    for axis in reversed(AXES):  # (the last first: a tensor split is named before a context one)
        if axis in TORCH_AXES:
            continue
        if (size := getattr(mesh_cfg, axis)) != 1:
            raise ValueError(f"mesh.{axis}={size}: the torch backend shards with FSDP2 only "
                             "(mesh.data x mesh.fsdp): set it to 1 or use the JAX backend")
    sizes = dict(zip(AXES, mesh_shape(mesh_cfg, world)))
    data, fsdp = sizes["data"], sizes["fsdp"]
    splits = {}
    for name, p in table.items():
        stacked = name.startswith("layers.")
        rows = p.shape[len(model.stacked_axes(name))]  # of the tensor of one layer (and expert)
        per = " per layer" if stacked else ""
        where = f"rows over fsdp={fsdp}{per}" if fsdp > 1 else "whole"
        splits[name] = where, -(-rows // fsdp) / rows  # torch.chunk: ceil(rows / fsdp) a rank
    summary = f"torch {torch.__version__}: {world} process(es), mesh data={data} x fsdp={fsdp}"
    return layout_table(table, splits) + [summary + (" (FSDP2)" if world > 1 else "")]


def is_dtensor(t):
    # imported here, not at the top: torch.distributed.tensor takes ~1 s to import, and JAX runs
    # never need it
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def torch_local(t):
    """(local piece of `t`, its index, writes: on replica 0 only), cut as torch.chunk cuts."""
    if not is_dtensor(t):
        return t, (slice(None),) * t.ndim, True
    local = t.to_local()
    idx = [slice(None)] * t.ndim
    writes = True
    for axis, placement in enumerate(t.placements):
        at, size = t.device_mesh.get_local_rank(axis), t.device_mesh.size(axis)
        if placement.is_shard():
            n = t.shape[placement.dim]
            rows = -(-n // size)  # torch.chunk: ceil(n / size), the last short or empty
            idx[placement.dim] = slice(min(at * rows, n), min((at + 1) * rows, n))
        elif at:
            writes = False
    expect = tuple(len(range(*s.indices(n))) for s, n in zip(idx, t.shape))
    if tuple(local.shape) != expect:
        raise RuntimeError(f"FSDP2 holds a {tuple(local.shape)} piece of a {tuple(t.shape)} "
                           f"tensor, torch.chunk {expect}: this torch cuts differently")
    return local, tuple(idx), writes


def torch_full(t):
    """The whole tensor on each process (a DTensor all-gathered)."""
    return t.full_tensor() if is_dtensor(t) else t


def torch_sum(t):
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def torch_barrier():
    if dist.is_initialized():
        dist.barrier()


def torch_allgather(values, device):
    """Every process's int `values` (n,) -> (processes, n) numpy on each."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    if not dist.is_initialized():
        return mine[None].cpu().numpy()
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every).cpu().numpy()


def main(argv):
    cfg = load_config(argv)
    mesh = make_mesh(cfg.mesh)
    print(describe(mesh))
    print("\n".join(jax_layout(mesh, model.param_table(cfg.model))))


if __name__ == "__main__":
    run_cli(main)
