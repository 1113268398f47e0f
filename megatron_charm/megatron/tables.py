"""The paper's end-to-end Tables 6 and 7 on patched Megatron-LM ``pretrain_gpt.py`` (GPU path).

Both arms of a cell run the same ``pretrain_gpt.py`` command (Transformer Engine layers, fused
kernels, optimizer, mock data with a GPT-2-sized vocabulary); the only difference is
``--cp-comm-type``: ``charm`` against Transformer Engine's ``p2p`` ring (and, optionally,
``a2a+p2p``). Each run is one ``sbatch`` of ``scripts/tables/megatron_run.sbatch`` on 2 nodes x 8
GPUs, CP = 16 over all of them, as the paper runs it. Megatron-LM measures: ``--log-interval 1``
prints every iteration's time and ``--log-throughput`` its TFLOP/s per GPU (Megatron's own FLOP
formula); ``--log-memory-interval`` prints ``torch.cuda.max_memory_allocated`` at the last
iteration. :func:`parse_training_log` reads those lines back.

This is a different thing from the CPU-scale tables of :mod:`megatron_charm.bench.tables`, which
run megatron-charm's own trainer on tiny stand-in models.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: The paper's models with Megatron-LM's standard GPT-3 shapes (layers, hidden size, heads).
MODELS: dict[str, tuple[int, int, int]] = {
    "GPT-350M": (24, 1024, 16),
    "GPT-1.3B": (24, 2048, 16),
}
#: (models, [(batch, sequence length)]) of each table.
TABLES: dict[int, tuple[tuple[str, ...], tuple[tuple[int, int], ...]]] = {
    6: (("GPT-350M", "GPT-1.3B"), ((16, 2048), (8, 4096), (4, 8192), (2, 16384))),
    7: (("GPT-350M",), ((16, 16384), (32, 8192), (64, 4096), (128, 2048))),
}
#: ``--cp-comm-type`` of each arm; the first baseline is the paper's (Megatron's own ring).
METHOD = "charm"
BASELINES: tuple[str, ...] = ("p2p", "a2a+p2p")


@dataclass(frozen=True)
class Cluster:
    """Where the runs go: ``nodes`` x ``gpus_per_node`` GPUs, CP over all of them."""

    nodes: int = 2
    gpus_per_node: int = 8
    cpus_per_node: int = 64
    """Slurm CPU request per node: one torchrun task per node starts ``gpus_per_node`` ranks,
    each with its data loader and host-side work, so 8 cores per GPU by default."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cell:
    """One run: a model at one batch x sequence point with one ``--cp-comm-type``."""

    table: int
    model: str
    batch: int
    seq: int
    method: str

    @property
    def run_id(self) -> str:
        return f"table{self.table}-{self.model.lower()}-{self.batch}x{self.seq}-{self.method}"


def plan_cells(tables: Sequence[int], baselines: Sequence[str] = ("p2p",)) -> list[Cell]:
    """Every run of ``tables``, CHARM+ and each baseline interleaved per point."""
    for baseline in baselines:
        if baseline not in BASELINES:
            raise ValueError(f"--baseline {baseline}: choose from {', '.join(BASELINES)}")
    cells = []
    for table in tables:
        if table not in TABLES:
            raise ValueError(f"--table {table}: the paper's end-to-end tables are 6 and 7")
        models, points = TABLES[table]
        for model in models:
            for batch, seq in points:
                for method in (*baselines, METHOD):
                    cells.append(Cell(table, model, batch, seq, method))
    return cells


