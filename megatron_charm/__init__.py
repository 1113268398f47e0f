"""megatron-charm: CHARM+ context-parallel attention for Megatron-core.

Public API::

    import megatron_charm as mc

    topo = mc.CPTopology.build(cp_group, ranks_per_node=None)
    out = mc.cp_attention(q, k, v, topo, options=mc.PlanOptions(method="charm"), causal=True,
                          softmax_scale=None, qkv_format="bshd", return_lse=False)

``q`` is ``[b, s_local, h, d]`` (``"bshd"``) or ``[s_local, b, h, d]`` (``"sbhd"``); ``k`` and ``v``
have ``h_kv`` heads with ``h % h_kv == 0``. With ``causal=True`` the local sequence must be in the
zigzag layout (chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``), as Megatron's
``get_batch_on_this_cp_rank`` produces it.
"""

from __future__ import annotations

from typing import Any

from megatron_charm.plan import METHODS, PlanOptions
from megatron_charm.plan.docmask import DocMask

__all__ = ["CPTopology", "DocMask", "cp_attention", "METHODS", "PlanOptions"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy so that the pure planner (and the simulator) import without torch.distributed.
    if name == "CPTopology":
        from megatron_charm.comm.topology import CPTopology

        return CPTopology
    if name == "cp_attention":
        from megatron_charm.function import cp_attention

        return cp_attention
    raise AttributeError(f"module 'megatron_charm' has no attribute {name!r}")
