"""Exact rewrites of a (normalised, 2020-12) JSON schema into keywords more backends honour.

Each rewrite accepts exactly the instances the original accepts, except where a format becomes a
pattern: that pattern accepts a subset of the format's valid strings (`formats.py`), never more.

- a subschema with finitely many candidate values (`enum`, `const`, an `allOf` member with one of
  them, or a `type` of only `boolean` / `null`) and other assertions becomes the `enum` of the
  candidates that pass it (checked with jsonschema), whatever keywords (`not`, `oneOf`...) it holds;
- `oneOf` whose branches are pairwise disjoint becomes `anyOf` (`disjoint` states the proofs), and
  so does a `oneOf` of bare `required` lists (`_exactly_one_required`); otherwise, where every
  branch that may overlap another has a complement, "exactly one" is spelled out: each branch with
  the complements of the others (`exactly_one`);
- `not S` becomes S's complement where JSON Schema can state it without `not` (`negate`: per
  keyword, e.g. `not: {type}` the other types, `not: {required}` an object lacking a name,
  `not: {enum}` a pattern (patterns.py) and exclusive bounds that exclude the values), and
  `not: {}` is `false`; a format's pattern is never complemented (it narrows the format);
- `if` / `then` / `else` becomes "(if and then) or (complement of if and else)";
- `contains` that adds nothing to `items` becomes `minItems: 1`; on arrays of at most a few items
  (`maxItems`), "some position holds it" (`prefixItems`);
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
from tandem.grammars.patterns import literal_prefix, pattern_complement, strings_excluded
from tandem.grammars.support import ASSERTIONS, DEFINED_FORMATS

_BASIC_TYPES = ("null", "boolean", "object", "array", "string", "number")
_MAX_REF_DEPTH = 8
# A bound's complement: keyword -> (the type it constrains, the opposite keyword, step): "at least
# n" fails exactly where "at most n - 1" holds (integer counts), "minimum m" where "exclusiveMaximum m".
_OPPOSITE_BOUNDS = {
    "minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1),
    "minimum": ("number", "exclusiveMaximum", 0), "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0), "exclusiveMaximum": ("number", "minimum", 0),
}  # fmt: skip
# Keywords that constrain objects only: every other instance satisfies them.
_OBJECT_KEYWORDS = frozenset({
    "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
    "propertyNames", "dependentRequired", "dependentSchemas",
})  # fmt: skip
_MAX_ONE_OF_BRANCHES = 8  # a oneOf rewrite holds each branch with the complements of the others
_MAX_CONTAINS_POSITIONS = 8  # `contains` as "one of the first maxItems items" up to this many
_MAX_NEGATIONS = 10_000  # complements taken per schema: a recursive one is refused long before it gets big


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
    numbers), its values (None: unbounded; `_value_key`s), the properties it requires, those it
    forbids (`false`), the names an object may have at all (None: any; `additionalProperties:
    false`), per property the values that property may take, and a text a string starts with."""

    types: set[str] | None = None
    values: set | None = None
    required: set[str] = field(default_factory=set)
    forbidden: set[str] = field(default_factory=set)
    names: set[str] | None = None
    property_values: dict[str, set] = field(default_factory=dict)
    prefix: str | None = None

    def add(self, other: _Facts) -> None:
        """Also satisfy `other` (an allOf member, a $ref target): intersect (mutates)."""
        if other.types is not None:
            self.types = other.types if self.types is None else self.types & other.types
        if other.values is not None:
            self.values = other.values if self.values is None else self.values & other.values
        self.required |= other.required
        self.forbidden |= other.forbidden
        if other.names is not None:
            self.names = other.names if self.names is None else self.names & other.names
        for name, values in other.property_values.items():
            self.property_values[name] = self.property_values.get(name, values) & values
        if other.prefix is not None and (self.prefix is None or other.prefix.startswith(self.prefix)):
            self.prefix = other.prefix  # the longer of two compatible prefixes

    def excludes(self, other: _Facts) -> bool:
        """Whether an object of these facts cannot satisfy `other`'s: it lacks a name `other` requires."""
        return any(n in self.forbidden or (self.names is not None and n not in self.names) for n in other.required)


