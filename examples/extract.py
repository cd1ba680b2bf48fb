"""Structured extraction into a pydantic model with the Python API (no server).

    python examples/extract.py

The model reasons inside <think>…</think>, then its answer is constrained to the model's JSON
schema, so `Contact.model_validate_json` cannot fail on a finished answer.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from tandem.decoding.params import SamplingParams
from tandem.llm import LLM, best_draft, resolve_model

TEXT = "Meet Hana Rossi (41), from Lisbon. Email: hana.rossi@post.io."


class Contact(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    city: str
    email: str = Field(pattern=r"^[a-z.]+@[a-z]+\.[a-z]+$")


def main(model: str = "demo-llama") -> Contact:
    """Extract the contact in TEXT; print the reasoning and the validated object; return it."""
    llm = LLM(model, best_draft(resolve_model(model)))
    messages = [{"role": "user", "content": f"Extract the contact details from this text: {TEXT}"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=200), response_format=Contact)
    if out.finish_reason != "stop":
        raise RuntimeError(f"generation ended with {out.finish_reason!r} before the answer was complete")
    contact = Contact.model_validate_json(out.text)
    print("reasoning:", out.reasoning.strip())
    print("contact:  ", contact)
    return contact


if __name__ == "__main__":
    main()
