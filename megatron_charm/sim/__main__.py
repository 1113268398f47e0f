"""``python -m megatron_charm.sim``: see :mod:`megatron_charm.sim.cli`."""

from __future__ import annotations

import sys

from megatron_charm.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
