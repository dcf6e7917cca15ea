"""The test tiers, declared once: what makes a test distributed, a vLLM test or slow, and which tests make up the
fast tier (``bash scripts/test.sh --fast``; docs/testing.md).

A test's tiers come from where it lives and from what it calls, so nobody has to remember a marker:

- ``distributed``: it lives in tests/distributed/, or it calls ``launch`` (2 processes through ``accelerate``),
  directly or through a helper of a test module;
- ``vllm``: it asks for a fixture that starts vLLM or needs it installed (``VLLM_FIXTURES``);
- ``slow``: it asks for a fixture that trains a demo's warm start (``SLOW_FIXTURES``), or it carries
  ``@pytest.mark.slow`` (a single-process test over ~20 s that earned its place).

The fast tier is every test in none of these tiers, plus the ``smoke`` tests: a few chosen 2-process runs, so that
the fast tier still catches a broken launch. A fast-tier test that runs over ``FAST_LIMIT_S`` is named at the end
of the run: move it to the slow tier, or make it faster.
"""

import inspect
import types

TIERS = ("distributed", "vllm", "slow")
DISTRIBUTED_CALLS = {"launch"}  # tests/conftest.py's `accelerate launch` of a 2-process job
VLLM_FIXTURES = {"vllm_python"}  # tests/conftest.py: vLLM installed (every vLLM test or server fixture asks for it)
SLOW_FIXTURES = {"arithmetic_warm_start"}  # tests/conftest.py: a demo's SFT warm start, trained
FAST_LIMIT_S = 20.0


def called_names(function, seen: set | None = None) -> set[str]:
    """The global names ``function`` refers to (nested functions and lambdas included), and those of the test
    helpers it refers to, transitively: what a test calls."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    codes = [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    for name in list(names):
        helper = function.__globals__.get(name)
        if inspect.isfunction(helper) and helper.__module__.startswith("tests.") and helper not in seen:
            seen.add(helper)
            names |= called_names(helper, seen)
    return names


def tiers_of(item) -> set[str]:
    tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if "/tests/distributed/" in str(item.path):
        tiers.add("distributed")
    function = getattr(item, "function", None)
    if function is not None and called_names(function) & DISTRIBUTED_CALLS:
        tiers.add("distributed")
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & VLLM_FIXTURES:
        tiers.add("vllm")
    if fixtures & SLOW_FIXTURES:
        tiers.add("slow")
    return tiers


def in_fast_tier(item) -> bool:
    return item.get_closest_marker("smoke") is not None or not tiers_of(item)


def mark_and_select(config, items) -> None:
    """Marks each test with its tiers (``-m distributed`` and the like work on them; a JUnit report records them
    as the property ``tiers``, which scripts/test_durations.py reads) and, with ``--fast``, deselects everything
    outside the fast tier."""
    for item in items:
        tiers = tiers_of(item)
        for tier in tiers:
            item.add_marker(tier)
        item.user_properties.append(("tiers", ",".join(sorted(tiers))))
    if not config.getoption("--fast"):
        return
    kept, dropped = [], []
    for item in items:
        (kept if in_fast_tier(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


class SlowInFastTier:
    """Names the fast-tier tests that ran over FAST_LIMIT_S (set-up and call), at the end of the run."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        # a report carries its test's tiers (mark_and_select), also from a pytest-xdist worker to the controller,
        # which collects nothing itself: "" is a fast-tier test (a smoke test has "distributed")
        fast = dict(report.user_properties).get("tiers") == ""
        if fast and report.when in ("setup", "call"):
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter):
        over = sorted(((s, n) for n, s in self.seconds.items() if s > FAST_LIMIT_S), reverse=True)
        if over:
            terminalreporter.section(f"fast-tier tests over {FAST_LIMIT_S:.0f} s (docs/testing.md: move them to the "
                                     "slow tier, or make them faster)")
            for seconds, nodeid in over:
                terminalreporter.line(f"{seconds:6.1f} s  {nodeid}")


FAST = False  # set when the run is the fast tier (``--fast``)


def examples(full: int) -> int:
    """A Hypothesis test's example count: ``full`` in the whole suite, a fifth of it (at least 10) in the fast tier:
    ``@settings(max_examples=examples(400))``."""
    return max(10, full // 5) if FAST else full


def load_hypothesis_profile(config) -> None:
    """Hypothesis's profile for the run: "fast" in the fast tier (20 examples where a test sets none, a fifth where it
    does: ``examples``), "full" (Hypothesis's defaults) otherwise."""
    global FAST
    from hypothesis import settings

    FAST = bool(config.getoption("--fast"))
    settings.register_profile("full")
    settings.register_profile("fast", max_examples=20)
    settings.load_profile("fast" if FAST else "full")


def register(config) -> None:
    for line in ("distributed: launches 2 processes with accelerate (CPU, gloo); set by tests/tiers.py",
                 "vllm: starts a real vLLM engine or server; set by tests/tiers.py",
                 "slow: over ~20 s in one process (set by hand, or by tests/tiers.py for a demo's warm start)",
                 "smoke: a distributed or slow test that the fast tier runs too"):
        config.addinivalue_line("markers", line)
    config.pluginmanager.register(SlowInFastTier(), "slow-in-fast-tier")


def add_option(parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="Run the fast tier only: no distributed, vLLM or slow tests but the smoke ones "
                          "(tests/tiers.py).")

