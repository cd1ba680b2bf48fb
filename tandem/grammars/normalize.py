"""Draft-aware normalisation: any JSON schema (draft-04 to 2020-12) rewritten to the 2020-12 forms
the backends read, accepting exactly the same instances.

The draft is the schema's `$schema`; without one, 2020-12, unless the schema is written in an older
draft's forms (`schema_validator`). The rewrite, per subschema:

- `id` (draft-04) / `$id`, `$anchor`: resolved, then dropped: every `$ref` becomes a JSON pointer
  from the root (`#/$defs/a`), which every backend follows; a `$ref` that leaves the document is
  refused with its URL (remote schemas are never fetched);
- `definitions` -> `$defs`; a `$ref` target outside any schema keyword (`#/components/x`) is
  moved into `$defs`, so the support check sees it;
- array `items` -> `prefixItems`, `additionalItems` -> `items` (drafts 4 to 2019-09);
- `dependencies` -> `dependentRequired` (arrays) / `dependentSchemas` (schemas);
- draft-04's boolean `exclusiveMinimum` / `exclusiveMaximum` -> the 2020-12 numeric form;
- draft 4 to 7 ignore a `$ref`'s siblings, so they are dropped; a keyword the source draft does not
  define (draft-04's `const`...) is dropped too: its validator ignores it.

A schema with `$dynamicRef` / `$recursiveRef` / `$dynamicAnchor` is left as it is: those resolve
against the dynamic scope, which root pointers cannot state.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

import jsonschema

# Each draft's validator; its VALIDATORS are the keywords the draft defines.
DRAFTS: dict[str, type] = {
    "draft-04": jsonschema.Draft4Validator,
    "draft-06": jsonschema.Draft6Validator,
    "draft-07": jsonschema.Draft7Validator,
    "2019-09": jsonschema.Draft201909Validator,
    "2020-12": jsonschema.Draft202012Validator,
}
_ALL_KEYWORDS = frozenset(k for v in DRAFTS.values() for k in v.VALIDATORS)
_DYNAMIC = ('"$dynamicRef"', '"$recursiveRef"', '"$dynamicAnchor"', '"$recursiveAnchor"')
# Keywords whose value is a map of subschemas / a subschema / a list of subschemas (any draft).
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_ONE = ("additionalProperties", "propertyNames", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_LEGACY = ("dependencies", "additionalItems")  # keywords 2020-12 ignores: a schema using them meant an older draft
_DEFAULT_BASE = "https://tandem.invalid/schema.json"  # base URI of a schema without `$id`


def json_pointer(path: Sequence[str | int]) -> str:
    """RFC 6901 pointer for a path of keys/indices: ["a/b", 0] -> "/a~1b/0"; [] -> "" (the root)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def subschemas(schema: dict) -> list[tuple[tuple, Any]]:
    """(relative path, subschema) of the schema positions directly under `schema`, in any draft."""
    found = []
    for keyword in _MAPS:
        if isinstance(schema.get(keyword), dict):
            found += [((keyword, k), v) for k, v in schema[keyword].items() if isinstance(v, (dict, bool))]
    for keyword in _LISTS:
        if isinstance(schema.get(keyword), list):
            found += [((keyword, i), v) for i, v in enumerate(schema[keyword])]
    for keyword in _ONE:
        if isinstance(schema.get(keyword), (dict, bool)):
            found.append(((keyword,), schema[keyword]))
    return found


