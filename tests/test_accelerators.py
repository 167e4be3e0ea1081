"""The GPU and TPU paths, proved from this CPU: the attention each device gets, the real train step
lowered for CUDA and TPU (tests/lower_check.py), full fp32 matmuls, the shipped configs against
their targets, device tables, the memory JAX may use, a mesh that splits heads it cannot, an
accelerator JAX does not see, the train bench's rows (tests/bench.py)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

import model
import shard
import train
from bench import bench_rows
from common import SHIPPED, variant
from configs import load_config, run_cli

ROOT = Path(__file__).resolve().parents[1]
H100, A100, TPU, CPU = ("gpu", (9, 0)), ("gpu", (8, 0)), ("tpu", None), ("cpu", None)
def pick(monkeypatch, accelerator, m, dtype, documents=False, context=1):
    """shard.pick_attention on `accelerator` (platform, capability): its device query stubbed."""
    monkeypatch.setattr(shard, "accelerator", lambda device=None: accelerator)
    return shard.pick_attention(m, dtype, documents, None, context)


# --- 1, 12: attention that cannot crash --------------------------------------------------------

def test_auto_attention_takes_a_kernel_only_where_it_runs(monkeypatch):
    """auto on a GPU: cuDNN in bf16 only (JAX's cuDNN call raises NotImplementedError in fp32),
    head_dim 256 only from Hopper on, never with document ids or a context axis; on a TPU splash
    always (it takes both)."""
    m, h256 = variant("olmo3", head_dim=128), variant("olmo3", head_dim=256)
    assert pick(monkeypatch, H100, m, "float32") == "xla"
    assert pick(monkeypatch, H100, m, "bfloat16") == "cudnn"
    assert pick(monkeypatch, H100, m, jnp.bfloat16, documents=True) == "xla"
    assert pick(monkeypatch, H100, m, "bfloat16", context=2) == "xla"
    assert pick(monkeypatch, H100, h256, "bfloat16") == "cudnn"
    assert pick(monkeypatch, A100, h256, "bfloat16") == "xla"
    assert pick(monkeypatch, A100, m, "bfloat16") == "cudnn"
    # (a T4: no flash attention in cuDNN)
    assert pick(monkeypatch, ("gpu", (7, 5)), m, "bfloat16") == "xla"
    assert pick(monkeypatch, TPU, m, "float32", documents=True, context=8) == "splash"
    assert pick(monkeypatch, CPU, m, "bfloat16") == "xla"


def test_a_kernel_that_cannot_run_is_refused_up_front(monkeypatch):
    cudnn = variant("olmo3", head_dim=256, attention="cudnn")
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here: cuDNN takes "
                                         r"bfloat16 or float16, not float32: "
                                         r"set train.compute_dtype=bfloat16"):
        pick(monkeypatch, H100, cudnn, "float32")
    with pytest.raises(ValueError, match=r"head_dim <= 128, a multiple of 8, "
                                         r"on compute capability 8.0; not 256"):
        pick(monkeypatch, A100, cudnn, "bfloat16")
    with pytest.raises(ValueError, match=r"no document ids \(data.doc_mask\): use xla or splash"):
        pick(monkeypatch, H100, cudnn, "bfloat16", documents=True)
    with pytest.raises(ValueError, match=r"cuDNN needs an NVIDIA GPU, and JAX runs on cpu"):
        pick(monkeypatch, CPU, cudnn, "bfloat16")
    # ... before anything compiles: the JAX backend asks as it starts
    cfg = load_config(["configs/tiny.toml", "--model.attention=cudnn", "--data.path=."])
    with pytest.raises(ValueError, match=r"model.attention='cudnn' cannot run here"):
        train.JaxBackend(cfg)


@pytest.fixture(scope="module")
def lowered():
    """tests/lower_check.py: shipped configs' train steps and eval paths lowered for CUDA and TPU
    from this CPU."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "tests/lower_check.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", ["olmo2-1b", "olmo3-7b", "olmo3-7b-h256"])
def test_shipped_steps_lower_for_cuda_and_tpu(lowered, config):
    """The train step of each shipped config, bf16 as shipped, with attention=auto: the cuDNN custom
    call (forward, and its backward) on an H100, the Mosaic kernel on a TPU, and nothing raises;
    eval's forward too. On an A100 the 256-wide heads take XLA."""
    gpu, tpu = lowered[f"{config} h100"], lowered[f"{config} tpu"]
    assert gpu["attention"] == "cudnn"
    assert gpu["step"]["cudnn_forward"] and gpu["step"]["cudnn_backward"]
    assert gpu["forward"]["cudnn_forward"] and not gpu["step"]["mosaic"]
    assert tpu["attention"] == "splash" and tpu["step"]["mosaic"] and tpu["forward"]["mosaic"]
    assert not tpu["step"]["cudnn_forward"]
    if config == "olmo3-7b-h256":
        a100 = lowered[f"{config} a100"]
        assert a100["attention"] == "xla"
        assert not a100["step"]["cudnn_forward"] and a100["step"]["dots"]


def test_long_context_lowers_with_the_kernel_it_can_use(lowered):
    """Stage 3 (packed documents, 2 context devices per instance): XLA on a GPU (cuDNN takes
    neither), splash on a TPU, one kernel per context shard."""
    gpu, tpu = lowered["olmo3-7b-stage3 h100"], lowered["olmo3-7b-stage3 tpu"]
    assert gpu["attention"] == "xla" and not gpu["step"]["cudnn_forward"]
    assert tpu["attention"] == "splash"
    assert tpu["step"]["mosaic"] >= 2 * lowered["olmo3-7b tpu"]["step"]["mosaic"]


def test_moe_steps_lower_with_grouped_experts_and_all_to_all(lowered):
    """olmoe-1b-7b on fsdp 2 x expert 4, for an H100 and a TPU: the step's experts are ragged_dots
    (moe_compute auto: a grouped GEMM there, not the CPU's dense form), its (token, expert) pairs
    travel by all-to-all (shard.dispatch_to_experts), beside the device's attention kernel; eval's
    forward and generation run grouped experts too."""
    for accel, kernel in [("h100", "cudnn_forward"), ("tpu", "mosaic")]:
        case = lowered[f"olmoe-1b-7b {accel}"]
        assert case["step"]["ragged_dot"] and case["step"]["all_to_all"] and case["step"][kernel]
        assert case["forward"]["ragged_dot"] and case["generate"]["ragged_dot"]


def test_hybrid_steps_lower_with_the_chunked_rule(lowered):
    """olmo-hybrid-7b's first four layers (three Gated DeltaNet, one attention) on fsdp 4 x
    tensor 2, for an H100 and a TPU: the train step lowers with the attention layer's kernel beside the
    G layers' chunked rule, whose (I + A)⁻¹ is a loop of matmuls, no triangular_solve
    (model.unit_lower_inverse: why)."""
    for accel, kernel in [("h100", "cudnn_forward"), ("tpu", "mosaic")]:
        case = lowered[f"olmo-hybrid-7b {accel}"]
        assert case["step"][kernel] and case["step"]["dots"], case
        assert not case["step"]["triangular_solve"], accel


# --- 8: float32 means float32 ------------------------------------------------------------------

def test_float32_matmuls_are_full_precision_on_a_gpu(lowered):
    """JAX's default matmul precision is TF32 on GPUs; fp32 compute asks for HIGHEST in every matmul
    (step, eval's forward, generation), bf16 compute for the default."""
    fp32, bf16 = lowered["olmo2-1b-fp32 h100"], lowered["olmo2-1b h100"]
    for path in ("step", "forward", "generate"):
        assert fp32[path]["dots"] and fp32[path]["highest"] == fp32[path]["dots"], path
        assert bf16[path]["highest"] == 0, path


# --- issue 43, 5: a bf16 step multiplies in bf16 -------------------------------------------------

@pytest.mark.parametrize("case", ["olmo2-1b h100", "olmo3-7b-h256 a100", "olmo3-7b-stage3 h100"])
def test_bf16_steps_take_no_fp32_matmul_on_a_gpu(lowered, case):
    """Every dot of a bf16 step lowered for CUDA takes bf16 operands, the backward's too: JAX's
    transpose of linear's fp32-output dot took fp32 ones (TF32 on a GPU, half bf16's rate): 16
    of olmo2-1b's 25 dots, 30 of the tiny step's 58. XLA attention's fp32 score cotangent
    ("f32 as bf16") goes in as bf16 by its dot algorithm. The fp32 step stays fp32 throughout."""
    found = {path: lowered[case][path]["types"] for path in ("step", "forward", "generate")
             if path in lowered[case]}
    print(case, found)
    for path, types in found.items():
        assert set(types) <= {"bf16xbf16", "f32 as bf16xbf16"}, (path, types)
        assert sum(types.values()) == lowered[case][path]["dots"] > 0, path
    if "forward" in found:  # (the step holds the backward's dots: twice the forward's)
        assert found["step"]["bf16xbf16"] > 2 * found["forward"]["bf16xbf16"]
    xla_attention = lowered[case]["attention"] == "xla"
    assert ("f32 as bf16xbf16" in found["step"]) == xla_attention
    fp32 = lowered["olmo2-1b-fp32 h100"]
    assert {path: set(fp32[path]["types"]) for path in found} == {p: {"f32xf32"} for p in found}


# --- 2, 6: configs that fit where they say -------------------------------------------------------

@pytest.mark.parametrize("files", SHIPPED, ids=lambda f: "+".join(f))
def test_shipped_configs_fit_their_targets(files):
    """Every real-size config names a target and a mesh for it; its params and AdamW state per
    device fit what JAX may use there (the full plan, with activations, is
    `python train.py plan CONFIG...`, docs/sharding.md)."""
    cfg = load_config([f"configs/{f}.toml" for f in files])
    mc, m, dc, tc = cfg.mesh, cfg.model, cfg.data, cfg.train
    assert mc.device in shard.DEVICES and mc.devices > 0, "no target"
    sizes = dict(zip(shard.AXES, shard.mesh_shape(mc, mc.devices)))
    shard.check_mesh(sizes, m, dc.seq_len)
    ranks = math.prod(sizes[a] for a in shard.BATCH)  # (data x fsdp x expert)
    shard.check_batch(dc.global_batch, tc.micro_batch, ranks, "its target")
    assert tc.compute_dtype == "bfloat16"
    state = shard.state_gib(model.param_table(m), sizes)
    message = f"{state:.1f} GiB of weights and AdamW state per device"
    assert state < 0.5 * shard.usable_gib(mc.device), message


def test_every_real_size_config_is_planned():
    stacked = {files[-1] for files in SHIPPED}
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config([str(path)])
        if path.stem not in stacked and model.count_params(cfg.model) > 1e9:
            pytest.fail(f"{path.name} is a real-size config missing from SHIPPED")


def test_accelerator_flags_exist_in_this_jaxlib_and_yours_win():
    """XLA aborts a process whose XLA_FLAGS names a flag it lacks: ours start a JAX here. A flag
    given twice takes the last value, so a user's own XLA_FLAGS, placed after ours, wins."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    assert shard.set_accelerator_flags("h100", env) == "XLA_FLAGS"
    assert env["XLA_FLAGS"].startswith(shard.GPU_FLAGS[0])
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + env["XLA_FLAGS"]
    r = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"],
                       env=dict(os.environ, **env), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr[-2000:]  # (the later 3)
    tpu = {}
    assert shard.set_accelerator_flags("v5p", tpu) == "LIBTPU_INIT_ARGS"
    assert tpu["LIBTPU_INIT_ARGS"].split() == shard.TPU_FLAGS and "XLA_FLAGS" not in tpu
    assert shard.set_accelerator_flags("cpu", {}) is None


def test_fsdp_traffic_is_read_from_the_compiled_step():
    """bench.py fsdp, on tiny split over 8 devices: per micro-batch each gradient but the
    embedding's is reduced once in fp32 (the CPU compiler's all-reduce: a GPU's reduce-scatter;
    the embedding's gradient is summed where its rows live, from the gathered token ids), and the
    weights are gathered once or twice (forward, and again in the backward), in fp32: the cast to
    bf16 comes after the gather."""
    r = subprocess.run([sys.executable, "tests/bench.py", "fsdp", "configs/tiny.toml", "--mesh.data=1",
                        "--mesh.fsdp=8", "--mesh.devices=8", "--mesh.device=h100",
                        "--train.compute_dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    mb = {tuple(line.split()[:2]): float(line.split()[2].replace(",", "")) for line in r.stdout.splitlines()
          if line.startswith(("all-gather", "all-reduce", "reduce-scatter"))}
    m = load_config(["configs/tiny.toml"]).model
    params_mb = model.count_params(m) * 4 / 1e6
    embedding_mb = m.vocab_size * m.d_model * 4 / 1e6
    assert mb[("all-reduce", "f32")] == pytest.approx(params_mb - embedding_mb, abs=0.1), r.stdout
    assert params_mb <= mb[("all-gather", "f32")] <= 2 * params_mb + 0.1, r.stdout
    assert "MFU, traffic hidden" in r.stdout


def test_usable_memory_is_what_jax_takes(monkeypatch):
    """JAX's GPU allocator stops at 75% of the memory unless told otherwise; a TPU's is all
    usable."""
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert shard.usable_gib("h100") == pytest.approx(0.75 * 79.6)
    assert shard.usable_gib("v5p") == 95
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert shard.usable_gib("h200") == pytest.approx(0.9 * 140.4)


def test_plan_without_a_target_says_what_to_name(monkeypatch, capsys):
    """`train.py plan` of a config with no mesh.device: one line and exit 1, before anything
    compiles; run as the script runs it (run_cli), in this process (a fresh interpreter's
    imports were all of its time)."""
    monkeypatch.delenv("NANOLMO_TRACEBACK", raising=False)  # (with it, run_cli raises instead)
    with pytest.raises(SystemExit) as exited:
        run_cli(train.cli, ["plan", str(ROOT / "configs/tiny.toml")])
    assert exited.value.code == 1
    assert "names no target to plan for: set mesh.device and mesh.devices" in capsys.readouterr().err


# --- 11: tensor parallelism splits whole heads ----------------------------------------------------

def test_tensor_axis_must_divide_the_kv_heads():
    """32B's 8 kv heads cannot split 16 ways: each parameter divides (1024 rows of k_proj), so only
    the kernel's shard_map would have failed, mid-compile. Refused up front with the sizes that
    work."""
    m = load_config(["configs/olmo3-32b.toml"]).model
    sizes = dict(data=1, fsdp=16, context=1, tensor=16)
    for name, p in model.param_table(m).items():
        shard.spec_for(name, p, sizes)  # (every split divides)
    with pytest.raises(ValueError, match=r"mesh.tensor=16 splits the attention heads, "
                                         r"and model.n_heads=40 / n_kv_heads=8 "
                                         r"do not divide over it: "
                                         r"use mesh.tensor in \[1, 2, 4, 8\]"):
        shard.check_mesh(sizes, m, 8192)
    shard.check_mesh(dict(sizes, tensor=8), m, 8192)


# --- 5: MFU's peak, keyed as JAX and torch name the devices ---------------------------------------

@pytest.mark.parametrize("kind, peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("TPU7x", 2307e12 / 2),  # Ironwood: two TensorCores a chip, each its own JAX device
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA B200", 2250e12), ("NVIDIA GB200", 2500e12)])
def test_peak_flops_by_device_kind(kind, peak):
    """The dense bf16 peak of each device as JAX's device_kind names it (a v5p reports "TPU v5")."""
    assert shard.device_named(kind).peak == pytest.approx(peak)


def test_mfu_counts_causal_attention_in_full():
    """OLMo-core's convention (Attention.num_flops_per_token): 12·N·H per key each query could
    see, T on a full layer (not T/2), min(W, T) on a sliding one; 6 per matmul weight."""
    m = variant("olmo3", n_layers=4, layer_pattern="SSSF", sliding_window=16)
    matmul = model.count_params(m) - m.vocab_size * m.d_model
    assert model.flops_per_token(m, 64) == 6 * matmul + 12 * m.n_heads * m.head_dim * (3 * 16 + 64)


# --- 3: an accelerator JAX does not see -----------------------------------------------------------

def test_an_unseen_accelerator_is_said(monkeypatch):
    found = {"/dev/nvidia[0-9]*": ["/dev/nvidia0"]}
    monkeypatch.setattr(shard.glob, "glob", lambda pattern: found.get(pattern, []))
    said = ("has an NVIDIA GPU and this run uses the CPU: "
            "install for it with `make demo ACCEL=cuda`")
    assert said in shard.unseen_accelerator("cpu")
    assert shard.unseen_accelerator("gpu") is None
    found = {"/dev/vfio/[0-9]*": ["/dev/vfio/0"]}
    assert "ACCEL=tpu" in shard.unseen_accelerator("cpu")
    found.clear()
    assert shard.unseen_accelerator("cpu") is None


# --- 7: the train bench on an accelerator ---------------------------------------------------------

def test_bench_rows_on_a_gpu_are_valid_and_on_the_gpu(monkeypatch):
    """No cuDNN row in fp32 (it cannot run), torch and transformers on the GPU too, in both dtypes;
    on a TPU host no torch rows (they would run on its CPU)."""
    cfg = load_config(["configs/tiny.toml"])
    monkeypatch.setattr(shard, "accelerator", lambda device=None: H100)
    rows = {label: (dtype, on) for label, dtype, on, _ in bench_rows(cfg, "gpu", cuda=True)}
    assert "nanolmo JAX cudnn (gpu, bfloat16)" in rows
    assert "nanolmo JAX cudnn (gpu, float32)" not in rows
    assert "nanolmo JAX xla (gpu, float32)" in rows
    assert {"transformers (cuda, float32)", "transformers (cuda, bfloat16)",
            "nanolmo torch flex compiled (cuda, bfloat16)"} <= set(rows)
    assert all(on for _, on in rows.values())
    monkeypatch.setattr(shard, "accelerator", lambda device=None: TPU)
    labels = [label for label, *_ in bench_rows(cfg, "tpu", cuda=False)]
    assert labels and all(label.startswith("nanolmo JAX") for label in labels)
    monkeypatch.setattr(shard, "accelerator", lambda device=None: CPU)
    labels = [label for label, *_ in bench_rows(cfg, "cpu", cuda=False)]
    assert labels[-1] == "transformers (cpu, float32)"
    assert not any("cudnn" in label for label in labels)


# --- a real launch: one run folder every host can write -------------------------------------------

def test_a_run_folder_on_gcs_fuse_is_refused_for_several_hosts(tmp_path, monkeypatch):
    """GCS FUSE keeps the last writer's copy of a file several hosts write, and every process writes
    its pieces of each checkpoint into the same files: refused at the start, pointing at Filestore
    or NFS."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\n"
                      f"bucket {tmp_path / 'gcs'} fuse.gcsfuse rw,nodev 0 0\n")
    (tmp_path / "gcs" / "run").mkdir(parents=True)
    assert shard.filesystem(tmp_path / "gcs" / "run", mounts) == "fuse.gcsfuse"
    assert shard.filesystem(tmp_path, mounts) == "ext4"
    monkeypatch.setattr(shard, "filesystem", lambda path: "fuse.gcsfuse")
    with pytest.raises(OSError, match=r"is on GCS FUSE, where renaming a folder is a copy then a "
                                      r"delete"):
        shard.check_hosts_agree(SimpleNamespace(processes=2), tmp_path / "gcs" / "run", "data")


# --- the prepared GPU check runs, here at a tiny size ---------------------------------------------

def test_device_check_counts_a_lowered_programs_dots_by_operand_dtypes():
    """The dots row's parser, on a real lowering: one bf16 x bf16, three f32 x f32 (one batched,
    one from bf16 x f32 promoted), one f32 x bf16 whose algorithm runs it in bf16."""
    import jax

    import device_check
    a, b, c = (jnp.ones((2, 8, 8), t) for t in (jnp.bfloat16, jnp.float32, jnp.float32))
    as_bf16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    text = jax.jit(lambda a, b, c: (a[0] @ a[1], b @ c, b[0] @ c[0], a[0] @ b[0],
                                    jax.lax.dot(b[0], a[0], precision=as_bf16))
                   ).lower(a, b, c).as_text()
    counts = device_check.dot_counts(text)
    assert counts == {"bf16 x bf16": 1, "f32 x f32": 3, "f32 x bf16 (as bf16 x bf16)": 1}


def test_device_check_runs_on_the_cpu(tmp_path):
    """tests/device_check.py is for a GPU machine; its code runs here at tiny shapes: every row
    comes out, each in a process of its own and written as it finishes; a row that raises or is
    killed (as the OOM killer does) is recorded as failed, with why, and the rows after it run."""
    import re
    import time
    out, log = tmp_path / "check.md", tmp_path / "stdout.txt"
    env = {**os.environ, "NANOLMO_DEVICE_CHECK_FAIL": "train:torch:kill,train:jax-xla"}
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "tests/device_check.py", "--tiny", "--out", str(out)],
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    first = "| tiny-shaped OLMo-2-1B, bfloat16, 4 x 1 x 128, for cpu |"  # the first row's
    while first not in (out.read_text() if out.exists() else ""):
        assert p.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    assert p.poll() is None  # written while the other rows (a minute here) are still to run
    assert p.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = out.read_text()
    assert text.startswith("`python tests/device_check.py --tiny`: jax ") and " in all;" in text
    dots = re.search(r"for cpu \| (.*) \| (\d+) \|", text)
    assert re.search(r"bf16 x bf16: [1-9]", dots[1]) and f"f32 x f32: {dots[2]}" in dots[1]
    number = r"(\d\.\de-0\d)"
    for window in (0, 64):  # bf16 against fp32: a few 1e-3 (a wrong mask: order 1)
        for docs in (False, True):
            row = re.search(rf"\| JAX \| xla \| {window} \| {docs} \| {number} \| {number} \| "
                            r"[\d.]+ ms \|", text)
            assert row and max(map(float, row.groups())) < 3e-2, window
    assert "| JAX | cudnn | 0 | False | refused | cuDNN needs an NVIDIA GPU" in text
    flex = re.findall(rf"\| torch \| flex vs sdpa \| \d+ \| \w+ \| {number} \| n/a \| ", text)
    assert len(flex) == 3 and max(map(float, flex)) < 3e-2
    assert re.search(r"\| `train.py configs/tiny.toml` 4 steps of 2,048 tokens, bpe384.tiktoken "
                     r"data \| [\d,]+ \| n/a \| \d+ s \| -?[\d.]+ s \| \d+ s \| \d+ s \|", text)
    assert re.search(r"\| nanolmo JAX xla \(cpu, bfloat16\) \| [\d,]+ \| n/a \| \d+ s \|", text)
    # killed after its row: the row stays, and the kill is a row of its own; later rows run
    assert re.search(r"\| nanolmo torch sdpa eager \(cpu, bfloat16\) \| [\d,]+ \|", text)
    assert "| train:torch | failed: killed by SIGKILL (out of memory?)" in text
    assert re.search(r"\| transformers \(cpu, float32\) \| [\d,]+ \|", text)
    assert ("| train:jax-xla | failed: RuntimeError: NANOLMO_DEVICE_CHECK_FAIL asked row "
            "train:jax-xla to fail |") in text
    records = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    import device_check
    assert {r["unit"] for r in records} == {name for name, _, _ in device_check.UNITS}
    rows = [r for r in records if r["section"] != "env"]
    assert all("| " + " | ".join(r["cells"]) + " |" in text for r in rows)
    assert len(rows) == len(re.findall(r"^\| (?!---)", text, re.M)) - len(device_check.SECTIONS)
    # The budget (not --tiny): a row whose estimate does not fit is skipped, and says so
    r = subprocess.run([sys.executable, "tests/device_check.py", "--budget=10", "--out",
                        str(tmp_path / "budget.md")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = re.findall(r"^\| ([\w:-]+) \| skipped: ~\d+ s, \d+ s left of the 10 s budget \|",
                         (tmp_path / "budget.md").read_text(), re.M)
    assert sorted(skipped) == sorted(name for name, _, _ in device_check.UNITS)
