import sys

from megatron_charm.bench.tables.cli import main

sys.exit(main())
