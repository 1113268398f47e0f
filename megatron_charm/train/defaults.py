"""The embedded default configuration: byte-for-byte the shipped ``configs/gpt-tiny-cpu.yaml``.

``megatron-charm-train`` with no ``--config`` trains with this text, so the default works from an
installed wheel too. A test keeps it identical to the file in ``configs/``.
"""

DEFAULT_CONFIG_NAME = "gpt-tiny-cpu"

DEFAULT_CONFIG_YAML = """\
# Tiny GPT trained with CHARM+ context parallelism on 4 CPU ranks (gloo).
# This is the default of `megatron-charm-train`; any key can be overridden on the command line,
# e.g. `megatron-charm-train train.train_iters=20 parallel.cp_comm_type=ring`.
run:
  name: gpt-tiny-cpu
  dir: null                # null: runs/<name>
  seed: 1234
parallel:
  context_parallel_size: 4
  cp_comm_type: charm      # charm | rm+ | merge | ring; GPU + TE also: p2p | a2a | all_gather
  ranks_per_node: 2        # two emulated nodes of 2 ranks, so the cross-node path runs too;
                           # null: hierarchical_context_parallel_sizes, else from hostnames
  hierarchical_context_parallel_sizes: null
  nproc: 4                 # ranks started when launched without torchrun/Slurm
  # timeout_s is left at its default: Megatron's distributed timeout
model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: null   # null: multi-head attention; fewer groups: GQA
  ffn_hidden_size: null    # null: 4 x hidden_size
  seq_length: 128
  attention_dropout: 0.0
  hidden_dropout: 0.0
  init_method_std: 0.02
  transformer_impl: local  # local | transformer_engine
data:
  kind: indexed            # indexed | mock
  path: [tiny]             # prefixes of .bin/.idx pairs; "tiny" is the shipped corpus
  tokenizer: byte
train:
  micro_batch_size: 4
  global_batch_size: 4
  train_iters: 60
  lr: 3.0e-3
  min_lr: 3.0e-4
  lr_warmup_iters: 6
  weight_decay: 0.01
  clip_grad: 1.0
  precision: auto          # auto: bf16 on GPU, fp32 on CPU
logging:
  log_interval: 5
  progress_interval_s: 30
checkpoint:
  save_interval: 0         # 0: save only at the end
  resume: false            # true: continue from the latest checkpoint in the run directory
"""
