"""minidecode: long-context text generation for Llama-family models, with a stream-K decode kernel."""

from .errors import UserError
from .request import Request

# The public names load on first use (PEP 562): `import minidecode` and the CLI's --help stay
# free of torch, which takes a second or more to import.
_LAZY = {
    "ModelConfig": "models.config",
    "MemoryPlan": "memory",
    "GenerationStats": "sequence",
    "GenerationResult": "sequence",
    "LLM": "llm",
    "Stream": "llm",
    "BatchStream": "llm",
    "generate": "llm",
    "SamplingParams": "sampling",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'minidecode' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["GenerationResult", "GenerationStats", "LLM", "MemoryPlan", "ModelConfig", "Request"]
__all__ += ["BatchStream", "SamplingParams", "Stream", "UserError", "generate"]
__version__ = "0.1.0"
