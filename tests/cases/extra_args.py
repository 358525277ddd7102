"""spec.vllm.extraArgs' two CEL rules in Python, as words for a list: the oracle the unit tests hold the CRD's
rules to, and the contract test holds vLLM's own parsers to. The models evaluate the CEL itself."""

from __future__ import annotations

from kvpersist.api.spec import EXTRA_ARGS


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
