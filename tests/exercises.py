"""Course exercises that check themselves (docs/exercises.md lists them, in course order).

    python tests/exercises.py student DIR     # a student copy in DIR: every exercise's body -> raise NotImplementedError
    python tests/exercises.py check [NAME..]  # each exercise's tests fail with its bodies removed, and pass as written
    make exercises                            # the same check, for all of them

In the code, a one-line marker `# exercise: NAME` stands directly above each function (or method) that
the exercise asks for; one exercise may mark several functions. The student copy keeps the signature
and the docstring and replaces the rest of the body. docs/exercises.md names, under each `##` heading,
the marker (**Marker** `NAME`) and the tests that check it (**Test** `tests/test_x.py::test_y`).

`check` removes one exercise at a time (so a failing test can only be that exercise's doing), runs
its tests and asks for a failure that names the exercise; then runs every exercise's tests on the
solution and asks for all of them to pass (none skipped: a skip would hide a broken exercise).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^\s*# exercise: (\w+)\s*$")


def exercises(doc=ROOT / "docs" / "exercises.md"):
    """[(title, marker, [test ids])] from the `##` sections of docs/exercises.md, in order."""
    out = []
    for section in re.split(r"^## ", doc.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        marker = re.search(r"\*\*Marker\*\* `(\w+)`", section)
        tests = re.search(r"\*\*Tests?\*\* ((?:`[^`]+`(?:, )?)+)", section)
        if not marker or not tests:
            raise ValueError(f"{doc}: section '{title}' needs a **Marker** `name` and a **Test** `tests/...::test_...`")
        out.append((title, marker.group(1), re.findall(r"`([^`]+)`", tests.group(1))))
    return out


def marked(source):
    """{marker: [(first body line, last line, indent, docstring?)]} of the functions under markers (1-based lines)."""
    lines, found = source.splitlines(), {}
    defs = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            defs[start] = node
    for i, line in enumerate(lines, start=1):
        m = MARKER.match(line)
        if not m:
            continue
        node = defs.get(i + 1)
        if node is None:
            raise ValueError(f"line {i}: '# exercise: {m.group(1)}' must stand directly above a def")
        body = node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str)
        first = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
        if has_doc and len(body) == 1:
            raise ValueError(f"line {i}: the function under '# exercise: {m.group(1)}' has nothing but a docstring")
        indent = len(lines[body[0].lineno - 1]) - len(lines[body[0].lineno - 1].lstrip())
        found.setdefault(m.group(1), []).append((first, node.end_lineno, indent))
    return found


def stub(source, names):
    """The source with the bodies of the functions marked with any of `names` replaced by a raise."""
    lines = source.splitlines(keepends=True)
    spans = [(first, last, indent, name) for name, places in marked(source).items() if name in names
             for first, last, indent in places]
    for first, last, indent, name in sorted(spans, reverse=True):  # from the bottom, so line numbers hold
        raise_line = " " * indent + f'raise NotImplementedError("exercise: {name} (docs/exercises.md)")\n'
        lines[first - 1:last] = [raise_line]
    return "".join(lines)


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def where(names):
    """{file: source} of the tracked .py files holding markers for any of `names`."""
    out = {}
    for f in tracked_files():
        if f.endswith(".py") and not f.startswith("tests/"):
            source = (ROOT / f).read_text()
            if set(marked(source)) & set(names):
                out[f] = source
    return out


def write_copy(dest, names):
    """The tracked tree copied to dest, with the bodies of the `names` exercises removed; ../shared linked beside it
    so the tests that read it do not skip."""
    dest = Path(dest)
    for f in tracked_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    for f, source in where(names).items():
        (dest / f).write_text(stub(source, names))
    shared = ROOT.parent / "shared"
    if shared.is_dir() and not (dest.parent / "shared").exists():
        (dest.parent / "shared").symlink_to(shared)
    return dest


def pytest(cwd, tests):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", *tests],
                          cwd=cwd, capture_output=True, text=True, env=env)


def check(only=()):
    """True when every chosen exercise (all, by default) fails in its student copy and passes as written."""
    every = exercises()
    todo = [e for e in every if not only or e[1] in only]
    markers = {name for source in where([e[1] for e in every]).values() for name in marked(source)}
    problems = [f"{title}: no '# exercise: {name}' marker in the code" for title, name, _ in todo if name not in markers]
    with tempfile.TemporaryDirectory() as tmp:
        for title, name, tests in todo:
            copy = write_copy(Path(tmp) / name / "nanolmo", [name])
            r = pytest(copy, tests)
            ok = r.returncode == 1 and f"exercise: {name}" in r.stdout
            print(f"{'ok ' if ok else 'BAD'} {title} ({name}): {' '.join(tests)} fail(s) in the student copy", flush=True)
            if not ok:
                problems.append(f"{title}: with '{name}' removed, {' '.join(tests)} did not fail on NotImplementedError "
                                f"(exit {r.returncode}):\n{r.stdout[-1500:]}")
            shutil.rmtree(copy.parent)
    tests = [t for _, _, ts in todo for t in ts]
    r = pytest(ROOT, tests)
    skipped = re.search(r"\d+ skipped", r.stdout)
    ok = r.returncode == 0 and not skipped
    print(f"{'ok ' if ok else 'BAD'} the solution passes all {len(tests)} tests", flush=True)
    if not ok:
        problems.append(f"the solution does not pass (exit {r.returncode}{', ' + skipped.group(0) if skipped else ''}):\n"
                        f"{r.stdout[-2000:]}")
    print("\n".join(["", *problems]) if problems else f"all {len(todo)} exercises check")
    return not problems


def main(argv):
    if argv[:1] == ["student"] and len(argv) == 2:
        dest = Path(argv[1])
        if dest.exists() and any(dest.iterdir()):
            sys.exit(f"{dest} exists and is not empty: give a new folder")
        write_copy(dest, [e[1] for e in exercises()])
        print(f"wrote a student copy to {dest}: {len(exercises())} exercises (docs/exercises.md); "
              f"check one with `python -m pytest -q TEST` inside it")
    elif argv[:1] == ["check"]:
        sys.exit(0 if check(argv[1:]) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
