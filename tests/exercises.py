"""The course (docs/exercises.md) as commands: its exercises in order, a student copy without the
answers, one exercise's tests as a student runs them, and the check that the course can be taken in
order.

    python tests/exercises.py list                      # in course order: NAME, then its tests
    python tests/exercises.py student DIR [--from NAME] # a copy in DIR without NAME and every
                                                        # later exercise (default: without all)
    python tests/exercises.py test [NAME]               # in the copy: NAME's tests (default: the
                                                        # first exercise left to write); a skip
                                                        # fails
    python tests/exercises.py check [NAME..]            # each exercise k: the copy from k fails
                                                        # k's tests on k's marker, the copy from
                                                        # k + 1 passes them (none skipped)
    make exercises                                      # check, every exercise in order

In the code, the line `# exercise: NAME` stands directly above each function (or method) an
exercise removes; one marker may stand above several, such as the JAX function and its PyTorch
twin, which go together. The copy keeps the signature and the docstring and replaces the rest of
the body with `raise NotImplementedError("exercise: NAME (docs/exercises.md): FUNCTION is yours to
write")`, so a failing test names the function (the JAX one or its twin) still to write. A student's
run shows each failure as one line, where it was raised: pytest's usual report would print the
test's source, which holds the answer. Its verdict names what is left; for an exercise with a twin,
whose tests check the JAX function first, it says when the JAX half passes and only the PyTorch
half is left. docs/exercises.md names, under each
`##` heading, the marker (**Marker** `NAME`) and the tests that check it (**Tests** `tests/...`).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "exercises.md"
MARKER = re.compile(r"^\s*# exercise: (\w+)\s*$")
SETUP = ("the tests need the test extra (pytest, transformers): `make env` in the checkout makes "
         ".venv with it; run this with that .venv/bin/python")


def exercises(doc=None):
    """[(title, marker, [test ids])] from the `##` sections of docs/exercises.md, in order."""
    doc, out = doc or DOC, []
    for section in re.split(r"^## ", doc.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        marker = re.search(r"\*\*Marker\*\* `(\w+)`", section)
        tests = re.search(r"\*\*Tests?\*\* ((?:`[^`]+`(?:, )?)+)", section)
        if not marker or not tests:
            raise ValueError(f"{doc}: section '{title}' needs a **Marker** `name` and a "
                             "**Tests** `tests/...::test_...`")
        out.append((title, marker.group(1), re.findall(r"`([^`]+)`", tests.group(1))))
    return out


def marked(source):
    """{marker: [(first body line, last line, indent, name)]} of the functions under markers
    (lines 1-based; name: "function" or "Class.method")."""
    lines, found = source.splitlines(), {}
    tree = ast.parse(source)
    owner = {}  # a method -> the name of its class
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                owner[child] = node.name
    defs = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            defs[start] = node
    for i, line in enumerate(lines, start=1):
        m = MARKER.match(line)
        if not m:
            continue
        node = defs.get(i + 1)
        if node is None:
            raise ValueError(f"line {i}: '# exercise: {m.group(1)}' must stand directly above a "
                             "def")
        body = node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str)
        if has_doc and len(body) == 1:
            raise ValueError(f"line {i}: the function under '# exercise: {m.group(1)}' has nothing "
                             "but a docstring")
        first = body[1].lineno if has_doc else body[0].lineno
        indent = len(lines[body[0].lineno - 1]) - len(lines[body[0].lineno - 1].lstrip())
        name = f"{owner[node]}.{node.name}" if node in owner else node.name
        found.setdefault(m.group(1), []).append((first, node.end_lineno, indent, name))
    return found


def stub(source, names):
    """The source with the bodies of the functions marked with any of `names` replaced by a
    raise."""
    lines = source.splitlines(keepends=True)
    spans = []
    for exercise, places in marked(source).items():
        if exercise in names:
            spans += [(first, last, indent, exercise, function)
                      for first, last, indent, function in places]
    for first, last, indent, exercise, function in sorted(spans, reverse=True):  # bottom up: the
        # line numbers of the spans above stay valid
        message = f"exercise: {exercise} (docs/exercises.md): {function} is yours to write"
        lines[first - 1:last] = [" " * indent + f'raise NotImplementedError("{message}")\n']
    return "".join(lines)


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def sources():
    """{file: source} of the .py files outside tests/ (in a checkout or in a student copy)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.glob("*.py")]
    return {f: (ROOT / f).read_text() for f in sorted(files)}


