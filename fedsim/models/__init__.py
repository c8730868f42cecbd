"""Model zoo: small reference models, registered under :data:`fedsim.registry.MODELS`.

A model builder has the signature ``builder(params, input_shape, num_classes) -> nn.Module``.
Each model module registers its models when imported (:data:`fedsim.plugins.BUILTINS` says which);
importing this package imports only :mod:`fedsim.models.vision` (for :func:`build_model`).  The
MiniLM / Hugging Face LoRA classes are imported from their modules on first use, and the transformer
library only when one of those models is built.
"""

from __future__ import annotations

from fedsim.lazy import lazy_getattr

from fedsim.models.vision import CNNParams, MLPParams, SmallCNN, build_model  # noqa: F401

_LAZY: dict[str, str] = {
    "LoRALinear": "fedsim.models.minilm",
    "MiniLMLoRAClassifier": "fedsim.models.minilm",
    "MiniLMLoRAParams": "fedsim.models.minilm",
    "HFLoRAClassifier": "fedsim.models.hf_lora",
    "HFLoRAParams": "fedsim.models.hf_lora",
}

__all__ = ["CNNParams", "MLPParams", "SmallCNN", "build_model", *_LAZY]


__getattr__ = lazy_getattr("fedsim.models", _LAZY, globals())
