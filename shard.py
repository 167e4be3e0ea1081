"""Device meshes and shardings. The model never sees any of this: train.py asks here how to lay out the
params and the batch, and jit does the rest.

    python shard.py            # print the mesh this machine would build

For now the mesh has one axis, "data": every device holds all parameters and a slice of the batch,
and jit's gradient all-reduce makes it plain data parallelism. (FSDP and tensor parallelism add the
"fsdp" and "tensor" axes and the logical-axis rules.)
"""

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def make_mesh(mesh_cfg, devices=None):
    devices = jax.devices() if devices is None else devices
    n = len(devices) if mesh_cfg.data == -1 else mesh_cfg.data
    if n != len(devices):
        raise ValueError(f"mesh.data={mesh_cfg.data} but there are {len(devices)} devices; "
                         f"the mesh must use every device (-1 means all)")
    return Mesh(np.array(devices).reshape(n), ("data",))


def param_sharding(mesh):
    return NamedSharding(mesh, P())  # replicated


def batch_sharding(mesh):
    """Token batches (A micro-batches, B instances, T): instances split over "data"."""
    return NamedSharding(mesh, P(None, "data"))


def instance_sharding(mesh):
    """A plain batch of instances (B, T), split over "data"."""
    return NamedSharding(mesh, P("data"))


def local_ranks(mesh):
    """Data-parallel ranks whose devices belong to this process, in mesh order."""
    return [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]


def describe(mesh):
    kinds = sorted({d.device_kind for d in mesh.devices.flat})
    return (f"mesh {dict(mesh.shape)} over {mesh.devices.size} device(s) ({', '.join(kinds)}), "
            f"{jax.process_count()} process(es)")


if __name__ == "__main__":
    from configs import load_config
    print(describe(make_mesh(load_config(sys.argv[1:]).mesh)))
