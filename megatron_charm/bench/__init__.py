"""Benchmarks: side-by-side CP attention timings, memory and numerics (``megatron-charm-bench``).

Subcommands (``python -m megatron_charm.bench <cmd> --help``):

* ``attention``: times charm, rm+, merge, ring, all_gather and ring-flash-attention on identical
  inputs, on the emulated multi-node testbed, on local loopback, or on a cluster (torchrun/srun,
  NCCL).
* ``numerics``: the paper's Table 8 (errors against a float64 reference over random inputs).
* ``memory``: the paper's Table 3 (communication and saved buffers, ring vs charm).
"""
