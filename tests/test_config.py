import json
from pathlib import Path

import numpy as np
import pytest

import data
import model
from configs import ConfigError, ModelConfig, describe, load_config, load_json, run_cli, save_json
from model import count_params

ROOT = Path(__file__).resolve().parents[1]

# Published exact counts (reference/olmo-facts.md §2, each checked there against the HF classes).
PUBLISHED = {
    "olmo1-1b": 1_176_764_416,
    "olmo1-7b": 6_888_095_744,
    "olmo2-1b": 1_484_916_736,
    "olmo2-7b": 7_298_617_344,
    "olmo2-13b": 13_716_198_400,
    "olmo3-7b": 7_298_617_344,    # at the training vocabulary, 100352 rows
    "olmo3-32b": 32_234_279_936,  # likewise
    "olmo-hybrid-7b": 7_430_870_688,  # transformers' OlmoHybridConfig() (test_hybrid.py)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_released_shapes_have_published_counts(name):
    assert count_params(load_config([str(ROOT / f"configs/{name}.toml")]).model) == PUBLISHED[name]


def test_hf_vocab_counts():
    # The HF Olmo 3 checkpoints keep 100278 rows.
    cfg = load_config([str(ROOT / "configs/olmo3-7b.toml"), "--model.vocab_size=100278"])
    assert count_params(cfg.model) == 7_298_011_136
    cfg = load_config([str(ROOT / "configs/olmo3-32b.toml"), "--model.vocab_size=100278"])
    assert count_params(cfg.model) == 32_233_522_176


def model_py(capsys, config):
    """What `python model.py CONFIG` prints: its main as the script runs it (run_cli), in this process (a
    fresh interpreter's imports were nearly all of the time)."""
    capsys.readouterr()
    run_cli(model.main, [str(config)])
    return capsys.readouterr().out


def test_model_py_prints_total_params_last(capsys):
    """`python model.py CONFIG` lists the parameters and ends with their total, for scripts to read."""
    out = model_py(capsys, ROOT / "configs/olmo2-1b.toml")
    assert out.strip().splitlines()[-1] == "total_params=1484916736"
    assert "FLOPs/token" in out and "layers.self_attn.q_norm.weight" in out


def test_merge_left_to_right_and_overrides(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text("[model]\nd_model = 128\nn_heads = 2\n")
    b = tmp_path / "b.toml"
    b.write_text("[model]\nn_heads = 4\n")
    cfg = load_config([str(a), str(b), "--model.n_layers=3", "--model.family=olmo2", "--model.norm_eps=1e-5"])
    m = cfg.model
    assert (m.d_model, m.n_heads, m.n_layers, m.family, m.norm_eps) == (128, 4, 3, "olmo2", 1e-5)
    assert m.head_dim == 32 and m.n_kv_heads == 4
    assert m.mlp_hidden == 512  # 256·ceil(int(8·128/3)/256) = 256·ceil(341/256)
    text = describe(cfg)
    assert "= d_model / n_heads" in text and "256·ceil" in text


def test_each_config_gets_its_own_run_folder(tmp_path):
    """Issue 43: olmo2-1b after `make demo` was refused ("a different model") in runs/tiny. Unset,
    run_dir is runs/<the last file's name>; a TOML's own (a stage's) or an override wins."""
    run_dir = lambda *a: load_config([str(ROOT / "configs" / f) if f.endswith(".toml") else f  # noqa: E731
                                      for f in a]).train.run_dir
    assert run_dir("olmo2-1b.toml") == "runs/olmo2-1b"
    assert run_dir("olmo3-7b.toml") == "runs/olmo3-7b"
    assert run_dir("tiny.toml") == "runs/tiny"  # (the demo's, set in the file)
    assert run_dir("tiny.toml", "tiny-sft.toml") == "runs/tiny-sft"
    assert run_dir("olmo3-7b.toml", "olmo3-7b-stage3.toml") == "runs/olmo3-7b-stage3"
    assert run_dir("olmo2-1b.toml", "--train.run_dir=/nfs/runs/1b") == "/nfs/runs/1b"
    (tmp_path / "longer.toml").write_text("[train]\nsteps = 2000\n")
    assert run_dir("tiny.toml", str(tmp_path / "longer.toml")) == "runs/tiny"  # tiny.toml's stays
    shown = describe(load_config([str(ROOT / "configs/olmo2-1b.toml")]))
    assert "train.run_dir                    'runs/olmo2-1b'    = runs/<the last" in shown


def test_json_round_trip(tmp_path):
    cfg = load_config([str(ROOT / "configs/olmo3-7b.toml"), str(ROOT / "configs/olmo3-7b-stage3.toml")])
    save_json(cfg, tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text())["model"]["yarn_factor"] == 8.0
    again = load_json(tmp_path / "c.json")
    assert again == cfg
    assert again.model.yarn_attention_factor == pytest.approx(1.2079441541679836)


def test_unknown_key_suggests(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_modle = 64\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key model.d_modle \(did you mean model.d_model\?\)"):
        load_config([str(bad)])
    with pytest.raises(ConfigError, match=r"--model.n_layer=2: unknown key model.n_layer \(did you mean model.n_layers\?\)"):
        load_config(["--model.n_layer=2"])
    with pytest.raises(ConfigError, match=r"unknown section \[modle\] \(did you mean \[model\]\?\)"):
        load_config(["--modle.d_model=2"])


def test_wrong_types_and_shapes_of_input(tmp_path):
    with pytest.raises(ConfigError, match=r"model.n_layers='four' is str, expected int"):
        load_config(["--model.n_layers=four"])
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=1 is int, expected bool"):
        load_config(["--model.tie_embeddings=1"])
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(["--d_model=3"])
    flat = tmp_path / "flat.toml"
    flat.write_text("d_model = 64\n")
    with pytest.raises(ConfigError, match=r"flat.toml: top-level key 'd_model' must sit under a \[section\]"):
        load_config([str(flat)])
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config([str(broken)])


def test_missing_file():
    with pytest.raises(ConfigError, match="config file configs/nope.toml not found"):
        load_config(["configs/nope.toml"])


def test_bad_head_counts(tmp_path):
    f = tmp_path / "gqa.toml"
    f.write_text("[model]\nn_heads = 6\nn_kv_heads = 4\n")
    with pytest.raises(ConfigError, match=r"gqa.toml: model.n_kv_heads=4: n_heads=6 must be a multiple of n_kv_heads"):
        load_config([str(f)])


@pytest.mark.parametrize("overrides, match", [
    (dict(layer_pattern="SSXF", sliding_window=8), r"string of S .*, F .* and G"),
    (dict(layer_pattern="GGGF"), "G .* layers are olmo_hybrid's"),
    (dict(family="olmo_hybrid", layer_pattern="G", n_layers=4), "needs at least one F"),
    (dict(family="olmo_hybrid", layer_pattern="GF", linear_key_heads=3), "multiple of"),
    (dict(rope_theta=0.0), "0 .no RoPE. is olmo_hybrid's only"),
    (dict(linear_key_heads=2), "only olmo_hybrid has linear layers"),
    (dict(layer_pattern="SSF", sliding_window=8), "length 3 must divide n_layers=4"),
    (dict(layer_pattern="SSSF"), "needs sliding_window > 0 exactly when it has an S layer"),
    (dict(layer_pattern="F", sliding_window=8), "needs sliding_window > 0"),
    (dict(family="olmo2", layer_pattern="SSSF", sliding_window=8), "need family 'olmo3'"),
    (dict(family="olmo2", clip_qkv=8.0), "only OLMo 1 and OLMoE clamp"),
    (dict(family="olmo1"), "OLMo 1's LayerNorm eps is 1e-5"),
    (dict(family="olmo4"), "must be one of"),
    (dict(head_dim=33), "must be even"),
    (dict(yarn_factor=0.5), "must be > 1"),
    (dict(vocab_size=1000), "eos_token_id=100257: must be a token id below vocab_size=1000"),
])
def test_bad_model_configs(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**overrides)


def test_readme_table_is_current(capsys):
    """README's parameter table is what `python model.py configs/olmo3-7b.toml` prints now."""
    out = model_py(capsys, ROOT / "configs/olmo3-7b.toml")
    table = out[out.index("name "):].strip()
    assert table in (ROOT / "README.md").read_text(), "README's parameter table is stale: paste the new output"


# What the official scripts set, file -> the values a config reproducing it carries: OLMo-core
# fa6c501's src/scripts/official/OLMo3/ for Olmo 3; for OLMo 1 and 2, the old trainer's YAMLs
# that made the releases (allenai/OLMo configs/official/ @15af6688, configs/official-0425/ and
# official-1124/ @59a53e3f). seed: the old trainer's 6198 is 6197 here
# (test_old_trainer_seeds_give_its_data_order).
OLMO2 = dict(schedule="cosine", units="tokens", warmup=8_388_608_000, t_max=5_000_000_000_000,
             alpha_f=0.1, warmup_min_lr=0.0, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
             clip=1.0, z_loss=1e-5, skip_step=False, seed=6197, instance_filter=True)
OLMO1 = dict(warmup_min_lr_fraction=0.1, alpha_f=0.1, t_max=0, weight_decay=0.1, beta1=0.9,
             beta2=0.95, eps=1e-5, clip=1.0, z_loss=0.0, skip_step=False, seed=6197,
             tokens_per_step=2048 * 2048, instance_filter=False)
OFFICIAL = {
    "olmo1-1b": ("OLMo-1B.yaml", dict(OLMO1, lr=4e-4, schedule="cosine", warmup=2000,
                                      steps=739_328)),
    "olmo1-7b": ("OLMo-7B.yaml", dict(OLMO1, lr=3e-4, schedule="linear", warmup=5000,
                                      steps=2 * 10**12 // (2048 * 2048))),  # 476,837: rounded down
    "olmo2-1b": ("OLMo2-1B-stage1.yaml", dict(  # 4e12 tokens, rounded up by the old trainer's HEAD
        OLMO2, lr=4e-4, steps=-(-4 * 10**12 // (512 * 4096)), tokens_per_step=512 * 4096)),
    "olmo2-7b": ("OLMo2-7B-stage1.yaml", dict(OLMO2, lr=3e-4, epochs=1,
                                             tokens_per_step=1024 * 4096)),
    "olmo2-13b": ("OLMo2-13B-stage1.yaml", dict(OLMO2, lr=3e-4, epochs=1,
                                               tokens_per_step=2048 * 4096)),
    "olmo3-7b": ("OLMo-3-1025-7B-pretrain-1.py", dict(
        lr=3e-4, warmup=2000, schedule="cosine", alpha_f=0.1, t_max=1_192_093, steps=597_046,
        skip_step=True, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip=1.0,
        z_loss=1e-5, seed=34521, tokens_per_step=512 * 8192, instance_filter=False)),
    "olmo3-32b": ("OLMo-3-1025-32B-pretrain.py", dict(
        lr=6e-4, warmup=2000, schedule="cosine", alpha_f=0.1, epochs=1, skip_step=True,
        weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip=1.0, z_loss=1e-5, seed=34521,
        tokens_per_step=8 * 1024 * 1024, instance_filter=True)),
    "olmo-hybrid-7b": ("OLMo-hybrid-7B-pretrain.py", dict(
        lr=3e-4, warmup=2000, schedule="cosine", alpha_f=0.1, steps=1_414_078, skip_step=True,
        weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip=1.0, z_loss=1e-5, seed=34521,
        tokens_per_step=512 * 8192, instance_filter=True)),
    # A stage is its file stacked on the model's (name + name): only the stage's own values here.
    "olmo3-7b+olmo3-7b-pretrain-2": ("OLMo-3-1025-7B-pretrain-2.py", dict(
        run_dir="runs/olmo3-7b", schedule="half_cosine", epochs=1, lr=3e-4, skip_step=True,
        warmup=5 * 10**12 // (512 * 8192) // 2 + 2000 // 2,  # the script's own arithmetic
        t_max=-(-7 * 10**12 // (512 * 8192)))),              # Duration.tokens(7e12), rounded up
    "olmo3-7b+olmo3-7b-stage2": ("OLMo-3-1025-7B-midtrain.py", dict(
        init_from="runs/olmo3-7b/step_1413814", load_optimizer=True, lr=0.00020712352850360292,
        schedule="linear", warmup=0, alpha_f=0.0, t_max=0, steps=-(-100 * 10**9 // 2**21),
        skip_step=True, weight_decay=0.1, z_loss=1e-5, clip=1.0, micro_batch=2, seed=1337,
        tokens_per_step=2**21, instance_filter=False,
        mix="configs/mixes/OLMo-midtraining-mix-0625-100B.txt")),
    "olmo3-32b+olmo3-32b-stage2": ("OLMo-3-1025-32B-midtrain-ingredient-1.py", dict(
        init_from="runs/olmo3-32b/step_656000", load_optimizer=True, lr=0.0002071235285,
        schedule="linear", warmup=0, alpha_f=0.0, epochs=0, steps=-(-100 * 10**9 // 2**22),
        skip_step=True, weight_decay=0.1, z_loss=1e-5, clip=1.0, seed=42069,
        tokens_per_step=4 * 1024 * 1024, instance_filter=True,
        mix="configs/mixes/OLMo-midtraining-mix-0925-ingredient1-100B.txt")),
    "olmo3-7b+olmo3-7b-stage3": ("OLMo-3-1025-7B-long-context.py", dict(
        lr=0.00020712352850360292, schedule="linear", warmup=200, alpha_f=0.0, steps=11_921,
        skip_step=True, seed=34521, tokens_per_step=65536 * 64, instance_filter=False)),
    "olmo3-32b+olmo3-32b-stage3": ("OLMo-3-1025-32B-long-context.py", dict(
        lr=0.0002071235285, schedule="linear", warmup=200, alpha_f=0.0,
        steps=-(-100 * 10**9 // (8 * 1024 * 1024)), skip_step=True, seed=34521,
        tokens_per_step=8 * 1024 * 1024, instance_filter=True)),
}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_real_size_configs_carry_the_official_recipe(name):
    script, want = OFFICIAL[name]
    files = [f"configs/{part}.toml" for part in name.split("+")]
    cfg = load_config(files)
    assert script in (ROOT / files[-1]).read_text()  # it names its source
    got = {**{k: getattr(cfg.train, k, None) for k in want}, "seed": cfg.data.seed,
           "mix": cfg.data.path,
           "tokens_per_step": cfg.data.global_batch * cfg.data.seq_len,
           "instance_filter": cfg.data.instance_filter,
           # the Feb-2024 warmup starts at 0.1 x lr (olmo/optim.py @15af6688, _linear_warmup)
           "warmup_min_lr_fraction": cfg.train.warmup_min_lr / cfg.train.lr}
    assert {k: got[k] for k in want} == want


def test_old_trainer_seeds_give_its_data_order():
    # allenai/OLMo olmo/data/iterable_dataset.py (@15af6688 and HEAD), _build_and_save_global_indices:
    # indices = np.arange(N, dtype=np.uint32); PCG64(seed=self.seed + self.epoch).shuffle(indices),
    # with the first epoch 0 (olmo/data/__init__.py: epoch=train_config.epoch or 0) and seed 6198.
    old_trainer = np.arange(1000, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed=6198 + 0)).shuffle(old_trainer)
    for name in ("olmo1-1b", "olmo1-7b", "olmo2-1b", "olmo2-7b", "olmo2-13b"):
        seed = load_config([f"configs/{name}.toml"]).data.seed
        assert np.array_equal(data.epoch_permutation(1000, seed, 1), old_trainer), name


def test_the_olmo3_stages_start_where_the_one_before_ends():
    def stage(*names):
        return load_config([f"configs/{n}.toml" for n in names]).train
    # 7B: stage 1 (its two parts, one run) -> stage 2 -> stage 3. Stage 1 ends at the epoch's end,
    # step 1,413,814 in OLMo-3-1025-7B.csv (its length depends on the data, not the config).
    part2, mid, long = (stage("olmo3-7b", s) for s in
                        ("olmo3-7b-pretrain-2", "olmo3-7b-stage2", "olmo3-7b-stage3"))
    assert part2.run_dir == stage("olmo3-7b").run_dir  # part 2 resumes part 1's run
    assert mid.init_from == f"{part2.run_dir}/step_1413814"
    assert long.init_from == f"{mid.run_dir}/step_{mid.steps}"
    # 32B: two stage-2 runs (the second by overrides), their soup, then stage 3 from the soup
    mid, long = (stage("olmo3-32b", s) for s in ("olmo3-32b-stage2", "olmo3-32b-stage3"))
    header = (ROOT / "configs/olmo3-32b-stage2.toml").read_text().replace("\\\n#", "")
    two = mid.run_dir.replace("ingredient1", "ingredient2")
    assert f"--train.run_dir={two}" in header and "ingredient2-100B.txt" in header
    soup = f"soup {mid.run_dir}/step_{mid.steps}       {two}/step_{mid.steps} --out {long.init_from}"
    assert " ".join(soup.split()) in " ".join(header.split())
    assert not long.load_optimizer  # a soup has no AdamW moments


@pytest.mark.parametrize("mix", sorted((ROOT / "configs/mixes").glob("OLMo-*.txt")), ids=lambda p: p.stem)
def test_shipped_mix_files_read_the_folders_they_name(tmp_path, mix):  # (the official ones)
    # The mix as a user lays it out: the file in configs/mixes/, a token file in each folder under
    # data/ that its header names; each source then reads its own folder's two instances.
    (tmp_path / "configs/mixes").mkdir(parents=True)
    copy = tmp_path / "configs/mixes" / mix.name
    copy.write_text(mix.read_text())
    lines = [line.split("#")[0].strip() for line in mix.read_text().splitlines()]
    lines = [line.split(",") for line in lines if line]
    for i, (_, glob) in enumerate(lines):
        folder = (copy.parent / glob).parent
        folder.mkdir(parents=True, exist_ok=True)
        np.full(8, i, np.uint32).tofile(folder / "part-00-00000.npy")
    sources = data.read_mix(copy)
    assert [label for label, _, _ in sources] == [label for label, _ in lines]
    instances = data.open_instances(copy, 4)
    assert instances.n == 2 * len(lines)
    assert {int(instances.read(i)[0]) for i in range(instances.n)} == set(range(len(lines)))
