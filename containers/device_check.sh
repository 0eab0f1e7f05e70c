#!/usr/bin/env bash
# The GPU check in one call (containers/device_check.py says what it does), run from the repository's
# root on a machine that reaches no network, with .device/ (make device-bundle) beside it:
#   containers/device_check.sh [--toy] [--no-build] [--no-install] [--budget SECONDS] [--only NAME,PREFIX*]
# PYTHON chooses the interpreter (default: python3, the one whose torch sees the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # offline: nothing is fetched
exec "${PYTHON:-python3}" containers/device_check.py --python "${PYTHON:-python3}" "$@"
