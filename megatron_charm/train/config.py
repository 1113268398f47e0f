"""Training configuration: YAML -> dataclasses, with ``section.key=value`` overrides.

Every key has a default here; a YAML file sets any subset of them. Unknown keys are errors (a typo
must not silently train the wrong model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.plan.options import PlanOptions
from megatron_charm.train.defaults import DEFAULT_CONFIG_YAML
from megatron_charm.train.validate import CHARM_COMM_TYPES, TE_COMM_TYPES, validate_config

__all__ = [
    "CHARM_COMM_TYPES",
    "TE_COMM_TYPES",
    "Config",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_override",
]


@dataclass
class RunConfig:
    name: str = "gpt-tiny-cpu"
    """Run name; also the default run directory ``runs/<name>``."""
    dir: str | None = None
    """Run directory (metrics, resolved config, checkpoints); ``None`` means ``runs/<name>``."""
    seed: int = 1234
    """Seed for weights and data order."""
    overwrite: bool = False
    """Train from scratch into a run directory that already holds metrics or checkpoints,
    replacing them. Without it such a run is refused; ``checkpoint.resume`` continues it instead."""


@dataclass
class ParallelConfig:
    context_parallel_size: int = 4
    """CP ranks per sequence. The data-parallel size is world size / context_parallel_size."""
    cp_comm_type: str = "charm"
    """charm | rm+ | merge | ring | a2a+p2p | auto; on GPU with Transformer Engine also p2p |
    a2a | all_gather. ``auto`` picks one of ours per layer shape from ``profile``."""
    profile: str | None = None
    """With ``cp_comm_type: auto``: a ``megatron-charm-sim calibrate`` JSON or a preset (H100,
    H20, L20) that the simulator predicts every method on."""
    ranks_per_node: int | None = None
    """Explicit CHARM+ node split (CP ranks per node); overrides everything else."""
    node_split: str = "host"
    """What a detected node is: ``host`` (host name) or ``numa`` (NUMA domains of GPUs without
    NVLink between them, the paper's PCIe servers; needs ``nvidia-ml-py``)."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """Megatron's ``[ranks_per_node, num_nodes]``; used as the node split when set."""
    nproc: int = 4
    """Ranks to start on this machine when the command is not launched by torchrun or Slurm."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Timeout for collective operations, so a hang fails instead of waiting forever (default:
    Megatron's own distributed timeout)."""
    kernel: str | None = None
    """Block attention kernel of the CHARM+ methods: ``torch``, ``flash_attn`` (CUDA fp16/bf16)
    or ``math`` (float64 reference); ``None`` means ``$MEGATRON_CHARM_KERNEL`` if set, else the
    default by device and dtype (flash-attn for bf16 on GPU when it imports, else torch)."""


@dataclass
class ModelConfig:
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); ``None`` means one per query head."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` means ``4 * hidden_size``."""
    seq_length: int = 128
    """Tokens per sample (the whole sequence, before the CP split)."""
    attention_dropout: float = 0.0
    """Must be 0 with CHARM+ methods."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    make_vocab_size_divisible_by: int = 64
    """The tokenizer's vocabulary is padded up to a multiple of this."""
    transformer_impl: str = "local"
    """local (megatron-core modules; CPU and GPU) | transformer_engine (GPU)."""


@dataclass
class DataConfig:
    kind: str = "indexed"
    """indexed (Megatron .bin/.idx pairs) | mock (megatron-core MockGPTDataset)."""
    path: list[str] = field(default_factory=lambda: ["tiny"])
    """Dataset prefixes (``--data-path`` style: ``[prefix]`` or ``[w1, prefix1, w2, prefix2]``).
    ``tiny`` is the corpus shipped with the package."""
    tokenizer: str = "byte"
    """byte: 256 byte values plus end-of-document; needs no download."""
    cache_dir: str | None = None
    """Where Megatron writes dataset index caches; ``None`` means ``<run dir>/data_cache``."""
    reset_attention_mask: bool = False
    """Documents: every token attends only to its own document and positions restart at each
    document, as Megatron-LM's ``--reset-attention-mask --reset-position-ids``. The attention
    reads the documents from the mask and skips the blocks they leave empty."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Sequences per data-parallel rank per forward/backward."""
    global_batch_size: int = 4
    """Sequences per optimizer step (micro_batch_size x data-parallel size x accumulation)."""
    train_iters: int = 60
    """Optimizer steps."""
    lr: float = 3.0e-3
    """Peak learning rate (AdamW)."""
    min_lr: float = 3.0e-4
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 6
    """Linear warmup steps."""
    lr_decay_iters: int | None = None
    """Cosine decay length; ``None`` means ``train_iters``."""
    exit_interval: int | None = None
    """Save a checkpoint and stop when the iteration is a multiple of this (Megatron's
    ``--exit-interval``); a later run with ``checkpoint.resume=true`` continues from there."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW second-moment decay."""
    adam_eps: float = 1.0e-8
    """AdamW denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16."""


