"""Time of a full weight update on the bench model (docs/architecture.md; written to /tmp/benchmodel
on first use): the whole state_dict from torch (safetensors), then from disk.

    python benches/update_weights.py [rounds]
"""

from __future__ import annotations

import os
import sys
import time

from safetensors.torch import load_file

from detspec import LLM, _core


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    model = os.environ.get("DETSPEC_BENCH_MODEL", "/tmp/benchmodel")
    if not os.path.exists(os.path.join(model, "config.json")):
        _core.write_demo_model(model, "bench", 0)
    state = load_file(os.path.join(model, "model.safetensors"))
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    llm = LLM(model)
    for i in range(rounds):
        t = time.perf_counter()
        llm.update_weights(state.items())
        print(f"update_weights {i}: {time.perf_counter() - t:.3f} s ({mb:.0f} MB)")
    for i in range(rounds):
        t = time.perf_counter()
        llm.update_weights_from_disk(model)
        print(f"update_weights_from_disk {i}: {time.perf_counter() - t:.3f} s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
