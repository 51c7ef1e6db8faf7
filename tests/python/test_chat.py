"""Chat templates: detspec's Rust (minijinja) rendering equals transformers' (jinja2) on the
same model directory, and ``LLM.chat`` generates from exactly that rendering."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

import detspec
from detspec import InvalidRequestError, SamplingParams

CONVERSATION = [
    {"role": "system", "content": "You keep the lighthouse."},
    {"role": "user", "content": "How many ships passed tonight?"},
    {"role": "assistant", "content": "Three, and a gull."},
    {"role": "user", "content": "  Write it in the notebook.  "},
]

# Exercises what real templates use: bos_token, loop variables, filters, Python string
# methods, a namespace, raise_exception and extra variables.
RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "[{{ loop.index }}{% if loop.first %}*{% endif %}] {{ m['role'] | upper }}: "
    "{{ m['content'].strip() }}{% if not loop.last %}\n{% endif %}"
    "{% endfor %}"
    "{% if tools %}\nTOOLS {{ tools | length }}{% endif %}"
    "\n({{ ns.n }} messages)"
    "{% if add_generation_prompt %}\nASSISTANT:{% endif %}"
)


def hf_render(path, conversation, add_generation_prompt=True, **kwargs) -> str:
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )


@pytest.fixture(scope="module")
def llama_llm(llama_case):
    llm = detspec.LLM(llama_case.path, num_kv_pages=256)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_matches_transformers(llama_case, llama_llm, add_generation_prompt):
    want = hf_render(llama_case.path, CONVERSATION, add_generation_prompt)
    got = llama_llm.get_tokenizer().apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt
    )
    assert got == want


def test_rich_template_from_jinja_file_matches_transformers(copy_model_dir):
    d = copy_model_dir("llama")
    (d / "chat_template.jinja").write_text(RICH_TEMPLATE)
    llm = detspec.LLM(d, num_kv_pages=64)
    try:
        tok = llm.get_tokenizer()
        assert tok.apply_chat_template(CONVERSATION) == hf_render(d, CONVERSATION)
        tools = [{"name": "log", "parameters": {}}]
        assert tok.apply_chat_template(CONVERSATION, tools=tools) == hf_render(
            d, CONVERSATION, tools=tools
        )
        ids = tok.apply_chat_template(CONVERSATION, tokenize=True)
        assert (
            ids
            == AutoTokenizer.from_pretrained(str(d))(
                hf_render(d, CONVERSATION), add_special_tokens=False
            )["input_ids"]
        )
        with pytest.raises(InvalidRequestError, match="unknown role robot"):
            tok.apply_chat_template([{"role": "robot", "content": "beep"}])
        # a template that trims the message (strip()): cut after the trimmed text
        conv = [*CONVERSATION[:2], {"role": "assistant", "content": "  Three  "}]
        kw = dict(add_generation_prompt=False, continue_final_message=True)
        assert tok.apply_chat_template(conv, **kw) == hf_render(d, conv, **kw)
        # LLM.chat passes tools to the template
        sp = SamplingParams(temperature=0.0, max_tokens=2)
        (out,) = llm.chat(CONVERSATION, sp, use_tqdm=False, tools=tools)
        assert out.prompt == hf_render(d, CONVERSATION, tools=tools)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("final", ["The lamp is ", "  Three  ", "Done.\n", "x"])
def test_continue_final_message_matches_transformers(llama_case, llama_llm, final):
    """transformers' ``continue_final_message``: the text ends inside the last message
    (its trailing whitespace kept where the template wrote the message whole)."""
    conv = [*CONVERSATION[:2], {"role": "assistant", "content": final}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    want = hf_render(llama_case.path, conv, **kw)
    tok = llama_llm.get_tokenizer()
    assert tok.apply_chat_template(conv, **kw) == want
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llama_llm.chat(conv, sp, use_tqdm=False, **kw)
    assert out.prompt == want
    ids = tok.encode(want, add_special_tokens=False)
    ref = llama_llm.generate([ids], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        tok.apply_chat_template(conv, continue_final_message=True)


def test_continue_final_message_errors_name_the_message(copy_model_dir):
    d = copy_model_dir("llama")
    # a template that leaves out the assistant's words cannot continue them
    drops = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
    (d / "chat_template.jinja").write_text(drops + "{% endfor %}")
    llm = detspec.LLM(d, num_kv_pages=64)
    try:
        tok = llm.get_tokenizer()
        conv = [*CONVERSATION[:2], {"role": "assistant", "content": "Three"}]
        kw = dict(add_generation_prompt=False, continue_final_message=True)
        with pytest.raises(InvalidRequestError, match=r"messages\[2\]\.content") as e:
            tok.apply_chat_template(conv, **kw)
        assert e.value.param == "messages[2].content"
        with pytest.raises(InvalidRequestError, match="needs text to continue"):
            tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], **kw)
        # content parts: the last text part is continued (this template prints the list)
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}]}]
        assert str(tok.apply_chat_template(parts, **kw)).endswith('"text": "Hi ')
    finally:
        llm.shutdown()


def test_chat_generates_from_the_rendered_prompt(llama_case, llama_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    other = [{"role": "user", "content": "Light the lamp."}]
    outs = llama_llm.chat([CONVERSATION, other], sp, use_tqdm=False)
    hf = AutoTokenizer.from_pretrained(str(llama_case.path))
    for conv, out in zip([CONVERSATION, other], outs, strict=True):
        text = hf_render(llama_case.path, conv)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert out.prompt == text
        assert out.prompt_token_ids == ids
        ref = llama_llm.generate([ids], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # One conversation (a list of messages) is one request.
    (single,) = llama_llm.chat(other, sp, use_tqdm=False)
    assert single.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_given_template_matches_transformers(llama_case, llama_llm):
    """A ``chat_template`` argument replaces the model's, as in transformers; a model without
    a template chats with one given."""
    want = hf_render(llama_case.path, CONVERSATION, chat_template=RICH_TEMPLATE, tools=[{}])
    tok = llama_llm.get_tokenizer()
    got = tok.apply_chat_template(CONVERSATION, chat_template=RICH_TEMPLATE, tools=[{}])
    assert got == want != tok.apply_chat_template(CONVERSATION, tools=[{}])
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    (out,) = llama_llm.chat(CONVERSATION, sp, use_tqdm=False, chat_template=RICH_TEMPLATE)
    assert out.prompt == hf_render(llama_case.path, CONVERSATION, chat_template=RICH_TEMPLATE)
    with pytest.raises(InvalidRequestError, match="chat_template"):
        tok.apply_chat_template(CONVERSATION, chat_template="{% for m in messages %}")


def test_chat_errors_name_the_problem(copy_model_dir, llama_llm):
    with pytest.raises(InvalidRequestError, match="messages"):
        llama_llm.chat([], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="messages"):
        llama_llm.get_tokenizer().apply_chat_template([{"role": "user", "content": object()}])
    d = copy_model_dir("llama")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = detspec.LLM(d, num_kv_pages=64)
    try:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
        (given,) = llm.chat(
            [{"role": "user", "content": "hi"}],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
            chat_template="{{ messages[0]['content'] }}",
        )
        assert given.prompt == "hi"
        # The engine still serves plain prompts afterwards.
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
