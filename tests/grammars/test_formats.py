"""Format patterns narrow, never widen: every string a pattern accepts is valid for its format."""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import uuid
from datetime import date, datetime, time
from urllib.parse import urlsplit

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.grammars.formats import FORMAT_PATTERNS, format_pattern
from tandem.grammars.support import DEFINED_FORMATS, UNKNOWN_FORMATS, native_formats

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
_DURATION = re.compile(r"P(?=\d|T\d)(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?|P\d+W")


def _hostname_ok(s: str) -> bool:  # RFC 1123
    labels = s.split(".")
    return len(s) <= 253 and all(
        0 < len(x) <= 63 and re.fullmatch(r"[A-Za-z0-9-]+", x) and x[0] != "-" and x[-1] != "-" for x in labels
    )


def _uri_ok(s: str) -> bool:
    parts = urlsplit(s)
    return bool(parts.scheme) and bool(parts.netloc) and not re.search(r"[^\x21-\x7e]|%(?![0-9A-Fa-f]{2})", s)


def _pointer_ok(s: str) -> bool:  # RFC 6901: "/"-separated tokens, "~" only as "~0" / "~1"
    return s == "" or (s.startswith("/") and "~" not in re.sub("~[01]", "", s))


def _template_ok(s: str) -> bool:  # RFC 6570, ASCII literals
    pct = re.compile("%[0-9A-Fa-f]{2}")
    at = 0
    while at < len(s):
        if s[at] == "{":
            end = s.find("}", at)
            body = s[at + 1 : end] if end > at else ""
            body = body[1:] if body[:1] and body[0] in "+#./;?&=,!@|" else body
            for spec in body.split(","):
                name, _, prefix = (spec[:-1], "", "") if spec.endswith("*") else spec.partition(":")
                parts = pct.sub("_", name).split(".")
                if not all(p and all(c.isascii() and (c.isalnum() or c == "_") for c in p) for p in parts):
                    return False
                if prefix and not (prefix.isdigit() and prefix[0] != "0" and len(prefix) <= 4):
                    return False
            at = end + 1
        elif s[at] == "%":
            if not pct.match(s, at):
                return False
            at += 3
        elif not s[at].isascii() or s[at] <= " " or s[at] in "\"'<>\\^`{|}\x7f":
            return False
        else:
            at += 1
    return True


# Independent checks for the formats jsonschema's FormatChecker leaves unchecked without its
# optional dependencies (rfc3339-validator, fqdn, rfc3987, isoduration).
ORACLES = {
    "date": date.fromisoformat,
    "date-time": lambda s: datetime.fromisoformat(s.replace("Z", "+00:00")),
    "time": lambda s: time.fromisoformat(s.replace("Z", "+00:00")).tzinfo or 1 / 0,
    "duration": lambda s: _DURATION.fullmatch(s) or 1 / 0,
    "email": lambda s: (s.count("@") == 1 and ".." not in s and not s.startswith(".")) or 1 / 0,
    "uuid": uuid.UUID,
    "ipv4": ipaddress.IPv4Address,
    "ipv6": ipaddress.IPv6Address,
    "hostname": lambda s: _hostname_ok(s) or 1 / 0,
    "uri": lambda s: _uri_ok(s) or 1 / 0,
    "uri-reference": lambda s: _uri_ok(s) or not re.search(r"[^\x21-\x7e]|%(?![0-9A-Fa-f]{2})|^[^/?#]*:", s) or 1 / 0,
    "byte": lambda s: base64.b64decode(s, validate=True),
    "base64": lambda s: base64.b64decode(s, validate=True),
    "json-pointer": lambda s: _pointer_ok(s) or 1 / 0,
    "relative-json-pointer": lambda s: (
        (m := re.fullmatch("(0|[1-9][0-9]*)(.*)", s, re.S)) and (m[2] == "#" or _pointer_ok(m[2])) or 1 / 0
    ),
    "uri-template": lambda s: _template_ok(s) or 1 / 0,
}
ORACLES |= {"iri": ORACLES["uri"], "iri-reference": ORACLES["uri-reference"], "idn-email": ORACLES["email"]}