@dataclass
class LoggingConfig:
    log_interval: int = 5
    """Print a metrics line every this many iterations (every iteration goes to metrics.jsonl)."""
    progress_interval_s: float = 30.0
    """While training, print a progress line at least this often; 0 disables it."""


@dataclass
class CheckpointConfig:
    save_interval: int = 0
    """Save every this many iterations; 0 saves only at the end."""
    dir: str | None = None
    """Checkpoint directory; ``None`` means ``<run dir>/checkpoints``."""
    resume: bool = False
    """Continue from the latest checkpoint in ``dir`` when there is one (``--resume``)."""
    save: bool = True
    """Write checkpoints at all."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
    """CHARM+ plan options (``window``, ``cross_level``, ``intra_level``, ``cross_return``,
    ``foreign_q``, ``memory_budget``, ``combine_nodes``:
    see :class:`megatron_charm.PlanOptions`); the method is ``parallel.cp_comm_type``."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (what ``config.yaml`` in the run directory holds; it loads back)."""
        out = dataclasses.asdict(self)
        del out["plan"]["method"]  # parallel.cp_comm_type
        return out

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir if self.run.dir else Path("runs") / self.run.name)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    """Convert YAML values to the field's type (ints where floats are expected, and so on)."""
    where = f"{section}.{key}"
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}={value!r}: expected true or false.")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}={value!r}: expected an integer.")
        return value
    if isinstance(default, float):
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}={value!r}: expected a number.")
        return float(value)
    if isinstance(default, list):
        if not isinstance(value, list):
            value = [value]
        kind = type(default[0]) if default else str
        try:
            return [kind(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"{where}={value!r}: expected a list of {kind.__name__}.") from None
    if isinstance(default, str):
        return str(value)
    return value


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build a :class:`Config` from nested dicts, rejecting unknown sections and keys."""
    cfg = Config()
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}.")
    sections = _section_types()
    for section, values in data.items():
        if section not in sections:
            raise ValueError(
                f"unknown config section {section!r}; known sections: {', '.join(sections)}."
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {section!r} must be a mapping, got {values!r}.")
        target = getattr(cfg, section)
        known = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in known:
                raise ValueError(
                    f"unknown config key {section}.{key}; keys of {section}: {', '.join(known)}."
                )
            if (section, key) == ("plan", "method"):
                raise ValueError(
                    "plan.method is not a config key: the method is parallel.cp_comm_type."
                )
            default = getattr(target, key)
            if default is None:
                # Optional fields: take the type from the annotation's non-None default elsewhere.
                default = _optional_example(section, key)
            coerced = _coerce(section, key, value, default)
            if isinstance(target, PlanOptions):  # frozen: validated whole on every change
                target = target.replace(**{key: coerced})
                setattr(cfg, section, target)
            else:
                setattr(target, key, coerced)
    validate_config(cfg)
    return cfg


def _optional_example(section: str, key: str) -> Any:
    examples = {
        ("parallel", "ranks_per_node"): 1,
        ("parallel", "kernel"): "torch",
        ("parallel", "hierarchical_context_parallel_sizes"): [1],
        ("model", "num_query_groups"): 1,
        ("model", "ffn_hidden_size"): 1,
        ("train", "lr_decay_iters"): 1,
        ("train", "exit_interval"): 1,
    }
    return examples.get((section, key))


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value`` (value in YAML syntax) into its parts."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value.")
    path, raw = text.split("=", 1)
    parts = path.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(
            f"override {text!r}: the key must be section.key (e.g. train.train_iters=20)."
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(
            f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}); quote it, "
            "e.g. 'run.dir=\"my dir\"'."
        ) from None
    return parts[0], parts[1], value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's complaint and where it is, without the traceback."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return problem


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load a YAML config (``None``: the embedded default), then apply ``section.key=value``."""
    text = DEFAULT_CONFIG_YAML if path is None else Path(path).read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        where = "the embedded default config" if path is None else f"config file {path}"
        problem = _yaml_problem(exc)
        raise ValueError(f"{where} is not valid YAML: {problem}. Fix the file.") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must be a mapping of sections (run:, model:, ...), got "
            f"{type(data).__name__}."
        )
    for item in overrides:
        section, key, value = parse_override(item)
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        data[section][key] = value
    return config_from_dict(data)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (loadable by :func:`load_config`)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
