"""Bad inputs get errors that name the argument and what is wrong."""

import pytest
import torch

from tandem.decoding import RelaxedAcceptance, SamplingTensors, accept, sample

B, K, V = 2, 3, 40


def _call(**overrides):
    args = {
        "target_logits": torch.zeros(B, K + 1, V),
        "draft_tokens": torch.zeros(B, K, dtype=torch.int64),
        "draft_probs": None,
        "sampling": None,
        "bitmask": None,
        "in_thinking": None,
        "relaxed": None,
        "backend": "auto",
    }
    args.update(overrides)
    logits, drafts = args.pop("target_logits"), args.pop("draft_tokens")
    return accept(logits, drafts, **args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"target_logits": torch.zeros(B, V)}, r"target_logits must have shape \[\*, \*, \*\], got \[2, 40\]"),
        ({"target_logits": torch.zeros(B, K + 1, V, dtype=torch.int64)}, "target_logits must be float32 or bfloat16"),
        (
            {"draft_tokens": torch.zeros(B, K + 1, dtype=torch.int64)},
            r"draft_tokens must have shape \[2, 3\], got \[2, 4\]",
        ),
        ({"draft_tokens": torch.zeros(B, K, dtype=torch.int32)}, "draft_tokens must be int64, got int32"),
        ({"draft_probs": torch.zeros(B, K, V + 1)}, r"draft_probs must have shape \[2, 3, 40\]"),
        ({"bitmask": torch.zeros(B, K + 1, 1, dtype=torch.int32)}, r"bitmask must have shape \[2, 4, 2\]"),
        ({"bitmask": torch.zeros(B, K + 1, 2, dtype=torch.int64)}, "bitmask must be int32, got int64"),
        ({"in_thinking": torch.zeros(B, K, dtype=torch.bool)}, r"in_thinking must have shape \[2, 4\]"),
        ({"in_thinking": torch.zeros(B, K + 1)}, "in_thinking must be bool"),
        ({"sampling": SamplingTensors.greedy(B + 1)}, "sampling has 3 rows, the logits have 2"),
        ({"sampling": "greedy"}, "sampling must be a SamplingTensors or None, got str"),
        ({"relaxed": 0.6}, "relaxed must be a RelaxedAcceptance or None, got float"),
        (
            {"target_logits": torch.zeros(B, 0, V), "draft_tokens": torch.zeros(B, 0, dtype=torch.int64)},
            "k\\+1 >= 1 positions",
        ),
        ({"target_logits": torch.zeros(B, K + 1, 0)}, "vocabulary of V >= 1 tokens"),
        ({"backend": "cuda"}, "backend must be 'auto', 'torch' or 'triton', got 'cuda'"),
    ],
)
def test_accept_rejects_bad_inputs_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_sample_rejects_bad_inputs_with_a_clear_message():
    with pytest.raises(ValueError, match=r"logits must have shape \[\*, \*\], got \[2, 3, 40\]"):
        sample(torch.zeros(B, K, V))
    with pytest.raises(ValueError, match=r"bitmask must have shape \[2, 2\], got \[2, 3\]"):
        sample(torch.zeros(B, V), bitmask=torch.zeros(B, 3, dtype=torch.int32))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, r"temperature\[1\] = -0.5 must be >= 0"),
        ("top_k", -1, r"top_k\[1\] = -1 must be >= 0"),
        ("top_p", 0.0, r"top_p\[1\] = 0.0 must be in \(0, 1\]"),
        ("min_p", 1.5, r"min_p\[1\] = 1.5 must be in \[0, 1\]"),
    ],
)
def test_sampling_tensors_reject_out_of_range_values(field, value, message):
    good = SamplingTensors.full(3)
    values = {f: getattr(good, f).clone() for f in ("temperature", "top_k", "top_p", "min_p", "seed")}
    values[field][1] = value
    with pytest.raises(ValueError, match=message):
        SamplingTensors(**values)


def test_sampling_tensors_reject_wrong_dtypes_and_ragged_rows():
    good = SamplingTensors.full(3)
    with pytest.raises(ValueError, match="SamplingTensors.top_k must be torch.int64"):
        SamplingTensors(good.temperature, good.top_k.int(), good.top_p, good.min_p, good.seed)
    with pytest.raises(ValueError, match="SamplingTensors.seed has 2 rows, temperature has 3"):
        SamplingTensors(good.temperature, good.top_k, good.top_p, good.min_p, good.seed[:2])


@pytest.mark.parametrize(("top_k", "delta"), [(0, 0.6), (10, -0.1), (10, 1.5)])
def test_relaxed_acceptance_rejects_bad_parameters(top_k, delta):
    with pytest.raises(ValueError, match="RelaxedAcceptance"):
        RelaxedAcceptance(top_k=top_k, delta=delta)


def test_out_of_vocabulary_drafts_are_rejected_not_indexed():
    logits = torch.zeros(1, 3, V)
    logits[0, :, 7] = 5.0
    result = accept(logits, torch.tensor([[7, V + 3]]))
    assert result.tokens.tolist() == [[7, 7, -1]]
    result = accept(logits, torch.tensor([[-2, 7]]), sampling=SamplingTensors.full(1, seed=0))
    assert result.num_accepted.tolist() == [0]
