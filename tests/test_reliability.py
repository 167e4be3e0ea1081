"""Bad input and faults: every expected error is one line naming the file, field or value (exit 1; 2 for
usage), and a full disk, a torn log or a kill at the worst moment leaves the last good checkpoint or dataset
as it was. Runs are in this process (train.cli, as `python train.py` calls it) to keep them quick; kills are
faults injected into the exact call (os.replace, shutil.rmtree, os.posix_fallocate), or a signal to ourselves."""
import errno
import gzip
import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import convert
import data
import eval as evaluate
import train
from configs import run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def own_signals():
    """train.main installs SIGTERM / SIGINT handlers in this process: put pytest's back after each test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def fails(capsys, main, argv, status=1):
    """Run a CLI's main as its script does; return its one-line error (asserting the exit status)."""
    with pytest.raises(SystemExit) as e:
        run_cli(main, [str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == status, err
    assert "Traceback" not in err
    return err.splitlines()[-1]


def train_run(toml, run_dir, *extra):
    run_cli(train.cli, [str(toml), f"--train.run_dir={run_dir}", "--eval.prompt=", *extra])


def stopped_run(toml, run_dir, *extra):
    """train_run stopped by a signal (stop_at): it saves, then exits 143, not 0."""
    with pytest.raises(SystemExit) as e:
        train_run(toml, run_dir, *extra)
    assert e.value.code == 128 + signal.SIGTERM


def stop_at(monkeypatch, step, sig=signal.SIGTERM):
    """SIGTERM ourselves while step `step` runs, as a scheduler's preemption would."""
    lr_at = train.lr_at

    def lr(s, *a):
        if s == step:
            os.kill(os.getpid(), sig)
        return lr_at(s, *a)
    monkeypatch.setattr(train, "lr_at", lr)


def digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir()) if p.is_file()}


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def ckpt(setup, tmp_path_factory):
    """A 2-step run's checkpoint, for the CLIs that read one."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    train_run(setup[1], d, "--train.steps=2")
    return d / "step_2"


# --- bad input: refused, one line, naming the field, file or value -------------------------------------------

@pytest.mark.parametrize("override, says", [
    ("--train.lr=-0.003", "train.lr=-0.003: must be >= 0"), ("--train.warmup_min_lr=-1e-4", "train.warmup_min_lr"),
    ("--train.beta1=1.0", "train.beta1=1.0: must be in [0, 1)"), ("--train.beta2=-0.5", "train.beta2"),
    ("--train.eps=0", "train.eps=0.0: must be positive"), ("--train.weight_decay=-0.1", "train.weight_decay"),
    ("--train.clip=-1", "train.clip"), ("--train.z_loss=-1e-5", "train.z_loss"), ("--train.lr=nan", "train.lr=nan"),
    ("--eval.temperature=-1", "eval.temperature"),
    ("--data.seq_len=64", "data.seq_len=64 is longer than model.max_seq_len=32"),
])
def test_nonsense_settings_are_refused(setup, tmp_path, capsys, override, says):
    line = fails(capsys, train.cli, [setup[1], f"--train.run_dir={tmp_path / 'run'}", "--train.steps=2", override])
    assert line.startswith("train.py: error: ") and says in line
    assert not list(tmp_path.glob("run/step_*"))  # nothing trained


@pytest.mark.parametrize("argv, says", [
    (["--step", "-1"], "argument --step: -1: must be >= 0"),
    (["--step", "1", "--world", "2", "--rank", "2"], "--rank 2 is not below --world 2"),
    (["--step", "1", "--world", "0"], "argument --world: 0: must be >= 1"),
])
def test_inspect_refuses_steps_and_ranks_out_of_range(setup, capsys, argv, says):
    args = ["inspect", setup[0] / "data", "--seq-len", "32", "--global-batch", "8", "--seed", "0", *argv]
    assert says in fails(capsys, data.main, args, status=2)


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"),
                                         ("--top-k", "-1"), ("--max-new", "0")])
def test_generate_refuses_sampling_settings_out_of_range(ckpt, capsys, flag, value):
    line = fails(capsys, evaluate.main, ["generate", ckpt, "--prompt", "x", flag, value], status=2)
    assert f"argument {flag}: {value}: must be" in line


def test_damaged_json_names_the_file(setup, ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(ckpt.parent, run)
    (run / "step_2" / "nanolmo.json").write_text('{"step": 2, "config": {')
    before = digest(run / "step_2")
    line = fails(capsys, train.cli, [setup[1], f"--train.run_dir={run}", "--train.steps=4", "--eval.prompt="])
    assert f"{run / 'step_2' / 'nanolmo.json'}: not valid JSON" in line and f"delete {run / 'step_2'}" in line
    assert digest(run / "step_2") == before and (run / "latest").read_text().strip() == "step_2"
    ds = tmp_path / "ds"
    shutil.copytree(setup[0] / "data", ds)
    (ds / "prepare.json").write_text("{")
    line = fails(capsys, data.main, ["inspect", ds, "--seq-len", "32", "--global-batch", "8", "--seed", "0",
                                     "--step", "0"])
    assert f"{ds / 'prepare.json'}: not valid JSON" in line and "rerun `data.py prepare`" in line


def test_truncated_gzip_names_the_file_and_line(setup, ckpt, tmp_path, capsys):
    docs = [json.dumps({"text": f"document {i}: " + "words and more words " * 30}) for i in range(400)]
    whole = gzip.compress("\n".join(docs).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    out = tmp_path / "out"
    line = fails(capsys, data.main, ["prepare", cut, "--out", out, "--tokenizer", setup[0] / "bpe.tiktoken"])
    assert f"{cut}: unreadable after line" in line and "truncated or corrupt" in line
    assert not out.exists() and not out.with_name("out.tmp").exists()
    line = fails(capsys, evaluate.main, ["bpb", ckpt, cut])
    assert f"{cut}: unreadable after line" in line


class Hostile:
    """Unpickled, it runs code: open(path, "w") creates the file `path` (what a hostile .npy could
    do to anyone who loads it with allow_pickle=True)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_object_arrays_are_refused_by_name(ckpt, tmp_path, capsys):
    bad, ran = tmp_path / "tokens.npy", tmp_path / "pickle-ran"
    # A hostile file: an object array is a pickle inside the .npy, here one whose unpickling
    # creates `ran`. The test writes it (numpy writes a pickle only with allow_pickle=True, and
    # writing runs nothing); our reader loads with allow_pickle=False and must refuse it by name.
    np.save(bad, np.array([[1, 2], [3, Hostile(ran)]], dtype=object), allow_pickle=True)
    line = fails(capsys, convert.main, ["check", f"jax:{ckpt}", f"jax:{ckpt}", "--tokens", bad])
    assert f"{bad}: not a readable array of token ids" in line and "int32, int64, uint16, uint32" in line
    assert not ran.exists()  # never unpickled


