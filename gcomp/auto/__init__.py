"""``auto``: each bucket reduced by the allowed method measured fastest for it on this link.

- ``allow``: the methods it may choose from; ``method``: ``AutoMethod``, the composite that runs them;
- ``chooser``: ``AutoChooser``, what it measured and decided per bucket layout;
- ``choice``: the price of a candidate on a link and the choice; ``record``: one layout's measurements;
- ``agree``: its own collectives (the ranks agreeing, the link probe); ``tee``: a bucket's counters kept apart.
"""
from gcomp.auto.allow import allowed_methods
from gcomp.auto.choice import BucketCost, Choice, choose, link_network, predict_s

__all__ = ["BucketCost", "Choice", "allowed_methods", "choose", "link_network", "predict_s"]
