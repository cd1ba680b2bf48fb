"""`tandem eval-schemas`: check grammar backends against MaskBench, and measure keyword support.

For every MaskBench file (`{schema, tests: [{valid, data}]}`) and backend: compile (counting
refusals and failures), then walk each test instance's compact JSON text through a matcher the
way decoding would: before each token the mask is filled, the token must be allowed by it and
accepted, and EOS must end the text. A valid instance that fails is a completeness miss; an
invalid instance that passes is *wrongly accepted*, a soundness failure. With `--json` the
summary is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.assets import ASSETS_DIR
from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import BACKENDS, CompiledGrammar
from tandem.grammars.compiler import GrammarCompiler, lowered
from tandem.grammars.errors import GrammarCompileTimeout, GrammarError, GrammarRefused
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.support import ASSERTIONS, KEYWORD_TYPES, schema_assertions
from tandem.grammars.tokenizer import GrammarTokenizer

BACKEND_CHOICES = (*sorted(BACKENDS), "auto")


def instance_text(data: Any) -> str:
    """The text a model would emit for `data`: compact JSON, non-ASCII kept."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def walk_instance(
    compiled: CompiledGrammar, tokens: list[int], eos_token_id: int, buffer: torch.Tensor, mask_seconds: list[float]
) -> bool:
    """Whether masked decoding can emit `tokens` then EOS with a fresh matcher.

    buffer: [1, W] int32 scratch row. Appends the time of each mask fill to `mask_seconds`.
    """
    matcher = compiled.new_matcher()
    for token in [*tokens, eos_token_id]:
        start = time.perf_counter()
        matcher.fill_bitmask(buffer, 0)
        mask_seconds.append(time.perf_counter() - start)
        if not (int(buffer[0, token >> 5]) >> (token & 31)) & 1 or not matcher.accept_token(token):
            return False
    return matcher.is_terminated()


SPLIT_COUNTS = ("schemas", "compiled", "valid", "valid_accepted", "invalid", "invalid_accepted")


def split_name(path: Path) -> str:
    """The MaskBench split a file belongs to: `Github_easy---o1.json` -> Github_easy, `BFCL_java_0.json` -> BFCL."""
    return path.stem.split("---")[0] if "---" in path.stem else path.stem.split("_")[0]


@dataclass
class BackendReport:
    """Counts for one backend over a set of schemas."""

    schemas: int = 0
    compiled: int = 0
    refused: int = 0
    failed: int = 0
    timed_out: int = 0
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_accepted: int = 0
    chosen: dict[str, int] = field(default_factory=dict)  # backend="auto": which backend compiled
    wrongly_accepted_files: list[str] = field(default_factory=list)
    refused_keywords: dict[str, int] = field(default_factory=dict)
    compile_seconds: dict[str, list[float]] = field(default_factory=dict)  # per split
    mask_seconds: dict[str, list[float]] = field(default_factory=dict)  # per split: one per mask fill
    splits: dict[str, dict[str, int]] = field(default_factory=dict)  # per split: schemas, compiled, valid...

    def count(self, split: str, key: str, n: int = 1) -> None:
        """Add `n` to `key` overall and in `split`'s counts."""
        setattr(self, key, getattr(self, key) + n)
        counts = self.splits.setdefault(split, dict.fromkeys(SPLIT_COUNTS, 0))
        counts[key] += n

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: float, scale: float) -> float | None:
            return round(float(np.percentile(values, q)) * scale, 1) if values else None

        top_refused = sorted(self.refused_keywords.items(), key=lambda kv: -kv[1])[:10]
        splits = {
            split: {
                **counts,
                "mask_us_per_token_p50": pct(self.mask_seconds.get(split, []), 50, 1e6),
                "compile_ms_p99": pct(self.compile_seconds.get(split, []), 99, 1e3),
            }
            for split, counts in sorted(self.splits.items())
        }
        mask_seconds = [t for times in self.mask_seconds.values() for t in times]
        compile_seconds = [t for times in self.compile_seconds.values() for t in times]
        return {
            "schemas": self.schemas, "compiled": self.compiled, "refused": self.refused,
            "failed": self.failed, "timed_out": self.timed_out,
            "valid": self.valid, "valid_accepted": self.valid_accepted,
            "invalid": self.invalid, "invalid_wrongly_accepted": self.invalid_accepted,
            "mask_us_per_token_p50": pct(mask_seconds, 50, 1e6), "mask_us_per_token_p99": pct(mask_seconds, 99, 1e6),
            "compile_ms_p50": pct(compile_seconds, 50, 1e3), "compile_ms_p99": pct(compile_seconds, 99, 1e3),
            "chosen": self.chosen, "top_refused_keywords": dict(top_refused),
            "wrongly_accepted_files": self.wrongly_accepted_files[:20],
            "splits": splits,
        }  # fmt: skip


