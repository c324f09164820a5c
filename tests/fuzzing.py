"""How many inputs the fuzz tests take: a reduced count in CI (each test well under 30 s on one
core, the same inputs every run), the issue's full count with DEEPINFER_FUZZ_FULL=1
(scripts/fuzz.sh; fresh random inputs each run)."""
import os

from hypothesis import HealthCheck, settings

FULL = os.environ.get("DEEPINFER_FUZZ_FULL") == "1"


def fuzz_settings(ci: int, full: int):
    return settings(max_examples=full if FULL else ci, deadline=None, database=None, derandomize=not FULL,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def check_clean(call, errors):
    """`call()` returns, or raises one of the project's `errors` with a one-line message; any other
    exception is a crash and fails the test."""
    try:
        return call()
    except errors as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"{type(e).__name__} message is not one line: {msg!r}"
        return None
