"""Planted bugs for the tests of the GPU check (``--plant``, test-only; not for users).

A check that cannot fail proves nothing, so the tests plant a bug in every process of a check and
expect it to fail:

* ``merge``: the merge of partial results scales the merged output by 1.01 (every CP method with
  more than one rank merges, so ``cp4`` must fail);
* ``kernel``: the ``torch`` block kernel's forward scales its output by 1.01 (``megatron`` and
  ``cp4`` must fail). The plant reaches the ``torch`` kernel only, so on CUDA it matters for
  half precision only where the check runs ``kernel="torch"`` (the default there is
  flash-attn);
* ``destroy``: ``CPTopology.destroy`` does nothing (``cp4`` must fail: its ranks keep every
  split's groups).
"""

from __future__ import annotations

import dataclasses

PLANTS = ("merge", "kernel", "destroy")


def apply_plant(name: str | None) -> None:
    """Install planted bug ``name`` in this process (``None``: nothing)."""
    if name is None:
        return
    if name == "merge":
        from megatron_charm.comm import buffers

        real_merge = buffers.merge_partial

        def bad_merge(out, lse, out_b, lse_b) -> None:  # noqa: ANN001
            real_merge(out, lse, out_b, lse_b)
            out.mul_(1.01)

        buffers.merge_partial = bad_merge
    elif name == "kernel":
        from megatron_charm.kernels import backends

        kern = backends._KERNELS["torch"]
        real_forward = kern.forward

        def bad_forward(*args):  # noqa: ANN002, ANN202
            out, lse = real_forward(*args)
            return out * 1.01, lse

        backends._KERNELS["torch"] = dataclasses.replace(kern, forward=bad_forward)
    elif name == "destroy":
        from megatron_charm.comm.topology import CPTopology

        CPTopology.destroy = lambda self: None  # type: ignore[method-assign]
    else:
        raise ValueError(f"--plant {name!r}: expected one of {', '.join(PLANTS)} (test-only flag)")
