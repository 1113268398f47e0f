"""Per-iteration metrics: console lines, a JSON-lines file, throughput, FLOPs and memory."""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from megatron_charm.train.config import Config


def flops_per_iteration(cfg: Config, vocab_size: int, tokens: int, causal: bool = True) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), as Megatron counts them.

    Per token and layer: QKV, projection and MLP matmuls (``2 * params``), plus the attention
    score and value matmuls (``4 * s * h``, halved for causal masks); the output layer adds
    ``2 * h * vocab``.
    """
    m = cfg.model
    h, s, layers = m.hidden_size, m.seq_length, m.num_layers
    kv = (m.num_query_groups or m.num_attention_heads) * (h // m.num_attention_heads)
    ffn = m.ffn_hidden_size or 4 * h
    matmul_params = h * (h + 2 * kv) + h * h + 2 * h * ffn
    attention = 4 * s * h * (0.5 if causal else 1.0)
    forward = tokens * (layers * (2 * matmul_params + attention) + 2 * h * vocab_size)
    return 3.0 * forward


def peak_memory_mb(on_gpu: bool) -> float:
    """Peak allocated GPU memory, or this process's peak resident memory on CPU, in MiB."""
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / 1024.0 if sys.platform != "darwin" else rss_kb / 2**20


class MetricsWriter:
    """Appends one JSON object per iteration to ``metrics.jsonl`` (rank 0 only).

    A fresh run (``resumed_at=None``) starts the file over. A resumed run keeps the records up to
    the checkpoint it resumed from and drops later ones: those iterations run again, and a crash
    between a checkpoint and the next must not leave them in the file twice.
    """

    def __init__(self, path: Path | None, resumed_at: int | None = None) -> None:
        self.path = path
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _records_through(path, resumed_at) if resumed_at is not None else []
            self._file = path.open("w", encoding="utf-8")
            for line in kept:
                self._file.write(line + "\n")
            self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _records_through(path: Path, iteration: int) -> list[str]:
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # A line cut short by a crash; everything after it is gone too.
            break
        if isinstance(record, dict) and record.get("iteration", 0) <= iteration:
            kept.append(line)
    return kept


def format_line(record: dict[str, Any], train_iters: int) -> str:
    return (
        f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
        f"{record['tokens_per_s']:,.0f} tok/s | {record['tflops_per_rank']:.4f} TFLOPS/rank | "
        f"{record['iter_ms']:.0f} ms | peak mem {record['peak_mem_mb']:.0f} MB"
    )


class Progress:
    """Prints a progress line every ``interval_s`` from a background thread while training runs.

    Long iterations (big models, slow links) would otherwise leave the console silent for minutes.
    """

    def __init__(self, interval_s: float, train_iters: int, out: TextIO = sys.stdout) -> None:
        self.interval_s = interval_s
        self.train_iters = train_iters
        self.out = out
        self.iteration = 0
        self.start_iteration = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, iteration: int) -> None:
        self.iteration = self.start_iteration = iteration
        self.started = time.monotonic()
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = self.iteration - self.start_iteration
        left = self.train_iters - self.iteration
        eta = f"{elapsed / done * left:.0f}s" if done > 0 else "unknown"
        pct = 100.0 * self.iteration / max(1, self.train_iters)
        return (
            f"progress: iteration {self.iteration}/{self.train_iters} ({pct:.0f}%), "
            f"elapsed {elapsed:.0f}s, eta {eta}"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            print(self.line(), file=self.out, flush=True)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
