"""The public API is exactly what sluice.__all__ lists."""

import sluice


def test_all_exports_exist() -> None:
    for name in sluice.__all__:
        assert hasattr(sluice, name), name


def test_public_names_are_exported() -> None:
    public = {n for n in dir(sluice) if not n.startswith("_")} - {"engine", "errors", "embedded", "cli"}
    assert public == set(sluice.__all__) - {"__version__"}