EXAMPLES = {  # format: (valid strings the pattern accepts, invalid strings)
    "date": (["2024-02-29", "1999-12-31", "0001-01-01"],
             ["2023-02-29", "2024-13-01", "2024-04-31", "0000-01-01", "24-1-1"]),
    "date-time": (["2024-05-06T07:08:09Z", "2024-05-06T07:08:09.5+05:30"],
                  ["2024-05-06 07:08:09Z", "2024-05-06T25:00:00Z", "2024-05-06T07:08:09"]),
    "time": (["23:59:59Z", "00:00:00.123-01:00"], ["24:00:00Z", "12:60:00Z", "12:00:00"]),
    "duration": (["P1Y2M3D", "PT4H5M6S", "P3W", "P1DT1S"], ["P", "PT", "P1S", "1Y", "P1Y2W"]),
    "email": (["a.b+c@example.com", "x@y"], ["a@@b", "@b.com", "a@", "a..b@c.com", "a b@c.com"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456"]),
    "ipv4": (["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "01.2.3.4", "1.2.3"]),
    "ipv6": (["::1", "::", "2001:db8::ff00:42:8329", "1:2:3:4:5:6:7:8"],
             ["1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", ":1"]),
    "hostname": (["example.com", "a-b.c0"], ["-a.com", "a-.com", "a..b", "a_b.com", "a" * 64]),
    "uri": (["https://example.com/a/b?c=d#e", "ftp://h:21/%20x"],
            ["example.com", "http://", "http://a b", "/relative"]),
    "uri-reference": (["/a/b?c#d", "", "x/y", "https://example.com"], ["a b", ":x", "%zz"]),
    "byte": (["", "YWJj", "YWI=", "YQ=="], ["YWJ", "Y===", "YW=J"]),
    "json-pointer": (["", "/", "/a~1b/0", "/ü~0"], ["a", "/a~2", "/~"]),
    "relative-json-pointer": (["0", "1#", "12/a/b"], ["01", "-1/a", "/a", "1~0"]),
    "uri-template": (["http://x/{id}", "/s{?q,lang}", "{+path:6}/h", "{a.b*}{#x}", "a%20b"],
                     ["{}", "{a", "x y", "{a:0}", "%zz", "{a..b}"]),
    "idn-email": (["a@b.c"], ["a@@b"]),
}  # fmt: skip


def _valid(name: str, text: str) -> bool:
    try:
        ORACLES[name](text)
    except Exception:
        return False
    return CHECKER.conforms(text, name)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_pattern_accepts_the_valid_examples_and_rejects_the_invalid(name):
    valid, invalid = EXAMPLES[name]
    pattern = re.compile(format_pattern(name))
    for text in valid:
        assert pattern.fullmatch(text) and _valid(name, text), (name, text)
    for text in invalid:
        assert not pattern.fullmatch(text), (name, text)


@pytest.mark.parametrize("name", sorted({p: n for n, p in sorted(FORMAT_PATTERNS.items())}.values()))  # aliases once
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_string_the_pattern_generates_is_valid_for_the_format(name, data):
    text = data.draw(st.from_regex(format_pattern(name), fullmatch=True, alphabet=st.characters(codec="utf-8")))
    assert _valid(name, text), (name, text)


def test_formats_without_a_pattern_have_none():
    assert format_pattern("regex") is None and format_pattern("date").startswith("^(")


def test_unknown_formats_fail_on_llguidance_and_the_others_compile():
    """Measures support.UNKNOWN_FORMATS: llguidance compiles a format it implements and names the
    rest unknown; the compiler gives it formats.py's pattern for those (native_formats)."""
    for name in sorted(DEFINED_FORMATS):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "format": name}))
        error = llguidance.LLMatcher.validate_grammar(grammar)
        assert ("Unknown format" in error) == (name in UNKNOWN_FORMATS["llguidance"]), (name, error)
    assert not native_formats("llguidance") & UNKNOWN_FORMATS["llguidance"]
