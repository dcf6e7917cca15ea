"""Where the test suite's time goes, per tier: runs a tier (or reads a run's JUnit XML) and writes the table between
the markers of docs/testing.md, and records the run's wall-clock time there.

    python scripts/test_durations.py --run all            # the whole suite (~25 min); rewrites the table
    python scripts/test_durations.py --run fast           # the fast tier; adds its row to "Measured runs"
    python scripts/test_durations.py --junit run.xml      # a run made before (pytest --junitxml=run.xml)

The tiers of each test come from tests/tiers.py (conftest records them in the XML as the property ``tiers``).
Without ``--write`` it only prints.
"""

import argparse
import collections
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "testing.md")
TABLE = ("<!-- durations:start -->", "<!-- durations:end -->")
RUNS = ("<!-- runs:start -->", "<!-- runs:end -->")
SLOWEST = 15


@dataclass
class Case:
    nodeid: str
    seconds: float
    tiers: tuple[str, ...]
    outcome: str  # passed, failed, skipped, xfailed

    @property
    def tier(self) -> str:
        """The row of the table it counts in: the fast tier, or the first of its slower tiers."""
        for tier in ("vllm", "distributed", "slow"):
            if tier in self.tiers:
                return tier
        return "fast"

    @property
    def file(self) -> str:
        return self.nodeid.split("::")[0]


def read_junit(path: str) -> list[Case]:
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skipped := case.find("skipped")) is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        tiers = tuple(t for t in properties.get("tiers", "").split(",") if t)
        cases.append(Case(f"{module}::{case.get('name')}", float(case.get("time", 0)), tiers, outcome))
    return cases


def table(cases: list[Case]) -> str:
    by_tier: dict[str, list[Case]] = collections.defaultdict(list)
    for case in cases:
        by_tier[case.tier].append(case)
    lines = ["| tier | tests | seconds (sum of tests) | slowest test |", "|---|---:|---:|---|"]
    for tier in ("fast", "slow", "distributed", "vllm"):
        group = by_tier.get(tier, [])
        if group:
            top = max(group, key=lambda c: c.seconds)
            lines.append(f"| {tier} | {len(group)} | {sum(c.seconds for c in group):.0f} | "
                         f"`{top.nodeid}` ({top.seconds:.0f} s) |")
    lines.append(f"| all | {len(cases)} | {sum(c.seconds for c in cases):.0f} | |")
    files: dict[str, list[Case]] = collections.defaultdict(list)
    for case in cases:
        files[case.file].append(case)
    lines += ["", f"The {SLOWEST} slowest files:", "", "| file | tier(s) | tests | seconds |", "|---|---|---:|---:|"]
    ranked = sorted(files.items(), key=lambda kv: -sum(c.seconds for c in kv[1]))[:SLOWEST]
    for name, group in ranked:
        tiers = ", ".join(sorted({c.tier for c in group}))
        lines.append(f"| `{name}` | {tiers} | {len(group)} | {sum(c.seconds for c in group):.0f} |")
    lines += ["", f"The {SLOWEST} slowest tests:", "", "| test | tier | seconds |", "|---|---|---:|"]
    for case in sorted(cases, key=lambda c: -c.seconds)[:SLOWEST]:
        lines.append(f"| `{case.nodeid}` | {case.tier} | {case.seconds:.1f} |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def replace_between(text: str, markers: tuple[str, str], body: str, append: bool = False) -> str:
    start, end = markers
    pattern = re.compile(re.escape(start) + r"\n(.*?)" + re.escape(end), re.S)
    match = pattern.search(text)
    if match is None:
        raise SystemExit(f"{DOC} has no {start} ... {end} markers")
    inner = (match.group(1) + body + "\n") if append else (body + "\n")
    return text[:match.start()] + start + "\n" + inner + end + text[match.end():]


def run(tier: str, pytest_args: list[str]) -> tuple[str, float, int]:
    junit = os.path.join(tempfile.mkdtemp(), "run.xml")
    # scripts/test.sh itself (its set-up is done by then: a few seconds), so the times are those of its workers
    command = ["bash", os.path.join(ROOT, "scripts", "test.sh"), *(["--fast"] if tier == "fast" else []),
               f"--junitxml={junit}", *pytest_args]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    code = subprocess.call(command, cwd=ROOT)
    return junit, time.monotonic() - started, code


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", choices=["fast", "all"], help="Run this tier (all: the whole suite) and time it.")
    source.add_argument("--junit", help="Read a run's JUnit XML instead.")
    parser.add_argument("--write", action="store_true", help=f"Write the results into {os.path.relpath(DOC, ROOT)}.")
    parser.add_argument("pytest_args", nargs="*", help="More pytest arguments (after --).")
    cli = parser.parse_args(argv)

    wall, code = None, 0
    junit = cli.junit
    if cli.run:
        junit, wall, code = run(cli.run, cli.pytest_args)
    cases = read_junit(junit)
    body = table(cases)
    print(body)
    counts = collections.Counter(c.outcome for c in cases)
    outcome = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped", "xfailed") if counts[k])
    row = None
    if wall is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        row = (f"| {datetime.date.today()} | {commit} | {cli.run} | {wall / 60:.1f} min | {outcome} | "
               f"{cpu_name()}, {os.cpu_count()} cores |")
        print(row)
    if cli.write:
        with open(DOC) as f:
            text = f.read()
        if cli.run != "fast":  # the per-tier table comes from whole-suite runs
            text = replace_between(text, TABLE, body)
        if row is not None:
            text = replace_between(text, RUNS, row, append=True)
        with open(DOC, "w") as f:
            f.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
