"""The acceptance pipeline: target distributions, sampling and speculative acceptance."""

from tandem.decoding.acceptance import AcceptanceResult, accept
from tandem.decoding.params import RelaxedAcceptance, SamplingTensors
from tandem.decoding.sampling import PLACEHOLDER_TOKEN_ID, sample

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "AcceptanceResult",
    "RelaxedAcceptance",
    "SamplingTensors",
    "accept",
    "sample",
]
