"""Device meshes and shardings: this file lays things out for the devices. The model never sees any of this:
train.py asks here how to lay out the params, the optimizer state and the batch, and jit (GSPMD)
inserts the communication. The torch backend's equivalent (torchrun processes, FSDP2's fully_shard)
is the second half. Between them: which piece of each array a process writes to a checkpoint and reads back, what
each device has (peak FLOP/s, HBM, and the XLA options its train step compiles with), and the ahead-of-time plan
(train.py's step, passed in, compiled for a mesh you do not have: `python train.py plan`).

    python shard.py configs/olmo3-7b.toml --mesh.data=1 --mesh.fsdp=-1   # the mesh and each parameter's layout here

The mesh has four axes, ("data", "fsdp", "context", "tensor"). The batch is split over data × fsdp, and each
instance's T positions over context; parameters are split by the logical axes the parameter table gives each
dimension, through RULES:
    embed -> fsdp (FSDP/ZeRO-3: each device keeps 1/fsdp of every weight, gathered for use). Not also over
             context, as OLMo-core shards: the embedding lookup's output would then be split on D over every
             device, and XLA cannot move that to (instances, positions) without first gathering all of it
             (measured with `train.py plan`: 32 GiB more per device at 64 x 65536)
    heads, kv_heads, mlp, vocab -> tensor (Megatron-style tensor parallelism)
    layers -> not split (the scan walks over it)
Context parallelism (`attention`) is the one place that writes its communication by hand.
"""

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax.experimental import multihost_utils, topologies
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import convert
import model
from configs import load_config, run_cli


RULES = {"embed": ("fsdp",), "heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",),
         "vocab": ("tensor",), "layers": ()}
AXES = ("data", "fsdp", "context", "tensor")
BATCH = ("data", "fsdp")  # the axes the instances of a batch are split over (context splits their positions)


def mesh_shape(mesh_cfg, n_devices):
    """(data, fsdp, context, tensor) with the one -1 filled in; checked against the device count."""
    sizes = [getattr(mesh_cfg, a) for a in AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {dict(zip(AXES, sizes))}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ValueError(f"mesh {dict(zip(AXES, sizes))}: {n_devices} devices do not divide by {known}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, there are {n_devices}")
    return tuple(sizes)


def make_mesh(mesh_cfg, devices=None):
    devices = jax.devices() if devices is None else devices
    # Auto axes: shardings go in through jit's in/out_shardings (jax.make_mesh defaults to Explicit).
    return jax.make_mesh(mesh_shape(mesh_cfg, len(devices)), AXES, axis_types=(AxisType.Auto,) * 4, devices=devices)


# exercise: fsdp_rules
def spec_for(name, param, mesh_sizes):
    """PartitionSpec of one parameter from its logical axes; every split must divide its dimension."""
    out = []
    for dim, logical in zip(param.shape, param.axes):
        axes = tuple(a for a in RULES[logical] if mesh_sizes[a] > 1)  # a mesh axis of size 1 splits nothing
        if dim % math.prod(mesh_sizes[a] for a in axes):
            raise ValueError(f"{name}: dimension '{logical}' of size {dim} does not divide over "
                             + " x ".join(f"mesh axis '{a}' of size {mesh_sizes[a]}" for a in axes))
        out.append(axes[0] if len(axes) == 1 else axes or None)
    return P(*out)


def param_shardings(mesh, table):
    sizes = dict(mesh.shape)
    return {name: NamedSharding(mesh, spec_for(name, p, sizes)) for name, p in table.items()}


def replicated(mesh):
    return NamedSharding(mesh, P())


def state_shardings(mesh, table):
    """(params, AdamW's m, v and count, the skip-step history): the moments laid out as their params."""
    p = param_shardings(mesh, table)
    return p, dict(m=p, v=p, count=replicated(mesh)), replicated(mesh)


def batch_sharding(mesh, ndim=2):
    """Step batches (A micro-batches, B rows, T): rows split over data × fsdp, positions over context; a value per
    row (ndim 1: DPO's reference log-prob, GRPO's advantage) (A, B) over data × fsdp."""
    return NamedSharding(mesh, P(None, BATCH, "context") if ndim == 2 else P(None, BATCH))


def instance_sharding(mesh, ndim=2):
    """A plain batch of rows (B, T), split over data × fsdp and context; (B,) over data × fsdp."""
    return NamedSharding(mesh, P(BATCH, "context") if ndim == 2 else P(BATCH))


def residual_constraint(mesh):
    """Pin the residual stream (B, T, D) to "instances over data x fsdp, positions over context". Measured with
    `plan`: without it GSPMD meets weights split on D over fsdp and may split the activations the same way, keeping
    whole batches on every device (olmo3-7b, fsdp=256, 512 x 8192: 3 TiB of temporaries per device)."""
    return lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(BATCH, "context", None)))