def test_bad_runs(setup, tmp_path, capsys):
    """A different model in the run directory, a truncated checkpoint, a loss gone to NaN: one line each."""
    toml, d = setup[1], tmp_path / "run"
    train_run(toml, d, "--train.steps=2")
    line = fails(capsys, train.cli, [toml, f"--train.run_dir={d}", "--train.steps=4", "--model.n_layers=4"])
    assert "holds a different model (there vs here: n_layers: 2 vs 4)" in line
    st = d / "step_2" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-50])
    line = fails(capsys, train.cli, [toml, f"--train.run_dir={d}", "--train.steps=4"])
    assert "model.safetensors: tensor" in line and "truncated or corrupt" in line
    wild = ["--train.steps=6", "--train.lr=1e30", "--train.warmup=0", "--train.clip=0", "--eval.prompt="]
    line = fails(capsys, train.cli, [toml, f"--train.run_dir={tmp_path / 'nan'}", *wild, "--train.checkpoint_every=1"])
    assert line.startswith("train.py: error: loss is nan at step") and "last good checkpoint: " in line and "/step_" in line
    train_run(toml, tmp_path / "skip", *wild, "--train.skip_step=true")
    assert any(json.loads(x)["skipped"] for x in (tmp_path / "skip/metrics.jsonl").read_text().splitlines())


# --- faults a run survives ----------------------------------------------------------------------------------

def test_resumed_log_lines_equal_the_uninterrupted_run_off_the_boundary(setup, tmp_path, monkeypatch):
    """The shipped config's logging (log_every 50), stopped at step 30: the rerun's step-50 line still averages
    steps 1-50 (the losses since the last line travel in the checkpoint). The small fixture's model takes
    tiny.toml's log_every: what is logged when depends on the steps, not on the model's size (tiny.toml's own
    model made its 120 steps 10 s of the test)."""
    args = [str(setup[1]), "--train.log_every=50", "--train.steps=60", "--eval.every=0"]
    train_run(args[0], tmp_path / "straight", *args[1:])
    stop_at(monkeypatch, 30)
    stopped_run(args[0], tmp_path / "cut", *args[1:])
    assert (tmp_path / "cut" / "latest").read_text().strip() == "step_30"
    monkeypatch.undo()
    train_run(args[0], tmp_path / "cut", *args[1:])
    assert losses(tmp_path / "cut") == losses(tmp_path / "straight") and list(losses(tmp_path / "cut")) == [50, 60]


