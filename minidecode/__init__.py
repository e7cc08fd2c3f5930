"""minidecode: long-context text generation for Llama-family models, with a stream-K decode kernel."""

from pathlib import Path as _Path

# kernels/ and models/ sit beside this folder in the repo and install as minidecode.kernels and
# minidecode.models. In a source checkout that was not installed with the mapping (PYTHONPATH=.,
# an old setuptools' develop mode) look for them beside this folder too.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "kernels").is_dir() and (_checkout / "kernels" / "decode.py").is_file():
    __path__.append(str(_checkout))

from .config import ModelConfig  # noqa: E402 (after the path set-up)
from .engine import GenerationStats, MemoryPlan  # noqa: E402
from .errors import UserError  # noqa: E402
from .llm import LLM, GenerationResult, Stream, generate  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

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
