"""Rank entry of :func:`megatron_charm.launch.run_function`.

``python -m megatron_charm.launch PAYLOAD``
"""

import sys

from megatron_charm.launch.call import rank_main

if __name__ == "__main__":
    rank_main(sys.argv[1])
