"""The demo tokenizer: a Llama-3-style byte-level BPE trained on the demo corpus.

Pre-tokenization uses Llama 3's split pattern (digits in groups of at most three), then
byte-level mapping, so every string round-trips: `decode(encode(s)) == s`. Special tokens
(`SPECIAL_TOKENS`) take the first ids, each a single token, and are never produced by BPE:
`<think>` in text encodes to its one id. EOS is `<|eot_id|>`; encoding with
`add_special_tokens=True` prepends `<|begin_of_text|>` as Llama 3 does.

The chat template (`CHAT_TEMPLATE`) is Llama 3's header layout:

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}[\\n\\n{tools block}]<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n<think>\\n{reasoning}\\n</think>{answer}<|eot_id|>

The tools block is `TOOLS_PREAMBLE` then one JSON object per tool (its `function` part when given
in OpenAI form), one per line. The generation prompt opens the assistant turn and `<think>\\n`,
so a prompt ends inside the reasoning, as DeepSeek-R1's template does. An assistant message
renders its `reasoning_content` (when given) inside `<think>…</think>`, then `content`, then
each of its `tool_calls` as `{"name": ..., "arguments": {...}}`: the format of `corpus.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tandem.demo.corpus import SYSTEM_PROMPT, iter_examples

BOS, END_OF_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
START_HEADER, END_HEADER = "<|start_header_id|>", "<|end_header_id|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PAD = "<|finetune_right_pad_id|>"
SPECIAL_TOKENS = [BOS, END_OF_TEXT, START_HEADER, END_HEADER, EOT, THINK_OPEN, THINK_CLOSE, PAD]  # ids 0..7

# Llama 3's pre-tokenizer split (tiktoken cl100k-style).
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOOLS_PREAMBLE = 'You can call these tools. To call one, answer with {"name": tool name, "arguments": {...}}.'

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- endif %}"
    "{%- if system is not none or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if system is not none %}{{- system }}{%- endif %}"
    "{%- if tools %}"
    "{%- if system is not none %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_PREAMBLE + "' }}"  # the preamble has no quote or backslash to escape
    "{%- for tool in tools %}"
    "{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is defined %}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>' }}"
    "{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{%- set arguments = function['arguments'] %}"
    "{{- '{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- (arguments if arguments is string else (arguments | tojson)) + '}' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<think>\\n' }}"
    "{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 2048  # including SPECIAL_TOKENS; the corpus saturates near 2.7k


def _training_texts(seed: int, num_examples: int) -> Iterator[str]:
    """The text pieces the model will see between special tokens (the template's and the corpus')."""
    yield from ["system", "user", "assistant", "\n\n", SYSTEM_PROMPT, TOOLS_PREAMBLE]
    stream = iter_examples(seed, "train")
    for _ in range(num_examples):
        example = next(stream)
        yield from (message["content"] for message in example.messages)
        yield from ("\n" + json.dumps(tool["function"], ensure_ascii=False) for tool in example.tools or [])
        yield f"\n{example.reasoning}\n"
        yield example.answer_text


def train_tokenizer(
    seed: int = 0, num_examples: int = 20_000, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on `num_examples` corpus examples; deterministic for a given seed."""
    if vocab_size <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size {vocab_size} leaves no room for merges (256 bytes + {len(SPECIAL_TOKENS)} specials)"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_texts(seed, num_examples), trainer)
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The template goes inside tokenizer_config.json (not chat_template.jinja) so older readers find it too.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir
