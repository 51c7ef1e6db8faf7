"""The reasoning split (pure Python, no server): any chunking of an output into streamed
pieces adds up to the non-streamed split; the split is on the ``</think>`` token; a leading
``<think>`` is dropped; where the output begins (inside the block or not) is read off the
generation prompt; a tokenizer without single-token tags is refused, naming the tag."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detspec.server.reasoning import (
    END,
    KIMI_SECTION,
    START,
    ReasoningParser,
    ReasoningSplit,
    generation_prompt,
    reasoning_parser,
)

START_ID, END_ID = 900, 901
QWEN3 = ReasoningParser("qwen3", START_ID, END_ID, special=False)
R1 = ReasoningParser("deepseek_r1", START_ID, END_ID, special=False)

# An output as (text, token id) pieces: words are ordinary tokens, the tags their own. The
# words can spell "<think>" ("<th" "ink>": dropped at the start as the tag is) but not
# "</think>" (see the next test for that).
piece = st.one_of(
    st.sampled_from([" ", "\n", "a", "bc", "<", "<th", "ink>", ">", "</", "{", "x y"]).map(
        lambda t: (t, 5)
    ),
    st.just((START, START_ID)),
    st.just((END, END_ID)),
)


def split_whole(
    tokens: list[tuple[str, int]], thinking: bool, parser: ReasoningParser = QWEN3
) -> tuple[str, str, int]:
    s = ReasoningSplit(parser, thinking)
    r, c = s.feed("".join(t for t, _ in tokens), [i for _, i in tokens])
    return r + s.finish(), c, s.num_tokens


def split_streamed(
    tokens: list[tuple[str, int]], cuts: list[int], thinking: bool, parser: ReasoningParser
) -> tuple[str, str, ReasoningSplit]:
    """The reasoning and content of ``tokens`` fed in pieces cut at ``cuts`` (token
    boundaries, as the engine's deltas come), and the split (its counts)."""
    s = ReasoningSplit(parser, thinking)
    got_r = got_c = ""
    bounds = sorted({0, len(tokens), *(min(c, len(tokens)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        chunk = tokens[a:b]
        r, c = s.feed("".join(t for t, _ in chunk), [i for _, i in chunk])
        got_r, got_c = got_r + r, got_c + c
    return got_r + s.finish(), got_c, s


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(piece, max_size=14),
    cuts=st.lists(st.integers(0, 14), max_size=6),
    thinking=st.booleans(),
)
def test_any_streaming_adds_up_to_the_whole(tokens, cuts, thinking) -> None:
    """Fed in pieces at token boundaries (as the engine's deltas come), the reasoning and
    content concatenate to the non-streamed split, which is the text around the first
    ``</think>`` token."""
    want_r, want_c, want_n = split_whole(tokens, thinking)
    got_r, got_c, s = split_streamed(tokens, cuts, thinking, QWEN3)
    assert (got_r, got_c, s.num_tokens) == (want_r, want_c, want_n)
    assert s.reasoning == want_r
    text = "".join(t for t, _ in tokens)
    ids = [i for _, i in tokens]
    if not thinking:
        assert (want_r, want_c, want_n) == ("", text, 0)
    elif END_ID in ids:
        k = ids.index(END_ID)
        before = "".join(t for t, _ in tokens[:k])
        assert want_c == "".join(t for t, _ in tokens[k + 1 :])
        lead = before.lstrip()
        assert want_r == (lead[len(START) :] if lead.startswith(START) else before)
        assert want_n == sum(i != START_ID for i in ids[:k])
    else:
        assert want_c == ""


def test_the_token_ends_the_reasoning_not_text_that_spells_it() -> None:
    s = ReasoningSplit(QWEN3, True)
    # "</think>" spelled by ordinary tokens is reasoning
    assert s.feed("a</" + "think>b", [5, 6, 7]) == ("a</think>b", "")
    assert s.thinking
    # the tag token ends it; in its piece the split is at the tag's text
    assert s.feed("c" + END + "d", [8, END_ID, 9]) == ("c", "d")
    assert not s.thinking and s.num_tokens == 4
    # the tag's text not decoded (a special token skipped): that piece is reasoning
    s = ReasoningSplit(QWEN3, True)
    assert s.feed("ab", [5, END_ID, 6]) == ("ab", "")
    assert s.feed("c", [7]) == ("", "c")


def test_a_leading_think_tag_is_dropped_and_held_back_while_it_may_be_one() -> None:
    s = ReasoningSplit(R1, True)
    assert s.feed("\n<th", [5, 6]) == ("", "")
    assert s.feed("ink>\nplan", [7, 8]) == ("\nplan", "")
    assert s.feed(" it" + END + "\n\nanswer", [9, END_ID, 10]) == (" it", "\n\nanswer")
    assert s.reasoning == "\nplan it"
    # not the tag after all: the held text is reasoning
    s = ReasoningSplit(R1, True)
    assert s.feed("<th", [5]) == ("", "")
    assert s.feed("e", [6]) == ("<the", "")
    # the output ends while held
    s = ReasoningSplit(R1, True)
    assert s.feed(" <", [5]) == ("", "")
    assert s.finish() == " <"


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(piece, max_size=14),
    cuts=st.lists(st.integers(0, 14), max_size=6),
    thinking=st.booleans(),
)
def test_append_think_keeps_the_thinking_in_the_content(tokens, cuts, thinking) -> None:
    """``minimax_m2_append_think`` (vLLM's): nothing is split off; the content is the output,
    after the ``<think>`` the generation prompt opened, under any streaming, and the thinking
    tokens are still counted as ``minimax_m2`` counts them."""
    append = ReasoningParser("minimax_m2_append_think", START_ID, END_ID, special=False)
    text = "".join(t for t, _ in tokens)
    got_r, got_c, s = split_streamed(tokens, cuts, thinking, append)
    assert got_r == ""
    assert got_c == (START if thinking and tokens else "") + text
    minimax = dataclasses.replace(append, name="minimax_m2")
    assert s.num_tokens == split_whole(tokens, thinking, minimax)[2]


SECTION_ID = 902
KIMI = ReasoningParser("kimi_k2", START_ID, END_ID, special=False, section_id=SECTION_ID)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.one_of(piece, st.just((KIMI_SECTION, SECTION_ID))), max_size=14),
    cuts=st.lists(st.integers(0, 14), max_size=6),
)
def test_kimi_k2_a_tool_call_section_ends_the_reasoning_too(tokens, cuts) -> None:
    """Kimi K2 Thinking (vLLM's ``kimi_k2``): the reasoning ends at the first ``</think>``
    (dropped) or tool-call section (kept: it begins the content, for the tool parser), under
    any streaming."""
    text = "".join(t for t, _ in tokens)
    ids = [i for _, i in tokens]
    want_r, want_c, want_n = split_whole(tokens, True, KIMI)
    k = next((i for i, t in enumerate(ids) if t in (END_ID, SECTION_ID)), len(ids))
    before = "".join(t for t, _ in tokens[:k])
    head = before.lstrip()
    assert want_r == (head[len(START) :] if head.startswith(START) else before)
    if k < len(ids):
        after = "".join(t for t, _ in tokens[k + (ids[k] == END_ID) :])
        assert want_c == after
    else:
        assert want_c == ""
    assert want_n == sum(t != START_ID for t in ids[:k])
    got_r, got_c, s = split_streamed(tokens, cuts, True, KIMI)
    assert (got_r, got_c, s.num_tokens) == (want_r, want_c, want_n)
    assert text.endswith(want_c)


def test_where_the_output_begins() -> None:
    # the generation prompt's last tag decides
    assert R1.thinks([3, START_ID, 4], {})
    assert not QWEN3.thinks([START_ID, 4, END_ID, 4], {})
    assert QWEN3.thinks([END_ID, START_ID], {"enable_thinking": False})
    # without a tag: the format's default, Qwen3's switch
    assert R1.thinks([3, 4], {"enable_thinking": False})
    assert QWEN3.thinks([3, 4], {})
    assert not QWEN3.thinks([3, 4], {"enable_thinking": False})
    # DeepSeek-V3.1: off unless `thinking` turns it on (its template's tag decides first)
    v3 = dataclasses.replace(QWEN3, name="deepseek_v3")
    assert not v3.thinks([3, 4], {}) and not v3.thinks([3, 4], {"enable_thinking": True})
    assert v3.thinks([3, 4], {"thinking": True})
    assert v3.thinks([3, START_ID], {}) and not v3.thinks([END_ID], {"thinking": True})
    # Kimi K2 Thinking: on unless `thinking` turns it off
    assert KIMI.thinks([3, 4], {}) and not KIMI.thinks([3, 4], {"thinking": False})
    # MiniMax-M2 (its template opens the block): inside unless the prompt closed it
    for name in ("minimax_m2", "minimax_m2_append_think"):
        m2 = dataclasses.replace(QWEN3, name=name)
        assert m2.thinks([3, 4], {"enable_thinking": False}) and not m2.thinks([END_ID], {})
    # the generation prompt is what follows the rendering without it
    assert list(generation_prompt([1, 2, 3, START_ID], [1, 2, 3])) == [START_ID]
    assert list(generation_prompt([1, 2, 9, 8], [1, 2, 3])) == [9, 8]


class _Tok:
    def __init__(self, vocab: dict[str, list[int]], special: bool = False) -> None:
        self.vocab = vocab
        self.special = special

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.vocab[text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "" if self.special and skip_special_tokens else END


def test_parser_needs_single_token_tags() -> None:
    p = reasoning_parser("qwen3", _Tok({START: [7], END: [8]}))  # type: ignore[arg-type]
    assert (p.start_id, p.end_id, p.special) == (7, 8, False)
    p = reasoning_parser("qwen3", _Tok({START: [7], END: [8]}, special=True))  # type: ignore[arg-type]
    assert p.special
    with pytest.raises(ValueError, match="'</think>' as one token"):
        reasoning_parser("deepseek_r1", _Tok({START: [7], END: [1, 2, 3]}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        reasoning_parser("r2", _Tok({}))  # type: ignore[arg-type]
