"""``cp4``: CP attention with 4 processes on one device, every method, against float64.

Four spawned processes share device 0 (or the CPU). Each builds two topologies with the node
identity passed as data, 2 nodes x 2 ranks and 1 node x 4 ranks (``CPTopology.build(
ranks_per_node=...)``), and runs ``cp_attention`` forward and backward for every method, causal
(zigzag shares) and full, with GQA, on its share of one seeded global problem. Each rank compares
its ``out``, ``dq``, ``dk`` and ``dv`` with float64 SDPA on the gathered sequence; the tolerance
per tensor is twice SDPA's own error in the input dtype plus one unit in the last place of the
reference's largest magnitude, so the check cannot pass by comparing a kernel with itself.

Transports:

* ``nccl`` (CUDA): NCCL with a distinct ``NCCL_HOSTID`` per process and sockets only
  (``NCCL_P2P_DISABLE=1``, ``NCCL_SHM_DISABLE=1``), so NCCL does not refuse several processes on
  one GPU. Best effort: it is reported, and fails the check only if it ran and was wrong.
* ``gloo-staged`` (CUDA): gloo with the device tensors staged through pinned host memory
  (:mod:`.staged`); compute stays on the GPU.
* ``gloo`` (CPU): gloo with CPU tensors.

With ``nccl``, one more causal ``charm`` forward and backward on the 2 x 2 split runs under
``torch.cuda.set_sync_debug_mode("error")``: a call must not make the host wait for the GPU
(Note [Call agreement] in :mod:`megatron_charm.comm.agreement`), and any synchronizing CUDA
operation inside it fails the check with the operation's message.

Each rank destroys a split's topology before it builds the next (``CPTopology.destroy``), and
must end holding no process group beyond those it held before the first: with ``nccl`` this is
where NCCL communicators are torn down and built again in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from megatron_charm.bench.gpu_check.procs import RanksFailed, init_group, run_ranks
from megatron_charm.comm.topology import live_process_groups
from megatron_charm.device import set_cuda_device

Tensor = torch.Tensor
WORLD = 4
NODE_SPLITS = {"2x2": 2, "1x4": 4}
TENSORS = ("out", "dq", "dk", "dv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def nccl_env(global_rank: int) -> dict[str, str]:
    """NCCL settings of one process of the ``nccl`` transport: its own host identity, sockets."""
    return {
        "NCCL_HOSTID": f"gpu-check-{global_rank}",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "lo",
    }


def _local_index(cp_rank: int, cp_size: int, seq: int, causal: bool, seq_layout: str) -> Tensor:
    """Positions of ``cp_rank``'s shard: causal in the method's ``seq_layout``, else contiguous."""
    from megatron_charm.plan import sequence_positions

    return torch.tensor(
        sequence_positions(cp_rank, cp_size, seq, seq_layout if causal else "contiguous")
    )


def sdpa_with_grads(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, causal: bool, scale: float | None = None
) -> list[Tensor]:
    """SDPA on ``[b, S, h, d]`` inputs (``k, v`` with ``h_kv`` heads) and its backward for ``do``;
    returns ``out, dq, dk, dv`` (``[b, S, ., d]``)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def max_err(a: Tensor, b: Tensor) -> float:
    """Largest absolute difference of ``a`` and ``b`` (one shape, any), in float64."""
    return (a.double() - b.double()).abs().max().item()


def sync_free(call: Callable[[], object], set_mode: Callable[[str], object]) -> dict:
    """Run ``call()`` with synchronizing CUDA operations made errors (``set_mode``:
    ``torch.cuda.set_sync_debug_mode``); ``{"ok", "why"}``, the first line of the error."""
    set_mode("error")
    try:
        call()
    except RuntimeError as exc:
        return {"ok": False, "why": str(exc).strip().splitlines()[0][:300]}
    finally:
        set_mode("default")
    return {"ok": True, "why": ""}


def cp4_worker(global_rank: int, world: int, port: int, cfg: dict) -> dict:
    """One rank: every node split, causal/full and method; returns its rows (errors, tolerances)
    and, with ``gloo-staged``, how many exchanges went through the host."""
    import torch.distributed as dist

    import megatron_charm as mc
    from megatron_charm.bench.gpu_check import staged

    device = torch.device(cfg["device"])
    if device.type == "cuda":
        set_cuda_device(0)
        device = torch.device("cuda", 0)
    transport = cfg["transport"]
    backend = "nccl" if transport == "nccl" else "gloo"
    init_group(global_rank, world, port, backend, cfg["timeout_s"])
    stager = staged.install() if transport == "gloo-staged" else None
    dtype = DTYPES[cfg["dtype"]]
    b, s_local, h, h_kv, d = cfg["shape"]
    seq = s_local * world
    g = torch.Generator().manual_seed(cfg["seed"])
    # one global problem, rounded to the input dtype, identical on every rank
    full = [torch.randn(b, seq, n, d, generator=g).to(dtype) for n in (h, h_kv, h_kv, h)]
    rows = []
    sync = None
    held = live_process_groups()
    try:
        for split in cfg["splits"]:
            topo = mc.CPTopology.build(None, ranks_per_node=NODE_SPLITS[split])
            if transport == "gloo-staged":
                staged.allow_device(topo)
            for causal in cfg["causal"]:
                ref_all = sdpa_with_grads(*(t.to(device, torch.float64) for t in full), causal)
                same = sdpa_with_grads(*(t.to(device) for t in full), causal)
                for method in cfg["methods"]:
                    layout = mc.PlanOptions(method=method).seq_layout
                    idx = _local_index(topo.cp_rank, world, seq, causal, layout).to(device)
                    ref = [r[:, idx] for r in ref_all]
                    tols = [
                        2 * max_err(s[:, idx], r) + torch.finfo(dtype).eps * r.abs().max().item()
                        for s, r in zip(same, ref, strict=True)
                    ]
                    local = [t.to(device)[:, idx].contiguous() for t in full]
                    q, k, v = (t.clone().requires_grad_() for t in local[:3])
                    out = mc.cp_attention(q, k, v, topo, method=method, causal=causal)
                    out.backward(local[3])
                    errs = [max_err(a, r) for a, r in zip((out, q.grad, k.grad, v.grad), ref,
                                                             strict=True)]  # fmt: skip
                    rows.append({
                        "split": split, "causal": causal, "method": method,
                        "errors": dict(zip(TENSORS, errs, strict=True)),
                        "tolerances": dict(zip(TENSORS, tols, strict=True)),
                    })  # fmt: skip
            if transport == "nccl" and split == "2x2":
                layout = mc.PlanOptions(method="charm").seq_layout
                idx = _local_index(topo.cp_rank, world, seq, True, layout).to(device)
                local = [t.to(device)[:, idx].contiguous() for t in full]
                q, k, v = (t.clone().requires_grad_() for t in local[:3])

                def call(q=q, k=k, v=v, do=local[3], topo=topo) -> None:
                    mc.cp_attention(q, k, v, topo, method="charm", causal=True).backward(do)

                call()  # first call of this shape: plans and kernel choices, outside the check
                torch.cuda.synchronize()
                sync = sync_free(call, torch.cuda.set_sync_debug_mode)
            topo.destroy()  # the next split builds its own channels
        left = None if held is None else len(live_process_groups() - held)
    finally:
        staged.uninstall()
        dist.destroy_process_group()
    return {
        "rows": rows,
        "staged_exchanges": stager.exchanges if stager else None,
        "sync_free": sync,
        "groups_left": left,
    }


