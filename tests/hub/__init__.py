"""Hub tests (a package, so its conftest does not shadow the root conftest module)."""
