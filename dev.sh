#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh up [batchline up flags]   install, build the demo models, run the whole mesh
#   ./dev.sh test [pytest args]        install, run the test suite
#   ./dev.sh lint                      install, run ruff and mypy (pyproject.toml says on what),
#                                      and check the commit subjects (scripts/check_commits.py)
# Installs into ./.venv (Python >= 3.11; set PYTHON to choose the interpreter).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.batchline-installed

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local want
  want=$(sha256sum pyproject.toml | cut -c1-16)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first, pinned: a package that needs torch would otherwise pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e ".[demo,optimize,dev]"
  echo "$want" > "$STAMP"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up)
    install
    exec "$VENV/bin/batchline" up "$@"
    ;;
  test)
    install
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  lint)
    install
    "$VENV/bin/ruff" check .
    "$VENV/bin/mypy"
    exec "$VENV/bin/python" scripts/check_commits.py
    ;;
  *)
    echo "usage: ./dev.sh up [batchline up flags] | ./dev.sh test [pytest args] | ./dev.sh lint" >&2
    exit 2
    ;;
esac
