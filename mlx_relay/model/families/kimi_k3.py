"""Kimi K3: attention residuals, the outputs of earlier blocks of layers carried with h
(carried.py)."""

from mlx_relay.model import carried
from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (FamilyAdapter(names=("kimi_k3",), carrier=carried.KimiK3()),)
