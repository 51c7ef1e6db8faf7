"""Server-wide determinism (``detspec serve --deterministic-by-default``).

Eval harnesses and RL frameworks send OpenAI bodies they cannot extend; with this option a
request that does not say ``deterministic`` is deterministic (``"deterministic": false`` opts
out), and a deterministic request that samples (temperature > 0) without a ``seed`` gets the
server's ``--default-seed`` (default 0), so such a run is reproducible bit for bit too.

The option changes what a request without these fields returns, so it is part of what the
server reports as its identity: ``system_fingerprint`` (and ``/v1/models``' ``fingerprint``)
gets the suffix ``+det-default-seed<N>``; the engine fingerprint before it is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from detspec.server import protocol as P

DEFAULT_SEED = 0


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves ``deterministic`` / ``seed`` unset gets."""

    deterministic_by_default: bool = False
    default_seed: int = DEFAULT_SEED

    def apply(self, req: P._SamplingFields) -> None:
        """Fills ``req.deterministic`` (never left None) and, under the option, ``req.seed``
        of a deterministic request that samples without one."""
        if req.deterministic is None:
            req.deterministic = self.deterministic_by_default
        if not self.deterministic_by_default or not req.deterministic or req.seed is not None:
            return
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature > 0:
            req.seed = self.default_seed

    def fingerprint_suffix(self) -> str:
        return f"+det-default-seed{self.default_seed}" if self.deterministic_by_default else ""
