"""``auto``: each bucket reduced by the allowed method measured fastest for it on this link: ``allow`` (the
candidates), ``method`` (``AutoMethod``, the composite), ``chooser`` (``AutoChooser``: measurements, decisions,
its own collectives), ``record`` (one layout's measurements), ``choice`` (a candidate's price on a link)."""
from gcomp.auto.allow import allowed_methods
from gcomp.auto.choice import BucketCost, Choice, choose, link_network, predict_s

__all__ = ["BucketCost", "Choice", "allowed_methods", "choose", "link_network", "predict_s"]