def test_torn_metrics_line_is_dropped_and_the_run_goes_on(setup, tmp_path, monkeypatch, capsys):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train_run(setup[1], straight, "--train.steps=6")
    stop_at(monkeypatch, 3)
    stopped_run(setup[1], cut, "--train.steps=6")
    monkeypatch.undo()
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 5.8')  # a kill during the append
    capsys.readouterr()
    train_run(setup[1], cut, "--train.steps=6")
    assert "dropped its torn last line" in capsys.readouterr().out
    assert losses(cut) == losses(straight)


def test_kill_during_the_metrics_rewrite_loses_nothing(setup, tmp_path, monkeypatch):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train_run(setup[1], straight, "--train.steps=6")
    stop_at(monkeypatch, 3)
    stopped_run(setup[1], cut, "--train.steps=6")
    monkeypatch.undo()
    metrics = cut / "metrics.jsonl"
    with open(metrics, "a") as f:  # as a run killed after logging steps 4 and 5, before checkpointing them
        f.writelines(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (4, 5))
    before, replace = metrics.read_bytes(), os.replace

    def killed(src, dst):
        if str(src).endswith("metrics.jsonl.tmp"):
            raise KeyboardInterrupt  # the kill, between writing the new file and putting it in place
        replace(src, dst)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(SystemExit) as e:
        train_run(setup[1], cut, "--train.steps=6")
    assert e.value.code == 130 and metrics.read_bytes() == before  # the whole history is still there
    monkeypatch.undo()
    train_run(setup[1], cut, "--train.steps=6")
    assert losses(cut) == losses(straight) and not (cut / "metrics.jsonl.tmp").exists()
    inode = metrics.stat().st_ino  # a rerun of the finished run has nothing to drop: the file is not rewritten
    train_run(setup[1], cut, "--train.steps=6")
    assert metrics.stat().st_ino == inode and losses(cut) == losses(straight)


def test_kill_while_pruning_leaves_no_half_checkpoint(setup, tmp_path, monkeypatch, capsys):
    run, rmtree = tmp_path / "run", shutil.rmtree

    def killed(path, *a, **k):  # delete one file of the old checkpoint, then die
        if str(path).endswith(".trash"):
            next(Path(path).iterdir()).unlink()
            raise KeyboardInterrupt
        rmtree(path, *a, **k)
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        train_run(setup[1], run, "--train.steps=6", "--train.checkpoint_every=1", "--train.keep=2")
    monkeypatch.undo()
    assert sorted(p.name for p in run.glob("step_*")) == ["step_1.trash", "step_2", "step_3"]
    train_run(setup[1], run, "--train.steps=6", "--train.checkpoint_every=1", "--train.keep=2")
    assert "step_1.trash, left by a run that was killed" in capsys.readouterr().out
    assert sorted(p.name for p in run.glob("step_*")) == ["step_5", "step_6"]


