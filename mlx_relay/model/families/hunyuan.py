"""Hunyuan-Large: cross-layer attention, a group's keys and values carried with h where
a hop parts the group (carried.py)."""

from mlx_relay.model import carried
from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (FamilyAdapter(names=("hunyuan",), carrier=carried.Hunyuan()),)