def where(names):
    """{file: source} of the code files holding markers for any of `names`."""
    return {f: s for f, s in sources().items() if set(marked(s)) & set(names)}


def left_to_write():
    """The exercises whose bodies are still `raise NotImplementedError(...)` here, in order."""
    code = "\n".join(sources().values())
    return [name for _, name, _ in exercises() if f'NotImplementedError("exercise: {name} ' in code]


def write_copy(dest, names):
    """The checkout's files copied into dest (nothing outside it), with the bodies of the `names`
    exercises removed."""
    dest = Path(dest)
    for f in tracked_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    for f, source in where(names).items():
        (dest / f).write_text(stub(source, names))
    return dest


def run_pytest(cwd, tests, quiet=True):
    """{test id: (passed | failed | error | skipped | not run, message)} and pytest's output (its
    own printing goes to the terminal when not quiet, each failure as one line: file, line and
    error, never the test's source). Outcomes come from pytest's junit report."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        one_line = () if quiet else ("--tb=line",)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *one_line, *tests]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        r = subprocess.run(cmd, cwd=cwd, env=env, text=True,
                           **(dict(capture_output=True) if quiet else {}))
        found = {}
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):  # classname: [tests.]test_x
                found[case.get("classname").rpartition(".")[2], case.get("name")] = case
    out = {}
    for t in tests:
        path, _, name = t.partition("::")
        case = found.get((Path(path).stem, name))
        if case is None:
            out[t] = ("not run", "pytest did not run it (a collection error? see its output)")
            continue
        kinds = dict(failure="failed", error="error", skipped="skipped")
        child = next((c for c in case if c.tag in kinds), None)
        out[t] = ("passed", "") if child is None else (kinds[child.tag], child.get("message", ""))
    return out, (r.stdout or "") + (r.stderr or "")


def raised_by(name, outcome):
    """Did this outcome come from exercise `name`'s stub?"""
    return outcome[0] == "failed" and f"NotImplementedError: exercise: {name} " in outcome[1]


def check(only=()):
    """True when, for every chosen exercise k (all, by default), the copy without k and the later
    ones fails k's tests, each on k's marker, and the copy without only the later ones passes
    them, none skipped. Copy j (without exercise j on) runs exercise j's tests and j - 1's."""
    every = exercises()
    names = [name for _, name, _ in every]
    todo = [i for i, (_, name, _) in enumerate(every) if not only or name in only]
    markers = {name for source in sources().values() for name in marked(source)}
    problems = [f"{every[i][0]}: no '# exercise: {every[i][1]}' in the code" for i in todo
                if every[i][1] not in markers]
    problems += [f"{name}: unknown exercise" for name in only if name not in names]
    ids = [t for _, _, tests in every for t in tests]
    problems += [f"{t} is listed under two exercises" for t in sorted({t for t in ids
                                                                        if ids.count(t) > 1})]
    if problems:
        print("\n".join(problems))
        return False
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for j in sorted({j for i in todo for j in (i, i + 1)}):
            must_fail = [every[j]] if j in todo else []
            must_pass = [every[j - 1]] if j - 1 in todo else []
            label = f"from {names[j]}" if j < len(names) else "with every exercise written"
            copy = write_copy(Path(tmp) / f"from-{j + 1}" / "nanolmo", names[j:])
            tests = [t for _, _, ts in must_fail + must_pass for t in ts]
            t0 = time.time()
            results, output = run_pytest(copy, tests)
            took = f"{time.time() - t0:.0f} s"
            for title, name, ts in must_pass:
                bad = [f"  {t}: {results[t][0]} {results[t][1][:300]}" for t in ts
                       if results[t][0] != "passed"]
                print(f"{'BAD' if bad else 'ok '} {title}: the copy {label} passes its "
                      f"{len(ts)} tests ({took})", flush=True)
                if bad:
                    problems.append(f"{title}: in the copy {label} (exercise {name} written):\n"
                                    + "\n".join(bad) + f"\n{output[-3000:]}")
            for title, name, ts in must_fail:
                bad = [f"  {t}: {results[t][0]} {results[t][1][:300]}" for t in ts
                       if not raised_by(name, results[t])]
                print(f"{'BAD' if bad else 'ok '} {title}: the copy {label} fails its "
                      f"{len(ts)} tests on `exercise: {name}` ({took})", flush=True)
                if bad:
                    problems.append(f"{title}: in the copy {label}, each test must fail on "
                                    f"NotImplementedError: exercise: {name}:\n" + "\n".join(bad)
                                    + f"\n{output[-3000:]}")
            shutil.rmtree(copy.parent)
    took = f"{time.time() - start:.0f} s"
    print("\n".join(["", *problems]) if problems else
          f"all {len(todo)} exercises check, in course order ({took})")
    return not problems


