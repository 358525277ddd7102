"""Rules restated in Python, the plain way, as oracles the tests hold the operator's own forms to: extraArgs' two CEL
rules (the models evaluate the CEL itself; the contract test also holds vLLM's parsers to them) and the table of
characters refused in free text (kvpersist.api.text compiles it into one class), less those a prompt may hold."""

from __future__ import annotations

from kvpersist.api.spec import EXTRA_ARGS
from kvpersist.api.text import FORBIDDEN, SURROGATES


def extra_args_problem(args: list[str]) -> str | None:
    """Why extraArgs would let vLLM run with other KV than the pins say, or None: each token must be an allowed
    flag or the value right after one that takes it."""
    wants_value = ""
    for arg in args:
        flag, eq, _ = arg.partition("=")
        if not arg.startswith("-"):
            if not wants_value:
                return f"{arg!r} is neither an allowed flag nor the value of one"
            wants_value = ""
        elif wants_value:
            return f"{wants_value} needs a value before {arg!r}"
        elif flag not in EXTRA_ARGS:
            return f"{arg!r} is not a flag extraArgs may set"
        else:
            wants_value = flag if EXTRA_ARGS[flag] and not eq else ""
    return f"{wants_value} needs a value" if wants_value else None


PROMPT_ALLOWED = "\t\n\r"


def forbidden(char: str) -> bool:
    """Whether one character is refused in a free string."""
    c = ord(char)
    return SURROGATES[0] <= c <= SURROGATES[1] or any(a <= c <= b for a, b in FORBIDDEN)
