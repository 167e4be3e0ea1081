"""docs/exercises.md and tests/exercises.py, in seconds: every exercise has its marker and its
tests, the student copy holds no answer (the torch twins go with their marker) and nothing outside
its folder, the commands' outputs, and the in-order check and the student runner on a toy course of
two exercises, skips refused. The real course in order is `make exercises` (minutes).

    .venv/bin/python -m pytest -q tests/test_exercises.py
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import exercises

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tests" / "exercises.py")]
# Each exercise's PyTorch twins, which its marker removes with the JAX functions.
TWINS = {"rmsnorm": ["RMSNorm.forward", "Block.forward"],
         "rope": ["rope_cos_sin_torch", "rope_torch"],
         "qk_norm": ["Attention.project"], "router": ["MoE.route"],
         "delta_rule": ["delta_rule_recurrent_torch"]}


def test_every_exercise_has_a_marker_and_existing_tests():
    every = exercises.exercises()
    assert len(every) == 16 and len({name for _, name, _ in every}) == len(every)
    sources = exercises.sources().values()
    markers = {name for source in sources for name in exercises.marked(source)}
    assert markers == {name for _, name, _ in every}, "a marker in the code without its section"
    ids = [t for _, _, tests in every for t in tests]
    assert len(ids) == len(set(ids)), "a test listed under two exercises"
    for title, name, tests in every:
        for t in tests:
            path, test = t.split("::")
            assert re.search(rf"^def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text(),
                             re.M), f"{title}: {t}"


def stubbed(source):
    """{'name' or 'Class.name': its exercise} of the functions whose body is an exercise's
    raise."""
    out, tree = {}, ast.parse(source)
    for node in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
        for child in node.body:
            if isinstance(child, ast.FunctionDef):
                name = f"{node.name}.{child.name}" if isinstance(node, ast.ClassDef) else child.name
                last = ast.unparse(child.body[-1])
                m = re.search(r"NotImplementedError\(.exercise: (\w+) ", last)
                if m and len(child.body) <= 2:
                    out[name] = m.group(1)
    return out


def test_student_copy_has_no_answer_and_stays_in_its_folder(tmp_path):
    names = [name for _, name, _ in exercises.exercises()]
    exercises.write_copy(tmp_path / "inside" / "nanolmo", names)
    assert [p.name for p in (tmp_path / "inside").iterdir()] == ["nanolmo"]  # no link beside it
    copy = tmp_path / "inside" / "nanolmo"
    removed = {}
    for f in ("model.py", "train.py", "shard.py", "data.py"):
        source = (copy / f).read_text()
        assert source.count('raise NotImplementedError("exercise: ') == source.count("# exercise: ")
        removed.update(stubbed(source))
    assert set(removed.values()) == set(names)
    for name, twins in TWINS.items():
        assert all(removed.get(t) == name for t in twins), (name, twins)
    call = "import torch, model; model.rope_torch(*[torch.ones(1, 2)] * 3)"
    r = subprocess.run([sys.executable, "-c", call], cwd=copy, capture_output=True, text=True)
    assert "NotImplementedError: exercise: rope (docs/exercises.md)" in r.stderr, r.stderr[-2000:]
    assert not (copy / ".venv").exists() and (copy / "docs" / "exercises.md").exists()


def run(*args):
    return subprocess.run([*SCRIPT, *args], capture_output=True, text=True)


def test_commands(tmp_path):
    lines = run("list").stdout.splitlines()
    every = exercises.exercises()
    assert [ln.split() for ln in lines] == [[name, *tests] for _, name, tests in every]
    r = run("student", str(tmp_path / "s"), "--from", "adamw")
    assert r.returncode == 0 and "without 8 of the 16 exercises (adamw to dpo" in r.stdout, r.stderr
    later = set(stubbed((tmp_path / "s" / "model.py").read_text()))
    assert later == {"cached_attention", "dpo_loss"}
    train = set(stubbed((tmp_path / "s" / "train.py").read_text()))
    assert train == {"adamw", "lr_at", "is_outlier"}
    r = run("student", str(tmp_path / "s"))
    assert r.returncode and "exists and is not empty" in r.stderr
    r = run("student", str(tmp_path / "t"), "--from", "ropes")
    assert r.returncode and "--from ropes: no such exercise" in r.stderr


TOY_CODE = '''
# exercise: double
def double(x):
    """2x."""
    return 2 * x


# exercise: plus_one
def plus_one(x):
    """double(x) + 1."""
    return double(x) + 1


# === PyTorch ===

# exercise: plus_one
def plus_one_twin(x):
    """plus_one's twin."""
    return 2 * x + 1
