"""The per-step engine, in layers that import only downward (``tests/test_layers.py``):
``hooks`` > ``group`` > ``comm`` > ``storage`` > ``meshes`` > ``common``."""
