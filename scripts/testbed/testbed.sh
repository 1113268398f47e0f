#!/usr/bin/env bash
# Run the testbed CLI from a checkout: scripts/testbed/testbed.sh {up,down,run,probe,status,cleanup} ...
# Uses $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m megatron_charm.testbed "$@"