def pretrain_gpt_args(
    cell: Cell, cluster: Cluster, train_iters: int = 30, micro_batch_size: int | None = None
) -> list[str]:
    """The ``pretrain_gpt.py`` flags of one run (identical across arms but ``--cp-comm-type``).

    Raises:
        ValueError: if the micro-batch does not divide the batch or the sequence does not split
            over ``2 x`` the CP size.
    """
    layers, hidden, heads = MODELS[cell.model]
    cp = cluster.world_size
    mbs = micro_batch_size or cell.batch
    if cell.batch % mbs != 0:
        raise ValueError(
            f"--micro-batch-size {mbs} does not divide the batch {cell.batch} of {cell.run_id}; "
            "pass a divisor of every batch of the tables, or leave it out to use the batch"
        )
    if cell.seq % (2 * cp) != 0:
        raise ValueError(
            f"sequence length {cell.seq} of {cell.run_id} must be a multiple of 2 x CP = "
            f"{2 * cp} (CP = --nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node}); "
            "pick --nodes and --gpus-per-node so that 2 x their product divides it"
        )
    flags: list[object] = [
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
        "--seq-length", cell.seq, "--max-position-embeddings", cell.seq,
        "--micro-batch-size", mbs, "--global-batch-size", cell.batch,
        "--train-iters", train_iters, "--eval-iters", 0,
        "--lr", 3.0e-4, "--min-lr", 3.0e-5, "--lr-decay-style", "cosine",
        "--lr-warmup-iters", 0, "--weight-decay", 0.1, "--clip-grad", 1.0,
        "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--init-method-std", 0.02,
        "--attention-dropout", 0.0, "--hidden-dropout", 0.0,
        "--bf16", "--transformer-impl", "transformer_engine",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 50257,
        "--context-parallel-size", cp, "--cp-comm-type", cell.method,
        "--distributed-timeout-minutes", 30,
        "--log-interval", 1, "--log-throughput", "--log-memory-interval", train_iters,
    ]  # fmt: skip
    if cell.method == METHOD:
        flags += ["--charm-ranks-per-node", cluster.gpus_per_node]
    elif cell.method == "a2a+p2p":
        flags += ["--hierarchical-context-parallel-sizes", cluster.gpus_per_node, cluster.nodes]
    return [str(f) for f in flags]


def sbatch_argv(
    cell: Cell,
    cluster: Cluster,
    megatron_lm: str,
    log_dir: str,
    sbatch_args: Sequence[str] = (),
    **kwargs: object,
) -> list[str]:
    """The ``sbatch`` command line of one run; ``kwargs`` go to :func:`pretrain_gpt_args`."""
    return [
        "sbatch",
        "--wait",
        f"--job-name={cell.run_id}",
        f"--nodes={cluster.nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={cluster.gpus_per_node}",
        f"--cpus-per-task={cluster.cpus_per_node}",
        f"--output={log_dir}/{cell.run_id}.log",
        f"--export=ALL,MEGATRON_LM={megatron_lm},CUDA_DEVICE_MAX_CONNECTIONS=1",
        *sbatch_args,
        "scripts/tables/megatron_run.sbatch",
        *pretrain_gpt_args(cell, cluster, **kwargs),  # type: ignore[arg-type]
    ]


def torchrun_line(cell: Cell, cluster: Cluster, megatron_lm: str, **kwargs: object) -> list[str]:
    """What ``megatron_run.sbatch`` runs on every node (the ``pretrain_gpt.py`` command line)."""
    return [
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "torchrun",
        f"--nnodes={cluster.nodes}",
        f"--nproc-per-node={cluster.gpus_per_node}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
        f"--rdzv-id={cell.run_id}",
        f"{megatron_lm}/pretrain_gpt.py",
        *pretrain_gpt_args(cell, cluster, **kwargs),  # type: ignore[arg-type]
    ]


# --- Megatron-LM's log, read back -------------------------------------------------------------

_ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|"
    r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|)?"
    r"(?:.*?global batch size:\s+(\d+) \|)?"
)
_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\).*?max allocated: ([\d.]+)"
)


