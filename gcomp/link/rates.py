"""A link's rate as text, in bits per second with tc's decimal units: ``parse_rate`` reads ``"100mbit"`` (as
``gcomp bench --bandwidth`` and ``gcomp simulate --bandwidth`` take it), ``bandwidth_label`` writes a rate back
in that form (``1e9`` -> ``"1gbit"``)."""
from __future__ import annotations

import re

RATE_UNITS = {"": 1, "bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000, "tbit": 1_000_000_000_000}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
RATE_FORMS = ("a rate in bits per second such as 500kbit, 100mbit, 1gbit, 2.5gbit (decimal multiples, as tc) "
               "or 'none'")


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> ``100_000_000`` bits per second; ``"none"`` or ``""`` -> ``None`` (no shaping)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"--bandwidth: cannot read {text!r}; expected {RATE_FORMS}")
    rate = round(float(match.group(1)) * RATE_UNITS[(match.group(2) or "").lower()])
    if rate <= 0:
        raise ValueError(f"--bandwidth: {text!r} is not a positive rate; expected {RATE_FORMS}")
    return rate


def bandwidth_label(bandwidth_bps: float) -> str:
    """``1e9`` -> ``"1gbit"``: the largest unit that keeps the number >= 1."""
    for unit, scale in sorted(RATE_UNITS.items(), key=lambda item: -item[1]):
        if unit and bandwidth_bps >= scale:
            return f"{bandwidth_bps / scale:g}{unit}"
    return f"{bandwidth_bps:g}bit"
