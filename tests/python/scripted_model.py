"""A model whose output is written by its prompt: for tests of output formats (gpt-oss's
Harmony, GLM-4.5's calls) that a random model would never produce.

A one-layer Qwen2 whose attention looks exactly ``OFFSET`` positions back, whatever the
tokens: its query and key are constant (biases, zero weights), and the query's phase per
RoPE frequency is set so that the score peaks at that distance (with base 100 the nearest
other distance scores 3.6 × the amplitude lower, thousands of logits at this amplitude).
The value is the token's embedding, the MLP is off, and the output layer is the embedding
matrix, so the next token is the token ``OFFSET`` back: a prompt whose last ``OFFSET``
tokens begin with a script makes the model say that script, token for token, on any
engine (this one and transformers alike). ``script_prompt`` pads a conversation so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch
import transformers
from conftest import BOS_ID, EOS_ID, TOKENIZER_VOCAB, VOCAB_SIZE, add_tokens, build_tokenizer
from tokenizers import Tokenizer

OFFSET = 128  # the token this many positions back is the next one
HIDDEN = 128
ROPE_BASE = 100.0
AMPLITUDE = 120.0  # of the query: the attention score's peak is 64 × this / sqrt(128)
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
STOPS = ["<|return|>", "<|call|>"]  # end the output, as gpt-oss's generation config says

# A Harmony-style chat template written for the tests: each message as gpt-oss's template
# writes it (an assistant's reasoning, sent back as `thinking`, as its analysis message).
HARMONY_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['thinking'] %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m['thinking'] }}<|end|>{% endif %}"
    "<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def marker_ids(markers: list[str] = MARKERS, stops: list[str] = STOPS) -> dict[str, int]:
    """Each marker's (and stop's) token id in a scripted model's tokenizer."""
    return {m: TOKENIZER_VOCAB + i for i, m in enumerate(markers + stops)}


def harmony_ids() -> dict[str, int]:
    """Each Harmony marker's token id in the scripted model's tokenizer."""
    return marker_ids()


def write_harmony_tokenizer(
    out: Path,
    markers: list[str] = MARKERS,
    stops: list[str] = STOPS,
    template: str = HARMONY_TEMPLATE,
) -> Tokenizer:
    """The tests' tiny tokenizer with ``markers`` and ``stops`` (Harmony's by default) as
    special tokens, and ``template`` as its chat template."""
    build_tokenizer(out)
    ids = {i: m for m, i in marker_ids(markers, stops).items()}
    add_tokens(out, ids, special=True, chat_template=template)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def write_scripted_model(
    out: Path,
    markers: list[str] = MARKERS,
    stops: list[str] = STOPS,
    template: str = HARMONY_TEMPLATE,
) -> Path:
    """The copying model of this module's doc, with a tokenizer of ``markers`` and ``stops``
    (Harmony's by default; the stops end the output) and chat ``template``, in ``out``."""
    write_harmony_tokenizer(out, markers, stops, template)
    ids = marker_ids(markers, stops)
    stop_ids = [EOS_ID, *(ids[s] for s in stops)]
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=HIDDEN,
        max_position_embeddings=512, rope_theta=ROPE_BASE, tie_word_embeddings=False,
        rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=stop_ids,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg)
    half = HIDDEN // 2
    freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) * 2 / HIDDEN)
    # score(distance d) = AMPLITUDE * sum_j cos((d - OFFSET + 1) * freq_j): the query at
    # position p peaks at the key p - (OFFSET - 1), whose token is next.
    phase = -(OFFSET - 1) * freq
    with torch.no_grad():
        emb = torch.randn(VOCAB_SIZE, HIDDEN, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(emb)
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        q = AMPLITUDE * torch.cat([torch.cos(phase), torch.sin(phase)])
        attn.q_proj.bias.copy_(q.float())
        attn.k_proj.bias.copy_(torch.cat([torch.ones(half), torch.zeros(half)]))
        attn.v_proj.weight.copy_(torch.eye(HIDDEN))
        attn.v_proj.bias.zero_()
        attn.o_proj.weight.copy_(20 * torch.eye(HIDDEN))  # the copy outweighs the residual
        model.model.layers[0].mlp.down_proj.weight.zero_()
    model.save_pretrained(out, safe_serialization=True)
    return out


def padding(prompt_len: int, script_at: int) -> int:
    """How many one-token fillers after the script put it ``OFFSET`` tokens before the
    end of a prompt of ``prompt_len`` tokens (without them) where it starts at
    ``script_at``."""
    n = script_at + OFFSET - prompt_len
    assert n >= 0, f"the script and what follows it exceed {OFFSET} tokens"
    return n


def scripted_messages(
    base_url: str, tok: Tokenizer, script: str, before: tuple = (), **body: Any
) -> list[dict]:
    """Messages whose last user message makes the scripted model served at ``base_url`` say
    ``script``: the script, then fillers (``<s>``, one token each) that put it ``OFFSET``
    tokens before the end of the rendered prompt. ``body``: what else the chat request sends
    that changes the rendering (``tools``, ``chat_template_kwargs``)."""
    ids = tok.encode(script, add_special_tokens=False).ids

    def render(content: str) -> list[int]:
        messages = [*before, {"role": "user", "content": content}]
        r = httpx.post(base_url + "/tokenize", json={"messages": messages, **body})
        r.raise_for_status()
        return r.json()["tokens"]

    prompt = render(script)
    at = max(i for i in range(len(prompt)) if prompt[i : i + len(ids)] == ids)
    content = script + "<s>" * padding(len(prompt), at)
    assert len(render(content)) == len(prompt) + padding(len(prompt), at)
    return [*before, {"role": "user", "content": content}]
