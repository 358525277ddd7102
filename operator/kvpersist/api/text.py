"""The characters no free-text field of the spec may hold: control characters cut or forge lines in pod specs, argv,
logs and `kubectl` output, format characters make one value read as another (Trojan Source). The CRD's pattern and
the models' check read one table, written out so that Go's and Python's Unicode versions cannot disagree."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

# Unicode 15.1 categories Cc (controls) and Cf (format characters, bidi controls among them), and
# Zl/Zp (U+2028 LINE SEPARATOR, U+2029 PARAGRAPH SEPARATOR: line breaks to JavaScript and many
# log viewers). Inclusive ranges of code points.
FORBIDDEN: tuple[tuple[int, int], ...] = (
    (0x0000, 0x001F),  # C0 controls: NUL, TAB, LF, CR, ESC, ...
    (0x007F, 0x009F),  # DEL and the C1 controls (U+0085 NEXT LINE, U+009B CSI)
    (0x00AD, 0x00AD),  # SOFT HYPHEN
    (0x0600, 0x0605),  # Arabic number signs
    (0x061C, 0x061C),  # ARABIC LETTER MARK (a bidi mark)
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),  # MONGOLIAN VOWEL SEPARATOR
    (0x200B, 0x200F),  # ZERO WIDTH SPACE, ZWNJ, ZWJ, LEFT-TO-RIGHT MARK, RIGHT-TO-LEFT MARK
    (0x2028, 0x202E),  # LINE/PARAGRAPH SEPARATOR; bidi embeddings and overrides LRE RLE PDF LRO RLO
    (0x2060, 0x2064),  # WORD JOINER, invisible operators
    (0x2066, 0x206F),  # bidi isolates LRI RLI FSI PDI, deprecated format characters
    (0xFEFF, 0xFEFF),  # ZERO WIDTH NO-BREAK SPACE (byte order mark)
    (0xFFF9, 0xFFFB),  # interlinear annotation
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),  # Egyptian hieroglyph format controls
    (0x1BCA0, 0x1BCA3),  # shorthand format controls
    (0x1D173, 0x1D17A),  # musical symbol format controls
    (0xE0001, 0xE0001),  # LANGUAGE TAG
    (0xE0020, 0xE007F),  # tag characters (invisible; spell hidden ASCII)
)
# Lone surrogates (U+D800-U+DFFF) cannot cross the API: JSON decoding in the API server turns
# them into U+FFFD, so the pattern leaves them out (Rust's regex, pydantic's, cannot even name
# them); the models refuse them too, for objects built in Python.
SURROGATES = (0xD800, 0xDFFF)


def _class(ranges: tuple[tuple[int, int], ...]) -> str:
    """RE2 (Go: the API server) and Rust regex (pydantic) syntax alike: \\x{...} escapes, ASCII only."""
    return "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges)


def _compiled(ranges: tuple[tuple[int, int], ...]) -> re.Pattern[str]:
    """The set as one compiled class: a check per character was the hottest line of a spec's parse."""
    return re.compile("[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in (*ranges, SURROGATES)) + "]")


NO_CONTROL_PATTERN = f"^[^{_class(FORBIDDEN)}]*$"
_REFUSED = _compiled(FORBIDDEN)
RULE = ("control and format characters are refused (Unicode Cc, Cf, Zl, Zp: NUL, TAB, CR, LF, bidi controls such as "
        "U+202E, zero-width characters such as U+200B): remove it")


CONTROL_NAMES = {"\x00": "NUL", "\t": "TAB", "\n": "LINE FEED", "\r": "CARRIAGE RETURN", "\x1b": "ESCAPE", "\x7f": "DELETE",
                 "\x85": "NEXT LINE", "\x9b": "CONTROL SEQUENCE INTRODUCER"}  # unicodedata names no control


def control_problem(value: str, refused: re.Pattern[str] = _REFUSED, rule: str = RULE) -> str | None:
    """Which refused character the value holds first, where, and the rule; None when it has none."""
    found = refused.search(value)
    if found is None:
        return None
    index, char = found.start(), found.group()
    name = unicodedata.name(char, "") or CONTROL_NAMES.get(char, "a control character")
    return f"U+{ord(char):04X} ({name}) at position {index + 1} of {len(value)}: {rule}"


def _refuser(refused: re.Pattern[str], rule: str) -> Callable[[Any], Any]:
    """A pydantic before-validator: runs ahead of a field's pattern, so a string with a refused
    character is told which one and where rather than just that it does not match."""
    def refuse(value: Any) -> Any:
        if isinstance(value, str) and (problem := control_problem(value, refused, rule)):
            raise ValueError(problem)
        return value

    return refuse


refuse_control = _refuser(_REFUSED, RULE)


# A prompt (spec.prewarm) is text a model reads, so it keeps its line breaks and tabs: TAB, LF and
# CR are allowed there, every other refused character stays refused. The prompt goes only to
# vLLM's /tokenize, never into argv, a log line or a condition (which name it by its place).
PROMPT_FORBIDDEN: tuple[tuple[int, int], ...] = ((0x00, 0x08), (0x0B, 0x0C), (0x0E, 0x1F), *FORBIDDEN[1:])
PROMPT_PATTERN = f"^[^{_class(PROMPT_FORBIDDEN)}]*$"
PROMPT_RULE = ("control and format characters other than TAB, LF and CR are refused in a prompt (NUL, ESC, bidi "
               "controls such as U+202E, zero-width characters such as U+200B): remove it, or put the prompt in the "
               "ConfigMap of spec.prewarm.configMapRef")
refuse_control_in_prompt = _refuser(_compiled(PROMPT_FORBIDDEN), PROMPT_RULE)


def printable(text: str) -> str:
    """text with every refused character as a \\u (or \\U) escape: for messages that quote user input
    (a condition, an event, a log line), so they carry no bidi override or line break of their own."""
    def escaped(found: re.Match[str]) -> str:
        c = ord(found.group())
        return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"

    return _REFUSED.sub(escaped, text)
