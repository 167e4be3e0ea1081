"""What one bf16 forward under FSDP2 leaves saved for the backward pass, with and without the mixed
precision policy (shard.torch_shard's dtype fp32 or bf16), and its loss and gradients against one
process. Run by tests/test_torch.py::test_fsdp2_bf16_saves_no_weight_copies:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_saved.py

Rank 0 prints one JSON line: per policy, the bytes each rank holds in saved bf16 tensors of a block
weight's full shape, and the loss and gradient errors relative to one process."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path is set)
import torch.distributed as dist  # noqa: E402

import model  # noqa: E402
import shard  # noqa: E402
from common import random_params, tokens, variant  # noqa: E402
from configs import MeshConfig  # noqa: E402


def run(net, x, y):
    """One bf16 forward, recording what autograd saves, then the backward: (bytes, loss, grads)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = net(x, torch.bfloat16)
    # The block weights' full shapes, either way round (a matmul saves the weight transposed).
    shapes = {tuple(p.shape) for n, p in net.named_parameters() if n.startswith("layers.")}
    shapes |= {s[::-1] for s in shapes}
    # FSDP2 frees a gathered weight after its block: a saved weight holds 0 bytes, a .to() copy all.
    held = {}
    for t in saved:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().size()
    loss = model.cross_entropy_torch(logits, y)[0]
    loss.backward()
    grads = {n: shard.torch_full(p.grad).float() for n, p in net.named_parameters()}
    return sum(held.values()), loss.item(), grads


def main():
    rank, world, device = shard.torch_start()
    m = variant("olmo2")
    params = random_params(m, std=0.1)
    # Every rank runs the same batch, so FSDP2's mean of the gradients is one process's gradient.
    x = tokens(m, B=2, T=20)  # (B*T differs from every weight dimension)
    x, y = torch.from_numpy(x), torch.from_numpy(model.shift_labels(x))
    _, loss1, grads1 = run(model.torch_model(m, params), x, y)  # one process: no FSDP2
    matrices = [n for n in params if n.startswith("layers.") and params[n].ndim == 3]
    out = dict(bf16_block_matrices=sum(2 * params[n].size for n in matrices))
    for name, dtype in (("no_policy", torch.float32), ("policy", torch.bfloat16)):
        mesh = MeshConfig(data=1, fsdp=2)
        net = shard.torch_shard(model.torch_model(m, params), mesh, world, device, dtype)
        held, loss, grads = run(net, x, y)
        every = [None] * world
        dist.all_gather_object(every, held)
        rel = max(float((grads[n] - grads1[n]).abs().max() / grads1[n].abs().max()) for n in grads1)
        out[name] = dict(saved_bytes=every, loss_rel=abs(loss - loss1) / abs(loss1), grad_rel=rel)
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
