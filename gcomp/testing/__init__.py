"""gcomp.testing: what a method needs to check itself against gcomp's contracts, without pytest.

``ranks``: gloo ranks on 127.0.0.1, pooled per world size; ``models``: the small model the checks train.
"""
