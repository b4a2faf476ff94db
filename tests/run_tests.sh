#!/usr/bin/env bash
# The project's test command (README "Quickstart", CI): lint, the one-process tests, then the
# distributed buckets the way Megatron's CI runs them -- torchrun -> pytest on every rank --
# with 2 and 4 gloo ranks on CPU (8 ranks in --slow); one combined coverage report and one
# closing "Total: N passed, N failed" line. Exit status is non-zero if anything failed or a
# bucket ran over its time budget.
#
#   bash tests/run_tests.sh              the default run (not slow, not experimental)
#   bash tests/run_tests.sh --slow       the larger matrices marked slow and the 8-rank launch
#                                        (a separate CI step)
#   bash tests/run_tests.sh --coverage   either run under coverage (CI's slow step): the
#                                        one-process tests by pytest-cov, rank 0 of each launch
#                                        by tests/tools/launch_pytest.py, one combined report.
#                                        Tracing roughly doubles a launch's wall time (its other
#                                        ranks wait for the traced one), so the default run,
#                                        whose 6-minute budget is the README's, is not traced.
#
# Lint runs beside the one-process tests, which run in MEGATRON_TESTS_WORKERS (2) processes,
# a file per process at a time (pytest-xdist --dist loadfile; coverage by pytest-cov).
# Each launch collects only the files that hold tests for its world size: the one-process run
# (which collects the whole tree anyway) writes that plan (conftest.py --plan-worlds). Only
# rank 0 of a launch runs under coverage (tests/tools/launch_pytest.py). The slowest tests of
# each bucket are printed (--durations). How a new test picks its world and what the budgets
# are: tests/README.md.
#
# Time budgets: seconds of wall time per bucket and for the whole run on a quiet 2-core
# machine, with headroom over the estimate when they were set (docs/performance.md "Test
# suite time"). MEGATRON_TESTS_TIME_SCALE=2 doubles them on a slower machine; 0 turns the
# check off.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -A BUDGET=([world1]=120 [world2]=110 [world4]=230)
# The README's promise is 6 minutes (360 s) on 2 cores, and the whole run's budget is that:
# the total has no headroom beyond the promise, so a run over it is a broken promise, not a
# false alarm. Measured on a clean clone with no other work on the machine: 321-354 s at the
# end of session 8, 335 s in session 9 (world 1 90 s, world 2 83 s, world 4 194 s). Each
# bucket's own budget is over its share (world 1 +33%, world 2 +33%, world 4 +19% in
# session 9), so the total is the check that binds.
TOTAL_BUDGET=360
REPORTS=test-reports
MARK=()
RUN=default
WORLDS=(2 4)
COVERAGE=0
SLOW=0
for arg in "$@"; do
  case "$arg" in
    --slow) SLOW=1 ;;
    --coverage) COVERAGE=1 ;;
    *) echo "tests/run_tests.sh: unknown option $arg (expected --slow and/or --coverage)" >&2; exit 2 ;;
  esac
done
export MEGATRON_TESTS_COVERAGE=$COVERAGE
COV_ARGS=()
[ "$COVERAGE" = 1 ] && COV_ARGS=(--cov --cov-report=)
if [ "$SLOW" = 1 ]; then
  MARK=(-m slow)
  RUN=slow
  REPORTS=test-reports-slow
  WORLDS=(2 4 8)
  BUDGET=([world1]=900 [world2]=600 [world4]=1500 [world8]=1800)
  TOTAL_BUDGET=4800  # CI: 90 minutes for the installs, the default run and this
fi
DEFAULT_SCALE=1
# tracing doubles a launch's wall time (header): --coverage alone gets twice the budgets
[ "$COVERAGE" = 1 ] && [ "$SLOW" = 0 ] && DEFAULT_SCALE=2
SCALE=${MEGATRON_TESTS_TIME_SCALE:-$DEFAULT_SCALE}
WORKERS=${MEGATRON_TESTS_WORKERS:-2}  # one-process tests in parallel (pytest-xdist, by file)
DURATIONS=(--durations=15 --durations-min=1)
PLAN="$REPORTS/plan"
rm -rf "$REPORTS" .coverage .coverage.*
mkdir -p "$REPORTS"
failed=0
over=()
start=$(date +%s)
bucket_start=$start
bucket=""

