"""Torch interop over DLPack. Imported on demand: ``import detspec`` never imports torch.

* ``to_torch(t)``: an engine tensor (``detspec._core.Tensor``, what ``get_logits`` and
  ``encode`` are built on) as a ``torch.Tensor`` sharing its buffer: no copy.
* ``from_torch(t)``: a CPU torch tensor (or any DLPack producer) as an engine tensor: one
  copy, same dtype (float32, bfloat16, float16, int64, int32), strides honoured; tensors
  that require grad are detached first (a view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from detspec import _core

if TYPE_CHECKING:
    import torch


def to_torch(t: Any) -> torch.Tensor:
    """The tensor as torch sees it, without a copy (``torch.from_dlpack``)."""
    import torch

    return torch.from_dlpack(t)


def from_torch(t: Any) -> _core.Tensor:
    """A copy of a CPU tensor's data in an engine buffer of the same dtype."""
    return _core.Tensor.from_dlpack(t)
