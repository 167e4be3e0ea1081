"""The README and docs/ against the code: the config table against configs/*.toml and model.count_params,
the reading order's functions and tests against the files, links, and the generated-block markers.

    .venv/bin/python -m pytest -q tests/test_readme.py
    python tests/tables.py configs        # when the config table is stale: regenerate it
"""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tables  # noqa: E402
from configs import load_config  # noqa: E402
from model import count_params, flops_per_token  # noqa: E402

README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text()
         for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
TEST_SOURCES = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))


def block(text, name):
    m = re.search(rf"<!-- table:{re.escape(name)} -->\n(.*?)<!-- /table -->", text, re.S)
    assert m, f"no <!-- table:{name} --> block"
    return m.group(1)


def config_table():
    """[{column: cell}] of the README's config table."""
    lines = [ln for ln in block(README, "configs").splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header, rows = cells[0], cells[2:]
    return [dict(zip(header, r)) for r in rows]


def test_readme_is_short():
    assert len(README.splitlines()) <= 250, "the README teaches; reference material goes to docs/"


def test_config_table_matches_the_configs():
    rows = config_table()
    assert rows, "the config table is empty: python tests/tables.py configs"
    shown = set()
    for row in rows:
        names = row["config"].strip("`").split(" + ")
        shown.update(names)
        m = load_config([str(ROOT / f"configs/{n}.toml") for n in names]).model
        where = f"README config table, row {row['config']}"
        assert int(row["params"].replace(",", "")) == count_params(m), f"{where}: params; python tests/tables.py configs"
        for col, field in dict(L="n_layers", D="d_model", N="n_heads", K="n_kv_heads", H="head_dim", F="mlp_hidden",
                               V="vocab_size", T="max_seq_len").items():
            assert int(row[col]) == getattr(m, field), f"{where}: {col} is {row[col]}, {field} is {getattr(m, field)}"
        assert row["family"] == m.family, where
        if m.sliding_window and "S" in m.layer_pattern:
            assert row["attention"].startswith(f"{m.layer_pattern}, W {m.sliding_window}"), where
        elif "G" in m.layer_pattern:  # OLMo Hybrid's Gated DeltaNet layers
            assert row["attention"].startswith(f"{m.layer_pattern} (G: DeltaNet)"), where
            assert row["attention"].endswith("no RoPE") == (m.rope_theta == 0), where
        else:
            assert row["attention"] == "full", where
        assert ("YaRN" in row["attention"]) == bool(m.yarn_factor), where
        value, unit = row["FLOPs/token"].split()
        assert float(value) * {"G": 1e9, "M": 1e6}[unit] == pytest.approx(flops_per_token(m), rel=5e-3), where
    files = {p.stem for p in (ROOT / "configs").glob("*.toml") if not tables.SAME_MODEL.search(p.stem)}
    assert files <= shown, f"configs not in the README's table: {sorted(files - shown)}"


def test_reading_order_names_exist():
    section = README[README.index("## Reading order"):]
    section = section[:section.index("\n## ", 1)]
    items = re.split(r"\n(?=\d+\. \*\*`)", section)[1:]
    assert len(items) >= 6, "the reading order lists the files"
    for item in items:
        path = re.match(r"\d+\. \*\*`([^`]+)`\*\*", item).group(1)
        for dotted in re.findall(r"`([\w.]+)\(\)`", item):
            module, _, name = dotted.rpartition(".")
            source = (ROOT / (f"{module}.py" if module else path)).read_text()
            assert re.search(rf"^\s*(def|class) {name}\b", source, re.M), f"reading order: no {name} in {module or path}"
        for test_file, test in re.findall(r"`(test_\w+\.py)::(test_\w+)`", item):
            test_source = (ROOT / "tests" / test_file).read_text()
            assert re.search(rf"^def {test}\(", test_source, re.M), f"reading order: no {test_file}::{test}"


def test_every_named_test_exists():
    for page, text in PAGES.items():
        # (not after a "/": a request folder's variant, e.g. arc_easy/test_mc_5shot, is no test)
        for name in set(re.findall(r"(?<![\w/])(test_\w+)\b(?!\.py)", text)):
            assert re.search(rf"^def {name}\(", TEST_SOURCES, re.M), f"{page} names {name}, which no test file defines"


def test_docs_links_exist():
    for link in set(re.findall(r"\bdocs/[\w./-]+\w", README)):
        assert (ROOT / link).exists(), f"README links {link}, which does not exist"
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" not in target:
                assert ((ROOT / page).parent / target).exists(), f"{page} links {target}, which does not exist"


def test_generated_blocks_are_closed_and_known():
    for page, text in PAGES.items():
        open_name = None
        for m in re.finditer(r"<!-- table:([\w.-]+) -->|<!-- /table -->", text):
            if m.group(1):
                assert open_name is None, f"{page}: block {m.group(1)} opens inside block {open_name}"
                assert m.group(1) in tables.TABLES, f"{page}: unknown block {m.group(1)}; known: {list(tables.TABLES)}"
                open_name = m.group(1)
            else:
                assert open_name is not None, f"{page}: a <!-- /table --> closes no block"
                open_name = None
        assert open_name is None, f"{page}: block {open_name} is never closed"