def student_test(name=None):
    """A student's run of one exercise's tests, here (in a copy): pytest's own output, then a
    verdict that counts a skipped or unrun test as not passed. True when every test passed."""
    every = {n: (title, tests) for title, n, tests in exercises()}
    if name is None:
        left = left_to_write()
        if not left:
            print("every exercise here is written; `python tests/exercises.py test NAME` runs one")
            return True
        name = left[0]
    if name not in every:
        sys.exit(f"no exercise {name!r}; `python tests/exercises.py list` lists them")
    title, tests = every[name]
    print(f"{title} ({name}): {' '.join(tests)}", flush=True)
    results, _ = run_pytest(ROOT, tests, quiet=False)
    not_passed = {t: r for t, r in results.items() if r[0] != "passed"}
    if not not_passed:
        later = [n for n in left_to_write() if n != name]
        print(f"\n{name}: done, all {len(tests)} tests pass." + (f" Next: {later[0]}" if later
                                                                  else ""))
        return True
    print(f"\n{name}: NOT done ({len(not_passed)} of {len(tests)} tests did not pass)")
    for t, (status, message) in not_passed.items():
        print(f"  {status:8} {t}: {message.splitlines()[0] if message else ''}")
        if status in ("skipped", "not run"):
            print(f"           a {status} test is no pass: {SETUP}")
    # An exercise may hold a JAX function and its PyTorch twin: say which ones still raise
    messages = " ".join(message for _, message in not_passed.values())
    left = sorted(set(re.findall(r"\(docs/exercises.md\): (\S+) is yours to write", messages)))
    jax_half, torch_half = halves(name)
    only_stubs = all(raised_by(name, outcome) for outcome in not_passed.values())
    if left and torch_half and only_stubs and set(left) <= set(torch_half):
        # each test checks the JAX function before its twin: failing only on a twin's stub, it
        # has passed the JAX half
        print(f"  the JAX half passes: {', '.join(jax_half)} (every test checks it before the "
              "twin)")
        print(f"  still to write, the PyTorch half: {', '.join(left)}")
    elif left:
        passed = len(tests) - len(not_passed)
        already = f" ({passed} of its tests pass already)" if passed else ""
        print(f"  still to write: {', '.join(left)}{already}")
    return False


def halves(name):
    """(JAX functions, PyTorch twins) of exercise `name`, by name: a twin stands below a file's
    `# === PyTorch ===` line (model.py's)."""
    jax_half, torch_half = [], []
    for source in where([name]).values():
        lines = source.splitlines()
        twins_from = next((i for i, line in enumerate(lines, start=1)
                           if line.startswith("# === PyTorch ===")), len(lines) + 1)
        for first, _, _, function in marked(source)[name]:
            if first > twins_from:
                torch_half.append(function)
            else:
                jax_half.append(function)
    return jax_half, torch_half


def main(argv):
    if argv[:1] == ["list"] and len(argv) == 1:
        for _, name, tests in exercises():
            print(name, *tests)
    elif argv[:1] == ["student"] and (len(argv) == 2 or len(argv) == 4 and argv[2] == "--from"):
        names = [name for _, name, _ in exercises()]
        first = argv[3] if len(argv) == 4 else names[0]
        if first not in names:
            sys.exit(f"--from {first}: no such exercise; they are {', '.join(names)}")
        dest = Path(argv[1])
        if dest.exists() and any(dest.iterdir()):
            sys.exit(f"{dest} exists and is not empty: give a new folder")
        removed = names[names.index(first):]
        write_copy(dest, removed)
        print(f"wrote a student copy to {dest}, without {len(removed)} of the {len(names)} "
              f"exercises ({first} to {removed[-1]}; docs/exercises.md). In it, with the "
              f"checkout's python: `python tests/exercises.py test` runs the first one's tests")
    elif argv[:1] == ["test"] and len(argv) <= 2:
        sys.exit(0 if student_test(*argv[1:]) else 1)
    elif argv[:1] == ["check"]:
        sys.exit(0 if check(argv[1:]) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
