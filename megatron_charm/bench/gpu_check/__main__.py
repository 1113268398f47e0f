import sys

from megatron_charm.bench.gpu_check import main

sys.exit(main())
