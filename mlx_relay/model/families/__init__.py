"""Model families as adapters: what a family does otherwise than a plain decoder.

Every module of this package but `base` and `ops` holds the adapters of one family (or
of a few model types that share their rules) in `ADAPTERS`; they are found here when the
package is imported, so a new family is one new module (docs/families.md). A model is
looked up by its config's `model_type`; one with no adapter gets the defaults
(`FamilyAdapter()`), a plain decoder's.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Any

from mlx_relay.model.families.base import FamilyAdapter, LayerRun, Parts

__all__ = [
    "PLAIN",
    "FamilyAdapter",
    "LayerRun",
    "Parts",
    "adapter_for",
    "adapter_of",
    "adapters",
    "family_of",
    "index",
    "wraps_text",
]

PLAIN = FamilyAdapter()
_SUPPORT = ("base", "ops")  # modules of the package that hold no family


def index(
    adapters: Iterable[FamilyAdapter],
) -> tuple[dict[str, FamilyAdapter], dict[str, str]]:
    """The adapters by model type, and the text family each wrapper wraps; ValueError if
    two adapters claim one model type."""
    by_type: dict[str, FamilyAdapter] = {}
    wrapped: dict[str, str] = {}
    for adapter in adapters:
        for name in (*adapter.names, *adapter.wrappers):
            if name in by_type or name in wrapped:
                raise ValueError(f"model type {name!r} has two family adapters")
        by_type.update(dict.fromkeys(adapter.names, adapter))
        wrapped.update(dict.fromkeys(adapter.wrappers, adapter.name))
    return by_type, wrapped


def _modules() -> list[str]:
    """The package's modules that hold families, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _SUPPORT)


def _collect() -> tuple[dict[str, FamilyAdapter], dict[str, str]]:
    """Every family module's adapters, indexed."""
    return index(
        adapter
        for name in _modules()
        for adapter in importlib.import_module(f"{__name__}.{name}").ADAPTERS
    )


_BY_TYPE, _WRAPPED = _collect()


def family_of(config: dict[str, Any]) -> str:
    """The family whose rules apply: the model type, or the text model's it wraps."""
    model_type = str(config.get("model_type", ""))
    return _WRAPPED.get(model_type, model_type)


def mlx_lm_model_class(family: str) -> type | None:
    """mlx-lm's `Model` class of `family` (a model type, remapped as mlx-lm remaps it);
    None where mlx-lm has no such family (or its module does not import here)."""
    from mlx_lm.utils import MODEL_REMAPPING

    try:
        module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    except Exception:  # noqa: BLE001 - no such family, or one whose imports fail here
        return None
    return getattr(module, "Model", None)


def wraps_text(model_type: Any) -> bool:
    """Whether this model type's ModelArgs only wrap a text family's config (gemma4)."""
    return model_type in _WRAPPED


def adapter_for(family: str) -> FamilyAdapter:
    """The adapter of a family (a model type), the plain one if it has none."""
    return _BY_TYPE.get(family, PLAIN)


def adapter_of(config: dict[str, Any]) -> FamilyAdapter:
    """The adapter whose rules a model of this config follows."""
    return adapter_for(family_of(config))


def adapters() -> dict[str, FamilyAdapter]:
    """Every model type that has an adapter, with it."""
    return dict(_BY_TYPE)
