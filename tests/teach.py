"""Failure messages that teach, for the exercises' tests (docs/exercises.md): what differs from the
reference, where (which positions, heads, ...), by how much, and which usual mistake gives exactly
that pattern. A test calls `compare`, which fails the test with the message and no traceback:

    from teach import compare, mistake
    compare("rope(q)", got, want, axes=("batch", "position", "head", "dim"),
            mistakes=[mistake("the interleaved (GPT-J) rotation", interleaved, "HF rotates ...")])
"""
import numpy as np
import pytest


def spans(indices):
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, indices = [], sorted(int(i) for i in indices)
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def mistake(name, array, fix):
    """A usual mistake: what it is, the output it gives on the test's input, and the fix."""
    return name, array, fix


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return False
    return np.abs(got - want).max(initial=0) <= tol * max(np.abs(want).max(), 1e-30)


def where_it_differs(bad, axes):
    """'  where: position 1-6 (0 matches); every head' over the named axes."""
    parts, everywhere = [], []
    for a, name in enumerate(axes):
        if name is None or bad.shape[a] == 1:
            continue
        hit = np.flatnonzero(bad.any(axis=tuple(i for i in range(bad.ndim) if i != a)))
        if len(hit) == bad.shape[a]:
            everywhere.append(name)
        else:
            ok = np.setdiff1d(np.arange(bad.shape[a]), hit)
            parts.append(f"{name} {spans(hit)} ({spans(ok)} match{'es' if len(ok) == 1 else ''})")
    if everywhere:
        parts.append("every " + ", every ".join(everywhere))
    return [f"  where: {'; '.join(parts)}"] if parts else []


def report(what, got, want, axes=(), tol=1e-5, mistakes=(), hint=""):
    """None when got equals want to tol (relative to want's largest value), else the message."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        names = ", ".join(map(str, axes))
        return f"{what}: shape {got.shape}, the reference's is {want.shape} ({names})"
    scale = max(np.abs(want).max(), 1e-30)
    diff = np.abs(got - want)
    bad = ~(diff <= tol * scale)  # NaN counts as a difference
    if not bad.any():
        return None
    at = np.unravel_index(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)), diff.shape)
    named = ", ".join(f"{n} {i}" for n, i in zip(axes, at) if n) or "the value"
    lines = [f"{what}: {bad.sum()} of {bad.size} values differ from the reference by more than "
             f"{tol:g} x its largest value ({scale:.3g})",
             f"  the largest difference: {diff[at]:.3g} at {named} (yours {got[at]:.4g}, the "
             f"reference {want[at]:.4g})",
             *where_it_differs(bad, axes)]
    ratio = got[bad] / np.where(want[bad] == 0, np.nan, want[bad])
    if np.all(np.isfinite(ratio)) and np.ptp(ratio) < 1e-4 * abs(ratio[0]):
        lines.append(f"  everywhere it differs, yours is {ratio[0]:.6g} x the reference")
    for name, array, fix in mistakes:
        if close(got, array, tol):
            lines.append(f"Yours is exactly what {name} gives: {fix}")
            break
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def compare(what, got, want, axes=(), tol=1e-5, mistakes=(), hint=""):
    """Fail the test with report's message (and no traceback: the message is the point)."""
    message = report(what, got, want, axes, tol, mistakes, hint)
    if message:
        pytest.fail(message, pytrace=False)


def number(what, got, want, rel=1e-6, mistakes=(), hint=""):
    """None when the number got equals want to rel, else what differs and which mistake gives it;
    mistakes: (description, the value it gives, the fix)."""
    got, want = float(got), float(want)
    if got == pytest.approx(want, rel=rel, abs=1e-12):
        return None
    lines = [f"{what}: yours {got:.7g}, the reference {want:.7g} (yours / reference = "
             f"{got / want if want else float('nan'):.6g})"]
    for name, value, fix in mistakes:
        if got == pytest.approx(float(value), rel=max(rel, 1e-6), abs=1e-12):
            lines.append(f"Yours is exactly what {name} gives: {fix}")
            break
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def fail(*lines):
    pytest.fail("\n".join(line for line in lines if line), pytrace=False)


def expect(*messages):
    """Fail with the messages that are not None (report's and number's), if any."""
    if any(messages):
        fail(*messages)
