"""The post-training chain of `make posttrain` (SFT -> DPO -> GRPO from stage 3's model) for several seeds,
and each stage's held-out exact match as one table: the spread a laptop user should expect, not one lucky
figure. A seed sets each stage's data order (data.seed) and GRPO's sampling (train.init_seed); the model
they start from is the same (`make posttrain` once first: it runs the stages before and prepares the data).

    python tests/posttrain_spread.py                       # seeds 0 1 2 into runs/spread/
    python tests/posttrain_spread.py --seeds 0 --out runs/spread-x -- --train.lr=1e-2   # extra SFT overrides
    python tests/posttrain_spread.py --base runs/tiny-midtrain-soup --model configs/tiny.toml \
        --out runs/spread-soup              # from stage 2's soup, stage 3 skipped (docs/posttrain.md)

Imitate an AVX2-only CPU for a second column of figures (docs/backends.md#other-cpus says what each variable
reaches): ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 XLA_FLAGS=--xla_cpu_max_isa=AVX2.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from configs import load_config  # noqa: E402
STAGES = ["sft", "dpo", "grpo"]  # configs/tiny-STAGE.toml, each stacked on --model
MODEL = "configs/tiny.toml,configs/tiny-stage3.toml"  # the model as stage 3 left it


def run(args):
    print("$", " ".join(args), file=sys.stderr, flush=True)  # (stdout: the table alone)
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def chain(base, seed, out, sft_extra, model):
    """Each stage from the one before; -> the four checkpoints, stage 3's model first."""
    ckpts, start = [base], base
    for name in STAGES:
        toml = f"configs/tiny-{name}.toml"
        steps = load_config([str(ROOT / f) for f in (*model, toml)]).train.steps
        run_dir = out / f"seed{seed}" / name
        args = [sys.executable, "train.py", *model, toml, f"--train.run_dir={run_dir}",
                f"--train.init_from={start}", f"--data.seed={seed}", f"--train.init_seed={seed}"]
        if name == "sft":
            args += sft_extra
        if name == "dpo":  # its reference (beside the data) is this seed's SFT model: a copy per chain
            pairs = ROOT / run_dir.parent / "arith-dpo"
            if not pairs.is_dir():
                shutil.copytree(ROOT / "data/arith-dpo", pairs, ignore=shutil.ignore_patterns("reference_logps*"))
            args.append(f"--data.path={pairs}")
        if not (ROOT / run_dir / f"step_{steps}" / "nanolmo.json").is_file():
            run(args)
        start = str(run_dir / f"step_{steps}")
        ckpts.append(start)
    return ckpts


def exact(ckpts):
    r = subprocess.run([sys.executable, "eval.py", "exact", *ckpts, "--prompts", "data/arith/heldout.jsonl",
                        "--template", "tulu"], cwd=ROOT, check=True, capture_output=True, text=True)
    return [float(m) for m in re.findall(r"^\s+\S+\s+([0-9.]+)$", r.stdout, re.M)]


def heldout_bpb(run_dir):
    """SFT's held-out bits per byte at each eval step: {step: bpb} (metrics.jsonl)."""
    rows = [json.loads(line) for line in (ROOT / run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_bpb"] for r in rows if "eval_bpb" in r}


def cpu_name():
    """This machine's CPU as the figures depend on it: its model name and widest vector unit."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(re.findall(r"^(model name|flags)\s*:\s*(.*)$", info, re.M))  # (every CPU lists the same)
    flags = set(fields.get("flags", "").split())
    widest = [isa for flag, isa in [("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")] if flag in flags]
    return ", ".join([fields.get("model name", "this CPU").strip(), *widest[:1]])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="runs/spread", type=Path)
    ap.add_argument("--base", default="runs/tiny-stage3/step_200", help="stage 3's model (this CPU's)")
    ap.add_argument("--model", default=MODEL, help="the config files the stages stack on, comma-separated")
    ap.add_argument("sft_extra", nargs="*", help="overrides for the SFT stage (after --)")
    a = ap.parse_args()
    isa = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "XLA_FLAGS") if k in os.environ}
    table = {}
    for seed in a.seeds:
        ckpts = chain(a.base, seed, a.out, a.sft_extra, a.model.split(","))
        table[seed] = exact(ckpts)
        bpb = heldout_bpb(a.out / f"seed{seed}" / "sft")
        print(f"seed {seed}: exact match {table[seed]}; SFT held-out bpb by step {bpb}", file=sys.stderr,
              flush=True)
    where = " ".join([cpu_name(), *(f"{k}={v}" for k, v in isa.items())])
    print(f"{'exact match':<12}" + "".join(f"{'seed ' + str(s):>9}" for s in a.seeds)
          + f"{'mean':>9}{'min':>9}   (held-out sums; {where})")
    for i, stage in enumerate(["base", *STAGES]):
        row = [table[s][i] for s in a.seeds]
        print(f"{stage:<12}" + "".join(f"{v:>9.3f}" for v in row) + f"{np.mean(row):>9.3f}{min(row):>9.3f}")


if __name__ == "__main__":
    main()