step() {  # step NAME TITLE: closes the previous bucket (its budget), opens the next
  local now elapsed limit
  now=$(date +%s)
  if [ -n "$bucket" ]; then
    elapsed=$((now - bucket_start))
    limit=$(awk -v b="${BUDGET[$bucket]:-0}" -v s="$SCALE" 'BEGIN { printf "%d", b * s }')
    echo "---- $bucket: ${elapsed}s (budget ${limit}s)"
    if [ "$limit" -gt 0 ] && [ "$elapsed" -gt "$limit" ]; then
      over+=("$bucket took ${elapsed}s, over its budget of ${limit}s")
    fi
  fi
  bucket=$1
  bucket_start=$now
  [ -n "$2" ] && printf '\n==== %s (%ss)\n' "$2" "$((now - start))"
}

step world1 "lint (black, isort, ruff) beside the one-process tests, pytest -n $WORKERS tests/unit_tests (writes the per-world plan)"
(black --check -q . && isort --check-only -q . && ruff check -q .) > "$REPORTS/lint.log" 2>&1 &
lint=$!
python -m pytest tests/unit_tests -q -n "$WORKERS" --dist loadfile "${COV_ARGS[@]}" \
    "${MARK[@]}" "${DURATIONS[@]}" --plan-worlds "$PLAN" --junitxml="$REPORTS/world1.xml" \
    || failed=1
wait "$lint" || { cat "$REPORTS/lint.log"; echo "lint FAILED"; failed=1; }

for n in "${WORLDS[@]}"; do
  # The files this launch runs: the plan's (the whole tree if the one-process run wrote none).
  if [ ! -d "$PLAN" ]; then
    files=(tests/unit_tests)
  elif [ "$RUN" = slow ] && [ "$n" = 8 ]; then
    mapfile -t files < <(sort -u "$PLAN/world8-default.txt" "$PLAN/world8-slow.txt")
  else
    mapfile -t files < "$PLAN/world$n-$RUN.txt"
  fi
  marks=("${MARK[@]}")
  [ "$RUN" = slow ] && [ "$n" = 8 ] && marks=(-m "not experimental")  # all of 8 ranks' tests
  if [ "${#files[@]}" = 0 ]; then
    step "" "torchrun --nproc-per-node $n: no tests for $n ranks in this run"
    continue
  fi
  step "world$n" "torchrun --nproc-per-node $n: pytest on ${#files[@]} files (rank 0 shown; all ranks in $REPORTS/logs-$n)"
  python -m torch.distributed.run --nproc-per-node "$n" --log-dir "$REPORTS/logs-$n" \
      --redirects 3 --tee 3 --local-ranks-filter 0 \
      -m tests.tools.launch_pytest "${files[@]}" -q "${marks[@]}" -p no:randomly \
      "${DURATIONS[@]}" --junitxml="$REPORTS/world$n.xml" 2>&1 | grep -v "^\[W" || true
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
done

if [ "$COVERAGE" = 1 ]; then
  step "" "coverage (megatron package: the one-process run and rank 0 of each launch, combined)"
  python -m coverage combine -q --append && python -m coverage report | tail -n 40
fi

step "" "summary"
python tests/tools/summarize_reports.py "$REPORTS" || failed=1
elapsed=$(( $(date +%s) - start ))
limit=$(awk -v b="$TOTAL_BUDGET" -v s="$SCALE" 'BEGIN { printf "%d", b * s }')
if [ "$limit" -gt 0 ] && [ "$elapsed" -gt "$limit" ]; then
  over+=("the whole run took ${elapsed}s, over its budget of ${limit}s")
fi
for line in "${over[@]}"; do
  echo "TIME BUDGET EXCEEDED: $line (MEGATRON_TESTS_TIME_SCALE=2 doubles the budgets)"
  failed=1
done
echo "elapsed: ${elapsed}s (budget ${limit}s)"
exit $failed
