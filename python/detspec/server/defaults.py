"""What a request gets for the fields it leaves unset: the model's sampling defaults
(``--generation-config``, server/generation_config.py) and server-wide determinism.

Server-wide determinism (``detspec serve --deterministic-by-default``):
Eval harnesses and RL frameworks send OpenAI bodies they cannot extend; with this option a
request that does not say ``deterministic`` is deterministic (``"deterministic": false`` opts
out), and a deterministic request that samples (temperature > 0) without a ``seed`` gets the
server's ``--default-seed`` (default 0), so such a run is reproducible bit for bit too.

The option changes what a request without these fields returns, so it is part of what the
server reports as its identity: ``system_fingerprint`` (and ``/v1/models``' ``fingerprint``)
gets the suffix ``+det-default-seed<N>``; the engine fingerprint before it is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detspec.server import protocol as P

DEFAULT_SEED = 0


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves sampling fields, ``deterministic`` or ``seed`` unset gets."""

    deterministic_by_default: bool = False
    default_seed: int = DEFAULT_SEED
    # Request field -> value, from the generation config (temperature, top_p, ..., max_tokens).
    sampling: dict[str, float | int] = field(default_factory=dict)
    # Names server settings that change what a request body means: ``+gen<hash>`` when
    # ``sampling`` is not the model's own (generation_config.py), ``+tmpl<hash>`` for a
    # --chat-template.
    settings_suffix: str = ""

    def apply(self, req: P._SamplingFields) -> None:
        """Fills the sampling fields ``req`` left None from the generation config (its
        ``max_tokens`` is a cap, applied where the context is known: ``max_tokens``),
        ``req.deterministic`` (never left None) and, under the option, ``req.seed`` of a
        deterministic request that samples without one."""
        for name, value in self.sampling.items():
            if name != "max_tokens" and getattr(req, name) is None:
                setattr(req, name, value)
        if req.deterministic is None:
            req.deterministic = self.deterministic_by_default
        if not self.deterministic_by_default or not req.deterministic or req.seed is not None:
            return
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature > 0:
            req.seed = self.default_seed

    def max_tokens(self, room: int) -> int:
        """A request's ``max_tokens`` when it sends none: the context left (OpenAI's rule),
        at most the generation config's ``max_new_tokens`` (vLLM's)."""
        cap = self.sampling.get("max_tokens")
        return room if cap is None else min(room, int(cap))

    def fingerprint_suffix(self) -> str:
        det = f"+det-default-seed{self.default_seed}" if self.deterministic_by_default else ""
        return self.settings_suffix + det
