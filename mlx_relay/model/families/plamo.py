"""PLaMo: the layer list sits in a decoder module that builds the masks and loops over
it (`layers.layers`); PLaMo 3's forward gives its sliding layers a mask of window + 1
over a cache of window."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

_NESTED = Parts(layers="layers.layers")
ADAPTERS = (
    FamilyAdapter(names=("plamo", "plamo2"), parts=_NESTED),
    FamilyAdapter(
        names=("plamo3",), parts=_NESTED, sliding_mask_window=lambda a: a.window_size + 1
    ),
)