@dataclass(frozen=True)
class RunSummary:
    """What one Megatron-LM run measured, after warm-up."""

    iterations: int
    """Iterations measured (after the warm-up ones)."""
    iter_ms: float
    """Median iteration time."""
    tokens_per_s: float
    """Global batch x sequence length / median iteration time."""
    tflops_per_gpu: float | None
    """Median of Megatron's ``throughput per GPU`` (``None`` without ``--log-throughput``)."""
    peak_mem_mb: float | None
    """Largest ``max allocated`` (``torch.cuda.max_memory_allocated``) of any rank's last
    memory report."""


def parse_training_log(text: str, seq_length: int, warmup: int = 5) -> RunSummary:
    """Summarise a ``pretrain_gpt.py`` log (``--log-interval 1``).

    Args:
        text: the job's output.
        seq_length: the run's ``--seq-length`` (for tokens/s).
        warmup: leading iterations left out of the timing.

    Raises:
        ValueError: when the log holds no iteration after the warm-up (the run failed or was
            too short); the message says how many it found.
    """
    times, tflops, batch = [], [], None
    for match in _ITERATION.finditer(text):
        iteration, ms, tput, gbs = match.groups()
        if int(iteration) <= warmup:
            continue
        times.append(float(ms))
        if tput is not None:
            tflops.append(float(tput))
        if gbs is not None:
            batch = int(gbs)
    if not times or batch is None:
        raise ValueError(
            f"the log has {len(times)} iteration line(s) after the {warmup} warm-up iterations "
            "(with 'global batch size'); was the run complete, with --log-interval 1?"
        )
    last: dict[int, tuple[int, float]] = {}
    for global_rank, after, mb in _MEMORY.findall(text):
        if int(after) >= last.get(int(global_rank), (-1, 0.0))[0]:
            last[int(global_rank)] = (int(after), float(mb))
    iter_ms = statistics.median(times)
    return RunSummary(
        iterations=len(times),
        iter_ms=iter_ms,
        tokens_per_s=batch * seq_length / (iter_ms / 1000.0),
        tflops_per_gpu=statistics.median(tflops) if tflops else None,
        peak_mem_mb=max(mb for _, mb in last.values()) if last else None,
    )


def table_rows(summaries: dict[Cell, RunSummary], baseline: str = "p2p") -> list[dict[str, object]]:
    """The paper's layout: per point, baseline and CHARM+ latency and memory, and the speedup
    (baseline latency / CHARM+ latency). Points missing either arm are left out."""
    rows = []
    for cell, ours in summaries.items():
        if cell.method != METHOD:
            continue
        base = summaries.get(Cell(cell.table, cell.model, cell.batch, cell.seq, baseline))
        if base is None:
            continue
        rows.append(
            {
                "table": cell.table,
                "batch": cell.batch,
                "seq": cell.seq,
                "model": cell.model,
                f"{baseline}_ms": base.iter_ms,
                f"{baseline}_mem_mb": base.peak_mem_mb,
                "charm_ms": ours.iter_ms,
                "charm_mem_mb": ours.peak_mem_mb,
                "charm_tokens_per_s": ours.tokens_per_s,
                "charm_tflops_per_gpu": ours.tflops_per_gpu,
                "speedup": base.iter_ms / ours.iter_ms,
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, object]], baseline: str = "p2p") -> str:
    """``rows`` as the paper's table (latency in ms, memory in MB)."""

    def fmt(value: object, digits: int = 1) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"  # type: ignore[str-format]

    head = (
        f"| Batch Size | Seq Len | Model | {baseline} Latency (ms) | {baseline} Memory (MB) | "
        "CHARM+ Latency (ms) | CHARM+ Memory (MB) | Speedup |"
    )
    lines = [head, "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['seq']:,} | {r['model']} | {fmt(r[f'{baseline}_ms'])} | "
            f"{fmt(r[f'{baseline}_mem_mb'], 0)} | {fmt(r['charm_ms'])} | "
            f"{fmt(r['charm_mem_mb'], 0)} | {fmt(r['speedup'], 2)}x |"
        )
    return "\n".join(lines) + "\n"
