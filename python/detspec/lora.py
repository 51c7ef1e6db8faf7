"""``LoRARequest``: which LoRA adapter a request runs with, as vLLM names it."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for a request (vLLM's ``LoRARequest(lora_name, lora_int_id,
    lora_path)``). The engine (built with ``enable_lora=True``) loads ``lora_path`` under
    ``lora_name`` the first time a request names it, and keeps it until ``unload_lora``;
    ``lora_int_id`` is accepted for vLLM's signature and not used (adapters are known by
    name). A deterministic request with an adapter is bitwise reproducible as without one;
    its fingerprint names the adapter's weights."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | os.PathLike[str] = ""

    @property
    def path(self) -> str:
        return os.fspath(self.lora_path)


LoRAType = LoRARequest | str | None
"""What the API takes for an adapter: a ``LoRARequest``, the name of a loaded adapter, or
``None`` (the base model)."""
