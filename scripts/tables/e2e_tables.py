#!/usr/bin/env python3
"""The end-to-end tables: same as ``python -m megatron_charm.bench.tables`` (see its ``--help``).

Kept so that commands recorded with earlier tables still run.
"""

import sys

from megatron_charm.bench.tables.cli import main

if __name__ == "__main__":
    sys.exit(main())
