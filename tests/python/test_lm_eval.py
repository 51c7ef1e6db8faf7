"""lm-evaluation-harness end to end against a real ``detspec serve`` on loopback.

Three small tasks are written into the test (YAML + local jsonl under tmp_path, nothing is
downloaded): multiple choice by loglikelihood, rolling loglikelihood (perplexity), and
generate-until (sampled, T = 0.7: lm-eval sends its seed 1234). lm-eval's
``local-completions`` model uses the server's own tokenizer through ``/tokenizer_info`` and
``/tokenize`` (``tokenizer_backend=remote``), and scores choices with ``echo`` + ``logprobs``.

Each server is evaluated twice: with ``num_concurrent=1`` on an idle server, then with
``num_concurrent=8`` while other clients load it. With ``--deterministic-by-default`` every
per-sample result (loglikelihoods, greedy flags, generated text) must be identical, bit for
bit. The negative control runs the same on a server without the option: the fast path's
scores move with the batch, so some per-sample result must differ (else the check above
could not see nondeterminism).
"""

# ruff: noqa: F811  (pytest fixtures imported from server_fixtures)

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import lm_eval  # noqa: E402
import pytest  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from server_fixtures import (  # noqa: E402, F401
    SERVED_NAME,
    ServerProcess,
    demo_model_dir,
    inline_server,
    start_server,
)

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Rome", "Madrid"],
     "answer": 0},
    {"question": "Which animal jumps over the lazy dog?",
     "choices": ["the cat", "the quick brown fox", "a small model", "the scheduler"], "answer": 1},
    {"question": "What comes after seven?", "choices": ["six", "nine", "eight", "twelve"],
     "answer": 2},
    {"question": "What does the verifier roll back?", "choices": ["the weights", "the prompt",
     "the tokenizer", "the cache past the first mismatch"], "answer": 3},
    {"question": "Where is Berlin the capital?", "choices": ["Italy", "Germany", "Spain", "France"],
     "answer": 1},
    {"question": "What do kernels reduce in a fixed order?", "choices": ["floating point sums",
     "stories", "pages of a book", "birds"], "answer": 0},
]  # fmt: skip
ROLLING_DOCS = [
    {"text": "Deterministic inference means that the same prompt, the same sampling parameters "
             "and the same seed give the same tokens and the same log probabilities, bit for "
             "bit, whatever else the server is doing."},
    {"text": "Dynamic batching changes the shapes of matrix products and the order of floating "
             "point reductions, so a request can see different numbers depending on its "
             "neighbours. Decode verify rollback keeps the fast path for everyone."},
    {"text": "Once upon a time there was a small model that wanted to tell stories about "
             "numbers, caches, pages, tokens, kernels, threads and schedulers."},
]  # fmt: skip
GEN_DOCS = [
    {"question": "What is the capital of Italy?", "answer": "Rome"},
    {"question": "Count: one two three", "answer": "four"},
    {"question": "The quick brown fox", "answer": "jumps"},
    {"question": "Hello world!", "answer": "Hello"},
]


def write_tasks(root: Path) -> list[str]:
    """Task YAMLs and their jsonl data under ``root``; returns the task names."""
    root.mkdir(parents=True, exist_ok=True)

    def data(name: str, docs: list[dict]) -> str:
        p = root / f"{name}.jsonl"
        p.write_text("".join(json.dumps(d) + "\n" for d in docs))
        return str(p)

    def yaml(name: str, body: str, docs: list[dict]) -> None:
        (root / f"{name}.yaml").write_text(
            f"task: {name}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data(name, docs)}\n"
            "test_split: test\n" + body
        )

    yaml(
        "detspec_mc",
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        MC_DOCS,
    )
    yaml(
        "detspec_rolling",
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        ROLLING_DOCS,
    )
    yaml(
        "detspec_gen",
        "output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: true\n  temperature: 0.7\n'
        "metric_list:\n  - metric: exact_match\n",
        GEN_DOCS,
    )
    return ["detspec_mc", "detspec_rolling", "detspec_gen"]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[TaskManager, list[str]]:
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    names = write_tasks(root)
    return TaskManager(include_path=str(root), include_defaults=False), names


