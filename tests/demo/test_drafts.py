"""The draft trainer (training-time test) computes exactly what the shipped drafts compute at inference."""

import json

import pytest
import torch
from transformers import AutoTokenizer, DeepseekV3ForCausalLM, LlamaForCausalLM

from tandem import cli
from tandem.assets import TOKENIZER_DIR
from tandem.demo.corpus import generate_examples
from tandem.demo.drafts import DRAFT_TARGETS, new_head, save_head, ttt_forward
from tandem.demo.train import SETTINGS_FILE, encode_chat, target_config
from tandem.models.base import ForwardBatch
from tandem.models.loading import load_draft, load_target
from tandem.training.ttt import DEPTHS
from tests.training.reference import chained_log_probs

TARGET_KIND = {
    "eagle3": ("llama", LlamaForCausalLM),
    "eagle": ("llama", LlamaForCausalLM),
    "mtp": ("deepseek", DeepseekV3ForCausalLM),
}
HIDDEN_KIND = {"eagle3": "aux", "eagle": "last", "mtp": "last"}  # what each loaded draft reads from the target


@pytest.fixture(scope="module", params=sorted(DRAFT_TARGETS))
def saved_pair(request, tmp_path_factory):
    """A tiny random target and a perturbed fresh draft head, saved as tandem ships them (fp32)."""
    kind = request.param
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    target_kind, model_class = TARGET_KIND[kind]
    torch.manual_seed(0)
    target = model_class(target_config(target_kind, tokenizer, "tiny")).eval()
    directory = tmp_path_factory.mktemp(kind) / DRAFT_TARGETS[kind]
    target.save_pretrained(directory)
    head = new_head(kind, target).eval()
    with torch.no_grad():  # move off the warm start so that every weight matters
        for param in head.parameters():
            param.add_(0.05 * torch.randn_like(param))
    draft_dir = save_head(kind, head, target, directory, torch.float32)
    return kind, target, head, directory, draft_dir, tokenizer


@torch.no_grad()
def test_ttt_depth_d_equals_the_loaded_draft_chained_d_steps(saved_pair):
    kind, hf_target, head, directory, draft_dir, tokenizer = saved_pair
    target = load_target(directory, dtype=torch.float32)
    draft = load_draft("mtp" if kind == "mtp" else draft_dir, target, dtype=torch.float32)
    ids = encode_chat(tokenizer, generate_examples(1, seed=3)[0])[0][:40]
    input_ids = torch.tensor([ids])
    _, ttt = ttt_forward(head, hf_target, input_ids, torch.ones_like(input_ids))
    out = target.forward(
        ForwardBatch.from_rows([ids], [0], [0]), target.new_cache(1, 64), return_hidden=True, return_aux=True
    )
    first = draft.fc(out.aux_hidden) if kind == "eagle3" else out.hidden  # depth-0 hidden at each position
    for depth in range(DEPTHS):
        for pair in (depth, depth + 9, len(ids) - 2):  # pair i: hidden at position i, token at i + 1
            torch.testing.assert_close(
                chained_log_probs(draft, ids, first, depth, pair),
                ttt[depth][0, pair],
                atol=2e-4,
                rtol=1e-4,
                msg=f"{kind} depth {depth} pair {pair}",
            )


@pytest.mark.parametrize("draft", sorted(DRAFT_TARGETS))
def test_tiny_train_demo_draft_stage_writes_a_draft_tandem_loads(tmp_path, draft):
    """The CLI path: a tiny target, then its draft from self-distilled chats, loaded by tandem's loader."""
    target_kind = TARGET_KIND[draft][0]
    common = ["--out", str(tmp_path), "--size", "tiny", "--steps", "2", "--batch-size", "2", "--eval-examples", "1"]
    assert cli.main(["train-demo", *common, "--only", target_kind]) == 0
    assert cli.main(["train-demo", *common, "--only", draft]) == 0
    target_dir = tmp_path / DRAFT_TARGETS[draft]
    draft_dir = target_dir if draft == "mtp" else target_dir.parent / f"{target_dir.name}-{draft}"
    record = json.loads((draft_dir / (f"tandem_{draft}.json" if draft == "mtp" else SETTINGS_FILE)).read_text())
    assert record["draft"] == draft
    assert record["data"]["self_distilled_chats"] == 2 and record["data"]["generated_tokens"] > 0
    target = load_target(target_dir)
    loaded = load_draft("mtp" if draft == "mtp" else draft_dir, target)
    assert loaded.hidden_kind == HIDDEN_KIND[draft]
