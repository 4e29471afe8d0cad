"""The GPU check's steps as bounded subprocesses: the time budget, running one command in its own process
group with a timeout that takes its children down too, a step's status from its output (a failed table row or
a failed test fails the step whatever the exit code), and the helpers that cut a step's output into its report
cell (``tools.gpu.check``)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout (tools/ is a top-level folder)


@dataclasses.dataclass
class Step:
    """One step's outcome: status is passed | failed | timed out | skipped."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    output: str = ""


class Budget:
    """The check's total time; each step gets what is left after reserving the later steps' minimum.

    ``sized_for``: the total the caps and reserves were chosen for; another budget scales the reserves in
    proportion, and a larger one the caps too (a CPU rehearsal given ``--budget 880`` gives every step twice
    the time; a smaller budget never cuts a step's cap). ``capped=False``: no step has a cap of its own, only the
    reserves (the CI rehearsal: a loaded CPU's seconds must not decide which step times out).
    """

    def __init__(self, seconds: float, sized_for: float | None = None, capped: bool = True) -> None:
        self.deadline = time.monotonic() + seconds
        self.total = seconds
        self.scale = 1.0 if sized_for is None else seconds / sized_for
        self.capped = capped

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def for_step(self, cap: float, reserve: float = 0.0) -> float:
        cap = cap * max(1.0, self.scale) if self.capped else float("inf")
        return max(0.0, min(cap, self.left() - reserve * self.scale))


def run(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; (return code or None on timeout, output, seconds).

    Output goes through a file (not a pipe a stuck grandchild could hold open); on timeout the
    whole group is terminated, then killed.
    """
    t0 = time.monotonic()
    if timeout < 1:
        return None, "no time left in the budget", 0.0
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        except OSError as err:
            return 127, f"cannot start {cmd[0]}: {err}", 0.0
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        text = out.read()
    seconds = time.monotonic() - t0
    with log.open("a", encoding="utf-8") as f:
        f.write(f"\n===== $ {' '.join(cmd)}  (rc={rc}, {seconds:.1f} s)\n{text}\n")
    return rc, text, seconds


def status_of(rc: int | None) -> str:
    return "timed out" if rc is None else ("passed" if rc == 0 else "failed")


def combined(parts: list[Step]) -> str:
    """One status for a step made of parts: failed if one failed, else timed out if one did, else passed if one
    passed (a part skipped beside it says so in the summary), else skipped. Never "passed" over a failed part."""
    statuses = {p.status for p in parts}
    for status in ("failed", "timed out", "passed"):
        if status in statuses:
            return status
    return "skipped"


def parts_step(name: str, parts: list[Step], note: str = "", lines: int = 30) -> Step:
    """One step of several parts (each its own subprocess): its status is ``combined``'s (never "passed" over a
    failed part), its summary every part's."""
    summary = note + "\n\n".join(f"**{p.name}** ({p.status})\n```\n{p.summary}\n```" for p in parts)
    return Step(name, combined(parts), sum(p.seconds for p in parts), summary,
                "\n\n".join(tail(p.output, lines) for p in parts))


def failed_rows(text: str) -> list[str]:
    """The table rows a benchmark printed with a cell that starts with "failed" or "error" (its own verdict on
    that row): a step that printed one failed, whatever its exit code."""
    return [line for line in text.splitlines() if line.startswith("|")
            and any(cell.strip().lower().startswith(("failed", "error")) for cell in line.strip("|").split("|"))]


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def table_rows(text: str) -> str:
    """The Markdown table rows a benchmark printed."""
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_TEST_LINE = re.compile(r"^(tests/\S+::\S+)(?:\s+(" + "|".join(OUTCOMES) + r")\b)?")


@dataclasses.dataclass
class PytestResults:
    """What a ``pytest -v`` run printed, test by test, as far as it got: ``outcomes`` {test id: outcome} of every
    test that finished (the worst of its reports: a teardown error after a pass is an error) and ``running``, the
    test that had started and not finished when the output ends (the one a timeout cut), or None."""

    outcomes: dict[str, str]
    running: str | None

    def named(self, *outcomes: str) -> list[str]:
        return [t for t, o in self.outcomes.items() if o in outcomes]

    def counts(self) -> str:
        found = [(o, sum(v == o for v in self.outcomes.values())) for o in OUTCOMES]
        return ", ".join(f"{n} {o.lower()}" for o, n in found if n) or "no test finished"


def pytest_results(text: str) -> PytestResults:
    """Parse ``pytest -v`` output: it names each test when it starts and appends its outcome when it ends, so
    every finished test's name and outcome survive a kill, and the test that was running is the last one named
    without an outcome."""
    worst = {o: i for i, o in enumerate(("PASSED", "XFAIL", "SKIPPED", "XPASS", "FAILED", "ERROR"))}
    outcomes: dict[str, str] = {}
    running = None
    for line in text.splitlines():
        m = _TEST_LINE.match(line.strip())
        if m is None:
            continue
        test, outcome = m.groups()
        if outcome is None:
            running = test
            continue
        if worst[outcome] >= worst.get(outcomes.get(test, "PASSED"), 0):
            outcomes[test] = outcome
        if running == test:
            running = None
    return PytestResults(outcomes, running)


def pytest_summary(text: str, rc: int | None = 0) -> str:
    """The tests that failed or errored by name, the outcome counts, the test a timeout cut (``rc`` None), and
    pytest's short summary (-rfEs: failures, errors, skip reasons) and closing line where it got that far."""
    results = pytest_results(text)
    lines = text.rstrip().splitlines()
    keep = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    closing = [ln for ln in lines if re.search(r"\d+ (passed|failed|skipped|error|deselected)", ln)
               and ln.startswith("=")]
    head = [f"tests finished: {results.counts()}"]
    bad = results.named("FAILED", "ERROR")
    if bad and not keep:   # cut before pytest's own summary: the names from the per-test lines
        head += [f"{results.outcomes[t]} {t}" for t in bad]
    if rc is None:
        head.append(f"running when the time cap hit: {results.running or 'none (between tests)'}")
    return "\n".join(head + keep + closing[-1:])


def pytest_status(rc: int | None, text: str) -> str:
    """A pytest run's status: failed when a test failed or errored (whatever the exit code), timed out when
    killed, failed on any other non-zero exit (collection errors, no tests collected), else passed."""
    if pytest_results(text).named("FAILED", "ERROR"):
        return "failed"
    return status_of(rc)


def fmt(x: object, spec: str) -> str:
    """``x`` formatted, "n/a" when absent, "non-finite" for NaN/inf (the metrics log a non-finite loss as None:
    callers say which)."""
    if x is None:
        return "n/a"
    if isinstance(x, (int, float)) and not math.isfinite(x):
        return "non-finite"
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)
