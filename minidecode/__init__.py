"""minidecode: long-context text generation for Llama-family models, with a stream-K decode kernel."""

from pathlib import Path as _Path

# kernels/ and models/ sit beside this folder in the repo and install as minidecode.kernels and
# minidecode.models. In a source checkout that was not installed with the mapping (PYTHONPATH=.,
# an old setuptools' develop mode) look for them beside this folder too.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "kernels").is_dir() and (_checkout / "kernels" / "decode.py").is_file():
    __path__.append(str(_checkout))

from .errors import UserError  # noqa: E402 (after the path set-up)

# The public names load on first use (PEP 562): `import minidecode` and the CLI's --help stay
# free of torch, which takes a second or more to import.
_LAZY = {
    "ModelConfig": "config",
    "GenerationStats": "engine",
    "MemoryPlan": "engine",
    "LLM": "llm",
    "GenerationResult": "llm",
    "Stream": "llm",
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


__all__ = [
    "LLM",
    "GenerationResult",
    "GenerationStats",
    "MemoryPlan",
    "ModelConfig",
    "SamplingParams",
    "Stream",
    "UserError",
    "generate",
]
__version__ = "0.1.0"
