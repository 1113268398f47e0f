"""``megatron``: megatron-core's ``GPTModel`` with ``CharmDotProductAttention`` on the device.

In one spawned process (a job of one rank, CP = 1):

1. **Model**: a GPT with the CHARM+ core attention, with local layers and, when
   ``transformer_engine`` imports on CUDA, with TE layers; one forward and backward of the
   language-model loss. Every core-attention call is captured: its output is compared with float64
   attention on the same q, k, v, and its q, k, v gradients with the float64 backward of the
   output gradient it received. Tolerance per tensor: twice SDPA's error in the model's dtype plus
   one unit in the last place of the reference's largest magnitude. Loss and every parameter
   gradient must be finite, and some gradient non-zero.
2. **Trainer**: ``iterations`` steps of :func:`megatron_charm.train.train` (the loop of
   ``megatron-charm-train``); on CUDA in bf16 with ``Float16Module``, megatron-core's DDP and
   optimizer. The loss must fall, and after the gradient sync every parameter must hold a finite,
   not all-zero ``main_grad`` (CUDA) or ``grad`` (CPU).
"""

from __future__ import annotations

import tempfile

import torch

from megatron_charm.bench.gpu_check.procs import RanksFailed, init_group, run_ranks
from megatron_charm.device import set_cuda_device

#: A small GPT (GQA) per device: sized to run in seconds.
SIZES = {
    "cuda": ["model.seq_length=256", "model.hidden_size=512", "model.num_attention_heads=8",
             "model.num_query_groups=2", "model.num_layers=2", "train.micro_batch_size=4",
             "train.global_batch_size=4"],
    "cpu": ["model.seq_length=64", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.num_layers=2", "train.micro_batch_size=2",
            "train.global_batch_size=2"],
}  # fmt: skip
#: The loss must fall by this much (nats) from the first iteration to the mean of the last three.
MIN_DROP = 0.3


def _config(device: str, run_dir: str, iterations: int, impl: str):
    from megatron_charm.train import load_config

    return load_config(None, [
        *SIZES[device], "parallel.context_parallel_size=1", "parallel.nproc=1",
        "parallel.ranks_per_node=null", "parallel.timeout_s=120", f"model.transformer_impl={impl}",
        f"train.train_iters={max(iterations, 1)}", "train.lr_warmup_iters=2",
        "logging.log_interval=1000", "logging.progress_interval_s=0", "checkpoint.save=false",
        f"run.dir={run_dir!r}", "run.overwrite=true",
    ])  # fmt: skip


def _capture(model: torch.nn.Module) -> list[dict]:
    """Record q, k, v and the output of every CHARM+ core-attention call (gradients retained)."""
    from megatron_charm.megatron import CharmDotProductAttention

    calls: list[dict] = []

    def pre(module, args):  # noqa: ANN001, ANN202
        for t in args[:3]:
            t.retain_grad()
        calls.append({"module": module, "qkv": args[:3]})

    def post(module, args, out):  # noqa: ANN001, ANN202
        out.retain_grad()
        calls[-1]["out"] = out

    for m in model.modules():
        if isinstance(m, CharmDotProductAttention):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)
    return calls


def _attention_errors(call: dict) -> tuple[dict, dict]:
    """Errors of one captured call against float64, and their tolerances (out, dq, dk, dv)."""
    from megatron_charm.bench.gpu_check.cp4 import TENSORS, max_err, sdpa_with_grads

    q, k, v = call["qkv"]
    out = call["out"]
    dout = out.grad.reshape(q.shape)  # [s, b, h*d] -> [s, b, h, d]
    scale = call["module"].softmax_scale
    bshd = [t.detach().transpose(0, 1) for t in (q, k, v, dout)]
    ref = sdpa_with_grads(*(t.double() for t in bshd), True, scale)
    same = sdpa_with_grads(*bshd, True, scale)
    got = [out.detach().reshape(q.shape).transpose(0, 1)]
    got += [t.grad.transpose(0, 1) for t in (q, k, v)]
    eps = torch.finfo(q.dtype).eps
    errs = {n: max_err(g, r) for n, g, r in zip(TENSORS, got, ref, strict=True)}
    tols = {n: 2 * max_err(s, r) + eps * r.abs().max().item()
            for n, s, r in zip(TENSORS, same, ref, strict=True)}  # fmt: skip
    return errs, tols


