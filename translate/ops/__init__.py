"""Op handlers, one module per family; importing this package registers them all."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name != "common":
        importlib.import_module(f"{__name__}.{_module.name}")
