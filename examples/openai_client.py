"""The minimal client: ask `tandem serve` for a JSON-schema answer with the official openai client.

    tandem serve --model demo-llama &            # then
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Without --base-url the script starts a server in-process on a free loopback port.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {"expression": {"type": "string"}, "result": {"type": "integer"}},
    "required": ["expression", "result"],
    "additionalProperties": False,
}


def main(base_url: str, model: str = "demo-llama") -> dict:
    """Ask one question; print the reasoning and the answer; return the answer as a dict."""
    client = OpenAI(base_url=base_url, api_key="unused")
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 7 + 5?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}},
        temperature=0,
        max_tokens=100,
    )
    message = response.choices[0].message
    print("reasoning:", message.reasoning_content)
    print("answer:   ", message.content)
    print("speculation:", response.speculative_decoding)  # tandem's extra field: draft, steps, accepted, ...
    return json.loads(message.content)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server's /v1 URL (default: start one in-process)")
    args = parser.parse_args()
    if args.base_url:
        main(args.base_url)
    else:
        from tandem.serve.server import ServerThread, build_app

        with ServerThread(build_app("demo-llama")) as server:
            main(server.base_url)
