"""TTT through tandem's provider computes what the loaded draft computes at inference: depth d of
`ttt_log_probs` over `provider_pass` is the draft chained d steps, for EAGLE-3 (reduced vocabulary)
and EAGLE; the loss trains only what the draft vocabulary can name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tandem.models.base import ForwardBatch
from tandem.models.loading import load_draft, load_target
from tandem.training.checkpoint import save_draft
from tandem.training.data import IGNORE_INDEX, pad_batch
from tandem.training.trainer import DraftSettings, new_head
from tandem.training.ttt import DEPTHS, provider_pass, scored_pairs, ttt_log_probs, ttt_loss, ttt_visibility
from tandem.training.vocab import DraftVocab, frequent_tokens
from tests.training.reference import chained_log_probs


@pytest.fixture(scope="module")
def ids(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    text = "Put lunch in my calendar for May 9, 2025, 16:30 with Ines and Vera. Then check the weather in Oslo."
    return tokenizer(text, add_special_tokens=False)["input_ids"][:40]


def test_ttt_visibility_is_committed_prefix_plus_one_key_per_earlier_chained_depth():
    visible = ttt_visibility(num_pairs=4, depth=2).int()
    # pair 3: committed pairs 0..1 at depth 0, then depth 1 at pair 2 and depth 2 (itself) at pair 3
    assert visible[3].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert ttt_visibility(4, 0).int().tolist() == torch.ones(4, 4).tril().int().tolist()  # depth 0 is causal
    assert visible[:, :4].tolist() == torch.ones(4, 4).tril(-2).int().tolist()  # committed: depth pairs fewer


def test_a_padded_row_of_the_provider_pass_equals_the_row_alone(tiny_target, ids):
    target = load_target(tiny_target, dtype=torch.float32)
    labels = [IGNORE_INDEX] * 10 + ids[10:]
    batch = pad_batch([(ids, labels), (ids[:25], labels[:25])], pad_id=0)
    where = scored_pairs(batch["labels"])
    both = provider_pass(target, "aux", batch["input_ids"], batch["attention_mask"], where)
    alone_where = scored_pairs(torch.tensor([labels[:25]]))
    alone = provider_pass(target, "aux", torch.tensor([ids[:25]]), torch.ones(1, 25, dtype=torch.long), alone_where)
    for name in ("features", "embeds"):
        torch.testing.assert_close(getattr(both, name)[1, :24], getattr(alone, name)[0], msg=name)
    assert len(both.teacher) == where.sum() == (len(ids) - 10) + 15  # scored pairs 8..len-3 and 8..22
    torch.testing.assert_close(both.teacher[len(ids) - 10 :], alone.teacher)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@torch.no_grad()
def test_ttt_depth_d_equals_the_loaded_draft_chained_d_steps(tiny_target, ids, kind, tmp_path):
    target = load_target(tiny_target, dtype=torch.float32)
    torch.manual_seed(0)
    vocab = frequent_tokens(ids, target.vocab_size, 64) if kind == "eagle3" else None  # ids outside it too
    head = new_head(DraftSettings(kind=kind), tiny_target, target, vocab).eval()
    for param in head.parameters():  # move off the warm start so that every weight matters
        param.add_(0.05 * torch.randn_like(param))
    save_draft(head, tmp_path, torch.float32)
    draft = load_draft(tmp_path, target, dtype=torch.float32)
    if vocab is not None:
        assert torch.equal(draft.target_ids, vocab.token_ids)
    every = torch.ones(1, len(ids) - 1, dtype=torch.bool)  # every pair scored
    out = provider_pass(target, head.hidden_kind, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), every)
    ttt = ttt_log_probs(head, target, out.embeds, out.features, DEPTHS)
    selected = ttt_log_probs(head, target, out.embeds, out.features, DEPTHS, where=every)
    assert all(torch.equal(a[0], b) for a, b in zip(ttt, selected))
    full = target.forward(
        ForwardBatch.from_rows([ids], [0], [0]), target.new_cache(1, 64), return_hidden=True, return_aux=True
    )
    torch.testing.assert_close(out.teacher, full.logits[1:])
    first = draft.fc(full.aux_hidden) if kind == "eagle3" else full.hidden  # depth-0 hidden at each position
    for depth in range(DEPTHS):
        for pair in (depth, depth + 9, len(ids) - 2):  # pair i: hidden at position i, token at i + 1
            expected = chained_log_probs(draft, ids, first, depth, pair)
            torch.testing.assert_close(expected, ttt[depth][0, pair], atol=2e-4, rtol=1e-4, msg=f"{depth} {pair}")


def test_the_loss_trains_only_positions_whose_target_token_the_draft_vocabulary_names():
    vocab = DraftVocab(torch.tensor([1, 3]), target_vocab_size=4)
    labels = torch.tensor([[IGNORE_INDEX, 7, 7, 7, 7]])  # pairs 0..2 scored; the last one's x_{i+2} is past the row
    where = scored_pairs(labels)
    assert where.tolist() == [[True, True, True, False]]
    teacher = torch.tensor([[0.0, 5, 0, 1], [0.0, 0, 5, 1], [0.0, 1, 0, 5]])  # top: 1, 2, 3
    draft = torch.tensor([[0.0, -9], [-9.0, 0], [-9.0, 0]])  # draft ids 0, 1, 1: target ids 1, 3, 3
    loss, agreement = ttt_loss([draft, draft], teacher, where.nonzero()[:, 1], vocab, decay=0.5)
    assert agreement == [pytest.approx(2 / 3), pytest.approx(1 / 2)]  # token 2 has no draft id: never agreed
    cross_entropy = -(teacher[:, [1, 3]].log_softmax(-1).exp() * draft).sum(-1)
    expected = cross_entropy[[0, 2]].mean() + 0.5 * cross_entropy[2]  # pair 1 untrained; depth 1 from pair 1 on
    torch.testing.assert_close(loss, expected)