'''
TOY_TESTS = '''
import os, sys, pathlib
import pytest
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import toy


def test_double():
    assert toy.double(2) == 4


def test_plus_one():
    if os.environ.get("TOY_SKIP"):
        pytest.skip("no reference here")
    if not os.environ.get("TOY_LOOSE"):  # loose: a test that cannot fail
        assert toy.plus_one(2) == 5
        assert toy.plus_one_twin(2) == 5  # the JAX function first, then its twin
'''
TOY_DOC = """# Toy
## 1. Double
**Marker** `double` · **Tests** `tests/test_toy.py::test_double`
## 2. Plus one
**Marker** `plus_one` · **Tests** `tests/test_toy.py::test_plus_one`
"""


def toy_course(root, monkeypatch):
    (root / "tests").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "toy.py").write_text(TOY_CODE)
    (root / "tests" / "test_toy.py").write_text(TOY_TESTS)
    (root / "docs" / "exercises.md").write_text(TOY_DOC)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    monkeypatch.setattr(exercises, "ROOT", root)
    monkeypatch.setattr(exercises, "DOC", root / "docs" / "exercises.md")


def test_check_and_runner_on_a_toy_course(tmp_path, monkeypatch, capfd):
    capsys = capfd  # (pytest's own output, from its process, too)
    toy_course(tmp_path / "toy", monkeypatch)
    assert exercises.check()
    out = capsys.readouterr().out
    assert ("ok  2. Plus one: the copy from plus_one fails its 1 tests on `exercise: plus_one`"
            in out)
    assert "ok  2. Plus one: the copy with every exercise written passes its 1 tests" in out
    monkeypatch.setenv("TOY_SKIP", "1")  # a skipped test is no pass
    assert not exercises.check(["plus_one"])
    assert "plus_one: skipped no reference here" in capsys.readouterr().out
    assert not exercises.student_test("plus_one")
    assert "skipped  tests/test_toy.py::test_plus_one" in capsys.readouterr().out
    monkeypatch.delenv("TOY_SKIP")
    monkeypatch.setenv("TOY_LOOSE", "1")  # a test that passes without its exercise
    assert not exercises.check(["plus_one"])
    assert "test_plus_one: passed" in capsys.readouterr().out
    monkeypatch.delenv("TOY_LOOSE")
    exercises.write_copy(tmp_path / "copy", ["plus_one"])  # a student's copy: the runner's verdict
    monkeypatch.setattr(exercises, "ROOT", tmp_path / "copy")
    monkeypatch.setattr(exercises, "DOC", tmp_path / "copy" / "docs" / "exercises.md")
    assert exercises.left_to_write() == ["plus_one"]
    assert not exercises.student_test()
    out = capsys.readouterr().out
    assert "plus_one: NOT done (1 of 1 tests did not pass)" in out
    assert "still to write: plus_one" in out  # the function, named in the stub's message
    assert "toy.plus_one(2) == 5" not in out  # the test's source, which holds the answer
    assert exercises.student_test("double")
    assert "double: done, all 1 tests pass. Next: plus_one" in capsys.readouterr().out
    toy = tmp_path / "copy" / "toy.py"  # the JAX half written, the twin still blank
    stub = 'raise NotImplementedError("exercise: plus_one (docs/exercises.md): plus_one is yours'
    source = toy.read_text()
    assert source.count(stub) == 1
    toy.write_text(source.replace(stub + ' to write")', "return double(x) + 1"))
    assert not exercises.student_test("plus_one")
    out = capsys.readouterr().out
    assert "the JAX half passes: plus_one (every test checks it before the twin)" in out
    assert "still to write, the PyTorch half: plus_one_twin" in out
