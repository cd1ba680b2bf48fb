"""A step's sampling tables ride its phase's staged copy (`SamplingTensors.to(device, staging)`): the same values and
batch-wide flags as the tables sent field by field, in the one copy the step's other values take."""

from __future__ import annotations

import torch

from tandem.core.transfer import Staging
from tandem.decoding.params import SamplingParams, SamplingTensors, batch_sampling

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1),
    SamplingParams(temperature=1.3, min_p=0.05, seed=2),
]
SEEDS = torch.tensor([0, 2**61 + 12345, 7])  # a 62-bit seed keeps every bit


def _fields(tables: SamplingTensors) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "seed")
    flags = ("all_greedy", "any_greedy", "any_top_k_top_p", "any_min_p", "max_top_k")
    return {name: getattr(tables, name).tolist() for name in names} | {f: getattr(tables, f) for f in flags}


def test_staged_tables_hold_the_values_and_flags_of_tables_sent_field_by_field():
    expected = batch_sampling(PARAMS, SEEDS, "cpu")
    staging = Staging("cpu")
    staging.int64([5, 6, 7])  # the phase's batch, staged before the tables
    staged = batch_sampling(PARAMS, SEEDS, "cpu", staging)
    assert staging.num_copies == 1  # the tables joined the batch's copy
    staging.send()
    assert _fields(staged) == _fields(expected)
    assert {name: getattr(staged, name).dtype for name in ("temperature", "top_k", "seed")} == {
        "temperature": torch.float32,
        "top_k": torch.int64,
        "seed": torch.int64,
    }


def test_the_flags_come_from_the_host_before_the_staging_sends():
    """The tables are views of the staging's buffer, unfilled until it sends; the batch-wide flags, which the hot
    path reads without asking the device, are the host tables' from the start."""
    staging = Staging("cpu")
    staged = SamplingTensors.full(2, temperature=0.5, top_k=3, seed=torch.tensor([11, 12])).to("cpu", staging)
    assert staged.max_top_k == 3 and not staged.any_greedy
    staging.send()
    assert staged.top_k.tolist() == [3, 3] and staged.seed.tolist() == [11, 12]
    assert staged.temperature.tolist() == [0.5, 0.5]
