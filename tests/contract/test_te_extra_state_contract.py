"""Our core_attention ``_extra_state`` against Transformer Engine's own ``set_extra_state``.

A user switches ``--cp-comm-type`` between TE's ``p2p`` and ``charm`` from one checkpoint to the
next, so a TE attention layer must load what ``CharmDotProductAttention`` saved. TE's pure-Python
wheel is downloaded with pip (cached outside the repository, as in ``test_te_contract.py``);
``TransformerEngineBaseModule.set_extra_state`` (and, from TE 2.20, the pickle classifier it calls)
is read from it with ``ast`` and run on our value, with a ``self`` that has no FP8 state: the call
must return before it would touch any. Importing TE itself needs CUDA, so only these functions
run.
"""

from __future__ import annotations

import ast
import functools
import io
import pickle
import zipfile

import pytest
import torch

from megatron_charm.megatron.attention import _no_fp8_state
from tests.contract import pypi

#: The oldest 2.x (no empty-tensor shortcut), the first that saves an empty tensor, a middle one,
#: and the newest checked (pickle classifier).
TE_VERSIONS = ("2.1.0", "2.4.0", "2.8.0", "2.20.2")


def _wheel(version: str) -> zipfile.ZipFile:
    dest = pypi.cache_dir() / "transformer-engine"
    wheel = dest / f"transformer_engine-{version}-py3-none-any.whl"
    if not wheel.is_file():
        pypi.pip_download(f"transformer-engine=={version}", dest, "--only-binary", ":all:")
    return zipfile.ZipFile(wheel)


def _function(source: str, cls: str, name: str) -> str:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return ast.unparse(item)
    raise AssertionError(f"{cls}.{name} not found")


@functools.cache
def te_set_extra_state(version: str):
    """TE ``version``'s ``TransformerEngineBaseModule.set_extra_state`` as a plain function."""
    with _wheel(version) as z:
        base = z.read("transformer_engine/pytorch/module/base.py").decode()
        names = set(z.namelist())
        extra_state = "transformer_engine/pytorch/_extra_state.py"
        te_functions: dict = {}
        if extra_state in names:
            src = z.read(extra_state).decode()
            # The classifier only names recipe classes by string; the import is for type hints.
            src = src.replace("from ..common.recipe import Recipe", "Recipe = object")
            exec(compile(src, extra_state, "exec"), te_functions)
    namespace = {"pickle": pickle, "io": io, "torch": torch, **te_functions}
    exec(_function(base, "TransformerEngineBaseModule", "set_extra_state"), namespace)
    return namespace["set_extra_state"]


@pytest.fixture(params=TE_VERSIONS)
def set_extra_state(request):
    try:
        return te_set_extra_state(request.param)
    except pypi.SourceUnavailable as exc:
        pytest.skip(f"Transformer Engine {request.param} unavailable (no PyPI access?): {exc}")


class _NoFp8State:
    """A TE module that was never run in FP8: any access to its FP8 state is a failure."""

    def __getattr__(self, name: str):
        raise AssertionError(f"set_extra_state touched self.{name}: it did not see 'no state'")


def test_te_loads_what_charm_saves_as_no_fp8_state(set_extra_state):
    assert set_extra_state(_NoFp8State(), _no_fp8_state()) is None


def test_te_2_1_cannot_read_an_empty_tensor():
    # Why we save a pickled None rather than TE >= 2.4's empty tensor.
    try:
        old = te_set_extra_state("2.1.0")
    except pypi.SourceUnavailable as exc:
        pytest.skip(f"Transformer Engine 2.1.0 unavailable: {exc}")
    with pytest.raises(EOFError):
        old(_NoFp8State(), torch.empty(0, dtype=torch.uint8))
