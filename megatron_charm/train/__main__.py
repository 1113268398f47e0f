import sys

from megatron_charm.train.cli import main

sys.exit(main())
