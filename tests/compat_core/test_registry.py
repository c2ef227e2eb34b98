"""compat_core.registry.Registry: names sorted, an unknown name lists every valid one, a taken name is refused."""
from __future__ import annotations

import pytest

from compat_core.registry import Registry


def test_register_get_and_list():
    registry: Registry = Registry("widget")

    @registry.register("b")
    def make_b():
        return "b"

    registry.register("a", len)
    assert registry.names() == ["a", "b"] and list(registry) == ["a", "b"] and len(registry) == 2
    assert registry.get("b") is make_b and "a" in registry and "c" not in registry
    with pytest.raises(KeyError, match="unknown widget 'c'; valid widget names: a, b"):
        registry.get("c")
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a", str)
    with pytest.raises(ValueError, match="widget name must be a non-empty string"):
        registry.register("", str)
    with pytest.raises(KeyError, match=r"valid gadget names: \(none registered\)"):
        Registry("gadget").get("x")
