"""``detspec run-batch`` (OpenAI's batch file format, vLLM's ``run_batch``) as a subprocess on
the tiny random model: every line is answered as the server answers it (a bad body is a 400
naming its field, a line that cannot be sent an ``error``, the rest run); with
``--deterministic-by-default`` the answers are bitwise the same whether the lines run one at
a time or all at once under a small ``--max-num-seqs``, and without it they are not (the
negative control); ``--compare`` finds a rerun the same, and names the answer and the field
that moved in a tampered earlier file and in a rerun without determinism."""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_fixtures import demo_model_dir  # noqa: F401

WORDS = ["river", "stone", "cloud", "lamp", "field", "north", "glass"]


def lines() -> list[str]:
    out = []
    for i in range(16):
        prompt = " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 2 + i % 5))
        if i % 2:
            url, body = (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "logprobs": True,
                },
            )
        else:
            url, body = "/v1/completions", {"prompt": prompt, "logprobs": 1}
        body |= {"max_tokens": 6 + i % 7, "temperature": 0.9, "seed": i, "ignore_eos": True,
                 "return_token_ids": True}  # fmt: skip
        out.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body}))
    bad = {"prompt": "x", "max_tokens": 4, "temperature": -1.0}
    out.insert(3, json.dumps({"custom_id": "bad", "url": "/v1/completions", "body": bad}))
    out.insert(7, "{not json")
    out.insert(9, json.dumps({"custom_id": "emb", "url": "/v1/embeddings", "body": {}}))
    stream = {"prompt": "x", "stream": True}
    out.append(json.dumps({"custom_id": "stream", "url": "/v1/completions", "body": stream}))
    out.append("")  # blank lines are skipped
    return out


def run(model: str, tmp: Path, name: str, *flags: str, rc: int = 0) -> list[dict]:
    """The output lines of one run-batch of ``lines()``; its stderr in ``tmp/<name>.err``."""
    src = tmp / "in.jsonl"
    src.write_text("\n".join(lines()) + "\n")
    dst = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "detspec", "run-batch", "-i", str(src), "-o", str(dst), model]
    p = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300)
    (tmp / f"{name}.err").write_text(p.stderr)
    assert p.returncode == rc, p.stderr
    assert "20 requests, 4 failed" in p.stderr, p.stderr
    return [json.loads(x) for x in dst.read_text().splitlines()]


def answers(outs: list[dict]) -> dict[str, tuple]:
    """Per answered line: token ids, text and logprobs (as JSON floats: f32 values, exact)."""
    got = {}
    for o in outs:
        r = o["response"]
        if r is None or r["status_code"] != 200:
            continue
        (ch,) = r["body"]["choices"]
        if "message" in ch:
            lps = [e["logprob"] for e in ch["logprobs"]["content"]]
            text = ch["message"]["content"]
        else:
            lps, text = ch["logprobs"]["token_logprobs"], ch["text"]
        got[o["custom_id"]] = (ch["token_ids"], text, lps)
    return got


@pytest.fixture(scope="module")
def model(demo_model_dir) -> str:
    return demo_model_dir


def test_lines_are_answered_as_the_server_answers(model, tmp_path) -> None:
    outs = run(model, tmp_path, "a", "--deterministic-by-default")
    ids = [o["custom_id"] for o in outs]
    assert ids[:4] == ["q0", "q1", "q2", "bad"] and ids[-1] == "stream" and len(ids) == 20
    by_id = {o["custom_id"]: o for o in outs if o["custom_id"] is not None}
    bad = by_id["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    assert by_id["emb"]["error"]["code"] == "invalid_url" and by_id["emb"]["response"] is None
    assert by_id["stream"]["error"]["code"] == "invalid_request"
    (unparsed,) = [o for o in outs if o["custom_id"] is None]
    assert unparsed["error"]["code"] == "invalid_json" and "line 8" in unparsed["error"]["message"]
    ok = [o for o in outs if o["response"] and o["response"]["status_code"] == 200]
    assert len(ok) == 16
    for o in ok:
        body = o["response"]["body"]
        assert o["response"]["request_id"] == body["id"]
        assert body["system_fingerprint"].endswith("+det-default-seed0")
        assert all(c["dvr_metrics"]["deterministic"] for c in body["choices"])
    assert len(answers(outs)) == 16


@pytest.mark.parametrize("deterministic", [True, False], ids=["dvr", "negative-control"])
def test_answers_do_not_depend_on_the_batching(model, tmp_path, deterministic) -> None:
    det = ["--deterministic-by-default"] if deterministic else []
    alone = answers(run(model, tmp_path, "alone", "--max-concurrency", "1", *det))
    together = answers(
        run(model, tmp_path, "together", "--max-num-seqs", "5", "--max-num-batched-tokens",
            "64", *det)
    )  # fmt: skip
    assert alone.keys() == together.keys() and len(alone) == 16
    if deterministic:
        assert alone == together
    else:  # the fast path's logprobs move with the batch
        assert any(alone[k][2] != together[k][2] for k in alone)


def test_compare_audits_a_rerun(model, tmp_path) -> None:
    det = "--deterministic-by-default"
    run(model, tmp_path, "first", det, "--max-concurrency", "1")
    first = str(tmp_path / "first.jsonl")
    run(model, tmp_path, "again", det, "--max-num-seqs", "5", "--compare", first)
    assert "19 same, 0 differ" in (tmp_path / "again.err").read_text()
    # one logprob of q5 moved in the earlier file: found, named, exit status 1
    outs = [json.loads(x) for x in (tmp_path / "first.jsonl").read_text().splitlines()]
    (q5,) = [o for o in outs if o["custom_id"] == "q5"]
    q5["response"]["body"]["choices"][0]["logprobs"]["content"][2]["logprob"] += 1e-6
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(o) + "\n" for o in outs))
    run(model, tmp_path, "audit", det, "--compare", str(tampered), rc=1)
    err = (tmp_path / "audit.err").read_text()
    assert "q5: differs at body.choices[0].logprobs.content[2].logprob" in err, err
    assert "18 same, 1 differ" in err, err
    # without determinism a batched rerun moves (negative control)
    run(model, tmp_path, "plain", "--max-concurrency", "1")
    run(model, tmp_path, "plain2", "--max-num-seqs", "5", "--max-num-batched-tokens", "64",
        "--compare", str(tmp_path / "plain.jsonl"), rc=1)  # fmt: skip
    assert "logprob" in (tmp_path / "plain2.err").read_text()
