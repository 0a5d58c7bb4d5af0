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


def _cut_after(text: str, armed_from: int, stops: list[str], keep: bool = False) -> tuple[str, bool]:
    """The reference with min_tokens (vLLM's window): only a stop string that ends past ``armed_from`` (where the
    text of the tokens after min_tokens starts) counts; it may start before."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s, max(0, armed_from - len(s) + 1))) >= 0]
    return (text[: min(hits)[0 if keep else 1]], True) if hits else (text, False)


def test_no_stop_string_ends_before_min_tokens():
    m = StopStringMatcher(["STOP", "."])
    assert m.feed("a. STO", armed=False) == ("a. ", False)  # held: the tail a later stop string may start with
    assert m.feed("P!", armed=False) == ("ST", False)  # a whole stop string before min_tokens is text
    assert m.feed("x. y") == ("OP!x", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST", armed=False) == ("go", False)
    assert m.feed("OP") == (" ", True)  # a stop string begun before min_tokens and ended after counts
    m = StopStringMatcher(["ab", "b"])
    assert m.feed("a", armed=False) == ("", False) and m.feed("b", armed=False) == ("a", False)
    assert m.feed("bb") == ("b", True)  # the "b" still held from before min_tokens ends nothing: "ab" in all


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab世", max_size=30), st.lists(st.text(alphabet="ab世", min_size=1, max_size=4),
       max_size=3), st.lists(st.integers(min_value=0, max_value=30), max_size=8), st.integers(0, 8), st.booleans())
def test_min_tokens_chunking_equals_cutting_the_whole_text_after_them(text, stops, cuts, unarmed, keep):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    unarmed = min(unarmed, len(chunks))  # the chunks of the first min_tokens tokens
    m, out, hit = StopStringMatcher(stops, keep_stop=keep), "", False
    for i, c in enumerate(chunks):
        piece, hit = m.feed(c, armed=i >= unarmed)
        out += piece
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == _cut_after(text, len("".join(chunks[:unarmed])), stops, keep)