def _conjoin(a: Any, b: Any) -> Any:
    """A schema of the instances both `a` and `b` accept."""
    if a is False or b is False:
        return False
    return b if a is True else a if b is True else {"allOf": [a, b]}


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
        self.complements: dict[str, Any] = {}  # JSON text of a complement `negate` made -> its schema
        # Format patterns accept a subset of the format, so their complement would accept too much:
        # a subschema holding one (JSON-escaped here) is never complemented or read by a proof.
        self.format_patterns: set[str] = set()
        self.negations = 0  # `negate` calls so far (_MAX_NEGATIONS)

    def narrowed(self, schema: Any) -> bool:
        """Whether `schema` holds a pattern that stands for a format (`lower_format`)."""
        text = json.dumps(schema, ensure_ascii=False) if self.format_patterns else ""
        return any(pattern in text for pattern in self.format_patterns)

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
                if sub is False:
                    facts.forbidden.add(name)
        if schema.get("additionalProperties") is False and "patternProperties" not in schema:
            facts.names = set(schema.get("properties", ()))
        if isinstance(schema.get("pattern"), str):
            facts.prefix = literal_prefix(schema["pattern"])
        if "$ref" in schema:
            facts.add(self.facts(self.resolve({"$ref": schema["$ref"]}), depth + 1))
        for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else ():
            facts.add(self.facts(member, depth + 1))
        for keyword in ("anyOf", "oneOf"):  # one of the branches holds: the union of their types / values
            if isinstance(schema.get(keyword), list) and schema[keyword]:
                branches = [self.facts(branch, depth + 1) for branch in schema[keyword]]
                union = _Facts()
                if all(b.types is not None for b in branches):
                    union.types = set().union(*(b.types for b in branches))
                if all(b.values is not None for b in branches):
                    union.values = set().union(*(b.values for b in branches))
                facts.add(union)
        return facts

    def disjoint(self, a: Any, b: Any, context: _Facts) -> bool:
        """Whether no instance of `context` (what the parent schema asserts beside them) satisfies
        both `a` and `b`, provably: their JSON types differ; or their const/enum values differ; or
        one lists finitely many values and the other accepts none of them; or only strings pass and
        their patterns start with different texts; or only objects pass (one of them or the parent)
        and one requires a property the other forbids (`false`, `additionalProperties: false`) or
        allows different const/enum values for (a discriminated union)."""
        fa, fb = self.facts(a), self.facts(b)
        fa.add(context)
        fb.add(context)
        if fa.types is not None and fb.types is not None and not fa.types & fb.types:
            return True
        if fa.values is not None and fb.values is not None and not fa.values & fb.values:
            return True
        if self.none_accepted(a, b) or self.none_accepted(b, a):
            return True
        if (fa.types is not None and fa.types <= {"string"}) or (fb.types is not None and fb.types <= {"string"}):
            if fa.prefix and fb.prefix and not (fa.prefix.startswith(fb.prefix) or fb.prefix.startswith(fa.prefix)):
                return True
        objects_only = (fa.types is not None and fa.types <= {"object"}) or (
            fb.types is not None and fb.types <= {"object"}
        )
        return objects_only and (
            fa.excludes(fb)
            or fb.excludes(fa)
            or any(
                name in fa.required | fb.required and not fa.property_values[name] & fb.property_values[name]
                for name in fa.property_values.keys() & fb.property_values.keys()
            )
        )

    def none_accepted(self, a: Any, b: Any) -> bool:
        """Whether `a` states finitely many values and `b` accepts none of them (checked with jsonschema)."""
        target = self.resolve(a)
        values = self.candidates(target) if isinstance(target, dict) else None
        if values is None or self.validator is None or self.narrowed(b):
            return False
        try:
            return not any(self.validator.evolve(schema=b).is_valid(v) for v in values)
        except Exception:  # a $ref jsonschema cannot follow: no proof
            return False

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
        if any(self.narrowed(schema.get(k)) for k in ("not", "oneOf", "if")):  # read negated: too wide
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
            out = self.lower_one_of(out)
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
        for keyword, rewrite in (("not", self.lower_not), ("if", self.lower_if), ("contains", self.lower_contains)):
            if keyword in out:
                out = rewrite(out)
                if not isinstance(out, dict):
                    return out
        if "if" not in out:  # `then` / `else` without `if` assert nothing
            out = {k: v for k, v in out.items() if k not in ("then", "else")}
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

    def lower_one_of(self, schema: dict) -> dict:
        """`schema` with its `oneOf` as an `anyOf` where the branches are provably disjoint or each
        has the complements it needs (`exactly_one`)."""
        branches = schema["oneOf"]
        rest = {k: v for k, v in schema.items() if k != "oneOf"}
        context = self.facts(rest)
        if (any_of := _exactly_one_required(branches)) is None:
            # Two branches that only constrain objects both hold for every non-object, so no
            # non-object passes the oneOf: it is "an object, and exactly one branch".
            vacuous = sum(
                b is True or isinstance(b, dict) and set(b) & ASSERTIONS <= _OBJECT_KEYWORDS for b in branches
            )
            objects_only = vacuous >= 2 and (context.types is None or not context.types <= {"object"})
            if objects_only:
                context.add(_Facts(types={"object"}))
            if all(self.disjoint(a, b, context) for i, a in enumerate(branches) for b in branches[i + 1 :]):
                any_of = branches
            else:
                any_of = self.exactly_one(branches, context)
            if any_of is not None and objects_only:
                any_of = [{"type": "object", "anyOf": any_of}]
        if any_of is None:
            return schema
        if "anyOf" in rest:  # keep both: the oneOf becomes an allOf member
            return {**rest, "allOf": [*rest.get("allOf", []), {"anyOf": any_of}]}
        return {**rest, "anyOf": any_of}

    def exactly_one(self, branches: list, context: _Facts) -> list | None:
        """`oneOf` as an `anyOf`: each branch together with the complement (`negate`) of every other
        branch not provably disjoint from it; None if a complement is missing or the branches are
        too many (the rewrite grows with their square)."""
        if len(branches) > _MAX_ONE_OF_BRANCHES:
            return None
        any_of = []
        for i, branch in enumerate(branches):
            others = []
            facts = self.facts(branch)
            facts.add(context)
            for j, other in enumerate(branches):
                if j != i and not self.disjoint(branch, other, context):
                    if (complement := self.negate(other, names=facts.names)) is None:
                        return None
                    others.append(complement)
            if all(c is not False for c in others):  # False: the other branch always holds too
                kept = [c for c in others if c is not True]
                any_of.append({"allOf": [branch, *kept]} if kept else branch)
        return any_of or [False]

    def lower_if(self, schema: dict) -> Any:
        """`if` / `then` / `else` as "(if and then) or (not if and else)", where `if` has a complement."""
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        then, otherwise = schema.get("then", True), schema.get("else", True)
        if then is True and otherwise is True:
            return rest
        if (complement := self.negate(schema["if"])) is None:
            return schema
        cases = [_conjoin(schema["if"], then), _conjoin(complement, otherwise)]
        cases = [c for c in cases if c is not False]
        if not cases:
            return False
        return {**rest, "allOf": [*rest.get("allOf", []), cases[0] if len(cases) == 1 else {"anyOf": cases}]}

    def lower_contains(self, schema: dict) -> Any:
        """`contains` where it says less than an array's other keywords: `minContains: 0` (always
        holds); every item satisfying it (`items` the same schema, or `contains: true`): one item,
        `minItems: 1`; at most n items (`maxItems`): one of the first n positions satisfies it
        (`prefixItems`). `maxContains` and `minContains` above 1 are left alone."""
        contains, at_least = schema["contains"], schema.get("minContains", 1)
        rest = {k: v for k, v in schema.items() if k not in ("contains", "minContains")}
        if "maxContains" in schema or not isinstance(at_least, int) or at_least > 1:
            return schema
        if at_least == 0:
            return rest
        if not (isinstance(contains, dict) and set(contains) & ASSERTIONS) and contains is not False:
            contains = True  # no assertion: any item satisfies it
        if contains is True or ("prefixItems" not in schema and schema.get("items") == contains):
            return {**rest, "minItems": max(rest.get("minItems", 0), 1)}
        bound = 0 if contains is False else schema.get("maxItems")
        if not isinstance(bound, int) or bound > _MAX_CONTAINS_POSITIONS:
            return schema
        positions = [{"prefixItems": [True] * i + [contains], "minItems": i + 1} for i in range(bound)]
        arrays_fail = {"type": [t for t in _BASIC_TYPES if t != "array"]}  # no position: no array holds it
        member = arrays_fail if not positions else positions[0] if len(positions) == 1 else {"anyOf": positions}
        return {**rest, "allOf": [*rest.get("allOf", []), member]}

    def lower_not(self, schema: dict) -> Any:
        """`schema` with its `not` replaced by `negate`'s complement, where there is one."""
        rest = {k: v for k, v in schema.items() if k != "not"}
        complement = self.negate(schema["not"])
        if complement is None or complement is False:
            return schema if complement is None else False
        if complement is True:
            return rest
        if set(complement) == {"type"} and "type" in rest:  # intersect the two type lists
            allowed = _types(complement)
            kept = [t for t in _types(rest) if ("number" if t == "integer" else t) in allowed]
            return {**rest, "type": kept if len(kept) > 1 else kept[0]} if kept else False
        if set(complement) == {"type"}:
            return {**rest, **complement}
        return {**rest, "allOf": [*rest.get("allOf", []), complement]}

    def negate(self, schema: Any, depth: int = 0, names: set[str] | None = None) -> Any:
        """A schema without `not` that exactly the instances failing `schema` satisfy (True / False
        for all / none), or None where no keyword the backends read can state it.

        A subschema is the conjunction of its keywords, so its complement is the `anyOf` of theirs:
        a `type`'s complement type; other values than an `enum`'s (`excluded`); an object lacking a
        `required` name, or with a `properties` value failing its schema; the opposite length /
        count / number bound (typed: `minLength` holds for every non-string); a pattern's complement
        where it is a fixed run of characters (`pattern_complement`); for `propertyNames`, one of
        the finitely many names its complement allows present; the `allOf` of an `anyOf`'s
        complements and the `anyOf` of an `allOf`'s; a `not`'s own schema; a `$ref`'s target's.
        Keywords that read each other (`additionalProperties`, `items`, `contains`, `if`...) and
        the rest (`multipleOf`, `format`, `oneOf`...) have none. `names`: the only property names an
        object may have where the complement applies (None: any); an object lacking a property
        `additionalProperties: false` does not declare then fails by holding one of the other names.
        A complement of a complement is the schema it was made from (`self.complements`)."""
        if isinstance(schema, bool):
            return not schema
        self.negations += 1
        if not isinstance(schema, dict) or depth > _MAX_REF_DEPTH or self.negations > _MAX_NEGATIONS:
            return None
        if self.narrowed(schema):
            return None
        if (key := json.dumps(schema, sort_keys=True)) in self.complements:
            return self.complements[key]
        parts = []
        for keyword in [k for k in schema if k in ASSERTIONS]:
            part = self.negate_keyword(keyword, schema[keyword], schema, depth, names)
            if part is None or part is True:
                return part
            if part is not False:  # the keyword always holds: no instance fails it
                parts.append(part)
        complement = False if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}
        if isinstance(complement, dict) and names is None:  # with `names`, a complement only within them
            self.complements[json.dumps(complement, sort_keys=True)] = schema
        return complement

    def negate_keyword(self, keyword: str, value: Any, schema: dict, depth: int, names: set[str] | None) -> Any:
        """The complement of `{keyword: value}` within `schema` (see `negate`), or None."""
        if keyword == "type":
            excluded = value if isinstance(value, list) else [value]
            if "integer" in excluded and "number" not in excluded:
                return None  # "a number but not an integer" has no `type`
            allowed = [t for t in _BASIC_TYPES if t not in excluded]
            return {"type": allowed if len(allowed) > 1 else allowed[0]} if allowed else False
        if keyword in ("enum", "const"):
            values = [value] if keyword == "const" else value
            return self.excluded(values) if isinstance(values, list) else None
        if keyword == "required" and isinstance(value, list):
            absent = [{"properties": {name: False}} for name in dict.fromkeys(value)]
            return {"type": "object", **(absent[0] if len(absent) == 1 else {"anyOf": absent})} if absent else False
        if keyword == "additionalProperties" and value is False and "patternProperties" not in schema:
            if names is None:
                return None
            undeclared = sorted(names - set(schema.get("properties", ())))
            return {"anyOf": [{"type": "object", "required": [n]} for n in undeclared]} if undeclared else False
        if keyword == "properties" and isinstance(value, dict):
            if "patternProperties" in schema or schema.get("additionalProperties", False) not in (True, False):
                return None  # additionalProperties reads which names `properties` declares
            failing = []
            for name, sub in value.items():
                if names is not None and name not in names:
                    continue  # never present where the complement applies
                complement = self.negate(sub, depth + 1)
                if complement is None:
                    return None
                if complement is not False:
                    failing.append({"type": "object", "required": [name], "properties": {name: complement}})
            return False if not failing else failing[0] if len(failing) == 1 else {"anyOf": failing}
        if keyword == "additionalProperties" and value is True:
            return False
        if keyword in _OPPOSITE_BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            instance_type, opposite, step = _OPPOSITE_BOUNDS[keyword]
            if step == -1 and value <= 0:
                return False  # a minimum length / count of 0 always holds
            if step and value != int(value):
                return None
            return {"type": instance_type, opposite: int(value) + step if step else value}
        if keyword == "pattern" and isinstance(value, str):
            return pattern_complement(value)
        if keyword == "propertyNames":  # some name fails it: one of finitely many names present
            complement = self.negate(value, depth + 1)
            if complement is True or complement is False:
                return {"type": "object", "minProperties": 1} if complement else False
            listed = self.candidates(complement) if isinstance(complement, dict) else None
            if listed is None or self.validator is None or not all(isinstance(n, str) for n in listed):
                return None
            try:  # the listed names the complement accepts (its other keywords may rule some out)
                failing = [n for n in dict.fromkeys(listed) if self.validator.evolve(schema=complement).is_valid(n)]
            except Exception:  # a $ref jsonschema cannot follow
                return None
            return {"anyOf": [{"type": "object", "required": [n]} for n in failing]} if failing else False
        if keyword in ("anyOf", "allOf") and isinstance(value, list) and value:
            complements = [self.negate(sub, depth + 1, names) for sub in value]
            if any(c is None for c in complements):
                return None
            # An anyOf's complement is the allOf of its members' (True changes nothing, False decides
            # it), an allOf's the anyOf (False changes nothing, True decides it).
            neutral = keyword == "anyOf"
            kept = [c for c in complements if c is not neutral]
            if any(c is (not neutral) for c in kept):
                return not neutral
            if not kept:
                return neutral
            return kept[0] if len(kept) == 1 else {("allOf" if neutral else "anyOf"): kept}
        if keyword == "not":
            return value
        if keyword == "$ref" and isinstance(value, str):
            target = self.resolve({"$ref": value})
            return None if target is None else self.negate(target, depth + 1, names)
        return None

    def excluded(self, values: list) -> Any:
        """A schema every JSON value but `values` satisfies: strings by a pattern, numbers by
        exclusive bounds either side, null / booleans by type or enum; None for arrays and objects."""
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
            return None
        strings = [v for v in values if isinstance(v, str)]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        scalars = {_value_key(v) for v in values if v is None or isinstance(v, bool)}
        parts = []
        if strings and (part := strings_excluded(strings)) is None:
            return None
        if strings:
            parts.append(part)
        parts += [{"anyOf": [{"exclusiveMaximum": n}, {"exclusiveMinimum": n}]} for n in dict.fromkeys(numbers)]
        if scalars:
            kept = [v for v in (None, False, True) if _value_key(v) not in scalars]
            other = [t for t in _BASIC_TYPES if t not in ("null", "boolean")]
            parts.append({"anyOf": [{"type": other}, {"enum": kept}]} if kept else {"type": other})
        return True if not parts else parts[0] if len(parts) == 1 else {"allOf": parts}

    def lower_format(self, schema: dict) -> dict:
        name = schema["format"]
        if name in self.native_formats:
            return schema
        pattern = format_pattern(name)
        rest = {k: v for k, v in schema.items() if k != "format"}
        if pattern is None:
            return schema if name in DEFINED_FORMATS else rest
        self.format_patterns.add(json.dumps(pattern)[1:-1])
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
