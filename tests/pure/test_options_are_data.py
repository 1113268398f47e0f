"""Options are data: the library takes its settings as arguments and reads no environment variable.

Environment variables are read only at entry points (the launchers, the command lines, the trainer,
the bench worker, the Megatron integration), through :mod:`megatron_charm.env`, and reach the
library as arguments. These tests set the variables to values that would change the result if the
library read them, and check that it does not; and they scan the package's source for modules that
touch ``os.environ`` outside an allow-list of entry points.
"""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_charm import env
from megatron_charm.kernels import select_kernel

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_charm"
CPU = torch.device("cpu")

#: Modules of ``megatron_charm`` that may touch ``os.environ`` / ``os.getenv``, and why. Each is an
#: entry point or a launcher; none reads a megatron-charm option except ``env.py``.
ENVIRON_ALLOWED = {
    # The accessors of every MEGATRON_CHARM_* variable: the one place they are read.
    "env.py": "accessors of megatron-charm's own variables",
    # `megatron-charm` command line: copies the environment for a git subprocess.
    "cli.py": "CLI entry point; passes the environment on to `git`",
    # Binds a rank to its GPU from the launch protocol's LOCAL_RANK (and names
    # CUDA_VISIBLE_DEVICES in its errors); called only by the trainer and bench entry points.
    "device.py": "launch protocol (LOCAL_RANK, CUDA_VISIBLE_DEVICES), called by entry points",
    # The launcher: builds each rank's environment from this process's and reads PYTHONPATH.
    "launch/call.py": "launcher: reads the rendezvous variables it set for its ranks",
    "launch/spec.py": "launcher: each rank's environment over this process's",
    # `megatron-charm-train`'s entry point and its process setup: RANK, WORLD_SIZE,
    # OMP_NUM_THREADS, Slurm's variables; fills the rendezvous variables for a lone rank.
    "train/cli.py": "trainer entry point (RANK, WORLD_SIZE, OMP_NUM_THREADS, Slurm)",
    "train/launch.py": "trainer process setup: fills RANK/WORLD_SIZE/MASTER_* for a lone rank",
    "train/setup.py": "trainer setup: the launcher's WORLD_SIZE, to check the config early",
    # The bench tables' runner and the GPU check's rank pool start ranks with their environment.
    "bench/tables/runner.py": "bench entry point: starts ranks (OMP_NUM_THREADS, NNODES)",
    "bench/gpu_check/procs.py": "GPU check launcher: installs a rank's environment",
    # The testbed's launcher: MASTER_PORT of an outer launch, if any.
    "testbed/launch.py": "testbed launcher: MASTER_PORT",
}


