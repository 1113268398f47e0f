"""flash-attn's real Python interface, per supported minor version, from its PyPI source
distribution, over a fake compiled extension.

``interface_module(version)`` downloads ``flash-attn==version`` as an sdist with pip (no deps, no
build; ``FLASH_ATTENTION_SKIP_CUDA_BUILD`` lets its metadata step run without CUDA), extracts only
``flash_attn/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp`` into a cache outside
the repository, and imports the interface with ``flash_attn_2_cuda`` bound to
:class:`FakeExtension`. The fake parses ``mha_fwd``/``mha_bwd`` from that version's
``flash_api.cpp``, checks every call's arity and argument types against them and the tensors
against the kernel's ``TORCH_CHECK`` rules, and computes the result with float64 math.

Two mechanical changes to the interface module: its ``torch.library`` op namespace is renamed per
version (so three versions load in one process), and the CUDA-only custom ops get a CPU kernel
(the same Python function).
"""

from __future__ import annotations

import functools
import re
import sys
import tarfile
import types
from pathlib import Path

import torch

from megatron_charm.kernels.math_kernel import math_backward, math_forward
from tests.contract import pypi
from tests.contract.pypi import SourceUnavailable

#: The newest release of each supported minor version.
VERSIONS = ("2.6.3", "2.7.4.post1", "2.8.3")
FILES = ("flash_attn/flash_attn_interface.py", "csrc/flash_attn/flash_api.cpp")


def cache_dir() -> Path:
    return pypi.cache_dir() / "flash-attn-sources"


def fetch_sources(version: str) -> Path:
    """Directory holding the two extracted files of ``flash-attn==version`` (cached)."""
    dest = cache_dir() / version
    if all((dest / f).is_file() for f in FILES):
        return dest
    dl = cache_dir() / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    tarball = dl / f"flash_attn-{version}.tar.gz"
    if not tarball.is_file():
        # The sdist's metadata step imports torch and would build CUDA code without this.
        pypi.pip_download(
            f"flash-attn=={version}", dl, "--no-binary", ":all:", "--no-build-isolation",
            env={"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"},
        )  # fmt: skip
        if not tarball.is_file():
            raise SourceUnavailable(f"pip download flash-attn=={version} left no {tarball.name}")
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            rel = member.name.split("/", 1)[-1]
            if rel in FILES:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    missing = [f for f in FILES if not (dest / f).is_file()]
    if missing:
        raise SourceUnavailable(f"flash-attn {version} sdist lacks {missing}")
    return dest


# --- the C++ signatures ------------------------------------------------------------------------


def _cpp_kind(decl: str) -> str:
    decl = re.sub(r"\bconst\b|&", " ", decl)
    if "optional<at::Tensor>" in decl:
        return "Tensor?"
    if "optional<at::Generator>" in decl:
        return "Generator?"
    for cpp, kind in (
        ("at::Tensor", "Tensor"),
        ("float", "float"),
        ("bool", "bool"),
        ("int", "int"),
    ):
        if re.search(rf"(^|\s){re.escape(cpp)}\s", decl + " "):
            return kind
    raise AssertionError(f"unparsed C++ parameter {decl!r}")