def test_full_disk_keeps_the_last_checkpoint(setup, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    train_run(setup[1], run, "--train.steps=2")
    before = digest(run / "step_2")

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    line = fails(capsys, train.cli, [setup[1], f"--train.run_dir={run}", "--train.steps=4", "--eval.prompt="])
    assert "checkpoint step_4 not written" in line and f"{run / 'step_4.tmp'}" in line and "bytes" in line
    assert "No space left on device" in line and not (run / "step_4.tmp").exists()
    assert digest(run / "step_2") == before and (run / "latest").read_text().strip() == "step_2"
    # convert.py and data.py prepare: the same, and no partial output.
    out = tmp_path / "converted"
    line = fails(capsys, convert.main, [run / "step_2", out])
    assert "cannot reserve" in line and not out.exists() and not out.with_name("converted.tmp").exists()
    monkeypatch.undo()

    def add(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(data.PartWriter, "add", add)
    ds = tmp_path / "ds"
    line = fails(capsys, data.main, ["prepare", setup[0] / "docs", "--out", ds, "--tokenizer",
                                     setup[0] / "bpe.tiktoken"])
    assert f"{ds}: no space left" in line and not ds.exists() and not ds.with_name("ds.tmp").exists()


def test_space_is_claimed_before_the_memory_map(tmp_path):
    """The checkpoint file is not sparse: its blocks are allocated, so the map cannot meet a full disk."""
    path = tmp_path / "x.safetensors"
    convert.allocate_safetensors(path, {"w": ((1024, 1024), np.float32)})
    assert path.stat().st_size > 4 * 2**20 and path.stat().st_blocks * 512 >= 4 * 2**20


def test_renames_are_made_durable(setup, tmp_path, monkeypatch):
    """latest.tmp is on disk before it is renamed, and the run directory after each rename."""
    events, fsync, replace = [], convert.fsync, os.replace
    monkeypatch.setattr(convert, "fsync", lambda p: events.append(("fsync", Path(p).name)) or fsync(p))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", Path(a).name)) or replace(a, b))
    run = tmp_path / "run"
    train_run(setup[1], run, "--train.steps=1")
    i = events.index(("replace", "latest.tmp"))
    assert events[i - 1] == ("fsync", "latest.tmp") and events[i + 1] == ("fsync", "run")
    j = events.index(("replace", "step_1.tmp"))
    assert events[j + 1] == ("fsync", "run")


def test_a_signal_during_the_final_eval_stops_the_run(setup, tmp_path, monkeypatch, capsys):
    """Once the last checkpoint is saved, Ctrl-C stops the eval and plot (exit 130) instead of waiting them out."""
    def plot(*a):
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the signal was swallowed")
    monkeypatch.setattr(train.evaluate, "plot", plot)
    run = tmp_path / "run"
    assert "interrupted" in fails(capsys, train.cli, [setup[1], f"--train.run_dir={run}", "--train.steps=2",
                                                      "--eval.prompt="], status=130)
    assert (run / "latest").read_text().strip() == "step_2"


# A `python train.py` process that sends itself SIGINT (Ctrl-C) at one point of its start: while `import jax`
# runs, while the config loads, while the data opens, while the step compiles (model.forward is traced), or as
# the first batch is read. The handlers are the script's own (configs.exit_on_signals), so it runs as __main__.
INTERRUPT_AT = """
import os, runpy, signal, sys
point, sys.argv = sys.argv[1], ["train.py", *sys.argv[2:]]
interrupt = lambda: os.kill(os.getpid(), signal.SIGINT)
if point == "imports":
    class Hook:  # Ctrl-C the moment jax.numpy starts to import
        def find_spec(self, name, path=None, target=None):
            if name == "jax.numpy":
                interrupt()
    sys.meta_path.insert(0, Hook())
else:
    import configs, data, model
    owner, name = dict(config=(configs, "load_config"), data=(data, "open_instances"),
                       compile=(model, "forward"), first_step=(data.Loader, "__iter__"))[point]
    wrapped = getattr(owner, name)
    def at_point(*a, **k):
        interrupt()
        return wrapped(*a, **k)
    setattr(owner, name, at_point)
runpy.run_path("train.py", run_name="__main__")
"""


def test_ctrl_c_at_any_point_of_the_start_is_one_line_and_exit_130(setup, tmp_path):
    """Ctrl-C before the loop: one line, exit 130, and the run folder this start made is gone. Once the loop
    runs (the compile is the first step's): the step finishes, is saved, and the exit is 130 too, never 0."""
    import subprocess
    import sys
    points = ["imports", "config", "data", "compile", "first_step"]
    procs = {p: subprocess.Popen([sys.executable, "-c", INTERRUPT_AT, p, str(setup[1]),
                                  f"--train.run_dir={tmp_path / p}", "--train.steps=3", "--eval.prompt="],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in points}
    for point, proc in procs.items():
        out = proc.communicate(timeout=300)[0]
        said = [line for line in out.splitlines() if "interrupted" in line or "SIGINT" in line]
        assert proc.returncode == 130, (point, out[-3000:])
        assert "Traceback" not in out and "Exception ignored" not in out and len(said) == 1, (point, out[-3000:])
        run = tmp_path / point
        if point in ("compile", "first_step"):
            assert said[0].startswith("SIGINT: saved") and (run / "latest").read_text().strip() == "step_1", point
        else:
            assert said[0] == "train.py: interrupted (SIGINT)" and not run.exists(), (point, out[-3000:])


def test_errors_say_the_next_step(setup, ckpt, tmp_path, capsys):
    """A missing input's error says what to do about it: how to make the data, that a path does not exist, that
    a shell pattern matched nothing, where the task files come from."""
    line = fails(capsys, train.cli, [setup[1], f"--train.run_dir={tmp_path / 'run'}", f"--data.path={tmp_path / 'nope'}"])
    assert "no such token file" in line and "make demo" in line and "data.py prepare" in line, line
    assert not (tmp_path / "run").exists()  # the failed start took its run folder with it
    line = fails(capsys, evaluate.main, ["generate", tmp_path / "no_ckpt", "--prompt", "x"])
    assert f"{tmp_path / 'no_ckpt'}: no such file or directory" in line, line
    line = fails(capsys, evaluate.main, ["bpb", ckpt, f"{tmp_path}/*.jsonl.gz"])  # as the shell passes it on
    assert "no file matches this pattern" in line, line
    line = fails(capsys, evaluate.main, ["tasks", ckpt, "--tasks", "arc_easy", "--data", tmp_path])
    assert "arc_easy: none of" in line and "pass --data DIR" in line, line


def test_scripts_answer_help(capsys):
    """-h/--help prints the usage and the script's examples (exit 0); train.py without a config prints the usage
    (exit 2) instead of training the defaults over runs/tiny."""
    import model
    for main, args in [(train.cli, ["-h"]), (train.cli, ["--help"]), (model.main, ["--help"])]:
        with pytest.raises(SystemExit) as e:
            run_cli(main, args)
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith("usage:") and "configs/" in out, out
    with pytest.raises(SystemExit) as e:
        run_cli(train.cli, [])
    assert e.value.code == 2 and "give a config file first" in capsys.readouterr().err


def test_a_gpu_config_on_the_cpu_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 43: below driver 580 (CUDA 13's) or without JAX's plugin, JAX only logs a warning and
    runs on the CPU, and torch finds no GPU; a config whose mesh.device names a GPU or TPU stops
    before compiling anything, saying what JAX/torch see, the likely cause and the fix."""
    import shard
    from configs import MeshConfig
    monkeypatch.setattr(train, "make_train_step", lambda *a: pytest.fail("compiled"))
    run = tmp_path / "run"
    for backend in ("jax", "torch"):
        line = fails(capsys, train.cli, ["configs/olmo2-1b.toml", f"--train.run_dir={run}",
                                         f"--train.backend={backend}"])
        assert line.startswith(f"train.py: error: mesh.device='h100' is NVIDIA H100 80GB HBM3, but "
                               f"{backend} sees only the CPU (") and "--mesh.device=" in line, line
        assert not run.exists()  # (the start's own folder, removed)
    h100, v5p = MeshConfig(device="h100"), MeshConfig(device="v5p")
    causes = [(h100, "jax", "", "no NVIDIA driver is loaded"),
              (h100, "jax", "550.54.14", "the NVIDIA driver: 550.54.14, and CUDA 13"),
              (h100, "jax", "580.65.06", "`make demo ACCEL=cuda`"),
              (h100, "torch", "580.65.06", "a CPU build of torch"),
              (v5p, "jax", "", "`make demo ACCEL=tpu`"),
              (v5p, "torch", "", "use --train.backend=jax")]
    for mesh, backend, driver, why in causes:
        with pytest.raises(ValueError, match=why):
            shard.check_platform(mesh, "cpu", "seen", backend, driver)
    shard.check_platform(h100, "gpu", "seen", "jax", "")  # on the GPU: nothing to say
    shard.check_platform(MeshConfig(), "cpu", "seen", "jax", "")  # no target (tiny.toml)


def test_the_logged_speed_leaves_out_the_compile(setup, tmp_path, monkeypatch, capsys):
    """Issue 43: the first line's tokens/s counted the step's compile (minutes at 7B). Here the
    first step takes 2 s more, as a compile would: it is logged as compile_s, and tokens/s is over
    the steps after it (with it, each of steps 1-2 would read over 1 s)."""
    step, calls = train.JaxBackend.step, []

    def slow_first(self, batch, lr):
        calls.append(lr)
        out = step(self, batch, lr)
        if len(calls) == 1:
            jax.block_until_ready(out)
            time.sleep(2)
        return out
    monkeypatch.setattr(train.JaxBackend, "step", slow_first)
    train_run(setup[1], tmp_path / "run", "--train.steps=4", "--train.log_every=2")
    first, second = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text()
                                     .splitlines()) if "loss" in r]
    per_step = 8 * 32  # global_batch x seq_len
    assert first["compile_s"] >= 2 and "compile_s" not in second
    assert per_step / first["tokens_per_s"] < 1, first  # step 2 alone
    assert f"first step {first['compile_s']:.1f} s (compile)" in capsys.readouterr().out
    train_run(setup[1], tmp_path / "one", "--train.steps=2")  # log_every=1: step 1 has no speed
    first = json.loads((tmp_path / "one/metrics.jsonl").read_text().splitlines()[0])
    assert first["tokens_per_s"] is None and first["mfu"] is None and first["compile_s"] > 0