def attention(mesh, m):
    """None where GSPMD splits model.attend (XLA) by itself; else an attend_fn for model.forward that runs attention
    on each device's own data under shard_map: its instances (data x fsdp) and heads (tensor), and with a context
    axis its slice of every sequence's positions.
    A kernel (model.attention splash or cudnn) is a custom call the partitioner cannot split: left to GSPMD it would
    gather every instance onto every device. Context parallelism (OLMo-core's "llama3", MaxText's all_gather):
    device c of the context axis holds positions [c·T/C, (c+1)·T/C) of every instance it shares. Each keeps its
    queries, all-gathers the keys, values and document ids of the whole sequence, and attends from its own offset,
    so causal, sliding and document masks are exactly those of one device; the backward pass reduce-scatters dK,
    dV (JAX transposes the gather). No load balancing (OLMo-core's choice too): the offset is traced, so a full
    layer scores its T/C queries against all T keys and masks, the same work on every shard (twice the causal
    minimum), and a sliding layer (3 of Olmo 3's 4) W keys on every shard. MaxText's zig-zag order pays only with a
    kernel that skips masked blocks. The XLA attention runs inside, whatever model.attention says (splash's masks
    are built for one T)."""
    impl, context = model.pick_attention(m), mesh.shape["context"]
    if context == 1 and (impl == "xla" or mesh.devices.size == 1):
        return None
    qkv, ids = P(BATCH, "context", "tensor", None), P(BATCH, "context")

    def attend_fn(q, k, v, window, scale, segments=None):
        def local(q, k, v, *segments):  # q (B/dp, T/C, N/tp, H), k and v (B/dp, T/C, K/tp, H)
            if context == 1:
                return model.ATTEND[impl](q, k, v, window, scale, *segments)
            gather = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)  # noqa: E731  (.., T, ..)
            offset = jax.lax.axis_index("context") * q.shape[1]
            return model.attend(q, gather(k), gather(v), window, scale, *map(gather, segments), offset=offset)
        args = (q, k, v) + (() if segments is None else (segments,))
        return jax.shard_map(local, mesh=mesh, in_specs=(qkv,) * 3 + (ids,) * (len(args) - 3), out_specs=qkv,
                             check_vma=False)(*args)  # (a kernel's custom call has no replication rule to check)
    return attend_fn


def check_context(context, seq_len):
    if seq_len % context:
        raise ValueError(f"data.seq_len={seq_len} does not divide over mesh.context={context}: each context "
                         "device holds an equal slice of every instance")


def mesh_where(mesh):
    return f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}"


def dp_size(mesh):
    return mesh.shape["data"] * mesh.shape["fsdp"]


def local_ranks(mesh):
    """Data-parallel ranks (data-major, then fsdp) with a device in this process, in order."""
    devs = mesh.devices.reshape(dp_size(mesh), -1)  # (ranks, tensor)
    return [r for r in range(len(devs)) if any(d.process_index == jax.process_index() for d in devs[r])]


def check_batch(global_batch, micro_batch, dp, where):
    """(instances per rank, micro-batch, micro-batches per step) for `dp` ranks (`where`: whence, for errors)."""
    if global_batch % dp:
        raise ValueError(f"data.global_batch={global_batch} does not divide over the {dp} data-parallel ranks ({where})")
    per_rank = global_batch // dp
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(f"train.micro_batch={micro} does not divide the {per_rank} instances each rank gets per step")
    return per_rank, micro, per_rank // micro


def layout_table(table, split, dtype_bytes=4):
    """One line per parameter: how it is split and its bytes per device (params only; AdamW adds 2x that).
    split(name, param) -> (where, the fraction of the tensor one device holds)."""
    lines, total = [], 0
    for name, p in table.items():
        where, fraction = split(name, p)
        per_dev = int(math.prod(p.shape) * dtype_bytes * fraction)
        total += per_dev
        lines.append(f"{name:<42} {where:<34} {per_dev / 2**20:>10.2f} MiB/device")
    lines.append(f"{'params in all':<42} {'':<34} {total / 2**30:>10.3f} GiB/device (+2x for AdamW moments)")
    return lines


