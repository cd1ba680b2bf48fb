"""The penalties' dense tables (`decoding.penalties.TokenTable`): sums of the sent entries, built from a staging's
copy once it has sent."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.core.transfer import Staging
from tandem.decoding.params import SamplingParams
from tandem.decoding.penalties import LogitAdjustments, TokenTable

VOCAB = 16
rows_of_tokens = st.dictionaries(st.integers(0, 3), st.lists(st.integers(0, VOCAB - 1), max_size=12), max_size=4)


@given(rows_of_tokens, st.booleans())
def test_a_dense_table_sums_its_entries_like_index_put_accumulate(tokens, weighted):
    values = {b: [0.5 * (i + 1) for i in range(len(row))] for b, row in tokens.items()} if weighted else None
    staging = Staging("cpu")
    table = TokenTable.stage((4, VOCAB), tokens, values, staging)
    staging.send()
    expected = torch.zeros(4, VOCAB)
    for b, row in tokens.items():
        for i, token in enumerate(row):
            expected[b, token] += values[b][i] if weighted else 1.0
    assert torch.equal(table.dense(), expected)


def test_adjustments_built_on_a_shared_staging_read_its_values_after_it_sends():
    params = [SamplingParams(repetition_penalty=1.5, logit_bias={3: 2.0}), SamplingParams(frequency_penalty=0.5)]
    prompts, outputs = [[1, 2], [4]], [[5, 5, 6], [7, 7]]
    own = LogitAdjustments.build(params, prompts, outputs, VOCAB)
    staging = Staging("cpu")
    staging.int64([9] * 5)  # other values of the step before the adjustments'
    shared = LogitAdjustments.build(params, prompts, outputs, VOCAB, staging=staging)
    staging.send()
    logits, drafts = torch.randn(2, 3, VOCAB), torch.tensor([[5, 3], [7, -1]])
    assert torch.equal(shared.apply(logits, drafts), own.apply(logits, drafts))
    assert own.output_counts[0, 5] == 2 and own.output_counts[1, 7] == 2 and own.bias[0, 3] == 2.0
    assert own.prompt_seen[0, 1] and not own.prompt_seen[1].any()
