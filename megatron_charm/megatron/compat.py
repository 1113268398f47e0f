"""Checks that the installed megatron-core speaks the core_attention contract we implement.

megatron-core builds ``core_attention`` with keyword arguments and calls it with a fixed
positional/keyword split. Both are fixed by the ``CoreAttentionBuilder`` protocol and the forward
protocol in ``megatron.core.transformer.attention``: ``CoreAttention`` in 0.16.x, renamed
``CoreAttentionInterface`` in 0.19.x with the same signatures. If a future release changes them, a
silent mismatch would surface as a confusing ``TypeError`` deep inside model construction, or worse,
as an argument bound to the wrong parameter. We compare signatures up front and fail loudly instead.
Which protocol name exists is looked up, never inferred from the version string.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

#: Keywords megatron-core passes when it builds ``core_attention`` (0.16.1 and 0.19.x).
CONSTRUCTOR_KEYWORDS: tuple[str, ...] = (
    "config",
    "layer_number",
    "attn_mask_type",
    "attention_type",
    "cp_comm_type",
    "softmax_scale",
    "pg_collection",
)
#: Positional arguments of ``core_attention.forward`` (after ``self``).
FORWARD_POSITIONAL: tuple[str, ...] = ("query", "key", "value", "attention_mask")
#: Keyword arguments of ``core_attention.forward``.
FORWARD_KEYWORDS: tuple[str, ...] = ("attn_mask_type", "attention_bias", "packed_seq_params")

#: The megatron-core versions this contract was checked against.
TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
#: Names of the ``core_attention.forward`` protocol, newest first (0.19.x, then 0.16.x).
FORWARD_PROTOCOL_NAMES: tuple[str, ...] = ("CoreAttentionInterface", "CoreAttention")
#: The megatron-core release to install for each Python line (``pyproject.toml`` pins the same).
SUPPORTED_INSTALLS = (
    "'megatron-core==0.16.1' on Python 3.10/3.11, 'megatron-core>=0.19,<0.20' on 3.12+"
)


class MegatronCompatibilityError(RuntimeError):
    """The installed megatron-core does not match the core_attention contract we implement."""


def _params(fn: Callable) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


def _check_constructor(fn: Callable, where: str) -> list[str]:
    names = {p.name for p in _params(fn) if p.kind is not inspect.Parameter.VAR_KEYWORD}
    problems = []
    missing = [k for k in CONSTRUCTOR_KEYWORDS if k not in names]
    extra = sorted(names - set(CONSTRUCTOR_KEYWORDS))
    if missing:
        problems.append(f"{where}: keywords {missing} are no longer passed")
    if extra:
        problems.append(f"{where}: new keywords {extra} are passed")
    return problems


def _check_forward(fn: Callable, where: str) -> list[str]:
    params = _params(fn)
    positional = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    problems = []
    if positional != list(FORWARD_POSITIONAL):
        problems.append(
            f"{where}: positional arguments are {positional}, expected {list(FORWARD_POSITIONAL)}"
        )
    if sorted(keywords) != sorted(FORWARD_KEYWORDS):
        problems.append(
            f"{where}: keyword arguments are {keywords}, expected {list(FORWARD_KEYWORDS)}"
        )
    return problems


def megatron_core_version() -> str:
    """Return the installed megatron-core version string (``"unknown"`` if it cannot be read)."""
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # pragma: no cover - very old or broken installs
        return "unknown"


def core_attention_contract_problems() -> list[str]:
    """List the differences between megatron-core's core_attention contract and ours.

    Reads the ``CoreAttentionBuilder.__call__`` and ``CoreAttention.forward`` protocols of the
    installed megatron-core. Returns an empty list when they match.
    """
    try:
        from megatron.core.transformer import attention as mc_attention
    except ImportError as exc:  # pragma: no cover - megatron-core is a dependency
        return [f"megatron.core.transformer.attention cannot be imported: {exc}"]
    builder = getattr(mc_attention, "CoreAttentionBuilder", None)
    found = [n for n in FORWARD_PROTOCOL_NAMES if hasattr(mc_attention, n)]
    if builder is None or not found:
        return [
            "megatron.core.transformer.attention defines no CoreAttentionBuilder and "
            f"{' / '.join(FORWARD_PROTOCOL_NAMES)} protocols, so the core_attention contract "
            "cannot be verified"
        ]
    protocol = getattr(mc_attention, found[0])
    problems = _check_constructor(builder.__call__, "CoreAttentionBuilder.__call__")
    problems += _check_forward(protocol.forward, f"{found[0]}.forward")
    return problems


@functools.cache
def check_megatron_compat() -> str:
    """Fail loudly unless the installed megatron-core's core_attention contract is ours.

    Returns the megatron-core version on success (cached: the check runs once per process).

    Raises:
        MegatronCompatibilityError: naming every difference, the installed version and the
            versions the plugin was checked against.
    """
    problems = core_attention_contract_problems()
    # Our own module must accept everything megatron-core passes; this guards against drift on
    # our side as much as on theirs.
    from megatron_charm.megatron.attention import CharmDotProductAttention

    ours = {p.name for p in _params(CharmDotProductAttention.__init__)}
    missing_ours = [k for k in CONSTRUCTOR_KEYWORDS if k not in ours]
    if missing_ours:
        problems.append(f"CharmDotProductAttention.__init__ lacks keywords {missing_ours}")
    problems += _check_forward(CharmDotProductAttention.forward, "CharmDotProductAttention.forward")
    version = megatron_core_version()
    if problems:
        raise MegatronCompatibilityError(
            "megatron-core "
            + version
            + " does not match the core_attention contract that megatron-charm implements "
            + f"(checked against megatron-core {', '.join(TESTED_MEGATRON_CORE)}):\n  - "
            + "\n  - ".join(problems)
            + f"\nInstall a supported megatron-core ({SUPPORTED_INSTALLS}) or "
            "update megatron_charm.megatron.attention to the new contract."
        )
    return version
