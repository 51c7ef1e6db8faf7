"""Embeddings (``LLM.embed``, ``POST /v1/embeddings``): the pooled last-layer hidden state
matches transformers' ``last_hidden_state``; a deterministic embedding is the same bits alone,
beside other prompts in one call and while generations run, and the fast path's is not (the
negative control); over HTTP with the real ``openai`` client (base64 and float), the same bits
as in process, and every bad field a 400 naming it."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import struct

import httpx
import numpy as np
import openai
import pytest
import torch
from server_fixtures import SERVED_NAME, demo_model_dir, server  # noqa: F401

import detspec
from detspec.server.embedding_routes import cosine


def f32_bits(xs) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


def hf_hidden(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model.model(torch.tensor([ids]))
    return out.last_hidden_state[0].float().numpy()


def test_embeddings_match_transformers_last_hidden_state(llama_case, llm_factory, token_prompts):
    llm = llm_factory("llama")
    prompts = [p for p in token_prompts if len(p) > 1]
    last = llm.embed(prompts)
    mean = llm.embed(prompts, pooling="mean", normalize=False)
    cut = llm.embed(prompts, dimensions=16)
    worst = 0.0
    for p, a, b, c in zip(prompts, last, mean, cut, strict=True):
        h = hf_hidden(llama_case.model, p)
        want = h[-1] / np.linalg.norm(h[-1])
        worst = max(worst, float(np.abs(np.array(a.outputs.embedding) - want).max()))
        assert np.allclose(b.outputs.embedding, h.mean(0), atol=1e-5)
        want16 = h[-1][:16] / np.linalg.norm(h[-1][:16])
        assert len(c.outputs.embedding) == 16
        assert np.allclose(c.outputs.embedding, want16, atol=1e-5)
        assert a.prompt_token_ids == p and a.fingerprint == llm.fingerprint
    assert worst < 1e-5, worst


def test_a_deterministic_embedding_is_the_same_bits_in_any_company(demo_model_dir):
    llm = detspec.AsyncLLM(demo_model_dir, verify_strategy="replay", num_threads=2)
    rng = np.random.default_rng(0)
    target = rng.integers(3, 900, 150).tolist()
    others = [rng.integers(3, 900, int(n)).tolist() for n in rng.integers(1, 200, 12)]

    async def run(deterministic: bool) -> tuple[list[int], list[list[int]]]:
        alone = (await llm.embed([target], deterministic=deterministic))[0]
        copies = []
        for k in (1, 4, 12):
            outs = await llm.embed(others[:k] + [target], deterministic=deterministic)
            copies.append(f32_bits(outs[-1].outputs.embedding))
        # and while generations stream
        params = detspec.SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True)

        async def gen(p):
            async for _ in llm.generate(p, params):
                pass

        gens = [asyncio.create_task(gen(p)) for p in others]
        await asyncio.sleep(0.05)
        busy = (await llm.embed([target], deterministic=deterministic))[0]
        await asyncio.gather(*gens)
        copies.append(f32_bits(busy.outputs.embedding))
        return f32_bits(alone.outputs.embedding), copies

    try:
        want, copies = asyncio.run(run(True))
        assert all(c == want for c in copies)
        # Negative control: the fast path's bits follow what it is computed with.
        plain, plain_copies = asyncio.run(run(False))
        assert any(c != plain for c in plain_copies), "the fast path looked invariant"
    finally:
        llm.shutdown()


def test_embedding_errors_name_their_parameter(llm_factory):
    llm = llm_factory("llama")
    with pytest.raises(detspec.InvalidRequestError) as e:
        llm.embed([[1, 2]], dimensions=10_000)
    assert e.value.param == "dimensions"
    with pytest.raises(detspec.InvalidRequestError) as e:
        llm.embed([[1, 2]], pooling="max")
    assert e.value.param == "pooling"
    assert len(llm.embed([[1, 2]])[0].outputs.embedding) > 0  # still serving


def test_embeddings_over_http_with_the_openai_client(server, demo_model_dir):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    inputs = [[5, 6, 7, 8, 9], [11, 12], [300] * 40]
    r = c.embeddings.create(model=SERVED_NAME, input=inputs, extra_body={"deterministic": True})
    got = [d.embedding for d in r.data]  # the client asked for base64 and decoded it
    assert r.usage.prompt_tokens == 47 and [d.index for d in r.data] == [0, 1, 2]
    as_float = c.embeddings.create(
        model=SERVED_NAME,
        input=inputs,
        encoding_format="float",
        extra_body={"deterministic": True},
    )
    assert [f32_bits(d.embedding) for d in as_float.data] == [f32_bits(g) for g in got]
    local = detspec.LLM(demo_model_dir, max_model_len=256)
    try:
        want = [o.outputs.embedding for o in local.embed(inputs)]
    finally:
        local.shutdown()
    assert [f32_bits(g) for g in got] == [f32_bits(w) for w in want]
    card = c.models.list().data[0]
    assert r.model_extra["fingerprint"] == card.model_extra["fingerprint"]
    # vLLM's pooling API on a language model: the same embeddings
    pooled = httpx.post(
        server.base_url + "/pooling",
        json={"model": SERVED_NAME, "input": inputs, "deterministic": True},
        timeout=60,
    ).json()
    assert [f32_bits(d["data"]) for d in pooled["data"]] == [f32_bits(g) for g in got]
    cut = c.embeddings.create(model=SERVED_NAME, input="hello there", dimensions=8)
    assert len(cut.data[0].embedding) == 8
    assert abs(float(np.linalg.norm(cut.data[0].embedding)) - 1) < 1e-6
    url = server.base_url + "/v1/embeddings"
    for body, param in [
        ({"model": SERVED_NAME, "input": []}, "input"),
        ({"model": SERVED_NAME, "input": [[1, 2], []]}, "input[1]"),
        ({"model": SERVED_NAME, "input": [99999]}, "input"),
        ({"model": SERVED_NAME, "input": "x", "dimensions": 100000}, "dimensions"),
        ({"model": SERVED_NAME, "input": "x", "pooling": "max"}, "pooling"),
        ({"model": "nope", "input": "x"}, "model"),
    ]:
        resp = httpx.post(url, json=body, timeout=30)
        assert resp.status_code in (400, 404, 422), resp.text
        assert param in resp.text, (body, resp.text)


def test_score_and_rerank_are_the_embeddings_cosines(server, demo_model_dir):
    """vLLM's ``/score`` and ``/rerank`` for an embedding model: each score is the cosine of
    the two deterministic embeddings (``LLM.embed`` in another process gives the same bits),
    under every pairing and every name vLLM takes; rerank orders by it, cut at ``top_n``."""
    query = "Where does the keeper write the weather?"
    docs = ["The keeper kept a small notebook.", "Bakers mix flour and water.", [7, 8, 9, 10]]
    local = detspec.LLM(demo_model_dir, max_model_len=256)
    try:
        q, *d = [o.outputs.embedding for o in local.embed([query, *docs])]
    finally:
        local.shutdown()
    want = [cosine(q, v) for v in d]
    # exact sums: close to float64 numpy's cosine, and a function of the vectors' bits alone
    for v, w in zip(d, want, strict=True):
        a, b = np.asarray(q, np.float64), np.asarray(v, np.float64)
        assert abs(w - a @ b / np.linalg.norm(a) / np.linalg.norm(b)) < 1e-12

    def post(path: str, body: dict) -> httpx.Response:
        body = {"model": SERVED_NAME, "deterministic": True, **body}
        return httpx.post(server.base_url + path, json=body, timeout=60)

    for path, names in [
        ("/score", ("text_1", "text_2")),
        ("/v1/score", ("queries", "documents")),
        ("/v1/score", ("queries", "items")),
        ("/score", ("data_1", "data_2")),
    ]:
        r = post(path, {names[0]: query, names[1]: docs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [x["index"] for x in body["data"]] == [0, 1, 2]
        assert [x["score"] for x in body["data"]] == want
    pairwise = post("/v1/score", {"text_1": [query, docs[1]], "text_2": [docs[0], query]}).json()
    assert [x["score"] for x in pairwise["data"]] == [want[0], want[1]]  # cosine is symmetric

    r = post("/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    best = sorted(range(3), key=lambda i: (-want[i], i))[:2]
    assert [x["index"] for x in results] == best
    assert [x["relevance_score"] for x in results] == [want[i] for i in best]
    for x in results:
        doc = docs[x["index"]]
        assert x["document"] == ({"text": doc} if isinstance(doc, str) else None)
    every = post("/rerank", {"query": query, "documents": docs}).json()["results"]
    assert (
        len(every) == 3
        and post("/v2/rerank", {"query": query, "documents": docs}).json()["results"] == every
    )

    for path, body, param in [
        ("/v1/score", {"text_1": [query, query], "text_2": docs}, "text_1"),
        ("/v1/score", {"text_1": query, "text_2": [docs[0], []]}, "text_2[1]"),
        ("/v1/score", {"text_1": query, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": query, "documents": docs}, "text_1"),
        ("/v1/score", {"text_1": query, "text_2": docs, "queries": query}, "text_1"),
        ("/v1/rerank", {"query": query, "documents": [[99999]]}, "documents"),
        ("/v1/rerank", {"query": "", "documents": docs}, "query"),
        ("/v1/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
    ]:
        resp = post(path, body)
        assert resp.status_code in (400, 422), (body, resp.text)
        assert param in resp.text, (body, resp.text)
    assert (
        post("/v1/score", {"text_1": query, "text_2": docs}).json()["data"][0]["score"] == want[0]
    )
