"""An RL rollout client over HTTP: a GRPO-shaped loop against ``detspec serve``.

Each step: ``n = 8`` seeded, deterministic samples per prompt (``/v1/completions``, or with
``--api sglang`` SGLang's native ``/generate`` as slime-style trainers send it), a reward
per sample, group-relative advantages, a toy policy step on the output embedding (numpy), then
the new weights go to the server as safetensors bytes (``/update_weights_from_tensor``) between
``/pause_generation`` and ``/continue_generation``, and every step's full checkpoint is stored.
``--check-replay`` then starts a second server on the original model and replays the run from
the stored seeds and checkpoints (``/update_weights_from_disk``): it must return the same token
ids and logprob bits at every step.

    python examples/rl_rollout_http.py                     # starts its own server (built-in model)
    python examples/rl_rollout_http.py --url http://127.0.0.1:8000 --model-dir MODEL_DIR
    python examples/rl_rollout_http.py --check-replay
    python examples/rl_rollout_http.py --api sglang --check-replay

Needs ``pip install '.[serve]' safetensors``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import save, save_file

PROMPTS = ["The quick brown fox", "Once upon a time there was", "What is the capital of"]
GROUP = 8


@contextlib.contextmanager
def server(model_dir: str | None) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "detspec", "serve", "--port", str(port),
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]  # fmt: skip
    if model_dir:
        cmd.insert(4, model_dir)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"detspec serve exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def load_f32(path: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 numpy arrays (bf16 too, which numpy lacks)."""
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = np.frombuffer(data[8 + n + a : 8 + n + b], dtype=kinds[meta["dtype"]])
        if meta["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(meta["shape"])
    return out


def post(url: str, path: str, **kw) -> dict:
    r = httpx.post(url + path, timeout=300, **kw)
    if r.status_code != 200:
        raise SystemExit(f"{path}: {r.status_code} {r.text}")
    return r.json()


def sample_bits(ids: list[int], logprobs: list[float]) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    return tuple(ids), tuple(struct.pack("<f", x) for x in logprobs)


def rollouts_sglang(url: str, step: int) -> list[dict]:
    """``rollouts`` through SGLang's native ``/generate``: one batched call, token ids and the
    sampled tokens' logprobs in ``meta_info``."""
    seeds = [1000 * step + i for i in range(len(PROMPTS))]
    body = {
        "text": PROMPTS,
        "sampling_params": [
            {"n": GROUP, "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed,
             "no_stop_trim": True, "skip_special_tokens": False}
            for seed in seeds
        ],
        "return_logprob": True,
        "deterministic": True,
    }  # fmt: skip
    outs = post(url, "/generate", json=body)
    groups = []
    for i, seed in enumerate(seeds):
        mine = outs[i * GROUP : (i + 1) * GROUP]
        samples = [
            sample_bits(o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]])
            for o in mine
        ]
        groups.append(
            {"seed": seed, "samples": samples, "fingerprint": mine[0]["meta_info"]["fingerprint"]}
        )
    return groups


def rollouts(url: str, step: int) -> list[dict]:
    """GROUP samples per prompt, all prompts concurrently; seeds derived from the step."""

    def one(i: int) -> dict:
        seed = 1000 * step + i
        body = {
            "prompt": PROMPTS[i],
            "n": GROUP,
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "deterministic": True,
            "return_token_ids": True,
        }
        out = post(url, "/v1/completions", json=body)
        samples = [
            sample_bits(c["token_ids"], c["logprobs"]["token_logprobs"])
            for c in sorted(out["choices"], key=lambda c: c["index"])
        ]
        return {"seed": seed, "samples": samples, "fingerprint": out["system_fingerprint"]}

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def reward(ids: tuple[int, ...]) -> float:
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))  # a stand-in for a verifier


def policy_step(w: np.ndarray, groups: list[dict], lr: float = 0.05) -> np.ndarray:
    grad = np.zeros(w.shape[0])
    for g in groups:
        r = np.array([reward(ids) for ids, _ in g["samples"]])
        for (ids, _), a in zip(g["samples"], r - r.mean(), strict=True):
            for t in ids:
                grad[t] += a
    return (w * (1.0 + lr * np.tanh(grad))[:, None].astype(np.float32)).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--model-dir", help="its model directory (default: the built-in model)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check-replay", action="store_true")
    ap.add_argument("--api", choices=["openai", "sglang"], default="openai")
    args = ap.parse_args()
    sample = rollouts_sglang if args.api == "sglang" else rollouts
    if args.model_dir is None:
        from detspec.default_model import default_model_dir

        args.model_dir = str(default_model_dir())
    weights = load_f32(os.path.join(args.model_dir, "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    store = Path(tempfile.mkdtemp(prefix="rl-http-"))
    log = []
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(server(args.model_dir))
        for step in range(args.steps):
            groups = sample(url, step)
            mean = np.mean([reward(ids) for g in groups for ids, _ in g["samples"]])
            weights = {**weights, head: policy_step(weights[head], groups)}
            ckpt = store / f"step{step}"
            ckpt.mkdir()
            save_file(weights, str(ckpt / "model.safetensors"))
            post(url, "/pause_generation", json={"mode": "wait"})
            post(url, "/flush_cache")
            upd = post(url, "/update_weights_from_tensor", content=save({head: weights[head]}),
                       headers={"Content-Type": "application/octet-stream"})  # fmt: skip
            post(url, "/continue_generation")
            print(f"step {step}: mean reward {mean:.3f}, fingerprint {groups[0]['fingerprint']}"
                  f" -> {upd['fingerprint']}")  # fmt: skip
            log.append((groups, ckpt))
    if not args.check_replay:
        return 0
    with server(args.model_dir) as url:
        for step, (groups, ckpt) in enumerate(log):
            again = sample(url, step)
            same = all(a["samples"] == b["samples"] for a, b in zip(groups, again, strict=True))
            print(f"replay step {step}: {'identical' if same else 'DIFFERENT'}")
            if not same:
                return 1
            post(url, "/update_weights_from_disk", json={"model_path": str(ckpt)})
    print("replay: every token id and logprob bit identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
