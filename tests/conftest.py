"""Suite-wide settings: hypothesis runs derandomized so CI results are repeatable; Triton interprets on CPU."""

import os

import torch
from hypothesis import HealthCheck, settings

# Triton kernels run under the interpreter without a GPU; the switch must precede their import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "tandem",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "tandem"))
