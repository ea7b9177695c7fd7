"""hetero: speculative decoding with CPU draft models and a lookahead cache, vLLM's API."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hetero.llm",
    "SamplingParams": "hetero.core.sampling_params",
    "StructuredOutputsParams": "hetero.core.sampling_params",
    "RequestOutput": "hetero.outputs",
    "CompletionOutput": "hetero.outputs",
    "EngineConfig": "hetero.core.config",
    "LLMEngine": "hetero.engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import lazily so that `import hetero.core.protocols` does not load torch and the model code."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
