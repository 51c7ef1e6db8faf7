#!/usr/bin/env python3
"""Train detspec's built-in default model: a few-million-parameter Llama that writes English.

Why this exists: the default model is what a new user sees first (``detspec generate`` with no
``--model``, ``LLM()``, ``detspec serve``, ``detspec demo``). Random weights print byte soup, so
the shipped default is trained here, offline, on text every Python install carries and that may
be redistributed: the docstrings of CPython's standard library (PSF license).

Everything is pinned so the script reproduces the committed weights: sorted file order, a fixed
filter, one seed for every random draw, ``torch.use_deterministic_algorithms(True)`` and a fixed
thread count (float sums depend on how they are split across threads). The number of steps is
fixed too; wall time is only reported. Whether the result is bitwise equal across machines
depends on torch's CPU kernels (ISA dispatch), so the run records the hash it got. The committed
weights (sha256 6a7b603a...25c9, torch 2.15 CPU, 2 threads) were reproduced bitwise by a second
full run on the same machine (654 s of training at load ~7, 238 s once it was quieter),
tokenizer and held-out file included.

Usage::

    python scripts/train_default_model.py   # writes python/detspec/_default_model/detspec-tiny-en/
    python scripts/train_default_model.py --out /tmp/m    # a second run, to compare hashes

Outputs: the HF model directory (config.json, generation_config.json, tokenizer.json,
tokenizer_config.json with a chat template, model.safetensors in bfloat16, training.json with the
numbers) and ``tests/data/default_model_heldout.txt`` (held-out docstrings for the test).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers is imported
# Idle OpenMP workers sleep instead of spinning: on a shared 2-core machine spinning threads
# slowed training several-fold. Changes timing only, not how sums are split.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "python" / "detspec" / "_default_model" / "detspec-tiny-en"
HELDOUT_PATH = REPO / "tests" / "data" / "default_model_heldout.txt"

SEED = 20251123
VOCAB_SIZE = 2048
SPECIALS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 0, 1
HELDOUT_EVERY = 50  # every 50th docstring (in corpus order) is held out
HELDOUT_CHARS = 6000  # how much held-out text is written for the test
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] | trim }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
# Sized for the budget: ~2 M parameters (4 MB in bf16; the wheel may grow 10 MB) trained for
# ~10 minutes on 2 shared cores -- large enough to spell words.
MODEL_SHAPE = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SEQ_LEN = 128
BATCH = 16
LR = 3e-3
WARMUP = 40


# --------------------------------------------------------------------------- corpus


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
    return out


def _keep(doc: str) -> bool:
    """English prose only: long enough, ASCII, not mostly code or tables."""
    if len(doc) < 60 or not doc.isascii():
        return False
    letters = sum(c.isalpha() or c == " " for c in doc)
    return letters / len(doc) > 0.8 and ">>>" not in doc


def stdlib_docstrings() -> list[str]:
    """Docstrings of the stdlib's own modules (tests and site-packages excluded), deduplicated,
    in sorted file order so every run sees the same corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages") or any(
            part in ("test", "tests", "idle_test") for part in rel
        ):
            continue
        files.append(p)
    seen: set[str] = set()
    docs = []
    for p in files:
        for doc in _docstrings(p):
            if _keep(doc) and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Prompts start like the training documents: with <s>.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def encode_docs(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model


def model_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=2,
        attention_bias=False,
        mlp_bias=False,
        **MODEL_SHAPE,
    )


def build_model(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(model_config()).float()


@torch.no_grad()
def eval_loss(model: transformers.LlamaForCausalLM, ids: torch.Tensor) -> float:
    """Mean next-token loss over consecutive SEQ_LEN windows of `ids`."""
    model.eval()
    n = (len(ids) - 1) // SEQ_LEN
    total, count = 0.0, 0
    for i in range(0, n * SEQ_LEN, SEQ_LEN * 16):
        rows = [
            ids[j : j + SEQ_LEN + 1] for j in range(i, min(i + SEQ_LEN * 16, n * SEQ_LEN), SEQ_LEN)
        ]
        batch = torch.stack(rows)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to write")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps (fixed, not timed)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (part of the recipe)")
    ap.add_argument(
        "--heldout", type=Path, default=HELDOUT_PATH, help="where the held-out text goes"
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()

    t0 = time.perf_counter()
    docs = stdlib_docstrings()
    train_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    heldout_text = ""
    for d in held_docs:
        if len(heldout_text) + len(d) > HELDOUT_CHARS:
            break
        heldout_text += d + "\n\n"
    tok = train_tokenizer(train_docs)
    train_ids = encode_docs(tok, train_docs)
    held_ids = encode_docs(tok, held_docs)
    print(
        f"corpus: {len(docs)} docstrings, {sum(map(len, docs)) / 1e6:.2f} M chars; "
        f"train {len(train_ids)} tokens, held-out {len(held_ids)} tokens",
        flush=True,
    )

    model = build_model(SEED)
    n_params = sum(p.numel() for p in model.parameters())
    random_loss = eval_loss(model, held_ids)
    print(f"model: {n_params / 1e6:.2f} M params; random-init held-out loss {random_loss:.3f}")

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:
        if step < WARMUP:
            return LR * (step + 1) / WARMUP
        frac = (step - WARMUP) / max(1, args.steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(SEED)
    model.train()
    t_train = time.perf_counter()
    ema = None
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = torch.stack([train_ids[s : s + SEQ_LEN + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t_train
            print(
                f"step {step:5d}  loss {loss.item():.3f}  (ema {ema:.3f})  {el:6.0f}s", flush=True
            )
    train_seconds = time.perf_counter() - t_train
    final_train_loss = eval_loss(model, train_ids[: len(held_ids)])
    held_loss = eval_loss(model, held_ids)
    print(f"trained: held-out loss {held_loss:.3f} (random {random_loss:.3f})")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": MODEL_SHAPE["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    record = {
        "corpus": "docstrings of the Python standard library (PSF license), "
        f"python {sys.version.split()[0]}",
        "docstrings": len(docs),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(held_ids),
        "params": n_params,
        "seed": SEED,
        "steps": args.steps,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "torch": torch.__version__,
        "threads": args.threads,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "final_train_loss": round(final_train_loss, 4),
        "final_train_loss_ema": round(ema or 0.0, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_loss_random_init": round(random_loss, 4),
        "model_safetensors_sha256": digest,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    args.heldout.parent.mkdir(parents=True, exist_ok=True)
    args.heldout.write_text(heldout_text)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
