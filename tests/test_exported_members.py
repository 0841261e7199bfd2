"""The public API is exactly what sluice.__all__ lists."""

import types

import sluice


def test_all_exports_exist() -> None:
    for name in sluice.__all__:
        assert hasattr(sluice, name), name


def test_public_names_are_exported() -> None:
    # Submodules (engine, cli, bench, ...) appear as attributes once imported; they are not API names.
    public = {
        n
        for n in dir(sluice)
        if not n.startswith("_") and not isinstance(getattr(sluice, n), types.ModuleType)
    }
    assert public == set(sluice.__all__) - {"__version__"}