def evaluate_backend(
    files: Iterable[Path], backend: str, tokenizer: GrammarTokenizer, compiler: GrammarCompiler, *, strict: bool = True
) -> BackendReport:
    """Compile each MaskBench file with `backend` and walk its test instances."""
    report = BackendReport()
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    files = list(files)
    jobs = []
    for path in files:  # submit everything first: the pool compiles while we walk
        case = json.loads(path.read_text())
        try:
            jobs.append(
                (
                    path,
                    case,
                    compiler.submit(GrammarSpec.json_schema(case["schema"], strict=strict), tokenizer, backend),
                )
            )
        except GrammarError as e:  # invalid schema: the spec itself refuses it
            jobs.append((path, case, e))
    for path, case, job in jobs:
        split = split_name(path)
        report.count(split, "schemas")
        try:
            if isinstance(job, GrammarError):
                raise job
            compiled = job.result()
        except GrammarRefused as e:
            report.refused += 1
            for item in e.unhonoured:
                keyword = item.rsplit(": ", 1)[-1]
                report.refused_keywords[keyword] = report.refused_keywords.get(keyword, 0) + 1
            continue
        except GrammarCompileTimeout:
            report.timed_out += 1
            continue
        except GrammarError:
            report.failed += 1
            continue
        report.count(split, "compiled")
        report.compile_seconds.setdefault(split, []).append(compiled.compile_seconds)
        report.chosen[compiled.backend] = report.chosen.get(compiled.backend, 0) + 1
        for test in case["tests"]:
            accepted = walk_instance(
                compiled,
                tokenizer.encode(instance_text(test["data"])),
                tokenizer.eos_token_id,
                buffer,
                report.mask_seconds.setdefault(split, []),
            )
            kind = "valid" if test["valid"] else "invalid"
            report.count(split, kind)
            report.count(split, f"{kind}_accepted", accepted)
            if accepted and not test["valid"] and path.name not in report.wrongly_accepted_files:
                report.wrongly_accepted_files.append(path.name)
    return report


def suite_labels(path: Path) -> tuple[str, ...]:
    """Keyword labels (see support.keyword_label) a JSON-Schema-Test-Suite file measures."""
    if path.parent.name == "format" and path.parent.parent.name == "optional":
        return (f"format:{path.stem}",)
    special = {
        "ref": ("$ref",),
        "dynamicRef": ("$dynamicRef",),
        "boolean_schema": ("false",),
        "if-then-else": ("if", "then", "else"),
    }
    if path.stem in special:
        return special[path.stem]
    return (path.stem,) if path.stem in ASSERTIONS and path.stem != "format" else ()


_JSON_TYPES = {"string": (str,), "number": (int, float), "array": (list,), "object": (dict,)}


def suite_cases(path: Path) -> Iterator[tuple[Any, list[dict]]]:
    """(schema, tests) of a suite file's groups, plus a typed variant of each untyped group.

    The variant adds the `type` the file's keyword constrains and keeps the instances of that
    type, whose validity adding `type` does not change; it measures the keyword next to a type.
    """
    keyword_type = KEYWORD_TYPES.get(suite_labels(path)[0].split(":")[0]) if suite_labels(path) else None
    for group in json.loads(path.read_text()):
        schema, tests = group["schema"], group["tests"]
        yield schema, tests
        if keyword_type and isinstance(schema, dict) and "type" not in schema:
            same_type = [
                t for t in tests if isinstance(t["data"], _JSON_TYPES[keyword_type]) and not isinstance(t["data"], bool)
            ]
            if same_type:
                yield {**schema, "type": keyword_type}, same_type


