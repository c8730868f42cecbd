"""Model zoo: small reference models, registered under :data:`fedsim.registry.MODELS`.

A model builder has the signature ``builder(params, input_shape, num_classes) -> nn.Module``.
Importing this package registers ``mlp``, ``cnn``, ``minilm_lora`` and ``hf_lora`` (the transformer library is
only imported when one of the last two is built).
"""

from fedsim.models.vision import CNNParams, MLPParams, SmallCNN, build_model  # noqa: F401
from fedsim.models.minilm import LoRALinear, MiniLMLoRAClassifier, MiniLMLoRAParams  # noqa: F401
from fedsim.models.hf_lora import HFLoRAClassifier, HFLoRAParams  # noqa: F401,E402 (registers "hf_lora")