def parse_cpp(source: str, fn: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``([(name, kind)], [returned names])`` of ``fn`` in ``flash_api.cpp``."""
    m = re.search(rf"^{fn}\((.*?)\)\s*\{{", source, re.S | re.M)
    assert m, f"{fn} not found"
    params = []
    for raw in re.sub(r"//[^\n]*", "", m.group(1)).split(","):
        decl = raw.strip()
        name = re.findall(r"\w+$", decl)[0]
        params.append((name, _cpp_kind(decl[: -len(name)])))
    body_end = source.index("\n}\n", m.end())
    rets = re.findall(r"return\s*\{([^}]*)\};", source[m.end() : body_end])
    assert rets, f"{fn}: no return list"
    return params, [r.strip() for r in rets[-1].split(",")]


# --- the fake extension ----------------------------------------------------------------------


def _check_type(fn: str, name: str, kind: str, value) -> None:
    ok = {
        "Tensor": isinstance(value, torch.Tensor),
        "Tensor?": value is None or isinstance(value, torch.Tensor),
        "Generator?": value is None or isinstance(value, torch.Generator),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
    }[kind]
    if not ok:
        raise TypeError(f"{fn}: argument {name} ({kind}) got {type(value).__name__}")


def _check_tensors(fn: str, a: dict) -> None:
    q = a["q"]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"{fn}: FlashAttention only support fp16 and bf16 data type")
    b, s_q, h, d = q.shape
    s_k, h_kv = a["k"].shape[1], a["k"].shape[2]
    shapes = {"q": (b, s_q, h, d), "k": (b, s_k, h_kv, d), "v": (b, s_k, h_kv, d)}
    for name in ("out", "dout", "dq"):
        shapes[name] = (b, s_q, h, d)
    for name in ("dk", "dv"):
        shapes[name] = (b, s_k, h_kv, d)
    for name, shape in shapes.items():
        t = a.get(name) if name in a else a.get(name + "_")
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != q.dtype or t.stride(-1) != 1:
            raise RuntimeError(
                f"{fn}: {name} {tuple(t.shape)} {t.dtype}, expected {shape} {q.dtype}"
            )
    if d % 8 or d > 256:
        raise RuntimeError(f"{fn}: head_size {d} must be a multiple of 8 and at most 256")
    if h % h_kv:
        raise RuntimeError(
            f"{fn}: Number of heads in key/value must divide number of heads in query"
        )
    plain = a["p_dropout"] == 0 and a["window_size_left"] == -1 and a["window_size_right"] == -1
    if not plain or a["softcap"] != 0 or a["alibi_slopes_"] is not None:
        raise RuntimeError(f"{fn}: the fake computes plain attention only")


class FakeExtension(types.ModuleType):
    """``flash_attn_2_cuda`` for one version: ``fwd`` and ``bwd`` per its ``flash_api.cpp``."""

    def __init__(self, cpp_source: str) -> None:
        super().__init__("flash_attn_2_cuda")
        self.fwd_sig = parse_cpp(cpp_source, "mha_fwd")
        self.bwd_sig = parse_cpp(cpp_source, "mha_bwd")
        self.calls: list[str] = []

    @staticmethod
    def _bind(fn: str, sig, args) -> dict:
        params, _ = sig
        if len(args) != len(params):
            raise TypeError(f"{fn}: {len(args)} arguments, the C++ signature has {len(params)}")
        for (name, kind), value in zip(params, args, strict=True):
            _check_type(fn, name, kind, value)
        return {name: value for (name, _), value in zip(params, args, strict=True)}

    def fwd(self, *args):
        a = self._bind("fwd", self.fwd_sig, args)
        _check_tensors("fwd", a)
        if a["out_"] is not None or a["return_softmax"]:
            raise RuntimeError("fwd: the fake supports out_=None, return_softmax=False")
        self.calls.append("fwd")
        sb = lambda t: t.transpose(0, 1)  # noqa: E731
        out, lse = math_forward(
            sb(a["q"]), sb(a["k"]), sb(a["v"]), a["is_causal"], a["softmax_scale"]
        )
        values = {
            "out": sb(out).contiguous(), "softmax_lse": lse.permute(1, 2, 0).contiguous(),
            "q_padded": a["q"], "k_padded": a["k"], "v_padded": a["v"],
            "out_padded": sb(out).contiguous(), "p": torch.empty(0),
            "rng_state": torch.zeros(2, dtype=torch.int64),
        }  # fmt: skip
        return [values[n] for n in self.fwd_sig[1]]

    def bwd(self, *args):
        a = self._bind("bwd", self.bwd_sig, args)
        _check_tensors("bwd", a)
        b, s_q, h, _ = a["q"].shape
        lse = a["softmax_lse"]
        if lse.dtype != torch.float32 or tuple(lse.shape) != (b, h, s_q) or not lse.is_contiguous():
            raise RuntimeError(f"bwd: softmax_lse {tuple(lse.shape)} {lse.dtype}")
        self.calls.append("bwd")
        sb = lambda t: t.transpose(0, 1)  # noqa: E731
        grads = math_backward(
            sb(a["dout"]), sb(a["q"]), sb(a["k"]), sb(a["v"]), sb(a["out"]), lse.permute(2, 0, 1),
            a["is_causal"], a["softmax_scale"],
        )  # fmt: skip
        outs = []
        for name, g in zip(("dq_", "dk_", "dv_"), grads, strict=True):
            dst = a[name] if a[name] is not None else torch.empty_like(sb(g))
            dst.copy_(sb(g))
            outs.append(dst)
        values = dict(zip(("dq", "dk", "dv"), outs, strict=True))
        values["softmax_d"] = (
            (sb(a["dout"]).float() * sb(a["out"]).float()).sum(-1).permute(1, 2, 0)
        )
        return [values[n] for n in self.bwd_sig[1]]


@functools.cache
def interface_module(version: str) -> tuple[types.ModuleType, FakeExtension]:
    """flash-attn ``version``'s ``flash_attn_interface`` over a fresh :class:`FakeExtension`."""
    src = fetch_sources(version)
    fake = FakeExtension((src / FILES[1]).read_text())
    code = (src / FILES[0]).read_text()
    ns = "flash_attn_contract_" + re.sub(r"\W", "_", version)
    code = code.replace('"flash_attn::', f'"{ns}::').replace(
        "torch.ops.flash_attn.", f"torch.ops.{ns}."
    )
    mod = types.ModuleType(f"{ns}.flash_attn_interface")
    mod.__file__ = str(src / FILES[0])
    saved = sys.modules.get("flash_attn_2_cuda")
    sys.modules["flash_attn_2_cuda"] = fake
    try:
        exec(compile(code, mod.__file__, "exec"), mod.__dict__)  # noqa: S102
    finally:
        if saved is None:
            sys.modules.pop("flash_attn_2_cuda", None)
        else:
            sys.modules["flash_attn_2_cuda"] = saved
    for name in ("_flash_attn_forward", "_flash_attn_backward"):
        op = getattr(mod, name)
        if hasattr(op, "register_kernel"):  # torch.library.custom_op, CUDA-only as shipped
            op.register_kernel("cpu", op._init_fn)
    return mod, fake
