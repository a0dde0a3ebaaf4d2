"""LoRA policies (`model.lora.rank > 0`), with peft: the adapters a policy trains, the tensors a
weight push carries, and the merged model an export writes.

The learner and every engine hold the same base weights with a peft adapter on top. Only the
adapter trains (the optimizer holds state for it alone), a push carries only the adapter's tensors
(`perf/weight_sync_bytes`), and the KL reference is the base itself with the adapter disabled: no
second copy of the model. A checkpoint's `policy/` is the adapter as a PEFT folder that names its
base; a resumed run builds the base again and loads the adapter and its optimizer state.
"""


def peft_config(lora):
    """peft's LoraConfig of `model.lora` (a comma-separated `target_modules`, or all-linear)."""
    import peft

    targets = lora.target_modules
    if targets != "all-linear":
        targets = [name.strip() for name in targets.split(",")]
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def with_adapter(model, lora):
    """`model` with a fresh adapter of `model.lora` (seed 0: every process builds the same one),
    or as it is when LoRA is off or the model came with its adapter (a checkpoint's folder)."""
    if not lora.rank or getattr(model, "_hf_peft_config_loaded", False):
        return model
    # peft is the lora extra's: a run without LoRA never imports it (workbench/extras.py)
    import peft
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return peft.get_peft_model(model, peft_config(lora))


def adapter_state(model):
    """The adapter's tensors, as a push carries them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter(model, state_dict):
    """Adopt pushed adapter tensors in place."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state_dict)
    if result.unexpected_keys:
        raise ValueError(f"Pushed adapter tensors the policy has no place for: {result}")


def merged_model(adapter_folder):
    """The base model with the adapter of a checkpoint's PEFT folder merged into its weights."""
    from peft import AutoPeftModelForCausalLM

    return AutoPeftModelForCausalLM.from_pretrained(adapter_folder).merge_and_unload()
