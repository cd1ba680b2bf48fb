"""String formats as regular expressions, for backends that do not implement a format themselves.

Each pattern accepts only valid strings of its format: a documented subset where the full format is
not regular or needs more than the backends' regex dialects share (plain groups, classes,
alternation and bounded repeats: no lookarounds, no `\\d`, no `.`). What is left out:

- date, date-time: years 0001-9999 (RFC 3339's syntax), with 29 February in leap years only;
- time, date-time: no leap second (`:60`), at most 6 fraction digits, upper-case `T` / `Z` only;
- duration: ISO 8601 as JSON Schema uses it (RFC 3339 appendix A), no fractions;
- email: an RFC 5321 dot-atom local part at a domain of letters, digits and hyphens (no quoted
  local parts, no address literals);
- hostname: at most 6 labels of at most 40 characters (so never over RFC 1123's 253);
- ipv6: no embedded IPv4 tail, no zone;
- uri: `scheme://host[:port]` with an optional path, query and fragment of unreserved, sub-delim
  and percent-encoded characters (no userinfo, no IP literals, no `mailto:x` form);
  uri-reference: such a URI, or a relative reference (path, query, fragment) of those characters;
- iri, iri-reference, idn-email: the ASCII ones (as uri, uri-reference, email);
- json-pointer, relative-json-pointer: exact (RFC 6901; a relative pointer without index moves);
- uri-template: RFC 6570 with ASCII literals only;
- byte / base64 (OpenAPI): padded standard base64.
"""

from __future__ import annotations

_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DURATION_DATE = "([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)"
_DURATION_TIME = "T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,38}[A-Za-z0-9])?"
_DOMAIN_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_H16 = "[0-9A-Fa-f]{1,4}"
_PCHAR = "([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_PCHAR_NO_COLON = "([A-Za-z0-9._~!$&'()*+,;=@-]|%[0-9A-Fa-f]{2})"
_QUERY = f"(\\?({_PCHAR}|[/?])*)?(#({_PCHAR}|[/?])*)?"
URI = f"[A-Za-z][A-Za-z0-9+.-]*://{_LABEL}(\\.{_LABEL}){{0,5}}(:[0-9]{{1,5}})?(/{_PCHAR}*)*{_QUERY}"
_RELATIVE = f"((/?{_PCHAR_NO_COLON}+(/{_PCHAR}*)*)|/)?{_QUERY}"
_POINTER = "(/([^/~]|~[01])*)*"
_PCT = "%[0-9A-Fa-f]{2}"
_VARCHAR = f"([A-Za-z0-9_]|{_PCT})"
_VARSPEC = f"{_VARCHAR}(\\.?{_VARCHAR})*(:[1-9][0-9]{{0,3}}|\\*)?"
_TEMPLATE_LITERAL = "[!#$&()*+,\\-./0-9:;=?@A-Z\\[\\]_a-z~]"

# format name -> a pattern (unanchored: `format_pattern` anchors it) accepting only valid strings.
FORMAT_PATTERNS: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": f"{DATE}T{TIME}",
    "duration": f"P({_DURATION_DATE}({_DURATION_TIME})?|{_DURATION_TIME}|[0-9]+W)",
    "email": f"{_ATOM}(\\.{_ATOM})*@{_DOMAIN_LABEL}(\\.{_DOMAIN_LABEL})*",
    "uuid": "[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}",
    "ipv4": f"{_OCTET}(\\.{_OCTET}){{3}}",
    "ipv6": "|".join(
        (
            f"({_H16}:){{7}}{_H16}",
            f"({_H16}:){{1,7}}:",
            f"({_H16}:){{1,6}}:{_H16}",
            f"({_H16}:){{1,5}}(:{_H16}){{1,2}}",
            f"({_H16}:){{1,4}}(:{_H16}){{1,3}}",
            f"({_H16}:){{1,3}}(:{_H16}){{1,4}}",
            f"({_H16}:){{1,2}}(:{_H16}){{1,5}}",
            f"{_H16}:(:{_H16}){{1,6}}",
            f":((:{_H16}){{1,7}}|:)",
        )
    ),  # fmt: skip
    "hostname": f"{_LABEL}(\\.{_LABEL}){{0,5}}",
    "uri": URI,
    "uri-reference": f"({URI}|{_RELATIVE})",
    "json-pointer": _POINTER,
    "relative-json-pointer": f"(0|[1-9][0-9]*)(#|{_POINTER})",
    "uri-template": f"({_TEMPLATE_LITERAL}|{_PCT}|\\{{[+#./;?&=,!@|]?{_VARSPEC}(,{_VARSPEC})*\\}})*",
    "byte": "([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?",
}
FORMAT_PATTERNS["base64"] = FORMAT_PATTERNS["byte"]
FORMAT_PATTERNS["iri"] = FORMAT_PATTERNS["uri"]  # an ASCII URI is an IRI
FORMAT_PATTERNS["iri-reference"] = FORMAT_PATTERNS["uri-reference"]
FORMAT_PATTERNS["idn-email"] = FORMAT_PATTERNS["email"]


def format_pattern(name: str) -> str | None:
    """The anchored pattern of format `name` (`^(...)$`), or None for a format without one."""
    pattern = FORMAT_PATTERNS.get(name)
    return None if pattern is None else f"^({pattern})$"


__all__ = ["FORMAT_PATTERNS", "format_pattern"]