def measure_suite(
    files: Iterable[Path], backend: str, tokenizer: GrammarTokenizer, compiler: GrammarCompiler
) -> dict[str, dict[str, int]]:
    """Per keyword label: test schemas compiled / failed / timed out / with an invalid instance
    wrongly accepted (`unsound`) / with a valid instance rejected (`narrowed`).

    Each schema of a JSON-Schema-Test-Suite file (and its typed variant, see `suite_cases`) is
    compiled non-strict, so the backend shows what it really does, and every instance is walked
    as in `evaluate_backend`; labels are read from the schema the backend is given (normalised
    and rewritten, `compiler.lowered`). A wrong acceptance (a wrong rejection) is blamed on the
    labels of the file's keyword in that schema (`maxLength` or `maxLength@untyped`), unless the
    schema also holds a label of another keyword that is itself blamed somewhere: that one
    explains it, and refusing it refuses this schema too.
    """
    buffer = torch.zeros(1, bitmask_width(tokenizer.vocab_size), dtype=torch.int32)
    cases = []  # (labels of the file's keyword, all labels, outcome, narrowed)
    for path in files:
        measured = suite_labels(path)
        for schema, tests in suite_cases(path):
            labels = {label for _, label in schema_assertions(schema)}
            narrowed = False
            try:
                spec = GrammarSpec.json_schema(schema, strict=False)
                labels = {label for _, label in schema_assertions(lowered(spec, backend).schema)}
                compiled = compiler.compile(spec, tokenizer, backend)
                outcome = "compiled"
                for test in tests:
                    walked = walk_instance(
                        compiled, tokenizer.encode(instance_text(test["data"])), tokenizer.eos_token_id, buffer, []
                    )
                    if walked and not test["valid"]:
                        outcome = "unsound"
                    narrowed |= test["valid"] and not walked
            except GrammarCompileTimeout:
                outcome = "timed_out"
            except GrammarError:
                outcome = "failed"
            own = {
                label for label in labels if {label.split("@")[0], label.split("@")[0].split(":")[0]} & set(measured)
            }
            cases.append((own, labels, outcome, narrowed))
    blamed = {label for own, _, outcome, _ in cases if outcome == "unsound" for label in own}
    blamed_narrowing = {label for own, _, _, narrowed in cases if narrowed for label in own}
    results: dict[str, dict[str, int]] = {}
    for own, labels, outcome, narrowed in cases:
        explained = outcome == "unsound" and bool((labels - own) & blamed)
        narrowing_explained = narrowed and bool((labels - own) & blamed_narrowing)
        for label in own:
            counts = results.setdefault(
                label, dict.fromkeys(("compiled", "failed", "timed_out", "unsound", "narrowed"), 0)
            )
            counts["compiled" if outcome == "unsound" else outcome] += 1
            counts["unsound"] += outcome == "unsound" and not explained
            counts["narrowed"] += narrowed and not narrowing_explained
    return results


def honoured_labels(measured: dict[str, dict[str, int]]) -> list[str]:
    """Labels with no wrong acceptance: the backend enforced them or refused to compile (loudly).

    A label with a schema that timed out is not honoured: what it would have done is unknown.
    """
    return sorted(label for label, c in measured.items() if not c["unsound"] and not c["timed_out"])


def narrowed_labels(measured: dict[str, dict[str, int]]) -> list[str]:
    """Labels with a valid instance rejected: the backend enforces more than the keyword says."""
    return sorted(label for label, c in measured.items() if c["narrowed"])