def _environ_uses(path: Path) -> list[str]:
    """Lines of ``path`` that touch ``os.environ`` / ``os.getenv`` (under any alias)."""
    tree = ast.parse(path.read_text(), str(path))
    os_names = {"os"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "os":
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "getenv", "environb", "getenvb"):
                    found.append(f"{node.lineno}: from os import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "environb", "getenvb")
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def _own_variable_reads(path: Path) -> list[str]:
    """Loads of a ``MEGATRON_CHARM_*`` name through any mapping: ``m.get("MEGATRON_CHARM_X")``,
    ``m["MEGATRON_CHARM_X"]`` (writes, which give child processes their variables, are fine)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def own(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("MEGATRON_CHARM_")
        )

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
            and own(node.args[0])
        ):
            found.append(f"{node.lineno}: .{node.func.attr}({node.args[0].value!r})")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and own(node.slice):
            found.append(f"{node.lineno}: [{node.slice.value!r}]")
        elif isinstance(node, ast.Compare) and any(own(c) for c in [node.left, *node.comparators]):
            found.append(f"{node.lineno}: 'MEGATRON_CHARM_...' in ...")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_entry_points_touch_os_environ():
    offenders = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        uses = _environ_uses(path)
        if uses and rel not in ENVIRON_ALLOWED:
            offenders[rel] = uses
    assert not offenders, (
        f"modules outside the entry points read the environment: {offenders}. Take the value as "
        "an argument, and read the variable at the entry point through megatron_charm.env"
    )


def test_the_allow_list_has_no_stale_entries():
    # An entry whose module no longer touches os.environ would let a later one in unseen.
    stale = [
        rel
        for rel in ENVIRON_ALLOWED
        if not (PACKAGE / rel).exists() or not _environ_uses(PACKAGE / rel)
    ]
    assert not stale, f"allow-listed modules that no longer read the environment: {stale}"


def test_megatron_charm_variables_are_read_in_env_py_only():
    offenders = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        reads = _own_variable_reads(path)
        if reads and rel != "env.py":
            offenders[rel] = reads
    assert not offenders, (
        f"MEGATRON_CHARM_* variables read outside megatron_charm/env.py: {offenders}"
    )


def test_the_scan_finds_what_it_looks_for(tmp_path):
    # The scans above must be able to fail.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os as o\nfrom os import getenv\n"
        "x = o.environ.get('A')\ny = getenv('B')\nz = {}.get('MEGATRON_CHARM_KERNEL')\n"
        "w = d['MEGATRON_CHARM_NODE_ID']\nv = 'MEGATRON_CHARM_DEVICE' in d\n"
    )
    assert len(_environ_uses(bad)) == 2
    assert len(_own_variable_reads(bad)) == 3
    good = tmp_path / "good.py"
    good.write_text(
        "'''os.environ['RANK'] in a docstring'''\nenv = {'MEGATRON_CHARM_NODE_ID': 'a'}\n"
    )
    assert _environ_uses(good) == [] and _own_variable_reads(good) == []


# ------------------------------------------------------------------ kernels


def test_select_kernel_ignores_megatron_charm_kernel(monkeypatch):
    monkeypatch.setenv(env.KERNEL, "math")
    # float32 on CPU defaults to torch: the variable would have made it math
    assert select_kernel(CPU, torch.float32).name == "torch"
    assert select_kernel(CPU, torch.float32, "math").name == "math"
    monkeypatch.setenv(env.KERNEL, "xformers")  # not a kernel: reading it would raise
    assert select_kernel(CPU, torch.float32).name == "torch"
    assert select_kernel(CPU, torch.float64).name == "math"
    assert select_kernel(CPU, torch.float32, "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown block kernel 'xformers'"):
        select_kernel(CPU, torch.float32, "xformers")


def test_megatron_module_reads_the_variable_once_as_its_default(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_charm.megatron.attention import resolve_kernel

    monkeypatch.delenv(env.KERNEL, raising=False)
    assert resolve_kernel(None) is None
    monkeypatch.setenv(env.KERNEL, "math")
    assert resolve_kernel(None) == "math"  # the entry-point default, kept for compatibility
    assert resolve_kernel("torch") == "torch"  # an explicit kernel wins
    monkeypatch.setenv(env.KERNEL, "xformers")
    assert resolve_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="MEGATRON_CHARM_KERNEL='xformers'"):
        resolve_kernel(None)
    with pytest.raises(ValueError, match="kernel='flash'"):
        resolve_kernel("flash")


def _core_attention(spec):
    return spec.submodules.self_attention.submodules.core_attention


def test_spec_helpers_carry_the_kernel():
    pytest.importorskip("megatron.core")
    from megatron_charm.megatron import get_gpt_layer_charm_spec
    from megatron_charm.megatron.spec import charm_core_attention_spec

    assert charm_core_attention_spec(kernel="math").params["kernel"] == "math"
    assert "kernel" not in charm_core_attention_spec().params
    assert _core_attention(get_gpt_layer_charm_spec(kernel="torch")).params["kernel"] == "torch"
    with pytest.raises(ValueError, match="kernel='xformers' is not a block kernel"):
        charm_core_attention_spec(kernel="xformers")


def test_trainer_config_has_a_kernel_option(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_charm.train.config import load_config
    from megatron_charm.train.model import build_layer_spec

    monkeypatch.setenv(env.KERNEL, "torch")  # the config's value wins over the variable
    cfg = load_config(None, ["parallel.kernel=math"])
    assert cfg.parallel.kernel == "math"
    assert load_config(None, []).parallel.kernel is None
    assert _core_attention(build_layer_spec(cfg)).params["kernel"] == "math"
    assert "kernel" not in _core_attention(build_layer_spec(load_config(None, []))).params
    with pytest.raises(ValueError, match="parallel.kernel='xformers' is not a block kernel"):
        load_config(None, ["parallel.kernel=xformers"])
    with pytest.raises(ValueError, match="parallel.kernel='math'.*Transformer Engine"):
        load_config(None, ["parallel.kernel=math", "parallel.cp_comm_type=p2p"])


# ------------------------------------------------------------------ one-rank process group


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo job in this process (CPTopology.build, cp_attention need one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        try:
            from megatron_charm.megatron.groups import clear_topology_cache

            clear_topology_cache()
        except ImportError:
            pass
        dist.destroy_process_group()


@pytest.fixture
def gathered_node_ids(monkeypatch):
    """The node identity each ``CPTopology.build`` gathers (its first all_gather_object)."""
    from megatron_charm.comm import topology

    seen: list[str] = []
    real = topology.dist.all_gather_object

    def spy(out, obj, group=None):
        if isinstance(obj, str):
            seen.append(obj)
        return real(out, obj, group=group)

    monkeypatch.setattr(topology.dist, "all_gather_object", spy)
    return seen


def test_topology_ignores_megatron_charm_node_id(one_rank, monkeypatch, gathered_node_ids):
    from megatron_charm.comm.topology import CPTopology

    monkeypatch.setenv(env.NODE_ID, "from-the-environment")
    CPTopology.build(None)
    CPTopology.build(None, node_id="from-the-argument")
    assert gathered_node_ids == [socket.gethostname(), "from-the-argument"]


def test_entry_points_pass_the_node_id_from_the_environment(
    one_rank, monkeypatch, gathered_node_ids
):
    from megatron_charm.bench.worker import start_rank

    monkeypatch.setenv(env.NODE_ID, "bench-node")
    threads = torch.get_num_threads()
    try:
        start_rank({"device": "cpu", "ranks_per_node": None})
    finally:
        torch.set_num_threads(threads)
    assert gathered_node_ids == ["bench-node"]

    pytest.importorskip("megatron.core")
    from megatron_charm.megatron.groups import clear_topology_cache, get_charm_topology

    clear_topology_cache()
    monkeypatch.setenv(env.NODE_ID, "megatron-node")
    monkeypatch.delenv(env.RANKS_PER_NODE, raising=False)
    get_charm_topology(SimpleNamespace(cp=one_rank))
    clear_topology_cache()
    assert gathered_node_ids == ["bench-node", "megatron-node"]


def _qkv(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 8, 2, 16, generator=gen, dtype=dtype) for _ in range(3)]


def test_cp_attention_with_an_explicit_kernel_ignores_the_variable(one_rank, monkeypatch):
    import megatron_charm as mc
    from megatron_charm import function

    topo = mc.CPTopology.build(None, node_id="n0")
    chosen: list[str] = []
    real = function.select_kernel

    def spy(device, dtype, name=None):
        kern = real(device, dtype, name)
        chosen.append(kern.name)
        return kern

    monkeypatch.setattr(function, "select_kernel", spy)
    q, k, v = _qkv()
    monkeypatch.delenv(env.KERNEL, raising=False)
    want = mc.cp_attention(q, k, v, topo, kernel="math")
    monkeypatch.setenv(env.KERNEL, "torch")
    got = mc.cp_attention(q, k, v, topo, kernel="math")
    monkeypatch.setenv(env.KERNEL, "xformers")  # would raise if it were read
    again = mc.cp_attention(q, k, v, topo, kernel="math")
    default = mc.cp_attention(q, k, v, topo)  # by device and dtype: torch for fp32 on CPU
    assert chosen == ["math", "math", "math", "torch"]
    assert torch.equal(want, got) and torch.equal(want, again)
    torch.testing.assert_close(default, want, atol=1e-5, rtol=1e-5)


def test_megatron_module_passes_its_kernel_to_cp_attention(one_rank, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_charm import function
    from megatron_charm.megatron import CharmDotProductAttention
    from megatron_charm.megatron.groups import clear_topology_cache

    chosen: list[str | None] = []
    real = function.select_kernel

    def spy(device, dtype, name=None):
        chosen.append(name)
        return real(device, dtype, name)

    monkeypatch.setattr(function, "select_kernel", spy)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, attention_dropout=0.0
    )

    def build(**kwargs):
        return CharmDotProductAttention(
            config=config,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            pg_collection=SimpleNamespace(cp=one_rank),
            **kwargs,
        )

    q, k, v = (t.transpose(0, 1).contiguous() for t in _qkv())  # [s, b, h, d]
    monkeypatch.delenv(env.KERNEL, raising=False)
    clear_topology_cache()
    try:
        build(kernel="math")(q, k, v, None)
        monkeypatch.setenv(env.KERNEL, "math")
        module = build()  # the variable is the default, read once here
        monkeypatch.setenv(env.KERNEL, "xformers")  # later changes do not reach it
        module(q, k, v, None)
        build(kernel="torch")(q, k, v, None)
        monkeypatch.delenv(env.KERNEL)
        build()(q, k, v, None)
    finally:
        clear_topology_cache()
    assert chosen == ["math", "math", "torch", None]
    assert "kernel=math" in module.extra_repr()
