"""minidecode: long-context text generation for Llama-family models, with a stream-K decode kernel."""

from .config import ModelConfig
from .engine import GenerationStats, MemoryPlan, Request
from .errors import UserError
from .llm import LLM, GenerationResult, Stream, generate
from .sampling import SamplingParams

__all__ = ["LLM", "GenerationResult", "GenerationStats", "MemoryPlan", "ModelConfig", "Request"]
__all__ += ["SamplingParams", "Stream", "UserError", "generate"]
__version__ = "0.1.0"
