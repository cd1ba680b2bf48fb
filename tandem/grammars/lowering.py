"""Exact rewrites of a (normalised, 2020-12) JSON schema into keywords more backends honour.

Each rewrite accepts exactly the instances the original accepts, except where a format becomes a
pattern: that pattern accepts a subset of the format's valid strings (`formats.py`), never more.

- a subschema with finitely many candidate values (`enum`, `const`, an `allOf` member with one of
  them, or a `type` of only `boolean` / `null`) and other assertions becomes the `enum` of the
  candidates that pass it (checked with jsonschema), whatever keywords (`not`, `oneOf`...) it holds;
- `oneOf` whose branches are pairwise disjoint becomes `anyOf` (`disjoint` states the proofs), and
  so does a `oneOf` of bare `required` lists (`_exactly_one_required`);
- `not` of a bare `type` becomes the complement `type`; `not` of a bare `required` becomes "an
  object lacking one of the names" (`properties: {name: false}`); `not: {}` is `false`;
- `dependentRequired: {a: [b]}` becomes `anyOf: [{properties: {a: false}}, {required: [b]}]`, and
  `dependentSchemas: {a: S}` becomes `anyOf: [{properties: {a: false}}, S]`;
- `uniqueItems` on an array of at most one item (`maxItems` <= 1), or `uniqueItems: false`, is dropped;
- a `format` the backend lacks becomes a `pattern` (next to an existing pattern: an `allOf` member);
  a format JSON Schema does not define (and `formats.py` has no pattern for) is an annotation, dropped.

A schema with `unevaluatedProperties` / `unevaluatedItems` is only normalised: the rewrites would
drop the annotations those keywords read.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import jsonschema

from tandem.grammars.formats import format_pattern
from tandem.grammars.normalize import normalize_source
from tandem.grammars.support import ASSERTIONS, DEFINED_FORMATS

_BASIC_TYPES = ("null", "boolean", "object", "array", "string", "number")
_MAX_REF_DEPTH = 8


def _value_key(value: Any) -> tuple[str, Any] | None:
    """(JSON type, value), equal for values JSON Schema calls equal (1 == 1.0, true != 1); None
    for arrays and objects."""
    if value is None:
        return ("null", None)
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    return ("string", value) if isinstance(value, str) else None


def _values_of(schema: Any) -> set | None:
    """Keys (`_value_key`) of the values `schema`'s const / enum allows; None if it has neither or
    lists an array or object."""
    if not isinstance(schema, dict):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list):
        return None
    keys = [_value_key(v) for v in values]
    return None if None in keys else set(keys)


def _types(schema: dict) -> list:
    return schema["type"] if isinstance(schema["type"], list) else [schema["type"]]


@dataclass
class _Facts:
    """What every instance of a subschema satisfies: its JSON types (None: any; integers count as
    numbers), its values (None: unbounded; `_value_key`s), the properties it requires and, per
    property, the values that property may take."""

    types: set[str] | None = None
    values: set | None = None
    required: set[str] = field(default_factory=set)
    property_values: dict[str, set] = field(default_factory=dict)

    def add(self, other: _Facts) -> None:
        """Also satisfy `other` (an allOf member, a $ref target): intersect (mutates)."""
        if other.types is not None:
            self.types = other.types if self.types is None else self.types & other.types
        if other.values is not None:
            self.values = other.values if self.values is None else self.values & other.values
        self.required |= other.required
        for name, values in other.property_values.items():
            self.property_values[name] = self.property_values.get(name, values) & values


def _pop_dict(schema: dict, keyword: str) -> dict:
    """`schema[keyword]` removed if it is an object (a dependency map), else {} (left as it is)."""
    return schema.pop(keyword) if isinstance(schema.get(keyword), dict) else {}


def _exactly_one_required(branches: list) -> list | None:
    """`oneOf` of two or more branches that only list `required` names, as an equivalent `anyOf`:
    an object with every name of one branch and, for each other branch, one of its names absent
    (`properties: {name: false}`); a non-object passes every branch, so none. None if a branch
    holds anything else."""
    if len(branches) < 2 or not all(
        isinstance(b, dict) and set(b) & ASSERTIONS == {"required"} and isinstance(b["required"], list)
        for b in branches
    ):
        return None
    names = [list(dict.fromkeys(b["required"])) for b in branches]
    any_of = []
    for i, own in enumerate(names):
        others = [[n for n in other if n not in own] for j, other in enumerate(names) if j != i]
        if not all(others):  # another branch's names are all among these: both would hold
            continue
        absent = [{"anyOf": [{"properties": {n: False}} for n in other]} for other in others]
        any_of.append({"type": "object", "required": own, "allOf": absent})
    return any_of or [False]


class _Lowering:
    def __init__(self, root: Any, native_formats: frozenset[str]):
        self.root = root
        self.native_formats = native_formats
        # Enums are filtered with formats asserted, and only where jsonschema checks every format
        # the schema names: a value kept past an unchecked format would lose it.
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        formats = set(re.findall(r'"format": "([^"]*)"', json.dumps(root)))
        checkable = isinstance(root, dict) and formats <= set(checker.checkers)
        self.validator = jsonschema.Draft202012Validator(root, format_checker=checker) if checkable else None

    def resolve(self, schema: Any) -> Any:
        """Follow `$ref`s that point from the root (normalised schemas have no other kind) to the
        schema they name; the schema itself if it has none, None if one cannot be followed."""
        for _ in range(_MAX_REF_DEPTH):
            ref = schema.get("$ref") if isinstance(schema, dict) else None
            if not isinstance(ref, str):
                return schema
            if not ref.startswith("#"):
                return None
            schema = self.root
            for token in unquote(ref[1:]).split("/")[1:]:
                token = token.replace("~1", "/").replace("~0", "~")
                if isinstance(schema, list) and token.isdigit() and int(token) < len(schema):
                    schema = schema[int(token)]
                elif isinstance(schema, dict) and token in schema:
                    schema = schema[token]
                else:
                    return None
        return None

    def facts(self, schema: Any, depth: int = 0) -> _Facts:
        """Constraints every instance of `schema` meets, read from type / const / enum / required /
        properties, through `$ref` and `allOf` (an instance satisfies all of them)."""
        facts = _Facts()
        if schema is False:
            facts.types, facts.values = set(), set()
        if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH:
            return facts
        if "type" in schema:
            facts.types = {"number" if t == "integer" else t for t in _types(schema)}
        if (values := _values_of(schema)) is not None:
            facts.add(_Facts(types={t for t, _ in values}, values=values))
        if isinstance(schema.get("required"), list):
            facts.required = {r for r in schema["required"] if isinstance(r, str)}
        if isinstance(schema.get("properties"), dict):
            for name, sub in schema["properties"].items():
                if (values := _values_of(self.resolve(sub))) is not None:
                    facts.property_values[name] = values
        if "$ref" in schema:
            facts.add(self.facts(self.resolve({"$ref": schema["$ref"]}), depth + 1))
        for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else ():
            facts.add(self.facts(member, depth + 1))
        return facts

    def disjoint(self, a: Any, b: Any, context: _Facts) -> bool:
        """Whether no instance of `context` (what the parent schema asserts beside them) satisfies
        both `a` and `b`, provably: their JSON types differ; or their const/enum values differ; or
        only objects pass (one of them or the parent), one requires a property, and the two allow
        different const/enum values for it (a discriminated union)."""
        fa, fb = self.facts(a), self.facts(b)
        fa.add(context)
        fb.add(context)
        if fa.types is not None and fb.types is not None and not fa.types & fb.types:
            return True
        if fa.values is not None and fb.values is not None and not fa.values & fb.values:
            return True
        objects_only = (fa.types is not None and fa.types <= {"object"}) or (
            fb.types is not None and fb.types <= {"object"}
        )
        return objects_only and any(
            name in fa.required | fb.required and not fa.property_values[name] & fb.property_values[name]
            for name in fa.property_values.keys() & fb.property_values.keys()
        )

    def candidates(self, schema: dict) -> list | None:
        """The finitely many values `schema` may take, if it states them (enum / const / a
        boolean-or-null type / an allOf member with one of those)."""
        if "const" in schema:
            return [schema["const"]]
        if isinstance(schema.get("enum"), list):
            return schema["enum"]
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if types and set(types) <= {"boolean", "null"}:
            return [v for v in (None, False, True) if _value_key(v)[0] in types]
        for member in schema.get("allOf", []):
            if isinstance(member, dict) and (found := self.candidates(member)) is not None:
                return found
        return None

    def filtered_enum(self, schema: dict) -> dict | None:
        """`schema` as the enum of its candidates that pass it, when that changes anything."""
        values = self.candidates(schema)
        assertions = set(schema) & ASSERTIONS - {"enum", "const", "type"}
        if values is None or self.validator is None:  # nothing finite, or a format jsonschema cannot check
            return None
        try:
            kept = [v for v in values if self.validator.evolve(schema=schema).is_valid(v)]
        except Exception:  # a $ref jsonschema cannot follow: leave the schema as it is
            return None
        if not assertions and len(kept) == len(values):
            return None
        out = {"enum": kept}
        if "$defs" in schema:
            out["$defs"] = schema["$defs"]
        return out

    def lower(self, schema: Any) -> Any:
        """The rewritten copy of `schema` (subschemas first, then this one)."""
        if not isinstance(schema, dict):
            return schema
        out = {}
        for keyword, value in schema.items():
            if keyword in ("properties", "patternProperties", "$defs") and isinstance(value, dict):
                out[keyword] = {k: self.lower(v) for k, v in value.items()}
            elif keyword in ("allOf", "anyOf", "oneOf", "prefixItems") and isinstance(value, list):
                out[keyword] = [self.lower(v) for v in value]
            elif keyword in ("additionalProperties", "propertyNames", "items", "contains", "not", "if", "then", "else"):
                out[keyword] = self.lower(value)
            else:
                out[keyword] = value
        if (filtered := self.filtered_enum(out)) is not None:
            return filtered
        if isinstance(out.get("oneOf"), list):
            branches = out["oneOf"]
            context = self.facts({k: v for k, v in out.items() if k != "oneOf"})
            if all(self.disjoint(a, b, context) for i, a in enumerate(branches) for b in branches[i + 1 :]):
                any_of = branches
            else:
                any_of = _exactly_one_required(branches)
            if any_of is not None:
                del out["oneOf"]
                if "anyOf" in out:  # keep both: the oneOf becomes an allOf member
                    out["allOf"] = [*out.get("allOf", []), {"anyOf": any_of}]
                else:
                    out["anyOf"] = any_of
        # A dependency holds where its property is absent: `a` absent, or (all of its names present | its schema).
        dependencies = [
            (name, {"required": names}) for name, names in _pop_dict(out, "dependentRequired").items() if names
        ] + [
            (name, self.dependent_schema(name, then))
            for name, then in _pop_dict(out, "dependentSchemas").items()
            if then is not True
        ]
        if dependencies:
            out["allOf"] = [
                *out.get("allOf", []),
                *({"anyOf": [{"properties": {name: False}}, then]} for name, then in dependencies),
            ]
        if "not" in out:
            out = self.lower_not(out)
            if not isinstance(out, dict):
                return out
        if out.get("uniqueItems") is False or (
            "uniqueItems" in out and isinstance(out.get("maxItems"), int) and out["maxItems"] <= 1
        ):
            del out["uniqueItems"]
        if isinstance(out.get("format"), str):
            out = self.lower_format(out)
        return out

    def dependent_schema(self, name: str, schema: Any) -> Any:
        """`dependentSchemas: {name: schema}`'s schema where it applies, to an object holding `name`: so
        stated, a `oneOf` tagged by that property can be proven disjoint; lowered."""
        if isinstance(schema, dict) and isinstance(schema.get("required", []), list):
            required = [name, *(n for n in schema.get("required", []) if n != name)]
            schema = {**schema, "type": schema.get("type", "object"), "required": required}
        return self.lower(schema)

    def lower_not(self, schema: dict) -> Any:
        negated = schema["not"]
        rest = {k: v for k, v in schema.items() if k != "not"}
        if negated is False or negated == {}:
            return rest if negated is False else False
        if negated is True:
            return False
        if isinstance(negated, dict) and set(negated) & ASSERTIONS == {"required"}:
            # an object without one of the names (`required` holds for every non-object)
            names = negated["required"]
            if not names:
                return False
            absent = [{"properties": {name: False}} for name in names]
            member = {"type": "object", **(absent[0] if len(absent) == 1 else {"anyOf": absent})}
            return {**rest, "allOf": [*rest.get("allOf", []), member]}
        if not isinstance(negated, dict) or set(negated) & ASSERTIONS != {"type"}:
            return schema
        excluded = negated["type"] if isinstance(negated["type"], list) else [negated["type"]]
        if "integer" in excluded and "number" not in excluded:
            return schema  # "a number but not an integer" has no `type`
        allowed = [t for t in _BASIC_TYPES if t not in excluded]
        if "type" in rest:
            own = rest["type"] if isinstance(rest["type"], list) else [rest["type"]]
            allowed = [t for t in own if ("number" if t == "integer" else t) in allowed]
        if not allowed:
            return False
        return {**rest, "type": allowed if len(allowed) > 1 else allowed[0]}

    def lower_format(self, schema: dict) -> dict:
        name = schema["format"]
        if name in self.native_formats:
            return schema
        pattern = format_pattern(name)
        rest = {k: v for k, v in schema.items() if k != "format"}
        if pattern is None:
            return schema if name in DEFINED_FORMATS else rest
        if "pattern" not in rest:
            return {**rest, "pattern": pattern}
        return {**rest, "allOf": [*rest.get("allOf", []), {"pattern": pattern}]}


@functools.lru_cache(maxsize=4096)
def lower_source(source: str, native_formats: frozenset[str] = frozenset()) -> tuple[str, tuple[str, ...]]:
    """(JSON text of the rewritten schema, problems) for the JSON text of a valid schema.

    `native_formats`: the formats the target backend checks itself (kept as `format`). `problems`
    are `normalize_source`'s (unresolvable `$ref`s), which no backend can compile.
    """
    source, problems = normalize_source(source)
    if problems or "unevaluated" in source:
        return source, problems
    schema = json.loads(source)
    return json.dumps(_Lowering(schema, native_formats).lower(schema), ensure_ascii=False), ()


__all__ = ["lower_source"]
