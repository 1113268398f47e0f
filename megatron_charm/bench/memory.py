"""``megatron-charm-bench memory``: the paper's Table 3 (ring vs CHARM+ memory) from real runs.

For one attention layer, on ``m x p`` local gloo ranks, every method runs forward and backward
once at the full shape (memory does not depend on link speed: the executor's accounting follows
program order). Per method and rank it records:

* ``fwd_peak``: the executor's ``peak_buffer_bytes`` of the forward (received inputs still to be
  used, receive buffers in flight, accumulators, received partials);
* ``saved``: what autograd keeps from forward to backward beyond the caller's q, k, v (out, lse;
  inputs are passed in ``sbhd`` so no layout copies are made);
* ``bwd_peak``: the executor's backward peak (foreign q pieces kept from the forward, Note
  [Keeping foreign queries], count here from the backward's start and in ``fwd_peak`` from their
  receive, not in ``saved``);
* ``peak``: ``max(fwd_peak, saved + bwd_peak)``, the attention's own memory at its peak, and
  ``with_inputs``: that plus q, k, v and the output gradient (identical for every method);
* ``process_peak``: an independent measurement of the same forward and backward, the rank
  process's peak resident memory over the call less its resident memory before (Linux
  ``VmHWM``, reset through ``/proc/self/clear_refs``; ``None`` elsewhere). It also counts the
  kernels' temporaries (on CPU, float32 copies of bf16 blocks) and autograd's own tensors.

Shapes: ``tiny`` is ``configs/gpt-tiny-cpu.yaml`` (micro batch 4, seq 128, 4 heads of 16, CP 4 as
2 x 2); ``gpt350m`` is GPT-3 350M's attention (16 heads of 64) at batch 1 and a 16K sequence on
CP 8 (2 x 4), like the paper's 8-GPU setup; ``gpt350m-gqa`` the same with 4 kv heads (GQA 4:1).
All in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from megatron_charm.launch import RankInfo, run_function

SHAPES = {
    # name: (nodes, ranks_per_node, batch, global seq, heads, head dim, kv heads)
    "tiny": (2, 2, 4, 128, 4, 16, 4),
    "gpt350m": (2, 4, 1, 16384, 16, 64, 16),
    # GPT-350M's attention with grouped-query attention at Llama 3's ratio (4 query heads per
    # kv head), where charm ships kv across nodes in the backward (Note [Cross level])
    "gpt350m-gqa": (2, 4, 1, 16384, 16, 64, 4),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", default="tiny,gpt350m", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--methods", default="ring,charm,rm+,merge")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--md", dest="md_out", default=None)


def _rank_main(info: RankInfo, shape: tuple, methods: list[str], out_path: str) -> None:
    import megatron_charm as mc
    from megatron_charm.bench.worker import _saved_bytes
    from megatron_charm.plan import zigzag_positions

    torch.set_num_threads(1)
    m, p, b, seq, h, d, h_kv = shape
    world = m * p
    cp_rank = info.global_rank
    info.init_process_group("gloo")
    topo = mc.CPTopology.build(None, ranks_per_node=p)
    s_local = seq // world
    gen = torch.Generator().manual_seed(cp_rank)
    q, k, v, dout = (
        torch.randn(s_local, b, heads, d, generator=gen).to(torch.bfloat16)
        for heads in (h, h_kv, h_kv, h)
    )
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    del zigzag_positions  # random local data: memory does not depend on values
    rows = {}
    # One unmeasured forward and backward of every method first: the first call in a process
    # also allocates what stays (thread pools, kernel workspaces), and a method's first exchange
    # on each of its channels sets up that gloo group's buffers for good (charm and rm+ use
    # channels that ring does not), which would count against the first call of each.
    for method in methods:
        wq, wk, wv = (t.clone().requires_grad_() for t in (q, k, v))
        mc.cp_attention(wq, wk, wv, topo, method=method, qkv_format="sbhd").backward(dout)
        del wq, wk, wv
    for method in methods:
        lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))

        traces: list = []

        def call(lq=lq, lk=lk, lv=lv, method=method, traces=traces):
            return mc.cp_attention(lq, lk, lv, topo, method=method, qkv_format="sbhd", trace=traces)

        saved_total, saved = _saved_bytes(call, [lq, lk, lv])
        base = _quiet_rss()
        out = call()
        out.backward(dout)
        process_peak = None if base is None else _peak_rss() - base
        # traces: the forward inside _saved_bytes, then this forward and its backward.
        fwd_peak = max(t.stats.peak_buffer_bytes for t in traces if not t.backward)
        bwd_peak = max(t.stats.peak_buffer_bytes for t in traces if t.backward)
        rows[method] = {
            "fwd_peak": fwd_peak,
            "saved": saved,
            "bwd_peak": bwd_peak,
            "peak": max(fwd_peak, saved + bwd_peak),
            "with_inputs": max(fwd_peak, saved + bwd_peak) + inputs_bytes,
            "process_peak": process_peak,
        }
        del out
    everyone: list = [None] * world
    dist.all_gather_object(everyone, rows)
    if cp_rank == 0:
        worst = {
            method: {key: _max(r[method][key] for r in everyone) for key in everyone[0][method]}
            for method in methods
        }
        with open(out_path, "w") as f:
            json.dump({"per_rank": everyone, "max_over_ranks": worst}, f)
    # Leave together, as the attention benchmark's ranks do: a rank that tore its groups down
    # while rank 0 was still writing could take a peer's gloo threads down with it (SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


def _max(values) -> int | None:
    values = list(values)
    return None if None in values else max(values)


def _ratio(ring: dict, charm: dict) -> str:
    r, c = ring.get("process_peak"), charm.get("process_peak")
    return f" ({c / r:.3f})" if r and c is not None else ""


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _quiet_rss() -> int | None:
    """Bytes resident after freeing what can be freed, with the kernel's high-water mark reset
    to it (Linux: ``/proc/self/clear_refs``); ``None`` where that is not available."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back to the kernel
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        return _status_kib("VmRSS") * 1024
    except (OSError, KeyError):
        return None


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.2f}"


