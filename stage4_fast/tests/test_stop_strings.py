"""Stop strings cut the text before the first match (after it, with include_stop_str_in_output), however the
stream is chunked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stage4_fast.server.stream import StopStringMatcher


def _cut(text: str, stops: list[str], keep: bool = False) -> tuple[str, bool]:
    """The reference on the whole text: cut before the stop string that ends first (longest on a tie), or after
    it with ``keep``."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[0 if keep else 1]], True) if hits else (text, False)


def _streamed(chunks: list[str], stops: list[str], keep: bool = False) -> tuple[str, bool]:
    m = StopStringMatcher(stops, keep_stop=keep)
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


def test_the_stop_string_itself_is_kept_when_asked():
    assert _streamed(["Hello wor", "ld! More"], ["world"], keep=True) == ("Hello world", True)
    assert _streamed(["x END y STOP"], ["STOP", "END"], keep=True) == ("x END", True)


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
       max_size=3), st.lists(st.integers(min_value=0, max_value=30), max_size=8), st.booleans())
def test_any_chunking_equals_cutting_the_whole_text(text, stops, cuts, keep):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _streamed(chunks, stops, keep) == _cut(text, stops, keep)
