"""Built-in methods; importing this package registers them by name."""
from gcomp.compressors import identity, lowprec, pactrain, topk  # noqa: F401  (registration side effects)
