"""The paper's end-to-end tables (6 and 7) against the simulator's attention layers, summed.

The simulator predicts one attention layer (Prediction.UNIT). A training iteration of the
paper's GPT runs ``L`` of them, forward and backward, plus everything else: the linear layers,
the element-wise kernels, the gradient all-reduce and the optimizer. This script replays the
paper's ring and CHARM+ (Note [The paper's baselines] in ``megatron_charm/sim/baselines.py``),
causal, for every row of Table 6 (16 L20) and Table 7 (16 H20 and 16 H100), and sets
``L x (forward + backward)`` beside the paper's iteration time. Also the linear layers' time at
the preset's kernel efficiency (Megatron's count, ``72 B S L H^2 + 6 B S H V`` FLOPs an
iteration over 16 GPUs), a lower bound on what the rest adds.

Its question: can the per-layer model be summed into an end-to-end prediction? ``share`` is
the paper's iteration time over the summed layers plus the linear layers; a model that
explained the tables would give one value (near 1, or some constant) across them.

The paper gives no node split for 16 L20 (Table 4 runs L20 nodes of 4, Figure 6 a node of 8):
both are replayed. Model shapes: GPT-3 350M (24 layers, hidden 1,024, 16 heads of 64) and 1.3B
(24 layers, hidden 2,048, 16 heads of 128), as ``megatron_charm.sim.scaling`` uses them; the
vocabulary is GPT-2's padded to 50,304.

Run: ``python scripts/bench/paper_e2e.py [--md FILE]`` (about 20 seconds).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import dataclass

from megatron_charm.bench.report import emit
from megatron_charm.sim.baselines import paper_predict
from megatron_charm.sim.predict import Problem
from megatron_charm.sim.topology import PRESETS

VOCAB = 50304
LAYERS = 24


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


GPT_350M = Model("GPT-350M", 1024, 16)
GPT_1_3B = Model("GPT-1.3B", 2048, 16)


@dataclass(frozen=True)
class Row:
    """One row of Table 6 or 7: iteration times in ms on 16 GPUs."""

    table: int
    gpu: str
    model: Model
    batch: int
    seq: int
    ring_ms: float
    charm_ms: float


ROWS = (
    # Table 6: 16 L20
    Row(6, "L20", GPT_350M, 16, 2048, 10082.6, 4847.0),
    Row(6, "L20", GPT_350M, 8, 4096, 10032.6, 4871.5),
    Row(6, "L20", GPT_350M, 4, 8192, 9914.5, 5173.6),
    Row(6, "L20", GPT_350M, 2, 16384, 10089.5, 5637.3),
    Row(6, "L20", GPT_1_3B, 16, 2048, 21505.5, 11738.3),
    Row(6, "L20", GPT_1_3B, 8, 4096, 22073.7, 11768.1),
    Row(6, "L20", GPT_1_3B, 4, 8192, 21857.8, 12097.5),
    Row(6, "L20", GPT_1_3B, 2, 16384, 22064.5, 12796.6),
    # Table 7: 16 H20 and 16 H100, GPT3-350M
    Row(7, "H20", GPT_350M, 16, 16384, 7304.6, 5601.3),
    Row(7, "H20", GPT_350M, 32, 8192, 7193.7, 4669.7),
    Row(7, "H20", GPT_350M, 64, 4096, 7169.6, 4452.5),
    Row(7, "H20", GPT_350M, 128, 2048, 7143.6, 4242.5),
    Row(7, "H100", GPT_350M, 16, 16384, 3385.1, 1925.7),
    Row(7, "H100", GPT_350M, 32, 8192, 3291.5, 1679.2),
    Row(7, "H100", GPT_350M, 64, 4096, 3234.6, 1538.6),
    Row(7, "H100", GPT_350M, 128, 2048, 3210.8, 1482.0),
)

#: Node splits of 16 GPUs replayed per GPU type (the paper names none for L20).
SPLITS = {"L20": ((4, 4), (2, 8)), "H20": ((2, 8),), "H100": ((2, 8),)}


def linear_ms(row: Row, gpus: int) -> float:
    """The linear layers of one iteration at the preset's efficiency, one GPU's share (ms)."""
    hw = PRESETS[row.gpu]
    tokens, h = row.batch * row.seq, row.model.hidden
    flops = 72 * tokens * LAYERS * h * h + 6 * tokens * h * VOCAB
    return flops / gpus / (hw.tflops * 1e12 * hw.efficiency) * 1e3


@dataclass(frozen=True)
class Summed:
    """One row against the replay on one node split (times in ms)."""

    row: Row
    split: tuple[int, int]
    ring_layer: float
    charm_layer: float
    linear: float

    def share(self, method: str) -> float:
        """The paper's iteration over the summed layers plus the linear layers."""
        paper, layer = (
            (self.row.ring_ms, self.ring_layer)
            if method == "ring"
            else (self.row.charm_ms, self.charm_layer)
        )
        return paper / (LAYERS * layer + self.linear)


