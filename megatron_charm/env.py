"""Every ``MEGATRON_CHARM_*`` environment variable that megatron-charm reads, read here and nowhere
else.

Library code (``cp_attention``, ``CPTopology.build``, the kernels, the planner) takes these values
as arguments and reads no environment variable. Only the entry points read them, through the
accessors below, and pass the values down: the trainer (``megatron-charm-train``), the bench, and
the Megatron integration (``megatron_charm.megatron``: the attention module and its groups, where
Megatron-LM offers no argument to carry them). One list thus documents them all. (The launchers
also read the launch protocol's own variables, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_PORT``, Slurm's, which are not options of megatron-charm.)

================================= ==========================================================
variable                          meaning
================================= ==========================================================
MEGATRON_CHARM_NODE_ID            this process's node identity for CHARM+'s node split
                                  (default: the hostname), read by the Megatron integration
                                  and the bench worker and passed to ``CPTopology.build(
                                  node_id=...)``, whose own default is the hostname. The
                                  testbed sets it to the rank's network namespace, so emulated
                                  nodes on one host count as nodes.
MEGATRON_CHARM_RANKS_PER_NODE     CP ranks per node for the Megatron integration, when the
                                  config and ``--charm-ranks-per-node`` do not set it.
MEGATRON_CHARM_TIMEOUT_S          seconds before a CHARM+ channel group times out when the
                                  Megatron integration gets no timeout (default: 600). Patched
                                  Megatron-LM passes its ``--distributed-timeout-minutes``, the
                                  trainer its ``parallel.timeout_s``.
MEGATRON_CHARM_KERNEL             the block kernel (``torch``, ``flash_attn``, ``math``) of the
                                  Megatron attention module when its ``kernel`` argument is
                                  unset (the trainer's ``parallel.kernel: null``; Megatron-LM).
                                  ``cp_attention(kernel=None)`` does not read it: it picks by
                                  device and dtype.
MEGATRON_CHARM_DEVICE             ``cpu``: the trainer runs on CPU (gloo) even where CUDA is
                                  available; any other value or unset: CUDA when available.
MEGATRON_CHARM_TESTBED_CROSS_BPS  the testbed's cross-link rate in bit/s, which the testbed
                                  gives every rank; the bench's ``--launcher env`` records it
                                  (default 0: not on a testbed).
================================= ==========================================================
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from megatron_charm.constants import DEFAULT_TIMEOUT_S

NODE_ID = "MEGATRON_CHARM_NODE_ID"
RANKS_PER_NODE = "MEGATRON_CHARM_RANKS_PER_NODE"
TIMEOUT_S = "MEGATRON_CHARM_TIMEOUT_S"
KERNEL = "MEGATRON_CHARM_KERNEL"
DEVICE = "MEGATRON_CHARM_DEVICE"
TESTBED_CROSS_BPS = "MEGATRON_CHARM_TESTBED_CROSS_BPS"


def kernel(environ: Mapping[str, str] | None = None) -> str | None:
    """``$MEGATRON_CHARM_KERNEL``, or ``None`` when unset or empty."""
    environ = os.environ if environ is None else environ
    return environ.get(KERNEL) or None


def node_id(environ: Mapping[str, str] | None = None) -> str:
    """This process's node identity: ``$MEGATRON_CHARM_NODE_ID`` if set, else the hostname."""
    environ = os.environ if environ is None else environ
    return environ.get(NODE_ID) or socket.gethostname()


def ranks_per_node(environ: Mapping[str, str] | None = None) -> str | None:
    """The raw ``$MEGATRON_CHARM_RANKS_PER_NODE`` (validated by the caller), or ``None``."""
    environ = os.environ if environ is None else environ
    value = environ.get(RANKS_PER_NODE, "").strip()
    return value or None


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``$MEGATRON_CHARM_TIMEOUT_S`` as positive seconds (default 600)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(TIMEOUT_S, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_S}={raw!r} must be a positive number of seconds")
    return seconds


def device(environ: Mapping[str, str] | None = None) -> str | None:
    """``$MEGATRON_CHARM_DEVICE``, or ``None`` when unset or empty (``cpu`` forces the CPU)."""
    environ = os.environ if environ is None else environ
    return environ.get(DEVICE) or None


def testbed_cross_bps(environ: Mapping[str, str] | None = None) -> int:
    """``$MEGATRON_CHARM_TESTBED_CROSS_BPS`` as bit/s (0 when unset: not on a testbed)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(TESTBED_CROSS_BPS, "").strip() or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{TESTBED_CROSS_BPS}={raw!r} must be an integer number of bit/s (the testbed sets it)"
        ) from None
