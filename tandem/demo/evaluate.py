"""Did a demo target learn the corpus? Greedy generation on held-out prompts, checked against the schemas.

A completion (the text after the generation prompt, which ends with `<think>\\n`) is well formed when
it is `reasoning \\n</think> answer <|eot_id|>` with exactly one `</think>`, no `<think>`, and an
answer that parses as JSON; it is valid when that JSON also validates against its family's schema,
and exact when it equals the reference answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jsonschema
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tandem.demo.corpus import TASK_FAMILIES, Example, generate_examples
from tandem.demo.tokenizer import EOT, THINK_CLOSE, THINK_OPEN


@dataclass
class EvalReport:
    """Counts over held-out examples; `by_family` maps family -> [valid, total]."""

    total: int = 0
    well_formed: int = 0
    valid: int = 0
    exact: int = 0
    by_family: dict[str, list[int]] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)  # a few completions, for the eye


def split_completion(text: str) -> tuple[str, object] | None:
    """(reasoning, parsed answer) of a completion decoded with special tokens, or None if malformed."""
    if not text.endswith(EOT) or text.count(THINK_CLOSE) != 1 or THINK_OPEN in text:
        return None
    reasoning, answer = text[: -len(EOT)].split(THINK_CLOSE)
    try:
        return reasoning, json.loads(answer)
    except json.JSONDecodeError:
        return None


def prompt_text(tokenizer: PreTrainedTokenizerBase, example: Example) -> str:
    """The chat-template prompt of `example`, ending inside `<think>`."""
    return tokenizer.apply_chat_template(
        example.messages, tools=example.tools, tokenize=False, add_generation_prompt=True
    )


def _left_padded(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask [B, T] int64, padded on the left (padding the tokenizer itself
    would leave its padding state switched on, and `save_pretrained` would write it out)."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in rows])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@torch.no_grad()
def evaluate_heldout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    num_examples: int = 30,
    seed: int = 0,
    batch_size: int = 10,
    max_new_tokens: int = 128,
) -> EvalReport:
    """Greedy-generate (transformers `generate`) for `num_examples` held-out prompts and check them."""
    model.eval()
    report, validators = (
        EvalReport(),
        {name: jsonschema.Draft202012Validator(f.schema) for name, f in TASK_FAMILIES.items()},
    )
    examples = generate_examples(num_examples, seed=seed, split="heldout")
    for start in range(0, num_examples, batch_size):
        chunk = examples[start : start + batch_size]
        batch = _left_padded(
            [tokenizer.encode(prompt_text(tokenizer, e), add_special_tokens=False) for e in chunk],
            tokenizer.pad_token_id,
        )
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for example, row in zip(chunk, output[:, batch["input_ids"].shape[1] :]):
            text = tokenizer.decode(row[row != tokenizer.pad_token_id])
            parsed = split_completion(text)
            valid = parsed is not None and validators[example.family].is_valid(parsed[1])
            report.total += 1
            report.well_formed += parsed is not None
            report.valid += valid
            report.exact += parsed is not None and parsed[1] == example.answer
            counts = report.by_family.setdefault(example.family, [0, 0])
            counts[0] += valid
            counts[1] += 1
            if len(report.samples) < 3:
                report.samples.append(text)
    return report
