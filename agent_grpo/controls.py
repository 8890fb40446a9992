"""Text made safe to print: control characters are shown as escapes, never obeyed.

Tool output is whatever a tool (or a hostile page, file or server behind it) wrote, and a
terminal obeys much of it: ESC starts sequences that clear the screen, move the cursor, recolour
text (so an observation can pass for a trainer message), set the window title or, with OSC 52,
write the clipboard; BEL rings, backspace and carriage return overwrite what was shown; C1
controls (U+0080-U+009F) act like ESC sequences on some terminals (U+009B is a one-character
CSI); bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069, ...) reorder text on
screen so it reads differently from what it is; U+2028 and U+2029 break lines on some
terminals; invisible characters (zero width space, tag characters, ...) hide text from a reader
that a model or a verifier still reads. Each is shown as a Python-style escape (`\\x1b`,
`\\u202e`), whether stdout is a terminal or a pipe (a pipe is often `less -R`, or a log cat-ed
to a terminal later). Newlines and tabs stay: transcripts are multi-line. A literal backslash
is left as it is, so text that already reads `\\x1b` looks like an escaped ESC; neither is
obeyed, which is the point.
"""

from __future__ import annotations

import re

__all__ = ["visible"]

_SHOWN = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f"  # C0 but newline and tab, DEL, C1
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # bidi marks, embeddings, overrides, isolates
    "\u2028\u2029"  # line and paragraph separators
    # invisible: soft hyphen, zero width space, word joiner and invisible operators, deprecated
    # format characters, BOM, interlinear annotation, tag characters (text smuggled past a reader)
    "\u00ad\u200b\u2060-\u2064\u206a-\u206f\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]"
)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def visible(text: str) -> str:
    """`text` with every control character a terminal would obey shown as an escape."""
    return _SHOWN.sub(_escape, text)