def markdown(results: dict) -> str:
    """Table 3's layout (ring vs CHARM+) plus the parts of each number, MiB per rank."""
    lines = [
        "| shape | B | Seq | Heads | d | m x p | Ring (MiB) | CHARM+ (MiB) | CHARM+ / Ring "
        "| with q, k, v, dout: Ring / CHARM+ (MiB) | process peak: Ring / CHARM+ (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        m, p, b, seq, h, d, h_kv = SHAPES[name]
        heads = str(h) if h == h_kv else f"{h} (kv {h_kv})"
        w = res["max_over_ranks"]
        if "ring" in w and "charm" in w:
            r, c = w["ring"], w["charm"]
            lines.append(
                f"| {name} | {b} | {seq} | {heads} | {d} | {m} x {p} | {_mib(r['peak'])} | "
                f"{_mib(c['peak'])} | {c['peak'] / r['peak']:.3f} | "
                f"{_mib(r['with_inputs'])} / {_mib(c['with_inputs'])} | "
                f"{_mib(r.get('process_peak'))} / {_mib(c.get('process_peak'))}{_ratio(r, c)} |"
            )
    lines += [
        "",
        "| shape | method | fwd peak | saved (out, lse) | bwd peak "
        "| peak = max(fwd, saved + bwd) | process peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for method, row in res["max_over_ranks"].items():
            lines.append(
                f"| {name} | {method} | {_mib(row['fwd_peak'])} | {_mib(row['saved'])} | "
                f"{_mib(row['bwd_peak'])} | {_mib(row['peak'])} | "
                f"{_mib(row.get('process_peak'))} |"
            )
    return "\n".join(lines) + "\n"


def run_memory(ns: argparse.Namespace) -> dict:
    """Run every requested shape; returns ``{shape: {"max_over_ranks": ..., "per_rank": ...}}``."""
    shapes = [s for s in ns.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise ValueError(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    methods = [m for m in ns.methods.split(",") if m]
    results = {}
    for name in shapes:
        tmp = tempfile.mkdtemp(prefix="mc-memory-")
        out = os.path.join(tmp, "out.json")
        m, p = SHAPES[name][:2]
        run_function(_rank_main, SHAPES[name], methods, out, nproc=m * p)
        with open(out) as f:
            results[name] = json.load(f)
    md = markdown(results)
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"shapes": {k: SHAPES[k] for k in shapes}, "results": results}, f, indent=1)
    if ns.md_out:
        with open(ns.md_out, "w") as f:
            f.write(md)
    print(md)
    return results
