"""Sequence classifiers and reward models (``*ForSequenceClassification`` checkpoints):
``LLM.classify`` and ``LLM.reward`` match transformers' ``logits`` and vLLM's activation
(softmax over the labels, the logistic function of a single one); a deterministic
classification is the same bits alone and in any company, the fast path's is not (the negative
control); a classifier refuses to generate or score with an error naming the model, and keeps
serving; ``POST /classify`` over real HTTP gives the in-process bits."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import base64
import copy
import json
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import CLASSIFIERS, build_classifier
from server_fixtures import SERVED_NAME, start_server

import detspec


def f32_bits(xs) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("classifiers")
    return {n: (root / n, build_classifier(n, root / n, tokenizer_dir)) for n in CLASSIFIERS}


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


PROMPTS = [[5], [7, 8, 9, 10, 11, 12, 13], list(range(20, 81)), "The quick brown fox"]


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_classify_and_reward_match_transformers(name, classifiers):
    path, model = classifiers[name]
    llm = detspec.LLM(str(path), max_model_len=128)
    try:
        labels = CLASSIFIERS[name][2] or ["LABEL_0", "LABEL_1"]
        assert llm.labels == labels
        out = llm.classify(PROMPTS)
        rewards = llm.reward(PROMPTS)
        for p, o, r in zip(PROMPTS, out, rewards, strict=True):
            ids = llm.get_tokenizer().encode(p) if isinstance(p, str) else p
            assert o.prompt_token_ids == ids and r.prompt_token_ids == ids
            want = hf_logits(model, ids)
            got = np.array(o.outputs.logits)
            assert got.shape == (len(labels),)
            assert np.abs(got - want).max() < 1e-5, (got, want)
            t = torch.tensor(want, dtype=torch.float64)
            act = torch.sigmoid(t) if len(labels) == 1 else torch.softmax(t, 0)
            assert np.abs(np.array(o.outputs.probs) - act.numpy()).max() < 1e-5
            assert o.outputs.label == labels[int(np.argmax(o.outputs.probs))]
            # reward: the raw logits, bit for bit
            assert f32_bits(r.outputs.data) == f32_bits(o.outputs.logits)
            assert o.fingerprint == llm.fingerprint
    finally:
        llm.shutdown()


def test_a_classifiers_score_layer_updates_by_its_hf_name(classifiers):
    path, model = classifiers["llama3"]
    llm = detspec.LLM(str(path), max_model_len=128)
    try:
        before = llm.fingerprint
        new = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
        llm.update_weights([("score.weight", new)])
        ref = copy.deepcopy(model)
        with torch.no_grad():
            ref.score.weight.copy_(new)
        got = np.array(llm.classify([[5, 6, 7, 8]])[0].outputs.logits)
        assert np.allclose(got, hf_logits(ref, [5, 6, 7, 8]), rtol=1e-5, atol=1e-5)
        assert llm.fingerprint != before
        # a classifier has no lm_head: the name is refused, nothing changes
        with pytest.raises(detspec.InvalidRequestError) as e:
            llm.update_weights([("lm_head.weight", torch.zeros(512, 64))])
        assert "lm_head.weight" in str(e.value)
    finally:
        llm.shutdown()


def test_a_deterministic_classification_is_the_same_bits_in_any_company(classifiers):
    path, _ = classifiers["llama3"]
    llm = detspec.LLM(str(path), max_model_len=128, num_threads=2)
    rng = np.random.default_rng(3)
    target = rng.integers(3, 400, 90).tolist()
    others = [rng.integers(3, 400, int(n)).tolist() for n in rng.integers(1, 120, 12)]

    def run(deterministic: bool) -> tuple[list[int], list[list[int]]]:
        def bits(batch):
            o = llm.classify(batch, deterministic=deterministic)[-1].outputs
            return f32_bits(o.logits) + f32_bits(o.probs)

        return bits([target]), [bits(others[:k] + [target]) for k in (1, 4, 12)]

    try:
        alone, copies = run(True)
        assert all(c == alone for c in copies)
        # Negative control: the fast path's bits follow what it is computed with.
        fast, fast_copies = run(False)
        assert any(c != fast for c in fast_copies), "the fast path looked invariant"
    finally:
        llm.shutdown()


def test_a_classifier_refuses_generation_and_scoring_and_keeps_serving(classifiers, llm_factory):
    path, _ = classifiers["qwen2_reward"]
    llm = detspec.LLM(str(path), max_model_len=128)
    try:
        for call in (
            lambda: llm.generate([[5, 6, 7]], detspec.SamplingParams(max_tokens=2)),
            lambda: llm.score([[5, 6, 7]], [[8, 9]]),
            lambda: llm.prompt_logprobs([[5, 6, 7]], 1),
        ):
            with pytest.raises(detspec.InvalidRequestError) as e:
                call()
            assert e.value.param == "model", e.value
            assert "sequence classifier" in str(e.value) and str(path) in str(e.value)
        assert len(llm.classify([[5, 6, 7]])[0].outputs.probs) == 1  # still serving
        assert len(llm.embed([[5, 6, 7]])[0].outputs.embedding) == 64  # the hidden state
    finally:
        llm.shutdown()
    # and a language model refuses to classify, naming the model
    lm = llm_factory("llama")
    with pytest.raises(detspec.InvalidRequestError) as e:
        lm.classify([[1, 2, 3]])
    assert e.value.param == "model" and "ForSequenceClassification" in str(e.value)
    assert lm.labels is None


def test_bad_id2label_is_an_error_naming_the_field(classifiers, tmp_path):
    path, _ = classifiers["llama3"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["id2label"] = {"0": "a", "2": "c"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(detspec.ModelLoadError) as e:
        detspec.LLM(str(bad))
    assert "id2label" in str(e.value)


def test_classify_over_http_is_the_in_process_bits(classifiers, tmp_path_factory):
    path, _ = classifiers["llama3"]
    inputs = ["Hello there", [5, 6, 7, 8], list(range(30, 70))]
    local = detspec.LLM(str(path), max_model_len=128)
    try:
        want = local.classify(inputs)
        fingerprint = local.fingerprint
        conv_ids = local.get_tokenizer().apply_chat_template(
            [
                {"role": "user", "content": "Is the sky blue?"},
                {"role": "assistant", "content": "Yes, on a clear day."},
            ],
            add_generation_prompt=False,
            tokenize=True,
        )
        conv_want = local.classify([conv_ids])[0]
    finally:
        local.shutdown()
    s = start_server(tmp_path_factory, "classify", str(path), "--max-model-len", "128")
    try:
        for route in ("/classify", "/v1/classify"):
            body = {"model": SERVED_NAME, "input": inputs, "deterministic": True}
            r = httpx.post(s.base_url + route, json=body, timeout=60)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["id"].startswith("classify-")
            assert body["fingerprint"].startswith(fingerprint)
            assert body["usage"]["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want)
            for i, (d, w) in enumerate(zip(body["data"], want, strict=True)):
                assert d["index"] == i and d["num_classes"] == 3
                assert d["label"] == w.outputs.label
                assert f32_bits(d["probs"]) == f32_bits(w.outputs.probs)
                assert f32_bits(d["logits"]) == f32_bits(w.outputs.logits)
        one = httpx.post(
            s.base_url + "/classify",
            json={"input": "Hello there", "deterministic": True},
            timeout=60,
        )
        assert f32_bits(one.json()["data"][0]["probs"]) == f32_bits(want[0].outputs.probs)
        # A conversation (what a reward model judges) is its rendered template's ids.
        conv = [
            {"role": "user", "content": "Is the sky blue?"},
            {"role": "assistant", "content": "Yes, on a clear day."},
        ]
        chat = httpx.post(
            s.base_url + "/v1/classify",
            json={"messages": conv, "deterministic": True},
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        assert f32_bits(chat.json()["data"][0]["logits"]) == f32_bits(conv_want.outputs.logits)
        both = httpx.post(s.base_url + "/classify", json={"input": "x", "messages": conv})
        assert both.status_code in (400, 422) and "messages" in both.text
        # vLLM's pooling API: a classifier's raw logits, as floats or base64 float32 bytes.
        pooled = httpx.post(
            s.base_url + "/pooling",
            json={"input": inputs, "deterministic": True},
            timeout=60,
        ).json()
        assert pooled["object"] == "list" and pooled["id"].startswith("pool-")
        assert [d["object"] for d in pooled["data"]] == ["pooling"] * 3
        assert [f32_bits(d["data"]) for d in pooled["data"]] == [
            f32_bits(w.outputs.logits) for w in want
        ]
        packed = httpx.post(
            s.base_url + "/pooling",
            json={"input": inputs[:1], "deterministic": True, "encoding_format": "base64"},
            timeout=60,
        ).json()["data"][0]["data"]
        raw = base64.b64decode(packed)
        assert list(struct.unpack(f"<{len(raw) // 4}I", raw)) == f32_bits(want[0].outputs.logits)

        # SGLang's reward-model body and answer: `text` / `input_ids` -> `embedding` (logits).
        def sglang(body: dict) -> dict | list:
            r = httpx.post(s.base_url + "/classify", json={**body, "deterministic": True})
            assert r.status_code == 200, r.text
            return r.json()

        one_text = sglang({"text": inputs[0]})
        assert f32_bits(one_text["embedding"]) == f32_bits(want[0].outputs.logits)
        assert one_text["meta_info"]["prompt_tokens"] == len(want[0].prompt_token_ids)
        texts = sglang({"text": [inputs[0]]})
        assert isinstance(texts, list) and texts[0]["embedding"] == one_text["embedding"]
        one_ids = sglang({"input_ids": inputs[1]})
        assert f32_bits(one_ids["embedding"]) == f32_bits(want[1].outputs.logits)
        many_ids = sglang({"input_ids": inputs[1:]})
        assert [f32_bits(x["embedding"]) for x in many_ids] == [
            f32_bits(w.outputs.logits) for w in want[1:]
        ]
        # A classifier of three labels is no cross-encoder: /score names the model.
        three = httpx.post(
            s.base_url + "/v1/score", json={"text_1": "a", "text_2": ["b"]}, timeout=30
        )
        assert three.status_code == 400 and "model" in three.text, three.text
        for body, param in [
            ({"input": []}, "input"),
            ({"input": [[1, 2], []]}, "input[1]"),
            ({"input": [99999]}, "input"),
            ({"model": "nope", "input": "x"}, "model"),
        ]:
            resp = httpx.post(s.base_url + "/v1/classify", json=body, timeout=30)
            assert resp.status_code in (400, 404, 422), resp.text
            assert param in resp.text, (body, resp.text)
        # A classifier's generation routes answer 400 naming the model; it keeps serving.
        chat = httpx.post(
            s.base_url + "/v1/completions",
            json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2},
            timeout=30,
        )
        assert chat.status_code == 400 and "sequence classifier" in chat.text, chat.text
        again = httpx.post(s.base_url + "/classify", json={"input": inputs[:1]}, timeout=60)
        assert again.status_code == 200
    finally:
        rc = s.stop()
    assert rc == 0, s.log()


def test_a_single_label_classifier_scores_and_reranks_pairs_as_a_cross_encoder(
    classifiers, tmp_path_factory, tmp_path
):
    """``/score`` and ``/rerank`` on a cross-encoder: each pair is one sequence, the texts
    joined by the tokenizer's pair template (here ``A </s> B </s>``, the ids the ``tokenizers``
    library gives), and its score the classifier's probability for it, bit for bit."""
    from tokenizers import Tokenizer, processors

    src, _ = classifiers["qwen2_reward"]
    path = tmp_path / "cross"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A </s> $B:1 </s>:1", special_tokens=[("</s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    query = "Where does the keeper write the weather?"
    docs = ["The keeper kept a small notebook.", "Bakers mix flour and water.", "Hello"]
    pairs = [tok.encode(query, d).ids for d in docs]
    assert all(p.count(1) == 2 for p in pairs)  # the template's separators are there
    local = detspec.LLM(str(path), max_model_len=128)
    try:
        assert local.get_tokenizer().encode_pair(query, docs[0]) == pairs[0]
        want = [o.outputs.probs[0] for o in local.classify(pairs)]
    finally:
        local.shutdown()
    s = start_server(tmp_path_factory, "cross", str(path), "--max-model-len", "128")
    try:

        def post(route: str, body: dict) -> httpx.Response:
            body = {"model": SERVED_NAME, "deterministic": True, **body}
            return httpx.post(s.base_url + route, json=body, timeout=60)

        r = post("/v1/score", {"text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        assert [f32_bits([x["score"]]) for x in r.json()["data"]] == [f32_bits([w]) for w in want]
        ids = post("/score", {"text_1": [pairs[0][:3]], "text_2": [pairs[0][3:]]}).json()
        assert f32_bits([ids["data"][0]["score"]]) == f32_bits(want[:1])  # ids concatenated
        rr = post("/v1/rerank", {"query": query, "documents": docs, "top_n": 2}).json()
        best = sorted(range(3), key=lambda i: (-want[i], i))[:2]
        assert [x["index"] for x in rr["results"]] == best
        assert [x["relevance_score"] for x in rr["results"]] == [want[i] for i in best]
        mixed = post("/v1/score", {"text_1": query, "text_2": [[5, 6]]})
        assert mixed.status_code == 400 and "text_2" in mixed.text
    finally:
        rc = s.stop()
    assert rc == 0, s.log()
