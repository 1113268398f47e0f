"""Reproduce the paper's end-to-end tables (Table 6 and Table 7) with ``megatron-charm-train``.

Every cell pair (ring, CHARM+) is one trainer run of the same config with ``section.key=value``
overrides; the per-iteration times and peak memory come from each run's ``metrics.jsonl``. The
command writes, per table, a CSV and a markdown table laid out like the paper's, with the speedup
column (ring latency / CHARM+ latency).

* Table 6: GPT-350M and GPT-1.3B, batch x seq in {16x2048, 8x4096, 4x8192, 2x16384}, ring vs
  CHARM+, iteration latency (ms) and memory (MB); the paper ran it on 16 L20 GPUs.
* Table 7: GPT3-350M, batch x seq in {16x16384, 32x8192, 64x4096, 128x2048}, ring vs CHARM+,
  iteration latency (ms); the paper ran it on 16 H20 and on 16 H100 GPUs.

Scales:

* ``--scale gpu``: the paper's sizes on 16 GPUs (2 nodes x 8, CP = 16, as the paper runs CP over
  all 16 GPUs). Launched with Slurm (``scripts/launch/slurm_train.sbatch``, one ``sbatch --wait``
  per run) or torchrun (``scripts/launch/torchrun_train.sh``); ``--dry-run`` prints the commands,
  ``--collect-only`` builds the tables from run directories that already exist.
* ``--scale cpu``: tiny stand-in models (``configs/tables/cpu-*.yaml``), 4 CPU ranks (gloo, CP = 4
  as 2 emulated nodes x 2), sequence lengths divided by 16 and the same batch sizes, so the tables
  keep the paper's shapes. It proves the pipeline end to end in a few minutes on 2 cores.

Modules: :mod:`.plan` (which runs), :mod:`.runner` (performing them), :mod:`.collect` (metrics
to cells), :mod:`.render` (CSV and markdown), :mod:`.cli` (the command).

Examples::

    python -m megatron_charm.bench.tables --scale cpu --out runs/tables-cpu
    python -m megatron_charm.bench.tables --scale gpu --table 7 --dry-run
    python -m megatron_charm.bench.tables --scale gpu --launcher slurm --out /shared/tables \\
        --sbatch-arg=--partition=gpu --label H100
"""
