"""Architecture name (``config.json: architectures[0]``) -> model class."""

from __future__ import annotations

from pyengine.models.config import DecoderConfig
from pyengine.models.decoder import (
    DecoderForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pyengine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pyengine.models.errors import UnsupportedModelError
from pyengine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pyengine.models.moe_families import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pyengine.models.parallel import ParallelContext
from pyengine.models.phi3 import Phi3ForCausalLM

MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def build_model(config: DecoderConfig, parallel: ParallelContext | None = None) -> DecoderForCausalLM:
    """Instantiate (uninitialised weights) the class registered for ``config.architecture``."""
    try:
        model_class = MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architectures: {config.architecture!r} is not supported (supported: {', '.join(MODEL_CLASSES)})"
        ) from None
    return model_class(config, parallel)


def check_tensor_parallel(config: DecoderConfig, world_size: int, expert_parallel: bool = False) -> None:
    """Raises ``InvalidConfigError`` naming the size that ``world_size`` ranks cannot split
    (attention heads, KV heads, intermediate size; the routed experts with
    ``expert_parallel``), by building the model's rank-0 shard on the meta device: no
    memory, no process, the same rules the layers apply."""
    import torch

    with torch.device("meta"):
        build_model(config, ParallelContext(rank=0, world_size=world_size, expert_parallel=expert_parallel))
