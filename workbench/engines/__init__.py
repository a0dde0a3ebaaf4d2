"""Rollout engines behind one protocol (engines/base.py): `engine=torch` (CPU) or `engine=vllm`.
A new engine is one module here implementing that protocol, and its case in `make_engine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from workbench.engines.torch_engine import TorchEngine


def make_engine(cfg: DictConfig, model_path: str, seed: int) -> TorchEngine:
    """The rollout engine `cfg.engine.name` names, loaded from `model_path`."""
    # The engines load here, not at the top: importing engines.base (light) runs this file first.
    if cfg.engine.name == "vllm":
        from workbench.engines.vllm_engine import VllmEngine

        engine = cfg.engine
        return VllmEngine(
            model_path,
            cfg.model.dtype,
            seed=seed,
            partial=cfg.rollout.partial,
            tensor_parallel_size=engine.tensor_parallel_size,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            check_weight_sync=engine.check_weight_sync,
            routed_experts=engine.routed_experts,
            lora=cfg.model.lora,
        )
    from workbench.engines.torch_engine import TorchEngine

    return TorchEngine(
        model_path, cfg.model.dtype, seed=seed, partial=cfg.rollout.partial, lora=cfg.model.lora
    )