def summed(row: Row, split: tuple[int, int]) -> Summed:
    """Replay ``row``'s attention layer (the paper's ring and CHARM+) on ``split``."""
    hw, (m, p) = PRESETS[row.gpu], split
    problem = Problem(row.batch, row.seq, row.model.heads, row.model.head_dim, causal=True)
    pred = paper_predict(
        hw.topology(m, p),
        problem,
        hw.compute_model(hw.efficiency),
        ("ring", "charm"),
        hw.a2a_topology(m, p),
    )
    # one layer's forward + backward, ms
    ring, charm = (pred.methods[method].total * 1e3 for method in ("ring", "charm"))
    return Summed(row, split, ring, charm, linear_ms(row, m * p))


def rows() -> list[str]:
    out = []
    for row in ROWS:
        for split in SPLITS[row.gpu]:
            s = summed(row, split)
            out.append(
                f"| {row.table} | {row.gpu} | {split[0]}x{split[1]} | {row.model.name} | "
                f"{row.batch} x {row.seq} | {row.ring_ms:,.0f} / {row.charm_ms:,.0f} | "
                f"{s.ring_layer:.1f} / {s.charm_layer:.1f} | "
                f"{LAYERS * s.ring_layer:,.0f} / {LAYERS * s.charm_layer:,.0f} | "
                f"{s.linear:.0f} | {s.share('ring'):.2f} / {s.share('charm'):.2f} | "
                f"{row.ring_ms / row.charm_ms:.2f}x | {s.ring_layer / s.charm_layer:.2f}x |"
            )
    return out


def attention_flops(row: Row, gpus: int) -> float:
    """Causal attention FLOPs of one iteration, one GPU's share: ``2 B S^2 H`` a layer forward
    (half of ``4 B S^2 H``), the backward 2.5 times that (the simulator's count)."""
    return LAYERS * 3.5 * 2 * row.batch * row.seq**2 * row.model.hidden / gpus


def implied_rates(gpus: int = 16) -> list[str]:
    """Per GPU type and model, the attention FLOPs that the longest sequence adds over the
    shortest (the same tokens an iteration) over the time the paper's CHARM+ iteration adds:
    the rate its attention blocks ran at in the paper's Megatron runs, if nothing else grew
    with the sequence (CHARM+ moves the same bytes at every row of a group)."""
    out = []
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in ROWS:
        groups.setdefault((row.gpu, row.model.name), []).append(row)
    for (gpu, name), group in groups.items():
        short, long = min(group, key=lambda r: r.seq), max(group, key=lambda r: r.seq)
        added = attention_flops(long, gpus) - attention_flops(short, gpus)
        rate = added / ((long.charm_ms - short.charm_ms) / 1e3) / 1e12
        hw = PRESETS[gpu]
        out.append(
            f"* {gpu} {name}: CHARM+'s iteration grows {long.charm_ms - short.charm_ms:,.0f} ms "
            f"from {short.batch} x {short.seq} to {long.batch} x {long.seq}, for "
            f"{added / 1e12:.1f} TFLOP of attention a GPU: {rate:.0f} TFLOP/s, "
            f"{rate / hw.tflops:.0%} of its {hw.tflops:g} TFLOPS (the replay's blocks: "
            f"{hw.efficiency:.0%})"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", help="write the table here as well")
    args = ap.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"The paper's ring and CHARM+, causal, on the presets; {LAYERS} layers; times in ms "
        f"({now:%Y-%m-%d %H:%M} UTC)",
        "",
        "| table | GPU | split | model | batch x seq | paper: iteration, ring / CHARM+ "
        "| one layer fwd+bwd, ring / CHARM+ | x layers | linear layers | share: paper / "
        "(layers + linear), ring / CHARM+ | paper's speedup | one layer's speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows(),
        "",
        *implied_rates(),
    ]
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
