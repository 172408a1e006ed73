"""IQuest Loop Coder: every layer runs twice a step (two_pass.py); decode groups row by
row, its second pass making its masks as of before the step, from a row's offset."""

from mlx_relay.model import two_pass
from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (FamilyAdapter(names=(two_pass.FAMILY,), passes=2, row_by_row=True),)
