"""Built-in methods, one module each; importing this package imports every module here, which registers them.

A new method is a new file in this folder with an ``@register``-ed factory: nothing else to edit.
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
