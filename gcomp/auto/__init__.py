"""``auto``'s candidates, costs and choice (``choice``) and decisions (``chooser``); ``AutoMethod``: composites."""
from gcomp.auto.choice import BucketCost, Choice, allowed_methods, choose, link_network, predict_s

__all__ = ["BucketCost", "Choice", "allowed_methods", "choose", "link_network", "predict_s"]
