"""Bind a Python call to an ATen op schema the way the dispatcher does, and check argument types.

``bind(schema, args, kwargs)`` returns ``{name: value}`` or raises ``TypeError`` naming the
argument. It also rejects what the dispatcher would accept but mean differently, which is what
the contract tests are for: :class:`RecordingOps` keeps every bound call, so that a test can
require ``None`` (an undefined tensor) where any defined tensor, even an empty one, means
something else to ATen.
"""

from __future__ import annotations

from typing import Any

import torch


def _type_ok(arg: Any, value: Any) -> bool:
    type_str = str(arg.type)
    optional = type_str.startswith("Optional[")
    base = type_str[len("Optional[") : -1] if optional else type_str
    if value is None:
        # The dispatcher turns None into an undefined tensor for Tensor arguments too.
        return optional or base == "Tensor"
    if base == "Tensor":
        return isinstance(value, torch.Tensor)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "bool":
        return isinstance(value, bool)
    if base == "List[bool]":
        ok = isinstance(value, (list, tuple)) and all(isinstance(x, bool) for x in value)
        return ok and (arg.N is None or len(value) == arg.N)
    raise AssertionError(f"schema type {type_str} is not handled by this helper")


def bind(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Bind ``args``/``kwargs`` to ``schema``'s arguments; defaults fill the rest."""
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(
            f"{schema.name}: {len(args)} positional arguments, at most {len(positional)}"
        )
    bound: dict[str, Any] = {}
    for a, value in zip(positional, args, strict=False):
        bound[a.name] = value
    names = {a.name for a in params}
    for name, value in kwargs.items():
        if name not in names:
            raise TypeError(f"{schema.name}: unknown keyword {name!r}")
        if name in bound:
            raise TypeError(f"{schema.name}: {name!r} given twice")
        bound[name] = value
    for a in params:
        if a.name not in bound:
            if not a.has_default_value():
                raise TypeError(f"{schema.name}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
        if not _type_ok(a, bound[a.name]):
            raise TypeError(
                f"{schema.name}: argument {a.name!r} of type {a.type} got {type(bound[a.name])}"
            )
    return bound


class RecordingOps:
    """Stands in for ``torch.ops.aten``: binds each call to the real op's schema, records it, and
    runs ``impl[name]`` (or the real op, e.g. on meta tensors)."""

    def __init__(self, impl: dict | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.impl = impl or {}

    def __getattr__(self, name: str) -> Any:
        real = getattr(torch.ops.aten, name)
        outer = self

        class _Overload:
            def __init__(self, overload: Any) -> None:
                self.overload = overload

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                bound = bind(self.overload._schema, args, kwargs)
                outer.calls.append((name, bound))
                fn = outer.impl.get(name)
                return fn(**bound) if fn is not None else self.overload(*args, **kwargs)

        class _Packet(_Overload):
            @property
            def default(self) -> _Overload:
                return _Overload(real.default)

        return _Packet(real.default)
