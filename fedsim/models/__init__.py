"""Model zoo: small reference models, registered under :data:`fedsim.registry.MODELS`.

A model builder has the signature ``builder(params, input_shape, num_classes) -> nn.Module``.
"""

from fedsim.models.vision import CNNParams, MLPParams, SmallCNN, build_model  # noqa: F401