def select_files(directory: Path, limit: int | None, sample: bool, seed: int) -> list[Path]:
    files = sorted(directory.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no MaskBench *.json files in {directory}")
    if sample:
        random.Random(seed).shuffle(files)
    return files[:limit] if limit else files


def load_tokenizer(path: Path | None, vocab_size: int | None) -> GrammarTokenizer:
    from transformers import AutoTokenizer

    path = path or ASSETS_DIR / "tokenizer"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}; pass --tokenizer PATH (a Hugging Face tokenizer directory)")
    return GrammarTokenizer(AutoTokenizer.from_pretrained(path), vocab_size)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="folder of MaskBench *.json files")
    parser.add_argument(
        "--backend",
        choices=(*BACKEND_CHOICES, "all"),
        default="all",
        help="backend to check (default: each, then auto)",
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="Hugging Face tokenizer dir (default: the shipped demo tokenizer)"
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="model vocab size V (default: the tokenizer's)")
    parser.add_argument("--limit", type=int, default=None, help="check at most N files")
    parser.add_argument("--sample", action="store_true", help="take a random sample of files (with --limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="compile time limit per schema, seconds")
    parser.add_argument("--workers", type=int, default=2, help="compile worker threads")
    parser.add_argument(
        "--no-strict", dest="strict", action="store_false", help="accept backends' approximations instead of refusing"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    parser.add_argument(
        "--measure-keywords", action="store_true",
        help="DIR is JSON-Schema-Test-Suite's draft2020-12 folder: "
        "print the keyword labels each backend narrows (support.NARROWED), then on the last line those it honours "
        "(support.HONOURED)",
    )  # fmt: skip


def suite_files(directory: Path) -> list[Path]:
    """The JSON-Schema-Test-Suite files that measure some keyword label."""
    files = sorted(directory.glob("*.json")) + sorted((directory / "optional" / "format").glob("*.json"))
    return [path for path in files if suite_labels(path)]


def run_keyword_measurement(args: argparse.Namespace, tokenizer: GrammarTokenizer) -> int:
    backends = sorted(BACKENDS) if args.backend in ("all", "auto") else [args.backend]
    compiler = GrammarCompiler(max_workers=args.workers, timeout_s=args.timeout)
    measured = {
        backend: measure_suite(suite_files(args.directory), backend, tokenizer, compiler) for backend in backends
    }
    compiler.shutdown()
    print(json.dumps({"narrowed": {backend: narrowed_labels(m) for backend, m in measured.items()}}))
    print(json.dumps({backend: honoured_labels(m) for backend, m in measured.items()}))  # the last line
    return 0


def run(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer, args.vocab_size)
    if args.measure_keywords:
        return run_keyword_measurement(args, tokenizer)
    files = select_files(args.directory, args.limit, args.sample, args.seed)
    backends = BACKEND_CHOICES if args.backend == "all" else (args.backend,)
    compiler = GrammarCompiler(max_workers=args.workers, timeout_s=args.timeout)
    results = {}
    for backend in backends:
        start = time.perf_counter()
        summary = evaluate_backend(files, backend, tokenizer, compiler, strict=args.strict).summary()
        summary["seconds"] = round(time.perf_counter() - start, 1)
        results[backend] = summary
        print(
            f"{backend:>10}: compiled {summary['compiled']}/{summary['schemas']} (refused {summary['refused']}, "
            f"failed {summary['failed']}, timed out {summary['timed_out']}); valid accepted "
            f"{summary['valid_accepted']}/{summary['valid']}; invalid wrongly accepted "
            f"{summary['invalid_wrongly_accepted']}/{summary['invalid']}; mask us/token p50 "
            f"{summary['mask_us_per_token_p50']} p99 {summary['mask_us_per_token_p99']}; compile ms p50 "
            f"{summary['compile_ms_p50']} p99 {summary['compile_ms_p99']}",
            file=sys.stderr if args.json else sys.stdout,
        )
    compiler.shutdown()
    if args.json:
        print(
            json.dumps(
                {
                    "files": len(files),
                    "strict": args.strict,
                    "tokenizer": tokenizer.hf.name_or_path,
                    "backends": results,
                }
            )
        )
    return 0