def _model_check(cfg, impl: str) -> tuple[dict, list[str]]:
    from megatron_charm.train.data import build_train_dataset, get_microbatch
    from megatron_charm.train.launch import setup_distributed
    from megatron_charm.train.model import build_model
    from megatron_charm.train.tokenizer import ByteTokenizer, padded_vocab_size

    ctx = setup_distributed(cfg)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    tok = ByteTokenizer()
    vocab = padded_vocab_size(tok.vocab_size, cfg.model.make_vocab_size_divisible_by)
    model = build_model(cfg, vocab, ctx.on_gpu, dtype)
    calls = _capture(model)
    data = build_train_dataset(cfg, tok, num_samples=cfg.train.global_batch_size)
    batch = {k: v.to(ctx.device) for k, v in get_microbatch(data, 0, 0, cfg, 0, 1).items()}
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    bad = []
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    if not torch.isfinite(loss):
        bad.append(f"{impl}: loss {loss.item()}")
    if any(g is None or not torch.isfinite(g).all() for g in grads):
        bad.append(f"{impl}: a parameter gradient is missing or not finite")
    elif max(g.abs().max().item() for g in grads) == 0:
        bad.append(f"{impl}: every parameter gradient is zero")
    layers = []
    for i, call in enumerate(calls):
        errs, tols = _attention_errors(call)
        failed = [n for n in errs if not errs[n] <= tols[n]]
        layers.append({"errors": errs, "tolerances": tols, "failed": failed})
        if failed:
            bad.append(f"{impl} layer {i}: attention {', '.join(failed)} over tolerance")
    if not calls:
        bad.append(f"{impl}: no CHARM+ core attention ran")
    return {"loss": loss.item(), "attention_calls": layers}, bad


def _trainer_check(cfg, on_gpu: bool) -> tuple[dict, list[str]]:
    from megatron_charm.train import train

    seen: dict = {}

    def hook(iteration: int, model: torch.nn.Module) -> None:
        if iteration != 0:
            return
        attr = "main_grad" if on_gpu else "grad"
        params = [p for p in model.parameters() if p.requires_grad]
        held = [getattr(p, attr, None) for p in params]
        seen["attr"] = attr
        seen["params"] = len(params)
        seen["missing"] = sum(g is None for g in held)
        present = [g for g in held if g is not None]
        seen["finite"] = all(bool(torch.isfinite(g).all()) for g in present)
        norms = [g.float().norm() for g in present]
        seen["norm"] = float(torch.stack(norms).norm()) if norms else 0.0

    result = train(cfg, grad_hook=hook)
    losses = [r["loss"] for r in result.records]
    bad = []
    if seen.get("missing") or not seen.get("finite") or not seen.get("norm"):
        bad.append(f"gradients after the sync ({seen}): every parameter needs a finite "
                   f"{seen.get('attr')}, not all zero")  # fmt: skip
    drop = losses[0] - sum(losses[-3:]) / len(losses[-3:])
    if not drop >= MIN_DROP:
        bad.append(f"trainer loss fell by {drop:.3f} < {MIN_DROP} over {len(losses)} iterations")
    grad_norms = [r["grad_norm"] for r in result.records]
    return {"losses": losses, "grad_norms": grad_norms, "gradients": seen}, bad


def megatron_worker(global_rank: int, world: int, port: int, cfg: dict) -> dict:
    """The model checks, then the trainer; one rank."""
    import torch.distributed as dist

    on_gpu = cfg["device"] == "cuda"
    if on_gpu:
        set_cuda_device(0)
    init_group(global_rank, world, port, "nccl" if on_gpu else "gloo", 120)
    out: dict = {"model": {}, "failures": []}

    def part(name: str, fn, *args) -> dict:  # noqa: ANN001
        # a crash of one part is its failure; the other parts still run and report
        try:
            res, bad = fn(*args)
        except Exception as exc:  # noqa: BLE001
            res, bad = {"error": f"{type(exc).__name__}: {exc}"}, [f"{name} crashed: {exc}"]
        out["failures"] += bad
        return res

    try:
        for impl in cfg["impls"]:
            c = _config(cfg["device"], cfg["run_dir"], cfg["iterations"], impl)
            out["model"][impl] = part(impl, _model_check, c, impl)
        if cfg["iterations"] > 0:
            c = _config(cfg["device"], cfg["run_dir"], cfg["iterations"], "local")
            out["trainer"] = part("trainer", _trainer_check, c, on_gpu)
        else:
            out["trainer"] = {"skipped": "--train-iters 0"}
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return out


def megatron_check(
    device: torch.device, iterations: int, plant: str | None
) -> tuple[dict, list[str]]:
    """Run :func:`megatron_worker` in a spawned process; ``(result, failures)``."""
    from megatron_charm.train.model import transformer_engine_available

    impls = ["local"]
    if device.type == "cuda" and transformer_engine_available():
        impls.append("transformer_engine")
    env = {} if device.type == "cuda" else {"MEGATRON_CHARM_DEVICE": "cpu"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as run_dir:
        cfg = {"device": device.type, "impls": impls, "iterations": iterations,
               "run_dir": run_dir}  # fmt: skip
        try:
            (res,) = run_ranks(megatron_worker, 1, cfg, timeout_s=300, env=env, plant=plant)
        except RanksFailed as exc:
            return {"impls": impls, "error": str(exc)[-3000:]}, [f"did not run: {exc}"[:500]]
    failures = res.pop("failures")
    if "transformer_engine" not in impls:
        res["transformer_engine"] = "skipped: needs CUDA and transformer_engine"
    return {"impls": impls} | res, failures
