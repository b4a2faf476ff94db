"""The torchrun entry of tests/run_tests.sh: pytest on every rank; with
``MEGATRON_TESTS_COVERAGE=1`` (``run_tests.sh --coverage``) traced by coverage on rank 0.

``python -m torch.distributed.run ... -m tests.tools.launch_pytest PYTEST_ARGS...``. Tracing
every rank cost ~40% more CPU per rank for the same lines: the ranks of a launch run the same
test code, so rank 0's trace plus the one-process run's make the combined report.
``MEGATRON_TESTS_COVER_ALL_RANKS=1`` traces every rank (the data files combine as before).
Even rank 0 alone roughly doubles a launch's wall time on 2 cores (the other ranks wait for it
at every collective), which is why the default run is not traced.
"""

import os
import sys

import pytest


def main(args) -> int:
    """Run pytest with ``args``; under coverage (pyproject's settings) on the traced ranks."""
    traced = os.environ.get("MEGATRON_TESTS_COVERAGE") == "1" and (
        os.environ.get("RANK", "0") == "0"
        or os.environ.get("MEGATRON_TESTS_COVER_ALL_RANKS") == "1"
    )
    if not traced:
        return int(pytest.main(args))
    import coverage

    cov = coverage.Coverage()
    cov.start()
    try:
        return int(pytest.main(args))
    finally:
        cov.stop()
        cov.save()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
