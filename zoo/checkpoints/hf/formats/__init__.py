"""The built-in checkpoint formats, one per HF ``model_type``; loaded as a plugin like any other."""

import importlib

from zoo.core.hooks import hookimpl

MODULES = ("llama", "moe", "gpt2", "gpt_neox", "gptj", "falcon", "deepseek", "deepseek_v32", "glm_moe_dsa", "deepseek_moe",
           "minimax", "minimax_m2", "mamba2", "qwen3_next", "nemotron_h", "dbrx", "cohere", "glm4_moe")


@hookimpl
def zoo_register(registry):
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for fmt in module.FORMATS:
            registry.add("checkpoint_format", fmt.model_type, fmt)
