"""What the lab needs besides Sluice, and the error that says how to get it.

sluice-lab depends on every package it imports (lab/pyproject.toml), so a
missing one means a broken or partial install: :func:`require` turns the
``ImportError`` into one line that says to reinstall sluice-lab. Parts of
Sluice itself behind extras (the store, the LLM layer) keep their own
:class:`~sluice.errors.MissingExtra`, which names the extra.
"""

from __future__ import annotations

import importlib

from sluice.errors import MissingExtra, SluiceError

#: How to install the lab (it is not on PyPI yet; in a checkout, scripts/bootstrap does it).
INSTALL = "pip install sluice-lab"
INSTALL_FROM_CHECKOUT = "pip install -e ./lab"


class MissingLabPackage(MissingExtra):
    """A package sluice-lab depends on cannot be imported; reinstalling sluice-lab brings it.

    A :class:`~sluice.errors.MissingExtra`, so code that degrades without an
    optional part (a report without its charts) treats both alike; its
    message names the distribution, not an extra of sluice-queue.
    """

    def __init__(self, feature: str, missing: str) -> None:
        SluiceError.__init__(
            self,
            f"sluice-lab needs {missing} for {feature}, and it is not installed: {INSTALL} "
            f"(in a checkout of Sluice: {INSTALL_FROM_CHECKOUT})",
        )
        self.extra = "sluice-lab"
        self.feature = feature


def require(feature: str, *modules: str) -> None:
    """Import ``modules`` or raise :class:`MissingLabPackage` naming the first one missing."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingLabPackage(feature, module) from None
