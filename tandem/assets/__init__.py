"""Small demo models and the tokenizer shipped with tandem, in Hugging Face format."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent

TOKENIZER_DIR = ASSETS_DIR / "tokenizer"  # the demo tokenizer alone (also copied into each model dir)
DEMO_LLAMA_DIR = ASSETS_DIR / "demo-llama"  # Llama-3 target (LlamaForCausalLM)
DEMO_DEEPSEEK_DIR = ASSETS_DIR / "demo-deepseek"  # DeepSeek-V3 target (DeepseekV3ForCausalLM, MLA + MoE)
# What `LLM()`, `tandem generate` and `tandem serve` run when no model is named: the demo that
# answers best (held-out checks in each tandem_demo.json) and speculates furthest (its MTP layer).
DEFAULT_MODEL = "demo-deepseek"
