#!/usr/bin/env bash
# The project's test command (README "Quickstart", CI): lint, the one-process tests, then the
# distributed buckets the way Megatron's CI runs them -- torchrun -> coverage run -> pytest on
# every rank -- with 2, 4 and 8 gloo ranks on CPU; one combined coverage report and one
# closing "Total: N passed, N failed" line. Exit status is non-zero if anything failed.
#
#   bash tests/run_tests.sh          the default run (not slow, not experimental)
#   bash tests/run_tests.sh --slow   the larger matrices marked slow (a separate CI step)
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
REPORTS=test-reports
MARK=()
if [ "${1:-}" = "--slow" ]; then
  # Some world sizes hold no slow test: conftest turns pytest's "no tests ran" into 0.
  MARK=(-m slow)
  REPORTS=test-reports-slow
  export MEGATRON_TESTS_ALLOW_EMPTY=1
fi
rm -rf "$REPORTS" .coverage .coverage.*
mkdir -p "$REPORTS"
failed=0
start=$(date +%s)

step() { printf '\n==== %s (%ss)\n' "$1" "$(( $(date +%s) - start ))"; }

step "lint: black, isort, ruff"
black --check -q . && isort --check-only -q . && ruff check -q . || { echo "lint FAILED"; failed=1; }

step "one process: pytest tests/unit_tests"
python -m coverage run -m pytest tests/unit_tests -q "${MARK[@]}" --junitxml="$REPORTS/world1.xml" || failed=1

for n in 2 4 8; do
  step "torchrun --nproc-per-node $n: coverage run -m pytest (rank 0 shown; all ranks in $REPORTS/logs-$n)"
  python -m torch.distributed.run --nproc-per-node "$n" --log-dir "$REPORTS/logs-$n" \
      --redirects 3 --tee 3 --local-ranks-filter 0 \
      -m coverage run -m pytest tests/unit_tests -q "${MARK[@]}" -p no:randomly \
      --junitxml="$REPORTS/world$n.xml" 2>&1 | grep -v "^\[W" || true
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
done

step "coverage (megatron package, all processes combined)"
python -m coverage combine -q && python -m coverage report | tail -n 40

step "summary"
python tests/tools/summarize_reports.py "$REPORTS" || failed=1
echo "elapsed: $(( $(date +%s) - start ))s"
exit $failed
