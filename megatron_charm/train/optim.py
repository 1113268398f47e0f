"""Optimizer backends behind one interface, so the training loop is the same on CPU and GPU.

* GPU: megatron-core's ``DistributedDataParallel`` (gradient buckets, fp32 gradient reduction) and
  ``get_megatron_optimizer`` (AdamW with fp32 main weights for bf16, gradient clipping).
* CPU: megatron-core's DDP and optimizer hard-code CUDA, so plain torch does the same job:
  ``torch.optim.AdamW``, one flattened all-reduce of the gradients, ``clip_grad_norm_``.

In both, gradients are summed (not averaged) over the data x context parallel ranks: the loss is
already divided by the global token count, so the sum is the gradient of the global mean loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_charm.train.config import Config


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Biases and norm weights are 1-D; decaying them hurts and Megatron does not decay them either.
    return param.dim() < 2 or name.endswith(".bias")


class TorchOptimizer:
    """AdamW + explicit gradient all-reduce over the data x context parallel group (CPU path)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, dp_cp_group: Any) -> None:
        self.model = model
        self.group = dp_cp_group
        t = cfg.train
        self.clip_grad = t.clip_grad
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = [
            {
                "params": [p for n, p in named if not _no_decay(n, p)],
                "weight_decay": t.weight_decay,
            },
            {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            # The loop is single-threaded per rank; foreach keeps the step cheap on CPU too.
            foreach=True,
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finish_grad_sync(self) -> None:
        grads = []
        for p in self.params:
            if p.grad is None:
                # A parameter that took no part must still join the collective with zeros.
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if dist.get_world_size(self.group) > 1:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(reduced)

    def step(self, lr: float) -> float:
        """Clip, step, and return the gradient norm before clipping."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class MegatronOptimizer:
    """megatron-core DDP + optimizer (GPU path)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, dtype: torch.dtype) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        t = cfg.train
        config = model.config
        # The loss is normalised by the global token count, so DDP must sum, not average.
        config.calculate_per_token_loss = True
        if dtype == torch.bfloat16:
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finish_grad_sync(self) -> None:
        self.model.finish_grad_sync()

    def step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def build_optimizer(
    model: torch.nn.Module, cfg: Config, on_gpu: bool, dtype: torch.dtype, dp_cp_group: Any
) -> TorchOptimizer | MegatronOptimizer:
    """Megatron's DDP/optimizer where it works (GPU), plain torch where it hard-codes CUDA."""
    if on_gpu:
        return MegatronOptimizer(model, cfg, dtype)
    return TorchOptimizer(model, cfg, dp_cp_group)
