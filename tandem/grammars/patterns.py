"""Pattern algebra for the rewrites (lowering.py): the complement of a pattern or of a set of
strings, and the text every match of a pattern starts with.

The patterns written here mean the same in jsonschema's `re` and in the backends' Rust-style
dialects: plain groups, classes and alternation, every meta character escaped, no letter escapes.
One difference remains: Python's `$` also matches before a final newline; a pattern is complemented
only where that cannot change a verdict.
"""

from __future__ import annotations

import re
from typing import Any

_MAX_EXCLUDED_CHARS = 2000  # excluded strings become a regex: llguidance's lexer limit comes before

_REGEX_META = frozenset("\\.^$|?*+()[]{}-/&~#")
_ANY_TEXT = "[\\s\\S]*"  # any characters, newlines included (`.` stops at one)


def _regex_char(c: str) -> str:
    """`c` as a regex atom both jsonschema's `re` and the backends' Rust-style dialect read the same
    way: meta characters escaped, control characters as `\\uXXXX`, letters never (`\\<` is a word
    boundary in Rust)."""
    if c in _REGEX_META:
        return "\\" + c
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c


def _trie_complement(node: dict, end: bool) -> str:
    """Regex of the strings that do not finish a word at `node` (a trie: char -> (child, end)),
    read from there; `end`: a word ends at `node`."""
    alternatives = [] if end else [""]
    alternatives.append(f"[^{''.join(map(_regex_char, node))}]{_ANY_TEXT}" if node else "[\\s\\S]+")
    alternatives += [_regex_char(c) + _trie_complement(child, child_end) for c, (child, child_end) in node.items()]
    return "(?:" + "|".join(alternatives) + ")"


def strings_excluded(words: list[str]) -> dict | None:
    """A `pattern` (it applies to strings only) that every string but `words` matches. None if a
    word holds a newline (Python's `$` also matches before a final newline, the backends' does not),
    or the words are too long for a backend's lexer."""
    if any("\n" in w for w in words) or sum(map(len, words)) > _MAX_EXCLUDED_CHARS:
        return None
    trie: dict = {}
    for word in words:
        node = trie
        for i, c in enumerate(word):
            child, end = node.get(c, ({}, False))
            node[c] = (child, end or i == len(word) - 1)
            node = child
    return {"pattern": f"^{_trie_complement(trie, '' in words)}$"}


# One character of a pattern: a class (no nesting, no Rust set operators such as `&&`), an escaped
# punctuation character, or a plain character.
_ATOM = re.compile(r"\[(\^?)((?:\\[^A-Za-z0-9]|[^\\\[\]])+)\]|\\([^A-Za-z0-9])|([^\\.^$|?*+()\[\]{}])")
_LITERAL = re.compile(r"\\([^A-Za-z0-9])|([^\\.^$|?*+()\[\]{}])")  # an escaped or plain character


def _atoms(text: str) -> list[tuple[str, str]] | None:
    """`text` as a run of single-character atoms, each as (regex, regex of every other character);
    None for anything else (quantifiers, groups, alternation, `.`, `$`, letter escapes)."""
    atoms, at = [], 0
    while at < len(text):
        match = _ATOM.match(text, at)
        if match is None or any(op in (match.group(2) or "") for op in ("&&", "--", "~~", "||")):
            return None
        if match.group(2) is not None:
            negated, body = match.group(1), match.group(2)
            atoms.append((match.group(0), f"[{'' if negated else '^'}{body}]"))
        else:
            char = _regex_char(match.group(3) or match.group(4))
            atoms.append((char, f"[^{char}]"))
        at = match.end()
    return atoms


def pattern_complement(pattern: str) -> Any:
    """A schema that exactly the strings `pattern` does not match (searched, as JSON Schema does)
    satisfy (a non-string passes `pattern`, so it fails the complement), or None. For `^` then a run
    of characters / classes: a string shorter than the run, or one whose first differing character
    is at some place of it; for one unanchored class: a string with no character of it."""
    anchored = pattern.startswith("^")
    atoms = _atoms(pattern[1:] if anchored else pattern)
    if atoms is None:
        return None
    if not atoms:
        return False  # "" and "^" match every string
    if anchored:
        differ = "|".join("".join(own for own, _ in atoms[:i]) + other for i, (_, other) in enumerate(atoms))
        return {
            "anyOf": [{"type": "string", "maxLength": len(atoms) - 1}, {"type": "string", "pattern": f"^(?:{differ})"}]
        }
    if len(atoms) > 1 or re.search(pattern, "\n"):  # `^[...]*$`: Python's `$` also matches before a final newline
        return None
    return {"type": "string", "pattern": f"^{atoms[0][1]}*$"}


def literal_prefix(pattern: str) -> str | None:
    """The text every string `pattern` matches starts with: `^` then plain or escaped characters up
    to the first other atom (a character a quantifier follows is not part of it); None if there is
    none or the pattern has an alternation anywhere."""
    if not pattern.startswith("^") or "|" in pattern:
        return None
    prefix, at = [], 1
    while (match := _LITERAL.match(pattern, at)) is not None:
        at = match.end()
        if at < len(pattern) and pattern[at] in "?*+{":
            break
        prefix.append(match.group(1) or match.group(2))
    return "".join(prefix) or None


__all__ = ["literal_prefix", "pattern_complement", "strings_excluded"]
