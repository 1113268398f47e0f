"""The run plan of the end-to-end tables: which trainer runs make which cell.

Every cell pair (baseline, CHARM+) of the paper's Tables 6 and 7 is one ``megatron-charm-train``
run per method (and per repeat) of the same config with ``section.key=value`` overrides. This
module only decides the runs; :mod:`.runner` performs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The source checkout: the configs and launch scripts the runs name live there.
REPO = Path(__file__).resolve().parents[3]

#: The paper's rows: (batch size, sequence length).
TABLE6_SHAPES = ((16, 2048), (8, 4096), (4, 8192), (2, 16384))
TABLE7_SHAPES = ((16, 16384), (32, 8192), (64, 4096), (128, 2048))
#: Sequence lengths are divided by this at --scale cpu (batch sizes stay as in the paper).
CPU_SEQ_DIVISOR = 16


@dataclass(frozen=True)
class Model:
    """A table's model: the paper's name and the config that stands for it at each scale."""

    name: str
    gpu_config: str
    cpu_config: str


MODELS = {
    "gpt-350m": Model("GPT-350M", "configs/gpt-350m.yaml", "configs/tables/cpu-350m.yaml"),
    "gpt-1.3b": Model("GPT-1.3B", "configs/gpt-1.3b.yaml", "configs/tables/cpu-1.3b.yaml"),
}


@dataclass(frozen=True)
class TableSpec:
    number: int
    title: str
    models: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    model_label: dict[str, str]
    with_memory: bool


TABLES = {
    6: TableSpec(
        6,
        "End-to-end performance of Ring-Attention and CHARM+ with model scaling",
        ("gpt-350m", "gpt-1.3b"),
        TABLE6_SHAPES,
        {"gpt-350m": "GPT-350M", "gpt-1.3b": "GPT-1.3B"},
        with_memory=True,
    ),
    7: TableSpec(
        7,
        "End-to-end performance of Ring-Attention and CHARM+ (GPT3-350M)",
        ("gpt-350m",),
        TABLE7_SHAPES,
        {"gpt-350m": "GPT3-350M"},
        with_memory=False,
    ),
}


@dataclass(frozen=True)
class Scale:
    """Where the runs go: ranks, CP split and iteration counts."""

    name: str
    nodes: int
    ranks_per_node: int
    train_iters: int
    warmup: int
    seq_divisor: int
    repeats: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


#: Default scales; the command line can change nodes, ranks, iterations and repeats.
SCALES = {
    # 4 ranks as 2 emulated nodes x 2: CHARM+ takes the cross-node path, as on 2 x 8 GPUs.
    # Two interleaved repeats per cell: other work on a shared machine then slows both
    # methods alike instead of one of them.
    "cpu": Scale("cpu", 2, 2, 16, 4, CPU_SEQ_DIVISOR, repeats=2),
    # The paper: 16 GPUs (Table 6: L20; Table 7: H20 and H100), context parallelism over all.
    "gpu": Scale("gpu", 2, 8, 30, 10, 1, repeats=1),
}


@dataclass
class Run:
    """One trainer invocation: one cell of a table for one method."""

    table: int
    model: str
    batch: int
    seq: int
    method: str
    config: str
    overrides: list[str]
    run_dir: Path
    repeat: int = 1

    @property
    def run_id(self) -> str:
        return self.run_dir.name


def _yaml_string(text: str) -> str:
    """``text`` as an override value: plain when YAML reads it back unchanged, else quoted."""
    import yaml

    return text if yaml.safe_load(text) == text else repr(text)


def plan_runs(
    tables: Sequence[int],
    scale: Scale,
    methods: Sequence[str],
    out: Path,
    models: Sequence[str] | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    micro_batch_size: int | None = None,
    extra: Sequence[str] = (),
) -> list[Run]:
    """Every run of the requested tables, in table order (baseline before CHARM+ per row)."""
    runs = []
    cp = scale.world_size
    for number in tables:
        spec = TABLES[number]
        for model in spec.models:
            if models and model not in models:
                continue
            for batch, paper_seq in spec.shapes:
                if shapes and (batch, paper_seq) not in shapes:
                    continue
                seq = paper_seq // scale.seq_divisor
                if seq % (2 * cp):
                    raise ValueError(f"sequence length {seq} is not divisible by 2 x CP = {2 * cp}")
                # CP over every rank (DP = 1), so a micro-batch is the whole batch unless the user
                # accumulates gradients over smaller ones to save memory.
                mbs = micro_batch_size or batch
                if batch % mbs:
                    raise ValueError(f"--micro-batch-size {mbs} does not divide batch {batch}")
                cfg = MODELS[model].cpu_config if scale.name == "cpu" else MODELS[model].gpu_config
                for repeat, method in itertools.product(range(1, scale.repeats + 1), methods):
                    run_id = f"table{number}-{model}-b{batch}-s{seq}-{method}"
                    if scale.repeats > 1:
                        run_id += f"-r{repeat}"
                    run_dir = (out / "runs" / run_id).resolve()
                    overrides = [
                        f"run.name={run_id}",
                        f"run.dir={_yaml_string(str(run_dir))}",
                        f"parallel.cp_comm_type={method}",
                        f"parallel.context_parallel_size={cp}",
                        f"parallel.ranks_per_node={scale.ranks_per_node}",
                        f"parallel.nproc={cp}",
                        f"model.seq_length={seq}",
                        f"train.global_batch_size={batch}",
                        f"train.micro_batch_size={mbs}",
                        f"train.train_iters={scale.train_iters}",
                        # The configs' warm-up is longer than a timing run; the schedule does not
                        # change the cost of an iteration.
                        "train.lr_warmup_iters=1",
                        "data.kind=mock",
                        "checkpoint.save=false",
                        "checkpoint.resume=false",
                        # A run is re-run from scratch (after a failure, or without
                        # --skip-existing); its directory then holds the earlier attempt.
                        "run.overwrite=true",
                        "logging.log_interval=1",
                        *extra,
                    ]
                    runs.append(
                        Run(number, model, batch, seq, method, cfg, overrides, run_dir, repeat)
                    )
    return runs
