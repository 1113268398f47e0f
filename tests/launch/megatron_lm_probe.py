"""Run command lines through a patched Megatron-LM checkout's ``parse_args`` + ``validate_args``.

Used by ``test_megatron_lm_checkout.py`` in a subprocess whose ``PYTHONPATH`` starts with the
checkout: ``python megatron_lm_probe.py CHECKOUT < cases.json > results.json``. Each case is
``{"env": {...}, "argv": [...], "world_size": N}``; each result is ``{"ok": true, "args": {...}}``
or ``{"ok": false, "error": "..."}``.

What is stubbed, and why: ``megatron/training/__init__.py`` imports the whole training loop (and
its optional dependencies), so the ``megatron.training`` package is created empty with the
checkout's folder as its path, and only ``arguments.py`` and what it imports are loaded. There is
no GPU here, so ``get_device_arch_version`` reports a Hopper GPU (9), as on an H100/H200, which
makes ``validate_args`` apply its ``CUDA_DEVICE_MAX_CONNECTIONS`` rule. For every case that
passes, the patched builder's ``_maybe_apply_charm`` (``gpt_builders`` in core_v0.16.1,
``megatron/training/models/gpt.py`` in core_v0.19.0) is applied to megatron-core's local layer
spec, and the resulting ``core_attention`` is reported.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types

#: The compute capability major reported in place of a GPU: Hopper (H100/H200).
HOPPER = 9
#: Arguments whose values the test compares (plain JSON values only).
REPORTED = (
    "cp_comm_type",
    "context_parallel_size",
    "charm_ranks_per_node",
    "charm_node_split",
    "charm_window",
    "charm_cross_return",
    "charm_cross_level",
    "charm_intra_level",
    "charm_foreign_q",
    "charm_memory_budget",
    "charm_combine_nodes",
    "charm_model_builder",
    "distributed_timeout_minutes",
    "transformer_impl",
    "gradient_accumulation_fusion",
    "vocab_size",
)


def _load_arguments(checkout: str) -> types.ModuleType:
    import megatron

    package = types.ModuleType("megatron.training")
    package.__path__ = [os.path.join(checkout, "megatron", "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume", "print_rank_0"):
        setattr(package, name, lambda *a, **k: None)
    sys.modules["megatron.training"] = package
    megatron.training = package
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: HOPPER
    return arguments


def _run(arguments: types.ModuleType, case: dict) -> dict:
    saved = dict(os.environ)
    os.environ.update({"RANK": "0", "WORLD_SIZE": str(case["world_size"]), **case["env"]})
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
            arguments.validate_args(
                args, {"tokenizer_type": "GPT2BPETokenizer", "charm_model_builder": "gpt"}
            )
        return {
            "ok": True,
            "args": {k: getattr(args, k, None) for k in REPORTED},
            "core_attention": _core_attention(args),
        }
    except (AssertionError, ValueError, ImportError, SystemExit) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _core_attention(args) -> dict:
    """What the patched builder makes of megatron-core's local spec: ``_maybe_apply_charm`` of
    ``gpt_builders`` (core_v0.16.1) or of ``megatron.training.models.gpt`` (core_v0.19.0, which
    reads the global args and the config's ``cp_comm_type``)."""
    import gpt_builders
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if hasattr(gpt_builders, "_maybe_apply_charm"):
        spec = gpt_builders._maybe_apply_charm(get_gpt_layer_local_spec(), args)
    else:
        from megatron.training import global_vars
        from megatron.training.models import gpt

        global_vars.set_args(args)
        values = args.cp_comm_type
        cp_comm_type = values[0] if len(values) == 1 else values
        config = types.SimpleNamespace(transformer=types.SimpleNamespace(cp_comm_type=cp_comm_type))
        spec = gpt._maybe_apply_charm(get_gpt_layer_local_spec(), config)
    core = spec.submodules.self_attention.submodules.core_attention
    module = core.module if hasattr(core, "module") else core
    params = dict(getattr(core, "params", {}) or {})
    if "options" in params:
        params["options"] = params["options"].as_dict()
    return {"module": module.__name__, "params": params}


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    arguments = _load_arguments(sys.argv[1])
    cases = json.load(sys.stdin)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1"})
    sys.argv = ["pretrain_gpt.py"]
    with contextlib.redirect_stdout(io.StringIO()):
        parsed = vars(arguments.parse_args())
    defaults = {k: v for k, v in parsed.items() if isinstance(v, (str, int, float, bool, list))}
    defaults.update({k: v for k, v in parsed.items() if v is None})
    results = [_run(arguments, case) for case in cases]
    json.dump({"defaults": defaults, "results": results}, sys.stdout, default=str)


if __name__ == "__main__":
    main()
