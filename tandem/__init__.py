"""tandem: speculative decoding that stays exact under structured output and reasoning."""

from tandem.decoding import AcceptanceResult, RelaxedAcceptance, SamplingTensors, accept, sample

__all__ = ["AcceptanceResult", "RelaxedAcceptance", "SamplingTensors", "accept", "sample"]
__version__ = "0.1.0"
