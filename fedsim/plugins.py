"""The manifest of built-in components: which module registers each name, per registry kind.

A lookup in :mod:`fedsim.registry` imports only the module listed here for the name it asks for, so
``fedsim run`` never imports the centralised track, and a typo in a config key is reported without
importing any plugin.  A new ``@STRATEGIES.register("name")`` (or any other registry) needs its line
here; ``tests/fedsim/test_plugins.py`` fails until it has one.

This module is pure data: it imports nothing.
"""

from __future__ import annotations

#: Packages whose modules register the built-in components (walked by the manifest test).
PLUGIN_PACKAGES: tuple[str, ...] = ("envs", "fedsim.models", "clients", "algorithms", "privacy", "strategies",
                                    "central", "fedsim.engine")

#: ``kind -> {name -> module}``; ``kind`` is :attr:`fedsim.registry.Registry.kind`.
BUILTINS: dict[str, dict[str, str]] = {
    "strategy": {
        "bulyan": "strategies.flower_builtin",
        "ckarl": "strategies.ckarl",
        "fedadagrad": "strategies.flower_builtin",
        "fedadam": "strategies.flower_builtin",
        "fedavg": "strategies.flower_builtin",
        "fedavg_lora": "strategies.lora",
        "fedavgm": "strategies.flower_builtin",
        "fedex_lora": "strategies.lora",
        "fedmedian": "strategies.flower_builtin",
        "fedmut": "strategies.fedmut",
        "fedphoenix": "strategies.fedphoenix",
        "fedprox": "strategies.fedprox",
        "fedsvd": "strategies.lora",
        "fedtrimmedavg": "strategies.flower_builtin",
        "fedyogi": "strategies.flower_builtin",
        "ffa_lora": "strategies.lora",
        "flora": "strategies.lora",
        "krum": "strategies.flower_builtin",
        "multikrum": "strategies.flower_builtin",
        "qfedavg": "strategies.flower_builtin",
    },
    "learner": {
        "ckarl": "clients.rl_learner",
        "imgda": "clients.graph_learner",
        "ldl": "clients.ldl_learner",
        "lora_meta": "clients.lora_meta",
        "supervised": "clients.supervised",
        "tta": "clients.tta_learner",
    },
    "dataset": {
        "cifar10": "envs.cifar",
        "digits": "envs.datasets",
        "glue": "envs.glue",
        "mnist": "envs.datasets",
        "stdlib_docs": "envs.text",
        "synthetic": "envs.datasets",
    },
    "model": {
        "cnn": "fedsim.models.vision",
        "hf_lora": "fedsim.models.hf_lora",
        "minilm_lora": "fedsim.models.minilm",
        "mlp": "fedsim.models.vision",
        "vgg": "fedsim.models.vision",
    },
    "partitioner": {
        "dirichlet": "envs.partition",
        "distribution": "envs.partition",
        "exponential": "envs.partition",
        "iid": "envs.partition",
        "inner_dirichlet": "envs.partition",
        "linear": "envs.partition",
        "pathological": "envs.partition",
        "shard": "envs.partition",
        "size": "envs.partition",
        "square": "envs.partition",
    },
    "centralised method": {
        "clic": "central.clic.run",
        "combo": "central.combo.run",
        "deft": "central.deft.run",
        "lasq": "central.lasq.run",
        "lrqk": "central.lrqk.run",
        "omnidraft": "central.omnidraft.method",
        "panlut": "central.panlut.run",
        "paretoq": "central.paretoq.run",
        "peft_meta_linear": "central.peft_meta.run",
        "pnn_ident": "central.pnn_ident.run",
        "spam_select": "central.spam_select.run",
        "tensor_compress": "central.tensor_compress.run",
        "watermark": "central.watermark.method",
    },
    "engine": {
        "flower": "fedsim.engine.flower",
        "local": "fedsim.engine.local",
        "ray": "fedsim.engine.ray_pool",
    },
}


def modules(kind: str) -> dict[str, str]:
    """The built-in ``name -> module`` table of registry ``kind`` (empty for a kind without built-ins)."""
    return BUILTINS.get(kind, {})


def all_modules() -> list[str]:
    """Every module that registers a built-in component, each once, in a stable order."""
    return sorted({module for table in BUILTINS.values() for module in table.values()})