def _combine(per_rank: list[list[dict]]) -> list[dict]:
    """Rows of all ranks into one row per case: worst error, its tolerance, failed tensors."""
    out = []
    for rows in zip(*per_rank, strict=True):
        failed = sorted(
            {f"{n} (cp_rank {r})" for r, row in enumerate(rows) for n in TENSORS
             if not row["errors"][n] <= row["tolerances"][n]}
        )  # fmt: skip
        ratio = max(row["errors"][n] / max(row["tolerances"][n], 1e-30)
                    for row in rows for n in TENSORS)  # fmt: skip
        first = rows[0]
        out.append({
            "split": first["split"], "causal": first["causal"], "method": first["method"],
            "max_err": {n: float(f"{max(r['errors'][n] for r in rows):.3g}") for n in TENSORS},
            "tol": {n: float(f"{min(r['tolerances'][n] for r in rows):.3g}") for n in TENSORS},
            "worst_err_over_tol": float(f"{ratio:.3g}"), "ok": not failed, "failed": failed,
        })  # fmt: skip
    return out


def cp4(
    device: torch.device,
    transports: list[str],
    methods: list[str],
    s_local: int,
    plant: str | None,
    save_partial: Callable[[dict], None],
) -> tuple[dict, list[str]]:
    """Run every transport; a result per transport (``save_partial`` after each)."""
    on_cuda = device.type == "cuda"
    shape = [2, s_local, 16, 4, 128] if on_cuda else [1, s_local, 8, 4, 16]
    base = {
        "device": device.type, "dtype": "bf16" if on_cuda else "fp32", "shape": shape,
        "methods": methods, "splits": list(NODE_SPLITS), "causal": [True, False], "seed": 3,
        "timeout_s": 120,
    }  # fmt: skip
    result: dict = {"shape_b_slocal_h_hkv_d": shape, "dtype": base["dtype"], "transports": {}}
    bad: list[str] = []
    for transport in transports:
        cfg = base | {"transport": transport}
        best_effort = transport == "nccl"
        t0 = time.time()
        try:
            per_rank = run_ranks(
                cp4_worker, WORLD, cfg, timeout_s=120 if best_effort else 240, plant=plant,
                per_rank_env=nccl_env if transport == "nccl" else None,
            )  # fmt: skip
        except RanksFailed as exc:
            why = str(exc).splitlines()[0][:500]
            result["transports"][transport] = {"ran": False, "why": why}
            if not best_effort:
                bad.append(f"{transport}: did not run: {why}")
            save_partial(result)
            continue
        rows = _combine([r["rows"] for r in per_rank])
        result["transports"][transport] = {
            "ran": True, "seconds": round(time.time() - t0, 1), "rows": rows,
        }  # fmt: skip
        if transport == "nccl":
            sync = [r["sync_free"] for r in per_rank]
            result["transports"][transport]["sync_free_per_rank"] = sync
            bad += [
                f"nccl: cp_rank {i}'s charm call made the host wait for the GPU: {s['why']}"
                for i, s in enumerate(sync)
                if s is not None and not s["ok"]
            ]
        left = [r["groups_left"] for r in per_rank]
        result["transports"][transport]["groups_left_per_rank"] = left
        bad += [
            f"{transport}: cp_rank {i} still holds {n} process groups after destroying its "
            "topologies (CPTopology.destroy)"
            for i, n in enumerate(left)
            if n
        ]
        if transport == "gloo-staged":
            staged = [r["staged_exchanges"] for r in per_rank]
            result["transports"][transport]["staged_exchanges_per_rank"] = staged
            if min(staged) == 0:
                bad.append("gloo-staged: no exchange went through the staging transport")
        bad += [
            f"{transport} {r['split']} {'causal' if r['causal'] else 'full'} {r['method']}: "
            f"{', '.join(r['failed'])} over tolerance"
            for r in rows
            if not r["ok"]
        ]
        save_partial(result)
    return result, bad
