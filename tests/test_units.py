import pytest

from hf_memo.units import format_bytes, format_tokens, parse_bytes, parse_tokens


@pytest.mark.parametrize(
    "text,expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1TiB", 2**40),
        ("1.5G", 3 * 2**29),
        ("512B", 512),
        ("0", 0),
        (4096, 4096),
        (" 2 kb ", 2000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["eighty", "80XB", "", "-1GiB", "1e9", True, -5])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["80", "64", " 1.5 "])
def test_parse_bytes_refuses_a_number_without_a_unit_and_shows_how_to_write_it(text):
    number = text.strip()
    with pytest.raises(ValueError) as error:
        parse_bytes(text)
    assert str(error.value) == f"{number} has no unit: write {number}GiB (binary) or {number}GB (decimal)"


@pytest.mark.parametrize("text,expected", [("128k", 131072), ("1M", 1048576), ("4096", 4096), (7, 7), ("1.5k", 1536)])
def test_parse_tokens(text, expected):
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("text", ["0", 0, -3, "-1k", "lots", "12 tokens"])
def test_parse_tokens_rejects(text):
    with pytest.raises(ValueError):
        parse_tokens(text)


def test_formatting():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 2**40) == "3.00 TiB"
    assert format_tokens(131072) == "128K"
    assert format_tokens(2**20) == "1M"
    assert format_tokens(5000) == "5000"
