#!/usr/bin/env bash
# Set everything up, then run all the checks: ruff, mypy (strict), and the whole test suite, kernel tests
# included (they need root; with CI set a missing tool or missing root is a failure, not a skip).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff" && .venv/bin/ruff check src tests bench
echo "== mypy" && .venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