def _uses_legacy_forms(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if any(k in schema for k in _LEGACY) or isinstance(schema.get("items"), list):
        return True
    return any(_uses_legacy_forms(sub) for _, sub in subschemas(schema))


def schema_validator(schema: Any) -> type:
    """The jsonschema validator class of the draft `schema` is written in.

    Its `$schema` when that names a draft; without one, 2020-12, unless the schema uses forms 2020-12
    rejects or ignores (array `items`, `additionalItems`, `dependencies`, boolean
    `exclusiveMinimum`): then draft-07, or draft-04 where only draft-04's metaschema accepts it.
    """
    if isinstance(schema, dict) and "$schema" in schema:
        return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if not _uses_legacy_forms(schema) and jsonschema.Draft202012Validator(
        jsonschema.Draft202012Validator.META_SCHEMA
    ).is_valid(schema):
        return jsonschema.Draft202012Validator
    for validator in (jsonschema.Draft7Validator, jsonschema.Draft4Validator):
        if validator(validator.META_SCHEMA).is_valid(schema):
            return validator
    return jsonschema.Draft202012Validator


class _Normaliser:
    def __init__(self, root: Any, draft: str):
        self.root = root
        self.draft = draft
        self.known = frozenset(DRAFTS[draft].VALIDATORS)
        self.legacy = draft in ("draft-04", "draft-06", "draft-07")
        self.id_keyword = "id" if draft == "draft-04" else "$id"
        self.new_paths: dict[tuple, tuple] = {}  # original path of a subschema -> its path in the output
        self.resources: dict[str, tuple] = {}  # absolute URI (no fragment) -> original path
        self.anchors: dict[tuple[str, str], tuple] = {}  # (resource URI, anchor name) -> original path
        self.bases: dict[tuple, str] = {}  # original path of a subschema -> its base URI
        self.refs: list[tuple[dict, tuple, str]] = []  # (output node, original path, its base URI)
        self.hoisted: dict[str, Any] = {}  # $defs added for $ref targets outside schema keywords
        self.problems: list[str] = []

    def node(self, schema: Any, path: tuple, new_path: tuple, base: str) -> Any:
        """The 2020-12 form of the subschema at original `path`, to be placed at `new_path`."""
        self.new_paths[path] = new_path
        self.bases[path] = base
        if not isinstance(schema, dict):
            return schema
        has_ref = isinstance(schema.get("$ref"), str)
        base = self.identify(schema, path, base, ignore_id=has_ref and self.legacy)
        out: dict[str, Any] = {}
        defs_key = "definitions" if set(schema.get("definitions", ())) & set(schema.get("$defs", ())) else "$defs"
        for keyword, value in schema.items():
            sub = path + (keyword,)
            if keyword in ("$defs", "definitions") and isinstance(value, dict):
                target = "$defs" if keyword == "$defs" else defs_key
                defs = out.setdefault(target, {})
                for name, s in value.items():
                    defs[name] = self.node(s, sub + (name,), new_path + (target, name), base)
            elif keyword in ("$schema", "$id", "id", "$anchor") or (has_ref and self.legacy and keyword != "$ref"):
                continue  # identifiers are resolved below; draft 4 to 7 ignore a $ref's siblings
            elif keyword == "$ref" and has_ref:
                out["$ref"] = value
                self.refs.append((out, path, base))
            elif keyword == "items" and isinstance(value, list):  # drafts 4 to 2019-09: a tuple
                if value:  # 2020-12's prefixItems must not be empty; an empty tuple constrains nothing
                    out["prefixItems"] = [self.node(s, sub + (i,), new_path + ("prefixItems", i), base) for i, s in
                                          enumerate(value)]  # fmt: skip
                if "additionalItems" in schema and "additionalItems" in self.known:
                    more = schema["additionalItems"]
                    out["items"] = self.node(more, path + ("additionalItems",), new_path + ("items",), base)
            elif keyword == "additionalItems":
                continue  # applies only beside an array `items`, handled there
            elif keyword == "dependencies" and "dependencies" in self.known and isinstance(value, dict):
                for name, dep in value.items():
                    if isinstance(dep, list):
                        out.setdefault("dependentRequired", {})[name] = dep
                    else:
                        target = new_path + ("dependentSchemas", name)
                        out.setdefault("dependentSchemas", {})[name] = self.node(dep, sub + (name,), target, base)
            elif keyword in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
                bound = "minimum" if keyword == "exclusiveMinimum" else "maximum"
                if value and bound in schema:
                    out[keyword] = schema[bound]
            elif keyword in ("minimum", "maximum") and schema.get(f"exclusive{keyword.title()}") is True:
                continue  # became the exclusive bound above
            elif keyword in _ALL_KEYWORDS and keyword not in self.known:
                continue  # a keyword of another draft: this draft's validator ignores it
            elif keyword in _MAPS and isinstance(value, dict):
                out[keyword] = {
                    name: self.node(s, sub + (name,), new_path + (keyword, name), base) if isinstance(s, (dict, bool))
                    else s for name, s in value.items()
                }  # fmt: skip
            elif keyword in _LISTS and isinstance(value, list):
                out[keyword] = [self.node(s, sub + (i,), new_path + (keyword, i), base) for i, s in enumerate(value)]
            elif keyword in _ONE and isinstance(value, (dict, bool)):
                out[keyword] = self.node(value, sub, new_path + (keyword,), base)
            else:
                out[keyword] = value
        return out

    def identify(self, schema: dict, path: tuple, base: str, ignore_id: bool) -> str:
        """Register the resource and anchors `schema` declares; returns its base URI."""
        ident = schema.get(self.id_keyword)
        if isinstance(ident, str) and not ignore_id:
            if self.legacy and ident.startswith("#"):
                self.anchors[(urldefrag(base)[0], ident[1:])] = path
            else:
                uri, fragment = urldefrag(urljoin(base, ident))
                base = uri
                self.resources.setdefault(uri, path)
                if fragment and not fragment.startswith("/"):
                    self.anchors[(uri, fragment)] = path
        for keyword in ("$anchor", "$dynamicAnchor"):
            if isinstance(schema.get(keyword), str) and not self.legacy:
                self.anchors[(urldefrag(base)[0], schema[keyword])] = path
        return base

    def target(self, ref: str, base: str) -> tuple | str:
        """The original path `ref` points to, or what is wrong with it."""
        uri, fragment = urldefrag(urljoin(base, ref))
        if uri not in self.resources:
            return f"{ref} is remote ({uri}): remote schemas are not fetched"
        path = self.resources[uri]
        if not fragment.startswith("/") and fragment:
            return self.anchors.get((uri, fragment), f"{ref} names no anchor of this schema")
        node = _at(self.root, path)
        for token in unquote(fragment).split("/")[1:] if fragment else ():
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and token.isdigit() and int(token) < len(node):
                key: str | int = int(token)
            elif isinstance(node, dict) and token in node:
                key = token
            else:
                return f"{ref} points to nothing"
            node, path = node[key], path + (key,)
        return path

    def resolve(self, out: dict) -> None:
        """Rewrite every collected `$ref` as a pointer from the root; a target outside the schema
        keywords is normalised into `self.hoisted`, under a name free in `out`'s `$defs`."""
        while self.refs:
            node, path, base = self.refs.pop()
            found = self.target(node["$ref"], base)
            if isinstance(found, str):
                self.problems.append(f"{json_pointer(path + ('$ref',)) or '/'}: $ref {found}")
                continue
            if found not in self.new_paths:  # not at a schema keyword: a schema all the same
                name = "_".join(map(str, found))
                while name in self.hoisted or name in out.get("$defs", {}):
                    name += "_"
                enclosing = next(found[:i] for i in range(len(found), -1, -1) if found[:i] in self.bases)
                self.hoisted[name] = self.node(_at(self.root, found), found, ("$defs", name), self.bases[enclosing])
            node["$ref"] = "#" + json_pointer(self.new_paths[found])


def _at(schema: Any, path: tuple) -> Any:
    for key in path:
        schema = schema[key]
    return schema


@functools.lru_cache(maxsize=1024)
def normalize_source(source: str) -> tuple[str, tuple[str, ...]]:
    """(2020-12 JSON text, problems) for the JSON text of a valid schema; cached by text.

    `problems` lists `pointer: $ref ...` for each reference that cannot be resolved inside the
    schema (remote, or pointing to nothing); those `$ref`s are left as they were.
    """
    schema = json.loads(source)
    if not isinstance(schema, dict) or any(word in source for word in _DYNAMIC):
        return source, ()
    validator = schema_validator(schema)
    draft = next((name for name, cls in DRAFTS.items() if cls is validator), None)
    if draft is None:  # draft-03: its forms (`required: true`, `extends`...) are not rewritten
        return source, (f"/$schema: {schema['$schema']} is not supported (drafts 4 to 2020-12 are)",)
    normaliser = _Normaliser(schema, draft)
    normaliser.resources[_DEFAULT_BASE] = ()
    out = normaliser.node(schema, (), (), _DEFAULT_BASE)
    normaliser.resolve(out)
    if normaliser.hoisted:
        out.setdefault("$defs", {}).update(normaliser.hoisted)
    return json.dumps(out, ensure_ascii=False), tuple(normaliser.problems)


def normalize(schema: Any) -> tuple[Any, list[str]]:
    """The 2020-12 form of `schema` and the problems found (see `normalize_source`)."""
    source, problems = normalize_source(json.dumps(schema, ensure_ascii=False))
    return json.loads(source), list(problems)


__all__ = ["DRAFTS", "json_pointer", "normalize", "normalize_source", "schema_validator", "subschemas"]