def jax_layout(mesh, table):
    """layout_table for a JAX mesh: each parameter's PartitionSpec."""
    specs = {name: sh.spec for name, sh in param_shardings(mesh, table).items()}
    axes = lambda spec: [a for d in spec if d for a in (d if isinstance(d, tuple) else (d,))]  # noqa: E731
    split = lambda name, p: (str(specs[name]), 1 / math.prod(mesh.shape[a] for a in axes(specs[name])))  # noqa: E731
    return layout_table(table, split)


def describe(mesh):
    kinds = sorted({d.device_kind for d in mesh.devices.flat})
    return (f"mesh {dict(mesh.shape)} over {mesh.devices.size} device(s) ({', '.join(kinds)}), "
            f"{jax.process_count()} process(es)")


def jax_barrier():
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("barrier")


def start_distributed():
    """Multi-host: when the launcher set JAX_COORDINATOR_ADDRESS (and JAX_NUM_PROCESSES, JAX_PROCESS_ID),
    join the other processes. TPU pods and SLURM fill these in by themselves; call before any device use."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU processes talk over gloo (tests, laptops)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))


# --- checkpoints: the piece of each array this process writes (train.save_checkpoint), and reads back ---------

def stored(name, shape, prefix, idx):
    """[(stored name, index)] that slice idx of a param covers, one per layer if stacked; prefix "model.": HF names."""
    rename = convert.hf_name if prefix == "model." else lambda n: prefix + n  # noqa: E731
    if not name.startswith("layers."):
        return [(rename(name), idx)]
    return [(rename(model.layer_name(name, i)), idx[1:]) for i in range(*idx[0].indices(shape[0]))]


def jax_pieces(trees):
    """(stored name, index, numpy) for replica 0 of every shard this process holds, of [(prefix, {name: array})]."""
    for prefix, tree in trees:
        for name, a in tree.items():
            for sh in a.addressable_shards:
                if sh.replica_id:
                    continue  # another device holds the same values and writes them
                value = np.asarray(sh.data)
                values = value if name.startswith("layers.") else [value]  # one per stored tensor
                for (fname, idx), v in zip(stored(name, a.shape, prefix, sh.index), values):
                    yield fname, idx, v


def jax_read(views, prefix, table, shardings):
    """{name: global array}, each device's slice read straight from the stored tensors (fp32 whatever they hold)."""
    def read(name, idx):
        parts = [np.asarray(views[f][i], np.float32) for f, i in stored(name, table[name].shape, prefix, idx)]
        return np.stack(parts) if name.startswith("layers.") else parts[0]

    return {k: jax.make_array_from_callback(p.shape, shardings[k], lambda idx, k=k: read(k, idx))
            for k, p in table.items()}


# --- what each device has (from the vendors' spec sheets) and how XLA compiles for it -------------
# Dense bf16 peak FLOP/s (the MFU in train.py's log; unknown devices, CPUs, get none) and HBM (a plan's budget).
PEAK_FLOPS = {
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
    "TPU v6e": 918e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA GH200 480GB": 989e12,
}  # (JAX's device_kind and torch.cuda.get_device_name give the same strings)
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100": 80, "h100": 80, "h200": 141, "b200": 180}


def compiler_options(mesh, dtype):
    """XLA options for the train step on this mesh's devices. On one CPU, XLA's own code for an elementwise fusion
    that also transposes (the MLP's gate gradient, laid out for its weight's matmul) runs ~15x slower than the same
    fusion untransposed; YNNPACK's elementwise fusions avoid it: fp32 steps ~12% faster (docs/backends.md). bf16
    steps ran slower with them, and on a mesh of CPU devices context parallelism's layouts make XLA refuse them
    ("unsupported layout in YNN fusion": they are experimental), so one CPU in fp32 only."""
    if mesh.devices.size > 1 or mesh.devices.flat[0].platform != "cpu" or dtype != "float32":
        return None
    kinds = ("INDIVIDUAL_DOT", "ELTWISE", "REDUCE")  # (XLA's default is the first and last)
    return {"xla_cpu_experimental_ynn_fusion_type": ",".join(f"LIBRARY_FUSION_TYPE_{k}" for k in kinds)}


