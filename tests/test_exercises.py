"""docs/exercises.md and tests/exercises.py: every exercise has its marker and its tests, the student copy
compiles with every body removed, and one exercise checks end to end (the rest: `make exercises`)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import exercises

ROOT = Path(__file__).resolve().parents[1]


def test_every_exercise_has_a_marker_and_existing_tests():
    every = exercises.exercises()
    assert len(every) >= 10 and len({name for _, name, _ in every}) == len(every)
    markers = {name for source in exercises.where([e[1] for e in every]).values() for name in exercises.marked(source)}
    for title, name, tests in every:
        assert name in markers, f"{title}: no '# exercise: {name}' in the code"
        for t in tests:
            path, test = t.split("::")
            assert re.search(rf"^def {re.escape(test.split('[')[0])}\(", (ROOT / path).read_text(), re.M), t


def test_student_copy_compiles_and_raises(tmp_path):
    exercises.write_copy(tmp_path / "nanolmo", [e[1] for e in exercises.exercises()])
    for f in ("model.py", "train.py", "shard.py", "data.py"):
        source = (tmp_path / "nanolmo" / f).read_text()
        ast.parse(source)
        assert source.count("raise NotImplementedError(\"exercise: ") == len(re.findall(r"# exercise: ", source)), f
    r = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp, model; model.cross_entropy(jnp.zeros((1, 2, 3)), "
                        "jnp.zeros((1, 2), int))"], cwd=tmp_path / "nanolmo", capture_output=True, text=True)
    assert "NotImplementedError: exercise: z_loss" in r.stderr
    assert not (tmp_path / "nanolmo" / ".venv").exists() and (tmp_path / "nanolmo" / "docs" / "exercises.md").exists()


def test_one_exercise_checks_end_to_end(capsys):
    assert exercises.check(["z_loss"])
    assert "ok  6. Cross-entropy with z-loss (z_loss)" in capsys.readouterr().out
