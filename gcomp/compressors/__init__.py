"""Built-in methods, one folder per family; importing this package imports every family, whose ``__init__``
registers its methods. A new family is a new folder here: nothing else to edit."""
import importlib
import pkgutil

for _family in pkgutil.iter_modules(__path__):
    if _family.ispkg:
        importlib.import_module(f"{__name__}.{_family.name}")