@pytest.fixture(scope="module")
def det_default_server(tmp_path_factory, demo_model_dir) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory,
        "lm-eval-det",
        demo_model_dir,
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "1024",
        "--deterministic-by-default",
    )
    yield s
    assert s.stop() == 0, s.log()


class Load:
    """Other clients hammering the server from a thread: generations (some deterministic,
    some not, sampled and greedy) and plain echo scoring, until stopped."""

    def __init__(self, base_url: str, clients: int = 6) -> None:
        self.base_url = base_url
        self.clients = clients
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as c:
            await asyncio.gather(*(self._client(c, i) for i in range(self.clients)))

    async def _client(self, c: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(i)
        while not self._stop.is_set():
            prompt = [rng.randrange(3, 900) for _ in range(rng.randint(8, 90))]
            if rng.random() < 0.5:
                body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                        "deterministic": False}  # fmt: skip
            else:
                body = {"prompt": prompt, "max_tokens": rng.randint(1, 24), "ignore_eos": True,
                        "temperature": rng.choice([0.0, 1.0]), "seed": rng.randrange(2**31),
                        "deterministic": rng.random() < 0.3}  # fmt: skip
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                self.errors.append(r.text)
            self.done += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def evaluate(server: ServerProcess, tasks, concurrency: int) -> dict[str, list[tuple]]:
    """Runs lm-eval's local-completions on the tasks; returns per task the per-sample
    results (doc id, raw responses, filtered responses) as exact reprs."""
    manager, names = tasks
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": server.base_url + "/v1/completions",
            "model": SERVED_NAME,
            "num_concurrent": concurrency,
            "max_retries": 1,
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "max_length": 96,
            "timeout": 300,
        },
        tasks=names,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    per_sample = {}
    for name in names:
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        assert samples, name
        per_sample[name] = [
            (s["doc_id"], repr(s["resps"]), repr(s["filtered_resps"])) for s in samples
        ]
    return per_sample


def run_twice(server: ServerProcess, tasks) -> tuple[dict, dict, int]:
    quiet = evaluate(server, tasks, concurrency=1)
    with Load(server.base_url) as load:
        loaded = evaluate(server, tasks, concurrency=8)
        done = load.done
    assert not load.errors, load.errors[:3]
    assert done > 0, "the load clients did not run during the concurrent evaluation"
    return quiet, loaded, done


def differing(a: dict, b: dict) -> dict[str, int]:
    return {t: sum(x != y for x, y in zip(a[t], b[t], strict=True)) for t in a}


def test_lm_eval_results_identical_with_deterministic_by_default(det_default_server, tasks):
    quiet, loaded, done = run_twice(det_default_server, tasks)
    diff = differing(quiet, loaded)
    sizes = {t: len(v) for t, v in quiet.items()}
    print(
        f"\nlm-eval, --deterministic-by-default: concurrency 1 vs concurrency 8 under load "
        f"({done} other requests): samples differing per task {diff} "
        f"(of {sizes})"
    )
    for t in quiet:
        for x, y in zip(quiet[t], loaded[t], strict=True):
            assert x == y, f"{t}: doc {x[0]} differs under load:\n{x}\n{y}"


def test_lm_eval_negative_control_without_the_option(inline_server, tasks):
    """The same two runs against a server without --deterministic-by-default: the scores of
    plain requests come from the fast path, whose bits depend on the batch."""
    quiet, loaded, done = run_twice(inline_server, tasks)
    diff = differing(quiet, loaded)
    print(
        f"\nlm-eval negative control (no option): concurrency 1 vs 8 under load ({done} other "
        f"requests): samples differing per task {diff}"
    )
    assert sum(diff.values()) > 0, (
        "every per-sample result was identical without the option: the identical-results "
        "check above could not see nondeterminism"
    )
