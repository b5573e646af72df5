"""The regex dialect of `regex` constraints: `\\d`, `\\w` and `\\s` take their ASCII meaning.

llguidance reads regexes with Rust's `regex` syntax, where `\\d` is every Unicode decimal digit
(U+0660 Arabic-Indic, U+1FBF8 segmented digits, ...), `\\w` every Unicode letter and `\\s` every
Unicode space. A user writing `\\d{4}` means 0-9, as JSON Schema patterns and ECMAScript do, and
a model handed the wider class does pick those digits. `ascii_classes` rewrites the six escapes to
Rust's ASCII POSIX classes (`[:digit:]` is [0-9], `[:word:]` [0-9A-Za-z_], `[:space:]`
[\\t\\n\\v\\f\\r ]), inside and outside bracket classes; every other character is kept as written,
so `\\p{Nd}` still asks for Unicode digits. `\\b` is refused by llguidance (no look-around).
"""

from __future__ import annotations

_POSIX = {"d": "digit", "w": "word", "s": "space"}


def ascii_classes(pattern: str) -> str:
    """`pattern` with \\d \\D \\w \\W \\s \\S replaced by their ASCII classes."""
    out: list[str] = []
    depth = 0  # bracket-class nesting (Rust allows [a[^0-9]])
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            escape = pattern[i + 1]
            name = _POSIX.get(escape.lower())
            if name is None:
                out.append(pattern[i:i + 2])  # \\. \\\\ \\p \\x ...: their argument follows as plain text
            elif escape.isupper():
                out.append(f"[^[:{name}:]]")  # a nested class is valid inside a class too
            else:
                out.append(f"[:{name}:]" if depth else f"[[:{name}:]]")
            i += 2
            continue
        if c == "[":
            if depth and pattern.startswith("[:", i):  # a POSIX class such as [:alpha:]
                end = pattern.find(":]", i + 2)
                if end != -1:
                    out.append(pattern[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a ']' first in a class is a literal
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
