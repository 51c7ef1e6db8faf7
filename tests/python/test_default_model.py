"""The shipped default model (python/detspec/_default_model): it comes with the installed
package, loads through the ordinary HF-directory path, writes English-looking text, and its loss on
held-out docstrings (tests/data/default_model_heldout.txt, written by
scripts/train_default_model.py) is far below a random model's of the same shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
from tokenizers import Tokenizer

import detspec
from detspec import LLM, SamplingParams
from detspec.default_model import default_model_dir

HELDOUT = Path(__file__).resolve().parent.parent / "data" / "default_model_heldout.txt"
HELDOUT_TOKENS = 384
PROMPTS = ["The quick brown fox", "Return the number of", "This module provides"]


def mostly_words(text: str) -> float:
    """Share of characters that are ASCII letters, spaces or common punctuation."""
    ok = sum(c.isascii() and (c.isalpha() or c in " \n.,'()-:") for c in text)
    return ok / max(1, len(text))


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM()
    yield engine
    engine.shutdown()


def test_ships_inside_the_installed_package() -> None:
    d = default_model_dir()
    assert d.is_relative_to(Path(detspec.__file__).resolve().parent)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (d / name).is_file(), name
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    with safetensors.safe_open(d / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes <= {"BF16", "F16"}, dtypes


def test_no_model_means_the_shipped_one(llm: LLM) -> None:
    assert Path(llm.model) == default_model_dir()


def test_writes_english_looking_words(llm: LLM) -> None:
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    for o in outs:
        text = o.outputs[0].text
        assert mostly_words(text) > 0.85, text
        words = [w for w in text.split() if w.isalpha()]
        assert len(words) >= 5, text


def test_chat_template_renders(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What does sorted return?"}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert "user" in out.prompt and out.prompt.rstrip().endswith("assistant:")
    assert out.outputs[0].token_ids


def test_generate_cli_prints_readable_text() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "detspec", "generate", "--prompt", "The quick brown fox",
         "--max-tokens", "32"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stdout.splitlines() if s.strip().startswith("output:"))
    assert mostly_words(line) > 0.85, line


def heldout_loss(model: transformers.LlamaForCausalLM, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x[:, :-1]).logits[0]
    return torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()


def test_heldout_loss_far_below_random() -> None:
    d = default_model_dir()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    config = transformers.AutoConfig.from_pretrained(d)
    bos = config.bos_token_id
    ids = [bos, *tok.encode(HELDOUT.read_text(), add_special_tokens=False).ids][:HELDOUT_TOKENS]
    assert len(ids) == HELDOUT_TOKENS
    trained = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    torch.manual_seed(0)
    random = transformers.LlamaForCausalLM(config).float().eval()
    got, rand = heldout_loss(trained, ids), heldout_loss(random, ids)
    assert got < rand - 2.5, (got, rand)
    recorded = json.loads((d / "training.json").read_text())
    # The script measured the whole held-out split; this is a slice of it.
    assert abs(got - recorded["heldout_loss"]) < 1.0, (got, recorded["heldout_loss"])
    assert abs(rand - recorded["heldout_loss_random_init"]) < 0.5
