"""Our Transformer Engine call (the ``te-p2p`` benchmark baseline) against TE's own Python sources,
per release: TE's pure-Python wheel is downloaded with pip (cached outside the repository) and
``attn_forward_func_with_cp``'s signature is read from it with ``ast`` (importing TE needs CUDA).

Not covered: the TE layers of the Transformer Engine GPT spec are called by megatron-core, not by
us; TE's own CUDA kernels are not run.
"""

from __future__ import annotations

import ast
import functools
import types
import zipfile

import pytest
import torch

from megatron_charm.bench.methods import TE_CP_MODULES, te_cp_kwargs
from tests.contract import pypi

#: The oldest 2.x on PyPI, the release that moved the function, a middle and the newest checked.
TE_VERSIONS = ("2.1.0", "2.4.0", "2.8.0", "2.20.2")


@functools.cache
def te_signature(version: str) -> tuple[str, list[str], set[str]]:
    """``(module, required params, all params)`` of ``attn_forward_func_with_cp`` in TE
    ``version``."""
    dest = pypi.cache_dir() / "transformer-engine"
    wheel = dest / f"transformer_engine-{version}-py3-none-any.whl"
    if not wheel.is_file():
        pypi.pip_download(f"transformer-engine=={version}", dest, "--only-binary", ":all:")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not (name.startswith("transformer_engine/pytorch/") and name.endswith(".py")):
                continue
            src = z.read(name).decode()
            if "def attn_forward_func_with_cp" not in src:
                continue
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.FunctionDef) and node.name == "attn_forward_func_with_cp":
                    a = node.args
                    names = [x.arg for x in a.args]
                    required = names[: len(names) - len(a.defaults)]
                    module = name[: -len(".py")].removesuffix("/__init__").replace("/", ".")
                    return module, required, set(names) | {x.arg for x in a.kwonlyargs}
    raise AssertionError(f"TE {version}: attn_forward_func_with_cp not found")


@pytest.fixture(params=TE_VERSIONS)
def te_version(request):
    try:
        return te_signature(request.param)
    except pypi.SourceUnavailable as exc:
        pytest.skip(f"Transformer Engine {request.param} unavailable (no PyPI access?): {exc}")


def _kwargs(causal=True):
    topo = types.SimpleNamespace(cp_size=2, cp_group=object(), global_ranks=[0, 1])
    q = torch.zeros(2, 8, 4, 16)
    k = torch.zeros(2, 8, 2, 16)
    return te_cp_kwargs(q, k, k, topo, object(), causal, 0.25)


def test_te_call_matches_attn_forward_func_with_cp(te_version):
    module, required, params = te_version
    kwargs = _kwargs()
    assert module in TE_CP_MODULES, f"{module} is not where we look for the function"
    assert set(required) <= set(kwargs), f"not passed: {sorted(set(required) - set(kwargs))}"
    assert set(kwargs) <= params, f"not accepted: {sorted(set(kwargs) - params)}"


def test_te_call_values():
    kw = _kwargs()
    # bshd: one sequence per batch row, of the full (CP-gathered) length
    assert kw["cu_seqlens_q"].tolist() == [0, 16, 32] and kw["max_seqlen_q"] == 16
    assert kw["cu_seqlens_q"].dtype == torch.int32
    assert kw["attn_mask_type"] == "causal" and _kwargs(False)["attn_mask_type"] == "no_mask"
    assert kw["cp_comm_type"] == "p2p" and kw["qkv_format"] == "bshd"
