"""Every environment variable that megatron-charm reads, read here and nowhere else.

Library code takes these values as arguments; the defaults of the entry points (the trainer, the
bench, the Megatron integration) come from here, so that one list documents them all.

============================== =============================================================
variable                       meaning
============================== =============================================================
MEGATRON_CHARM_NODE_ID         this process's node identity for CHARM+'s node split (default:
                               the hostname). The testbed sets it to the rank's network
                               namespace, so emulated nodes on one host count as nodes.
MEGATRON_CHARM_RANKS_PER_NODE  CP ranks per node for the Megatron integration, when the config
                               and ``--charm-ranks-per-node`` do not set it.
MEGATRON_CHARM_TIMEOUT_S       seconds before a CHARM+ channel group times out when the caller
                               passes no timeout (default: 600). Patched Megatron-LM passes its
                               ``--distributed-timeout-minutes``, the trainer its
                               ``parallel.timeout_s``.
MEGATRON_CHARM_KERNEL          the block kernel when a call does not name one (``torch``,
                               ``flash_attn``, ``math``).
============================== =============================================================
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
