"""tandem: speculative decoding that stays exact under structured output and reasoning."""

from typing import Any

from tandem.decoding import AcceptanceResult, RelaxedAcceptance, SamplingTensors, accept, sample
from tandem.decoding.params import SamplingParams

__all__ = ["LLM", "AcceptanceResult", "RelaxedAcceptance", "SamplingParams", "SamplingTensors", "accept", "sample"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in transformers and the model code: import it on first use, not with the package.
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
