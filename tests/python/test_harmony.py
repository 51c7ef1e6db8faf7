"""gpt-oss's Harmony format read from token ids (pure Python, no server), on the tests'
tokenizer with Harmony's markers as special tokens.

Properties, over random transcripts (hypothesis): the reader's reasoning, content and calls
are what the messages' headers say (an oracle written from the format's rules); any split
of the output into pieces (a stream, decoded as the engine decodes) adds up to exactly the
whole; the stop token's text taken off the end changes nothing; an output cut anywhere, or
junk, never raises; text that ordinary tokens spell like a marker is text; the generation
prompt decides where reading starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_model import write_harmony_tokenizer

from detspec.server.harmony import FINAL_HEADER, HarmonyFormat, Header, harmony_format
from detspec.server.tool_parsers import ParsedCall


class _Encoder:
    """What ``harmony_format`` asks of a tokenizer."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_harmony_tokenizer(Path(tmp_path_factory.mktemp("harmony-tok")))


@pytest.fixture(scope="module")
def fmt(tok) -> HarmonyFormat:
    return harmony_format(_Encoder(tok))


# --------------------------------------------------------------------------- transcripts

WORDS = st.sampled_from(["the", "cat", " sat", " on", " mat", ".", " 42", "\n", "Paris", " é"])
TEXT = st.lists(WORDS, min_size=1, max_size=8).map("".join)
ARGS = st.dictionaries(
    st.sampled_from(["city", "unit", "n"]), st.sampled_from(["Paris", "C", 3]), max_size=2
)


@st.composite
def messages(draw):
    """(header, body, kind, name): a message as gpt-oss writes it."""
    kind = draw(st.sampled_from(["analysis", "final", "preamble", "call", "builtin"]))
    if kind == "call":
        name = draw(st.sampled_from(["get_weather", "lookup"]))
        body = json.dumps(draw(ARGS))
        if draw(st.booleans()):  # the recipient after the channel, or before it
            header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
        else:
            header = f" to=functions.{name}<|channel|>commentary json"
        return header, body, kind, name
    body = draw(TEXT)
    channel = {"analysis": "analysis", "final": "final", "preamble": "commentary"}.get(kind)
    header = f"<|channel|>{channel}" if channel else "<|channel|>analysis to=browser.search"
    return header, body, kind, None


@st.composite
def transcripts(draw):
    """An answer's text after the generation prompt ``<|start|>assistant`` (messages after
    the first open with ``<|start|>assistant``), and its messages."""
    msgs = draw(st.lists(messages(), min_size=1, max_size=5))
    parts = []
    for i, (header, body, kind, _) in enumerate(msgs):
        end = "<|call|>" if kind == "call" else "<|return|>" if i == len(msgs) - 1 else "<|end|>"
        parts.append(("" if i == 0 else "<|start|>assistant") + f"{header}<|message|>{body}{end}")
    return "".join(parts), msgs


def oracle(msgs, calls: bool) -> tuple[str, str, list[ParsedCall]]:
    """What the format's rules make of the messages."""
    reasoning, content, out = [], [], []
    for _, body, kind, name in msgs:
        if kind == "call" and calls:
            out.append(ParsedCall(name, json.dumps(json.loads(body), ensure_ascii=False)))
        elif kind in ("analysis", "builtin", "call"):
            reasoning.append(body)
        else:
            content.append(body)
    return "\n".join(reasoning), "\n".join(content), out


def read(fmt, tok, ids, cuts=(), calls=True, primer="<|start|>assistant", keep_stop=True):
    """The reader fed ``ids`` in pieces split at ``cuts``, each piece's text the engine's
    incremental decode (the text of the ids so far, less what came before; a character
    still incomplete is held back)."""
    p_ids = tok.encode(primer, add_special_tokens=False).ids
    r = fmt.reader(calls, (primer, p_ids))
    reasoning, content, found = "", "", []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    said = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        text = tok.decode(ids[:b], skip_special_tokens=False)
        if b < len(ids):
            text = text.rstrip("\ufffd")
        assert text.startswith(said)
        if b == len(ids) and not keep_stop:
            stop = tok.decode(ids[-1:], skip_special_tokens=False)
            text = text.removesuffix(stop)
        piece, said = text[len(said) :], text
        rs, answer = r.feed(piece, ids[a:b])
        reasoning += rs
        content += answer.content
        found += answer.calls
    rs, answer = r.finish()
    return reasoning + rs, content + answer.content, found + answer.calls, r


