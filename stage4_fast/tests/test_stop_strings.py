"""Stop strings cut the text before the first match, however the stream is chunked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stage4_fast.server.stream import StopStringMatcher


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference on the whole text: cut before the stop string that ends first (longest on a tie)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def _streamed(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = ""
    for c in chunks:
        text, hit = m.feed(c)
        out += text
        if hit:
            return out, True
    return out + m.flush(), False


def test_stop_split_across_chunks():
    assert _streamed(["Hello wor", "ld! More"], ["world"]) == ("Hello ", True)
    assert _streamed(["a", "b", "c", "d"], ["bcd", "cx"]) == ("a", True)
    assert _streamed(["ab", "c"], ["bd"]) == ("abc", False)


def test_held_back_prefix_is_released_when_it_does_not_match():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("ART") == ("START", False)


def test_the_stop_string_that_completes_first_wins():
    assert _streamed(["x END y STOP"], ["STOP", "END"]) == ("x ", True)
    assert _streamed(["baa"], ["a", "baa"]) == ("b", True)  # "a" is complete before "baa" is
    assert _streamed(["b", "aa"], ["ba", "baa"]) == ("", True)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abc世😀", max_size=30), st.lists(st.text(alphabet="abc世😀", min_size=1, max_size=4),
       max_size=3), st.lists(st.integers(min_value=0, max_value=30), max_size=8))
def test_any_chunking_equals_cutting_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _streamed(chunks, stops) == _cut(text, stops)
