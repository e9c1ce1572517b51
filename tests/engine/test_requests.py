import sys

from ibedl.engine.requests import blank


def test_blank_means_whitespace_only():
    """NOT_BLANK spells out str.isspace(): one character is blank exactly when Python calls it whitespace."""
    assert [c for c in map(chr, range(sys.maxunicode + 1)) if blank(c) != c.isspace()] == []
    assert blank("") and blank(" \t\u3000") and not blank(" a ") and not blank("\ufeff")
