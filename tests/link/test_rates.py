"""A link's rate as text (``gcomp.link``): tc's units read in bits per second, bad text refused."""
from __future__ import annotations

import pytest

from gcomp.link import parse_rate


@pytest.mark.parametrize("text, bps", [
    ("100mbit", 100_000_000), ("500mbit", 500_000_000), ("1gbit", 1_000_000_000), ("10gbit", 10_000_000_000),
    ("2.5gbit", 2_500_000_000), ("100Mbit", 100_000_000), ("1GBIT", 1_000_000_000), (" 500kbit ", 500_000),
    ("64000", 64_000), ("64000bit", 64_000), ("none", None), ("None", None), ("", None),
])
def test_parse_rate_reads_tc_units_in_bits_per_second(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "100mb", "100 mbps", "1.2.3gbit", "-1gbit", "0mbit", "gbit", "100MB/s"])
def test_parse_rate_rejects_bad_text_naming_the_option_and_the_forms(text):
    with pytest.raises(ValueError, match="--bandwidth") as error:
        parse_rate(text)
    assert "100mbit" in str(error.value) and "none" in str(error.value)
