#!/usr/bin/env bash
# Run NVIDIA inprocess's own unit tests against elastic_ft.inprocess: the files of a release tag, unchanged
# but for the imports (nvidia_resiliency_ext.inprocess -> elastic_ft.inprocess, and 0.6's
# nvidia_resiliency_ext.shared_utils -> elastic_ft.shared_utils).
# Usage: scripts/nvidia_tests.sh NVIDIA_REPO [TAG]
#   NVIDIA_REPO: a clone of github.com/NVIDIA/nvidia-resiliency-ext (bare or not) that has the tag.
#   TAG: v0.4.1 (default) or v0.6.0.
# Prints one line per test and a count per file; the results table in docs/migration.md comes from it.
#
# How they are run, and why:
# - each test in a process of its own: test_wrap.py's tear-down counts every TCPStore still alive, and
#   pytest keeps a failed test's traceback (and with it the failed call's store), so one failure would
#   fail every later test of the file;
# - pytest with -p unittest.mock: test_monitor_thread.py and test_wrap.py use unittest.mock without
#   importing it (under NVIDIA's package something else imports it first);
# - test_app.py and test_torch.py with unittest: their test classes' constructors need a method name,
#   which pytest's collection does not give.
set -euo pipefail
repo=${1:?usage: scripts/nvidia_tests.sh NVIDIA_REPO [TAG]}
tag=${2:-v0.4.1}
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git --git-dir="$(git -C "$repo" rev-parse --absolute-git-dir)" archive "$tag" tests/inprocess | tar -x -C "$work"
find "$work/tests" -name '*.py' -exec sed -i -e 's/nvidia_resiliency_ext\.inprocess/elastic_ft.inprocess/g' \
    -e 's/nvidia_resiliency_ext\.shared_utils/elastic_ft.shared_utils/g' {} +
cd "$work"
pytest=("$python" -m pytest -p unittest.mock -p no:cacheprovider -o addopts= --timeout 120 -q)
for file in tests/inprocess/test_*.py; do
    name=$(basename "$file")
    passed=0 failed=0 skipped=0
    case $name in
        test_app.py | test_torch.py)
            if out=$(timeout 600 "$python" -c "import sys, unittest; sys.argv[1:] = ['-v', sys.argv[1]]; \
                unittest.main(module=None)" "tests.inprocess.${name%.py}" 2>&1); then :; fi
            passed=$(grep -cE ' \.\.\. (ok|expected failure)$' <<<"$out" || true)
            failed=$(grep -cE ' \.\.\. (FAIL|ERROR|unexpected success)$' <<<"$out" || true)
            skipped=$(grep -cE ' \.\.\. skipped' <<<"$out" || true)
            grep -E ' \.\.\. ' <<<"$out" | sed "s/^/  $name: /" || true
            ;;
        *)
            for test in $("${pytest[@]}" --collect-only "$file" 2>/dev/null | grep '::'); do
                result=$(timeout 300 "${pytest[@]}" "$test" 2>&1 | tail -1 || true)
                case $result in
                    *failed* | *error* | "") failed=$((failed + 1)); echo "  $test: FAILED ($result)" ;;
                    *passed*) passed=$((passed + 1)); echo "  $test: passed" ;;
                    *skipped*) skipped=$((skipped + 1)); echo "  $test: skipped" ;;
                esac
            done
            ;;
    esac
    echo "$name: $passed passed, $failed failed, $skipped skipped"
done