# --- the ahead-of-time plan: compile the train step for a mesh we do not have ---------------------

def plan(argv, make_step, new_history):
    """python train.py plan CONFIG.toml... --mesh data=D,fsdp=F,context=C,tensor=T [--batch B --seq T]
    [--device h100] [--topology v5p:8x8x4] [--section.key=value ...]: the train step compiled for that mesh, and
    its memory per device read off the compiler (memory_analysis), against the device's HBM. The step is train.py's,
    passed in (make_step(cfg, mesh), and new_history() its skip-step state), so that nothing here imports train.py."""
    ap = argparse.ArgumentParser(prog="train.py plan", description=plan.__doc__)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--mesh", required=True, help="data=D,fsdp=F,context=C,tensor=T (those left out: the config's)")
    ap.add_argument("--batch", type=int, help="instances per step (global); default data.global_batch")
    ap.add_argument("--seq", type=int, help="tokens per instance; default data.seq_len")
    ap.add_argument("--device", default="h100", choices=sorted(HBM_GIB), help="whose memory to compare against")
    ap.add_argument("--topology", default=None, help="with libtpu installed: compile for this TPU topology, e.g. v5p:8x8x4")
    args, extra = ap.parse_known_args(argv)  # extra: --section.key=value config overrides
    sizes = dict(part.split("=") for part in args.mesh.split(","))
    cfg = load_config(args.configs + extra + [f"--mesh.{k}={v}" for k, v in sizes.items()]
                      + [f"--data.global_batch={args.batch}"] * bool(args.batch) + [f"--data.seq_len={args.seq}"] * bool(args.seq))
    args.batch, args.seq = cfg.data.global_batch, cfg.data.seq_len
    n = math.prod(int(v) for v in sizes.values())
    if args.topology:
        devices, device = topologies.get_topology_desc(args.topology, "tpu").devices, args.topology.split(":")[0]
        caveat = f"TPU compiler for {args.topology} (libtpu): its own memory figures"
    else:
        jax.config.update("jax_num_cpu_devices", n)  # must happen before anything touches a backend
        devices, device = jax.devices(), args.device
        caveat = ("CPU compiler on fake devices: it lowers gradient reductions as all-reduce, not reduce-scatter, "
                  "so 'temporary' over-states what a TPU/GPU needs; params and optimizer state are exact")
    mesh = make_mesh(cfg.mesh, devices[:n])
    m, tc = cfg.model, cfg.train
    _, micro, accum = check_batch(args.batch, tc.micro_batch, dp_size(mesh), mesh_where(mesh))
    check_context(mesh.shape["context"], args.seq)
    p_sh, o_sh, h_sh = state_shardings(mesh, model.param_table(m))
    abstract = lambda shape, dtype, sh: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    params = {k: abstract(p.shape, jnp.float32, p_sh[k]) for k, p in model.param_table(m).items()}
    opt = dict(m=params, v=params, count=abstract((), jnp.int32, o_sh["count"]))
    hist = jax.tree.map(lambda x: abstract(x.shape, x.dtype, h_sh), jax.eval_shape(new_history))
    batch = dict(tokens=abstract((accum, args.batch // accum, args.seq), jnp.int32, batch_sharding(mesh)))
    t0 = time.perf_counter()
    compiled = make_step(cfg, mesh).lower(params, opt, hist, batch, jnp.float32(1e-4)).compile()
    seconds = time.perf_counter() - t0
    per_dev = lambda tree: sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(tree))  # noqa: E731
    p_bytes, o_bytes, temp = per_dev(params), per_dev(opt), compiled.memory_analysis().temp_size_in_bytes
    total, hbm = p_bytes + o_bytes + per_dev(batch) + temp, HBM_GIB[device]
    gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
    print(f"{m.family} {model.count_params(m) / 1e9:.2f}B params, mesh {dict(mesh.shape)} ({n} devices), "
          f"batch {args.batch} x {args.seq} tokens, {accum} micro-batch(es) of {micro} per rank, "
          f"remat={tc.remat}, compute {tc.compute_dtype}; compiled in {seconds:.0f} s")
    print(f"  params            {gib(p_bytes)} per device (fp32)")
    print(f"  optimizer state   {gib(o_bytes)} per device (AdamW m, v)")
    print(f"  gradients + activations + workspace (XLA temporary) {gib(temp)}")
    print(f"  total             {gib(total)} of {hbm} GiB ({device}): {'fits' if total <= hbm * 2**30 else 'does NOT fit'}")
    print(f"  ({caveat})")


# --- PyTorch: torchrun processes and FSDP2 --------------------------------------------------------
# torchrun starts one process per device (RANK, WORLD_SIZE, LOCAL_RANK); FSDP2's fully_shard splits each parameter's
# dim 0 over the ranks, gathers a block's weights just before it runs, reduce-scatters its gradients after. The mesh
# config means what it does in JAX: data = replicas, fsdp = shards (both > 1 is HSDP); no tensor parallelism.

def torch_start():
    """(rank, processes, device) of this process; under torchrun, join the others (nccl on GPUs, gloo on CPU)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def torch_shard(net, mesh_cfg, world, device):
    """fully_shard each block, then the root (embedding, final norm, head), over a (data, fsdp) device mesh."""
    data, fsdp, _, _ = mesh_shape(mesh_cfg, world)
    if world == 1:
        return net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # fully_shard on a 2-D mesh replicates over the first axis and shards over the second (HSDP);
    # data=N, fsdp=1 is plain data parallelism, each rank keeping whole weights.
    mesh = init_device_mesh(device.type, (data, fsdp), mesh_dim_names=("data", "fsdp"))
    for block in net.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def torch_layout(mesh_cfg, world, table):
    """layout_table for the torch backend: FSDP2 splits the rows of every tensor (each layer's, for stacked ones)."""
    for axis in ("tensor", "context"):
        if getattr(mesh_cfg, axis) != 1:
            raise ValueError(f"mesh.{axis}={getattr(mesh_cfg, axis)}: the torch backend shards with FSDP2 only "
                             f"(mesh.data x mesh.fsdp); {axis} parallelism is the JAX backend's")
    data, fsdp, _, _ = mesh_shape(mesh_cfg, world)

    def split(name, p):
        rows = p.shape[1] if name.startswith("layers.") else p.shape[0]
        where = f"rows over fsdp={fsdp}" + (" per layer" if name.startswith("layers.") else "") if fsdp > 1 else "whole"
        return where, -(-rows // fsdp) / rows  # torch.chunk's ceil(rows / fsdp) rows on the first ranks

    return layout_table(table, split) + [f"torch {torch.__version__}: {world} process(es), mesh data={data} x fsdp={fsdp}"
                                         + (" (FSDP2)" if world > 1 else "")]


def is_dtensor(t):
    # Imported here, not at the top: torch.distributed.tensor takes ~1 s to import, and JAX runs never need it.
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def torch_local(t):
    """(local tensor, index into the whole tensor, writes) for the piece of `t` this process holds. FSDP2
    cuts dim 0 as torch.chunk does (ceil(n/shards) rows each, the last ones shorter or empty). `writes` is
    False on all replicas but the first, so a checkpoint gets each value once."""
    if not is_dtensor(t):
        return t, (slice(None),) * t.ndim, True
    local, idx, writes = t.to_local(), [slice(None)] * t.ndim, True
    for axis, placement in enumerate(t.placements):
        at, size = t.device_mesh.get_local_rank(axis), t.device_mesh.size(axis)
        if placement.is_shard():
            n = t.shape[placement.dim]
            rows = -(-n // size)
            idx[placement.dim] = slice(min(at * rows, n), min((at + 1) * rows, n))
        elif at:
            writes = False
    expect = tuple(len(range(*s.indices(n))) for s, n in zip(idx, t.shape))
    if tuple(local.shape) != expect:
        raise RuntimeError(f"FSDP2 holds a {tuple(local.shape)} piece of a {tuple(t.shape)} tensor here, where "
                           f"torch.chunk would give {expect}: this torch cuts tensors differently")
    return local, tuple(idx), writes


def torch_full(t):
    """The whole tensor on every process (FSDP2 all-gathers a DTensor)."""
    return t.full_tensor() if is_dtensor(t) else t


def torch_sum(t):
    """Sum over the processes (nothing to do in one)."""
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def torch_barrier():
    if dist.is_initialized():
        dist.barrier()


def main(argv):
    cfg = load_config(argv)
    mesh = make_mesh(cfg.mesh)
    print(describe(mesh))
    print("\n".join(jax_layout(mesh, model.param_table(cfg.model))))


if __name__ == "__main__":
    run_cli(main)
