"""Which JSON-schema keywords each backend honours, and the check that refuses the rest.

Honoured means never silently ignored: the backend enforces the keyword, or fails to compile it
with an error.

Backends silently ignore some keywords (a schema with `uniqueItems` compiles, and then lets
duplicates through). `unhonoured(spec, backend)` walks every subschema and lists each assertion
keyword the backend is not known to honour, as `pointer: keyword`. The check is an allowlist:
a keyword nobody measured is refused, so the approximation is never silent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema

from tandem.grammars.normalize import subschemas
from tandem.grammars.spec import GrammarSpec, json_pointer

# Keywords that never reject an instance (annotations, identifiers, containers of definitions).
NON_ASSERTIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$vocabulary", "$comment", "$defs",
    "definitions", "title", "description", "default", "examples", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding", "contentSchema",
})  # fmt: skip

# Every assertion/applicator keyword of drafts 4 to 2020-12. Keywords outside both sets are
# unknown to JSON Schema and ignored by validators too.
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "maxProperties", "minProperties", "required",
    "dependentRequired", "dependentSchemas", "dependencies", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
    "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
})  # fmt: skip

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMAS = ("additionalProperties", "propertyNames", "items", "additionalItems", "contains", "not", "if",
            "then", "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")  # fmt: skip


# Formats JSON Schema defines; any other format name is an annotation no validator asserts.
DEFINED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex",
})  # fmt: skip


# The instance type a type-specific keyword constrains. Backends may honour such a keyword only
# beside a `type` (xgrammar reads `{"maxLength": 2}` as "any JSON"), so it is measured and
# checked in two variants: `maxLength` (next to a type) and `maxLength@untyped`.
KEYWORD_TYPES = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), "string"),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), "number"),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                     "minContains", "maxContains", "unevaluatedItems"), "array"),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                     "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                     "unevaluatedProperties"), "object"),
}  # fmt: skip


def keyword_label(keyword: str, value: Any, typed: bool = True) -> str | None:
    """The name a keyword is measured under: `format:<name>`, `items[]` (draft-4 tuple form),
    `exclusiveMinimum(bool)` / `exclusiveMaximum(bool)` (draft-4 form), else the keyword itself;
    `@untyped` appended to a type-specific keyword in a subschema without `type`.
    (`schema_assertions` also labels `required` naming properties not in `properties` as
    `required:undeclared`, and `properties` with names JSON must escape as `properties:escaped`:
    xgrammar mishandles both; and `enum`/`const` with a value its sibling keywords reject as
    `enum:unfiltered` / `const:unfiltered`: xgrammar and outlines-core emit any listed value.)
    None for a format JSON Schema does not define (an annotation)."""
    suffix = "" if typed or keyword not in KEYWORD_TYPES else "@untyped"
    if keyword == "format":
        return f"format:{value}{suffix}" if value in DEFINED_FORMATS else None
    return _base_label(keyword, value) + suffix


def _needs_escape(name: str) -> bool:
    return any(c in '"\\' or c < " " for c in name)


def _base_label(keyword: str, value: Any) -> str:
    if keyword in ("items", "dependencies") and isinstance(value, list):
        return f"{keyword}[]"
    if keyword in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
        return f"{keyword}(bool)"
    return keyword


def _values_fit_siblings(schema: dict, keyword: str) -> bool:
    """Whether every value `keyword` ("enum" or "const") lists satisfies the subschema's other
    assertions (formats included). Then a backend that emits any listed value and ignores the
    rest is exact. Siblings that cannot be checked locally (`$ref`...) count as not fitting."""
    values = schema["enum"] if keyword == "enum" else [schema["const"]]
    siblings = {
        k: v for k, v in schema.items() if k in ASSERTIONS and k != keyword and not (keyword == "const" and k == "enum")
    }
    if not siblings or not isinstance(values, list):
        return True
    validator = jsonschema.Draft202012Validator(siblings, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    try:
        return all(validator.is_valid(value) for value in values)
    except Exception:  # an unresolvable $ref, a malformed sibling: cannot tell, so refuse
        return False


def _overlapping(patterns: dict, names: dict) -> bool:
    """Whether a declared property name matches a `patternProperties` regex (unparseable: yes)."""
    try:
        return any(re.search(pattern, name) for pattern in patterns for name in names)
    except re.error:
        return True


def _combinations(schema: dict, path: tuple) -> Iterator[tuple[str, str]]:
    """Labels of keywords that some backend drops when they meet in one subschema (measured in
    HONOURED_COMBINATIONS): `pattern:with-length` (beside minLength / maxLength), `pattern:with-format`,
    `anyOf:with-properties`, `patternProperties:overlapping` (a pattern matching a declared name)."""
    if "pattern" in schema:
        if "minLength" in schema or "maxLength" in schema:
            yield json_pointer(path + ("pattern",)), "pattern:with-length"
        if schema.get("format") in DEFINED_FORMATS:
            yield json_pointer(path + ("pattern",)), "pattern:with-format"
    if "anyOf" in schema and "properties" in schema:
        yield json_pointer(path + ("anyOf",)), "anyOf:with-properties"
    patterns, names = schema.get("patternProperties"), schema.get("properties")
    if isinstance(patterns, dict) and isinstance(names, dict) and _overlapping(patterns, names):
        yield json_pointer(path + ("patternProperties",)), "patternProperties:overlapping"


def schema_assertions(schema: Any, path: tuple = ()) -> Iterator[tuple[str, str]]:
    """Yield (JSON pointer, keyword label) for every assertion in `schema` and its subschemas.

    A `false` subschema (rejects everything) is reported under the label `false`, except where
    its parent keyword's own measurement covers it (`additionalProperties: false`, `items: false`...).
    """
    if schema is False:
        yield json_pointer(path), "false"
    if not isinstance(schema, dict):
        return
    typed = "type" in schema
    for keyword, value in schema.items():
        label = keyword_label(keyword, value, typed) if keyword in ASSERTIONS else None
        if keyword == "required" and not set(value) <= set(schema.get("properties", ())):
            label = label.replace("required", "required:undeclared")  # names missing from `properties`
        if keyword == "properties" and isinstance(value, dict) and any(map(_needs_escape, value)):
            label = label.replace("properties", "properties:escaped")  # names JSON must escape
        if label is not None:
            yield json_pointer(path + (keyword,)), label
    for keyword in ("enum", "const"):
        if keyword in schema and not _values_fit_siblings(schema, keyword):
            yield json_pointer(path + (keyword,)), f"{keyword}:unfiltered"
    yield from _combinations(schema, path)
    for keyword in _SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                if isinstance(sub, (dict, bool)):
                    yield from schema_assertions(sub, path + (keyword, name))
    for keyword in _SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield from schema_assertions(sub, path + (keyword, i))
    for keyword in _SCHEMAS:
        if isinstance(schema.get(keyword), dict):
            yield from schema_assertions(schema[keyword], path + (keyword,))


def unhonoured(spec: GrammarSpec, backend: str) -> list[str]:
    """`pointer: keyword` for each assertion of a json_schema spec that `backend` may ignore.

    Empty for other spec kinds (regexes and grammars are compiled exactly) and for honoured schemas.
    A `whitespace` mode the backend only approximates is listed as `/: whitespace:<mode>`.
    """
    if spec.kind != "json_schema":
        return []
    honoured = (
        HONOURED.get(backend, frozenset())
        | HONOURED_BEYOND_SUITE.get(backend, frozenset())
        | HONOURED_COMBINATIONS.get(backend, frozenset())
    ) - IGNORED_BEYOND_SUITE.get(backend, frozenset())
    missing = [
        f"{pointer or '/'}: {label}" for pointer, label in schema_assertions(spec.schema) if label not in honoured
    ]
    if spec.whitespace in INEXACT_WHITESPACE.get(backend, ()):
        missing.append(f"/: whitespace:{spec.whitespace}")
    return missing


def _structure(schema: Any, path: tuple = ()) -> Iterator[tuple[str, str]]:
    """(pointer, label) of the shapes a backend may narrow: `properties:several` (two or more
    declared properties: the backends force their declared order) and `any` (a free-form value:
    a subschema without assertions, an array without `items`, an object that takes undeclared
    properties of any value)."""
    if schema is True or (isinstance(schema, dict) and not set(schema) & ASSERTIONS):
        yield json_pointer(path), "any"
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("properties"), dict) and len(schema["properties"]) > 1:
        yield json_pointer(path + ("properties",)), "properties:several"
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if "array" in types and not {"items", "prefixItems"} & set(schema):
        yield json_pointer(path), "any"
    may_be_object = "object" in types or (types == [None] and "properties" in schema)
    if may_be_object and schema.get("additionalProperties", True) is True and "patternProperties" not in schema:
        yield json_pointer(path), "any"  # undeclared properties take free-form values
    for keyword, sub in subschemas(schema):
        yield from _structure(sub, path + keyword)


def narrowed(spec: GrammarSpec, backend: str) -> list[str]:
    """`pointer: label` for each part of a json_schema spec where `backend` is measured to reject
    valid instances (NARROWED) beyond what every backend rejects: what a routing by mask speed would
    weigh (auto keeps llguidance first, grammars/compiler.py). A free-form value (`any`) counts only
    with compact whitespace."""
    if spec.kind != "json_schema" or backend not in NARROWED:
        return []
    labels = [*schema_assertions(spec.schema), *_structure(spec.schema)]
    return [
        f"{pointer or '/'}: {label}"
        for pointer, label in labels
        if label in NARROWED[backend] and (label != "any" or spec.whitespace in ("compact", None, 0))
    ]


def native_formats(backend: str) -> frozenset[str]:
    """The formats `backend` is measured to honour itself (next to `type: string`) and implements
    (not UNKNOWN_FORMATS); the compiler turns any other format into a pattern (`lowering.py`)."""
    return frozenset(label[len("format:") :] for label in HONOURED.get(backend, ()) if label.startswith("format:")
                     and "@" not in label) - UNKNOWN_FORMATS.get(backend, frozenset())  # fmt: skip


# Formats a backend honours by failing: it names them unknown and compiles nothing, so HONOURED lists
# them, but a schema with one compiles only once formats.py's pattern stands in for it.
# tests/grammars/test_formats.py (test_unknown_formats...) re-measures them.
UNKNOWN_FORMATS: dict[str, frozenset[str]] = {
    "llguidance": frozenset({
        "idn-email", "idn-hostname", "iri", "iri-reference", "json-pointer", "regex", "relative-json-pointer",
        "uri-reference", "uri-template",
    }),
}  # fmt: skip


# `GrammarSpec.whitespace` modes a backend can only approximate (it would allow more whitespace
# than asked, though still bounded): outlines-core puts one pattern in every gap between JSON
# tokens, so json.dumps's separators (a space after `,` and `:` only) become "at most one space
# in any gap" (tests/grammars/test_whitespace.py walks every mode through every backend).
INEXACT_WHITESPACE: dict[str, frozenset[str]] = {"outlines": frozenset({"default"})}


# Measured, not guessed: each JSON-Schema-Test-Suite (draft2020-12) schema, plus a typed variant
# of each untyped one, compiled non-strict by each backend, every instance walked through masks
# (evaluate.measure_suite). A label is honoured when no invalid instance got through (the backend
# enforced it or failed loudly). Regenerate with
#   tandem eval-schemas ../shared/data/json-schema-test-suite/draft2020-12 --measure-keywords \
#       --backend NAME --timeout 30
# (shipped tokenizer; xgrammar 0.2.9, llguidance 1.9.1, outlines-core 0.2.14; a label with a
# timed-out schema counts as not honoured; tests/grammars/test_support.py re-measures a sample).
# Labels absent here (never measured, e.g. draft-4 `items[]`, `dependencies`) are refused.
HONOURED: dict[str, frozenset[str]] = {
    "xgrammar": frozenset({
        "$dynamicRef", "additionalProperties", "additionalProperties@untyped", "anyOf", "const",
        "enum", "exclusiveMaximum", "exclusiveMinimum", "false", "format:duration",
        "format:email", "format:ipv4", "format:json-pointer", "format:relative-json-pointer",
        "format:uri", "format:uri-reference", "format:uri-template", "format:uuid", "items",
        "items@untyped", "maxContains", "maxContains@untyped", "maxItems", "maxLength",
        "maxProperties", "maximum", "minContains", "minContains@untyped", "minItems",
        "minLength", "minProperties", "minimum", "pattern", "patternProperties", "prefixItems",
        "prefixItems@untyped", "properties", "properties@untyped", "propertyNames", "required",
        "required@untyped", "type", "unevaluatedItems", "unevaluatedItems@untyped"
    }),
    "llguidance": frozenset({
        "$dynamicRef", "$ref", "additionalProperties", "additionalProperties@untyped", "allOf",
        "anyOf", "const", "contains", "contains@untyped", "dependentRequired",
        "dependentRequired@untyped", "dependentSchemas", "dependentSchemas@untyped", "else",
        "enum", "exclusiveMaximum", "exclusiveMaximum@untyped", "exclusiveMinimum",
        "exclusiveMinimum@untyped", "false", "format:duration", "format:duration@untyped",
        "format:email", "format:email@untyped", "format:idn-email", "format:idn-email@untyped",
        "format:idn-hostname", "format:idn-hostname@untyped", "format:ipv4",
        "format:ipv4@untyped", "format:ipv6", "format:ipv6@untyped", "format:iri",
        "format:iri-reference", "format:iri-reference@untyped", "format:iri@untyped",
        "format:json-pointer", "format:json-pointer@untyped", "format:regex",
        "format:regex@untyped", "format:relative-json-pointer",
        "format:relative-json-pointer@untyped", "format:uri", "format:uri-reference",
        "format:uri-reference@untyped", "format:uri-template", "format:uri-template@untyped",
        "format:uri@untyped", "format:uuid", "format:uuid@untyped", "if", "items",
        "items@untyped", "maxContains", "maxContains@untyped", "maxItems", "maxItems@untyped",
        "maxLength", "maxLength@untyped", "maxProperties", "maxProperties@untyped", "maximum",
        "maximum@untyped", "minContains", "minContains@untyped", "minItems", "minItems@untyped",
        "minLength", "minLength@untyped", "minProperties", "minProperties@untyped", "minimum",
        "minimum@untyped", "multipleOf", "multipleOf@untyped", "not", "oneOf", "pattern",
        "pattern@untyped", "patternProperties", "patternProperties@untyped", "prefixItems",
        "prefixItems@untyped", "properties", "properties:escaped", "properties:escaped@untyped",
        "properties@untyped", "propertyNames", "propertyNames@untyped", "required",
        "required:undeclared", "required:undeclared@untyped", "required@untyped", "then",
        "type", "unevaluatedItems", "unevaluatedItems@untyped", "unevaluatedProperties",
        "unevaluatedProperties@untyped", "uniqueItems", "uniqueItems@untyped"
    }),
    "outlines": frozenset({
        "$dynamicRef", "$ref", "additionalProperties", "additionalProperties@untyped", "allOf",
        "anyOf", "const", "contains@untyped", "dependentRequired", "dependentRequired@untyped",
        "dependentSchemas", "dependentSchemas@untyped", "else", "enum", "exclusiveMaximum",
        "exclusiveMaximum@untyped", "exclusiveMinimum", "exclusiveMinimum@untyped", "false",
        "format:date-time", "format:date-time@untyped", "format:date@untyped",
        "format:duration", "format:duration@untyped", "format:email", "format:email@untyped",
        "format:hostname", "format:hostname@untyped", "format:idn-email",
        "format:idn-email@untyped", "format:idn-hostname", "format:idn-hostname@untyped",
        "format:ipv4", "format:ipv4@untyped", "format:ipv6", "format:ipv6@untyped",
        "format:iri", "format:iri-reference", "format:iri-reference@untyped",
        "format:iri@untyped", "format:json-pointer", "format:json-pointer@untyped",
        "format:regex", "format:regex@untyped", "format:relative-json-pointer",
        "format:relative-json-pointer@untyped", "format:time@untyped", "format:uri-reference",
        "format:uri-reference@untyped", "format:uri-template", "format:uri-template@untyped",
        "format:uri@untyped", "format:uuid", "format:uuid@untyped", "if", "maxContains",
        "maxContains@untyped", "maxItems", "maxItems@untyped", "maxLength@untyped",
        "maxProperties", "maxProperties@untyped", "maximum", "maximum@untyped", "minContains",
        "minContains@untyped", "minItems", "minItems@untyped", "minLength@untyped",
        "minProperties", "minProperties@untyped", "minimum@untyped", "multipleOf@untyped",
        "not", "pattern", "pattern@untyped", "patternProperties", "patternProperties@untyped",
        "prefixItems", "prefixItems@untyped", "properties:escaped",
        "properties:escaped@untyped", "propertyNames", "propertyNames@untyped", "required",
        "required:undeclared", "required:undeclared@untyped", "required@untyped", "then",
        "type", "unevaluatedItems@untyped", "unevaluatedProperties",
        "unevaluatedProperties@untyped"
    }),
}  # fmt: skip

# Labels no JSON-Schema-Test-Suite file exercises, so `--measure-keywords` cannot measure them;
# measured instead by tests/grammars/test_support.py (test_enum_and_const_with_conflicting_siblings...),
# which walks invalid instances through every backend. Unlisted backends refuse these labels.
HONOURED_BEYOND_SUITE: dict[str, frozenset[str]] = {
    "llguidance": frozenset({"enum:unfiltered", "const:unfiltered"}),
}

# `_combinations`' labels, measured by tests/grammars/test_support.py (test_keyword_combinations...),
# which walks an invalid instance of each through every backend. MaskBench caught xgrammar on all
# four (Github_easy---o9867: a pattern's maxLength ignored; o44051: `format: uri` beside a pattern;
# o87825: `patternProperties: {".*": ...}` not applied to declared properties; Glaiveai2K---
# calculate_area_eb6be0b0: `properties` ignored beside `anyOf`); outlines-core on the overlap.
HONOURED_COMBINATIONS: dict[str, frozenset[str]] = {
    "llguidance": frozenset({
        "pattern:with-length", "pattern:with-format", "anyOf:with-properties", "patternProperties:overlapping",
    }),
    "outlines": frozenset({"pattern:with-length", "pattern:with-format", "anyOf:with-properties"}),
}  # fmt: skip

# Labels where a backend rejects valid instances that the other backends accept: from
# `--measure-keywords`' "narrowed" table (xgrammar less llguidance; both narrow `type`, `enum` and
# `const`, e.g. 1.0 for an integer), and from MaskBench's valid instances: xgrammar reads a
# `patternProperties` regex as anchored (o14471) and takes no escape in a string with a length bound
# (o9871). Both force the declared property order (o10094), so `properties:several` is listed for
# neither. xgrammar 0.2.8 also took one key or item in a free-form value with compact whitespace
# (Github_easy---o1008, o33825, JME_45: `any`) and narrowed nine untyped keywords more; 0.2.9 takes
# them all. tests/grammars/test_support.py (test_narrowed...) re-measures them.
NARROWED: dict[str, frozenset[str]] = {
    "xgrammar": frozenset({
        "additionalProperties@untyped", "unevaluatedItems@untyped", "unevaluatedProperties@untyped",
        "patternProperties", "patternProperties@untyped", "maxLength", "maxLength@untyped", "minLength",
        "minLength@untyped",
    }),
}  # fmt: skip

# Labels the suite measured as honoured that MaskBench caught being ignored (`tandem eval-schemas`
# let an invalid instance through): subtracted from HONOURED, so a regenerated table cannot bring
# them back. outlines-core drops `not` over object keywords (MaskBench Github_trivial---o91408:
# `{"not": {"required": [...]}}`; Handwritten---pnmp10: `not` over `anyOf`);
# tests/grammars/test_support.py (test_keywords_ignored_beyond_the_suite...) re-measures it.
IGNORED_BEYOND_SUITE: dict[str, frozenset[str]] = {
    "outlines": frozenset({"not"}),
}
