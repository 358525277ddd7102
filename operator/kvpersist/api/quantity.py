"""Kubernetes quantities, parsed exactly as the API server parses them (never through a float): the models' CEL
rules must reach its verdict on every value, so this follows apimachinery's ParseQuantity and AsApproximateFloat64
step by step, to the last bit."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_UP, Decimal, localcontext

MAX_INT64 = 2**63 - 1
_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
# <signedNumber><suffix>, apimachinery's grammar (its scanner also takes "1." and ".5").
_GRAMMAR = re.compile(r"([+-]?)0*([0-9]*)(?:\.([0-9]*))?([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")


@dataclass(frozen=True)
class Quantity:
    """A parsed quantity as apimachinery holds it: unscaled * 10**-scale."""

    unscaled: int
    scale: int


def parse(text: str) -> Quantity:
    """resource.ParseQuantity; ValueError where it returns an error."""
    m = _GRAMMAR.fullmatch(text)
    if not text or not m:
        raise ValueError(f"not a quantity: {text!r} (a number, then a suffix such as Gi, M or e6)")
    negative, num, denom, suffix = m.group(1) == "-", m.group(2) or "0", m.group(3) or "", m.group(4) or ""
    binary = suffix in _BINARY  # else decimal: a suffix or an exponent (e6)
    exponent = _BINARY[suffix] if binary else _SUFFIX[suffix] if suffix in _SUFFIX else int(suffix[1:])
    if not -(2**31) <= exponent < 2**31:
        raise ValueError(f"not a quantity: {text!r} (its exponent is out of range)")
    # The int64 fast path (int64Amount), taken when the digits surely fit.
    mantissa, scale = 1, 0
    if binary:
        precision = 15 - len(num) - int(exponent * 3 / 10) - 1 if not denom else -1
        mantissa = 1 << exponent
    else:
        scale, precision = exponent, 18 - (len(num) + len(denom))
    if precision >= 0:
        scale -= len(denom)
        if scale >= -9:
            shifted = int(num + denom)
            if shifted > MAX_INT64:
                raise ValueError(f"not a quantity: {text!r} (too many digits)")
            result = shifted * mantissa
            if result <= MAX_INT64:
                return Quantity(-result if negative else result, -scale)
    # The inf.Dec path: exact, then rounded up to nano, a binary one capped.
    amount = Decimal(f"{num}.{denom}" if denom else num)
    amount = amount * (1 << exponent) if binary else amount.scaleb(exponent)
    with localcontext() as ctx:
        ctx.prec = 1000
        unscaled = int((amount * 10**9).to_integral_value(rounding=ROUND_UP))
    scale_out = 9 if unscaled else 0
    if binary and Decimal(unscaled).scaleb(-scale_out) > MAX_INT64:
        unscaled, scale_out = MAX_INT64, 0
    return Quantity(-unscaled if negative else unscaled, scale_out)


def parse_quantity(text: str | int) -> Decimal:
    """A quantity's exact value (bytes, cores, ...) as the API server has it, like
    kubernetes.utils.parse_quantity but with the server's rounding and cap."""
    parsed = parse(str(text))
    return Decimal(parsed.unscaled).scaleb(-parsed.scale)


# Go's math.Pow10 tables: its products differ from a correctly rounded 10**n in the last bit at times.
_POW10 = [float(f"1e{i}") for i in range(32)]
_POW10_POS32 = [float(f"1e{i * 32}") for i in range(10)]
_POW10_NEG32 = [float(f"1e-{i * 32}") for i in range(11)]


def _go_pow10(n: int) -> float:
    if 0 <= n <= 308:
        return _POW10_POS32[n // 32] * _POW10[n % 32]
    if -323 <= n < 0:
        return _POW10_NEG32[-n // 32] / _POW10[-n % 32]
    return float("inf") if n > 0 else 0.0


def as_approximate_float(q: Quantity) -> float:
    """Quantity.AsApproximateFloat64: the unscaled integer as a float, times Pow10 of the exponent."""
    try:
        base = float(q.unscaled)
    except OverflowError:
        base = float("inf") if q.unscaled > 0 else float("-inf")
    exponent = -q.scale
    return base if exponent == 0 else base * _go_pow10(exponent)
