"""Device meshes and shardings: how train.py lays out params, optimizer state and batch (GSPMD
inserts the communication; the model sees no mesh). Also: torchrun + FSDP2, what a process
checkpoints, what each device has, the ahead-of-time plan. Why: docs/sharding.md#notes-from-shardpy.

    python shard.py configs/olmo3-7b.toml --mesh.data=1 --mesh.fsdp=-1  # the mesh, param layouts
"""

import functools
import glob
import hashlib
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
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import convert
import model
from configs import ConfigError, load_config, run_cli


# --- the mesh, and how params, optimizer state and batches split over it ---

# A parameter's logical axis -> the mesh axes it splits over: embed FSDP-style, the others
# Megatron-style, layers not (the scan walks them)
RULES = {"embed": ("fsdp",), "heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",),
         "vocab": ("tensor",), "layers": ()}
AXES = ("data", "fsdp", "context", "tensor")
BATCH = ("data", "fsdp")  # instances split over these (positions: context)


def mesh_shape(mesh_cfg, n_devices):
    """(data, fsdp, context, tensor), the -1 filled, checked against n_devices."""
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
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 4, devices=devices)


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
    """Rows (B, T) split over data × fsdp and context; (B,) over data × fsdp."""
    return NamedSharding(mesh, P(BATCH, "context") if ndim == 2 else P(BATCH))


def batch_sharding(mesh, ndim=2):
    """A step's batch (A micro-batches, B rows, T) or values (A, B); A not split."""
    return NamedSharding(mesh, P(None, *instance_sharding(mesh, ndim).spec))


def residual_constraint(mesh):
    """Pin the residual stream (B, T, D): instances over data x fsdp, positions over context (else
    GSPMD may split it on D like the weights)."""
    pinned = NamedSharding(mesh, P(BATCH, "context", None))
    return lambda x: jax.lax.with_sharding_constraint(x, pinned)


# --- attention on a mesh: a kernel or context parallelism under shard_map ---

def attention(mesh, m, dtype, documents):
    """model.forward's attention on this mesh: XLA's split by GSPMD; a kernel (which GSPMD would
    gather) or context parallelism under shard_map."""
    context, impl = mesh.shape["context"], attention_impl(mesh, m, dtype, documents)
    attend = model.ATTEND[impl]
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


def attention_impl(mesh, m, dtype, documents):
    """What `attention` runs (model.pick_attention on this mesh)."""
    return model.pick_attention(m, dtype, documents, mesh.devices.flat[0], mesh.shape["context"])


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


def mesh_where(mesh):
    """Data-parallel axes, for check_batch's errors."""
    return f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}"


def dp_size(mesh):
    return mesh.shape["data"] * mesh.shape["fsdp"]


def local_ranks(mesh):
    """Data-parallel ranks (data-major) with a device in this process."""
    devs = mesh.devices.reshape(dp_size(mesh), -1)  # (ranks, tensor)
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


# --- checkpoints: the piece of each array a process writes (train.save_checkpoint), reads back ---

def stored_slices(name, shape, prefix, idx):
    """[(stored name, index)] slice idx of a param covers, per layer if stacked; prefix "model.":
    HF's names (convert.hf_name)."""
    rename = convert.hf_name if prefix == "model." else lambda n: prefix + n  # noqa: E731
    if not name.startswith("layers."):
        return [(rename(name), idx)]
    return [(rename(model.layer_name(name, i)), idx[1:]) for i in range(*idx[0].indices(shape[0]))]


def jax_pieces(trees):
    """(stored name, index, read) of each shard here (replica 0) of [(prefix, {name: array})];
    read() copies it to the host then (a stacked shard once for all its layers)."""
    for prefix, tree in trees:
        for name, a in tree.items():
            for sh in a.addressable_shards:
                if sh.replica_id:
                    continue  # another device writes the same values
                host = functools.cache(lambda sh=sh: np.asarray(sh.data))
                stacked = name.startswith("layers.")  # one stored name per layer
                for i, (fname, idx) in enumerate(stored_slices(name, a.shape, prefix, sh.index)):
                    yield fname, idx, (lambda i=i, host=host: host()[i]) if stacked else host


def jax_read(views, prefix, table, shardings):
    """{name: global fp32 array}, each device's slice read from stored tensors."""
    def read(name, idx):
        pieces = stored_slices(name, table[name].shape, prefix, idx)
        parts = [np.asarray(views[f][i], np.float32) for f, i in pieces]
        return np.stack(parts) if name.startswith("layers.") else parts[0]

    return {k: jax.make_array_from_callback(p.shape, shardings[k], lambda idx, k=k: read(k, idx))
            for k, p in table.items()}


# --- what each device has, how XLA compiles for it, and the plan for a mesh we lack ---
# A JAX device: a TPU v4/v5p chip, TPU7x TensorCore or GPU (docs/sharding.md#devices)

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
    """GiB per device a JAX run may use: a TPU's all, 75% of a GPU's (unless XLA_*MEM_FRACTION
    moves it)."""
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
    # (DENSE_VMEM_LIMIT_FLAG) scoped VMEM for one op: splash's 2048-wide blocks (model.py) need
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


def compiler_options(mesh, dtype):
    """XLA options for the train step: on one CPU in fp32, YNNPACK's fusions (XLA's transpose
    slowly)."""
    if mesh.devices.size > 1 or mesh.devices.flat[0].platform != "cpu" or dtype != "float32":
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

def torch_start():
    """(rank, processes, device); under torchrun joined (nccl, or gloo on CPU)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    gpu = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    device = torch.device(gpu if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def torch_shard(net, mesh_cfg, world, device, dtype):
    """FSDP2 over a (data, fsdp) mesh; bf16 `dtype`: OLMo-core's mixed precision."""
    data, fsdp, _, _ = mesh_shape(mesh_cfg, world)
    if world == 1:
        return net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # HSDP: replicas over data, shards over fsdp
    mesh = init_device_mesh(device.type, (data, fsdp), mesh_dim_names=("data", "fsdp"))
    policy = {}
    if dtype == torch.bfloat16:  # else autograd keeps every weight's bf16 copy on each rank
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    for part in [*net.layers, net]:  # each block, then the root
        fully_shard(part, mesh=mesh, **policy)
    return net


def torch_layout(mesh_cfg, world, table):
    """layout_table for torch: FSDP2 splits each tensor's rows (a layer's rows, if stacked)."""
    for axis in ("tensor", "context"):
        if (size := getattr(mesh_cfg, axis)) != 1:
            raise ValueError(f"mesh.{axis}={size}: the torch backend shards with FSDP2 only "
                             "(mesh.data x mesh.fsdp): set it to 1 or use the JAX backend")
    data, fsdp, _, _ = mesh_shape(mesh_cfg, world)
    splits = {}
    for name, p in table.items():
        stacked = name.startswith("layers.")
        rows = p.shape[1] if stacked else p.shape[0]
        per = " per layer" if stacked else ""
        where = f"rows over fsdp={fsdp}{per}" if fsdp > 1 else "whole"
        splits[name] = where, -(-rows // fsdp) / rows  # torch.chunk: ceil(rows / fsdp) a rank
    summary = f"torch {torch.__version__}: {world} process(es), mesh data={data} x fsdp={fsdp}"
    return layout_table(table, splits) + [summary + (" (FSDP2)" if world > 1 else "")]


def is_dtensor(t):
    # imported here: slow, and JAX runs never need it
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
