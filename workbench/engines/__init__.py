"""Rollout engines behind one protocol (engines/base.py): `engine=torch` (CPU) or `engine=vllm`."""


def make_engine(cfg, model_path: str, seed: int):
    """The rollout engine `cfg.engine.name` names, loaded from `model_path`."""
    if cfg.engine.name == "vllm":
        from workbench.engines.vllm_engine import VllmEngine

        e = cfg.engine
        return VllmEngine(
            model_path,
            cfg.model.dtype,
            seed=seed,
            partial=cfg.rollout.partial,
            tensor_parallel_size=e.tensor_parallel_size,
            gpu_memory_utilization=e.gpu_memory_utilization,
            check_weight_sync=e.check_weight_sync,
            routed_experts=e.routed_experts,
        )
    from workbench.engines.torch_engine import TorchEngine

    return TorchEngine(model_path, cfg.model.dtype, seed=seed, partial=cfg.rollout.partial)
