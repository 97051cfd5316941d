"""``auto``: the method chosen per bucket from the link and the codecs, measured (work in progress: the
allowed set and the choice; the hook's measuring and switching come next)."""
from gcomp.auto.allow import allowed_methods
from gcomp.auto.choice import BucketCost, Choice, choose, link_network, predict_s

__all__ = ["BucketCost", "Choice", "allowed_methods", "choose", "link_network", "predict_s"]