@settings(max_examples=150, deadline=None)
@given(transcripts(), st.lists(st.integers(0, 200), max_size=12), st.booleans(), st.booleans())
def test_the_reader_gives_what_the_headers_say_in_any_pieces(fmt, tok, t, cuts, calls, stop):
    text, msgs = t
    ids = tok.encode(text, add_special_tokens=False).ids
    whole = read(fmt, tok, ids, calls=calls)[:3]
    assert whole == oracle(msgs, calls)
    assert read(fmt, tok, ids, cuts, calls=calls, keep_stop=stop)[:3] == whole


@settings(max_examples=150, deadline=None)
@given(transcripts(), st.integers(0, 200), st.lists(st.integers(0, 200), max_size=6))
def test_an_output_cut_anywhere_reads_as_its_whole_prefix_in_pieces(fmt, tok, t, cut, cuts):
    ids = tok.encode(t[0], add_special_tokens=False).ids[:cut]
    assert read(fmt, tok, ids, cuts)[:3] == read(fmt, tok, ids)[:3]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 406), max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_junk_never_raises_and_reads_the_same_in_pieces(fmt, tok, ids, cuts):
    assert read(fmt, tok, ids, cuts)[:3] == read(fmt, tok, ids)[:3]


def test_reasoning_tokens_count_the_analysis_bodies(fmt, tok):
    body = "the cat sat on the mat"
    n = len(tok.encode(body, add_special_tokens=False).ids)
    text = (
        f"<|channel|>analysis<|message|>{body}<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris<|return|>"
    )
    ids = tok.encode(text, add_special_tokens=False).ids
    reasoning, content, calls, r = read(fmt, tok, ids, cuts=range(len(ids)))
    assert (reasoning, content, calls) == (body, "Paris", [])
    assert r.num_tokens == n and r.began_thinking


def test_a_cut_short_call_is_a_call_only_if_its_arguments_parse(fmt, tok):
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    whole = tok.encode(head + '{"city": "Paris"}', add_special_tokens=False).ids
    assert read(fmt, tok, whole)[2] == [ParsedCall("get_weather", '{"city": "Paris"}')]
    cut = tok.encode(head + '{"city": "Pa', add_special_tokens=False).ids
    assert read(fmt, tok, cut)[1:3] == ('{"city": "Pa', [])
    # closed by <|call|>, its arguments are what the model wrote, JSON or not
    closed = tok.encode(head + "city=Paris<|call|>", add_special_tokens=False).ids
    assert read(fmt, tok, closed)[2] == [ParsedCall("get_weather", "city=Paris")]


def test_ordinary_tokens_that_spell_a_marker_are_text(fmt, tok):
    spelled = (
        tok.encode("<|", add_special_tokens=False).ids
        + tok.encode("end|>", add_special_tokens=False).ids
    )
    assert tok.decode(spelled, skip_special_tokens=False) == "<|end|>"
    assert not set(spelled) & set(fmt.markers)
    head = tok.encode("<|channel|>final<|message|>a", add_special_tokens=False).ids
    ids = head + spelled + tok.encode("b<|return|>", add_special_tokens=False).ids
    assert read(fmt, tok, ids, cuts=range(len(ids)))[1] == "a<|end|>b"


def test_the_generation_prompt_decides_where_reading_starts(fmt, tok):
    body = tok.encode("Paris is warm", add_special_tokens=False).ids
    # the template opened the answer: all of the output is content, constrained from the start
    opened = "<|start|>assistant<|channel|>final<|message|>"
    assert read(fmt, tok, body, primer=opened)[:3] == ("", "Paris is warm", [])
    assert fmt.reader(True, (opened, tok.encode(opened, add_special_tokens=False).ids)).answering
    # the prompt's last message is complete: the output opens its own
    done = "<|start|>user<|message|>hi<|end|>"
    ids = tok.encode("<|start|>assistant<|channel|>analysis<|message|>hm<|end|>").ids
    assert read(fmt, tok, ids, primer=done)[:3] == ("hm", "", [])
    # after the usual generation prompt the reader is in a header, before the answer
    assert not fmt.reader(True, ("<|start|>assistant", [])).answering


def test_headers_name_channel_recipient_and_content_type():
    h = Header.parse("assistant<|channel|>commentary to=functions.f <|constrain|>json")
    assert h == Header("commentary", "functions.f", "json")
    assert Header.parse(" to=functions.g<|channel|>commentary json") == Header(
        "commentary", "functions.g", None
    )
    assert Header.parse("assistant") == Header(None, None, None)


def test_a_tokenizer_without_the_markers_is_refused(tmp_path):
    from conftest import build_tokenizer
    from tokenizers import Tokenizer

    build_tokenizer(tmp_path)
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"needs '<\|start\|>' as one token"):
        harmony_format(_Encoder(plain))


def test_the_answers_constraint_starts_after_the_final_header(fmt, tok):
    assert list(fmt.final_header) == tok.encode(FINAL_HEADER, add_special_tokens=False).ids
