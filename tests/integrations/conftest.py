import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Within a module that defines `order_key(item)`, run its tests in that key's order (stable),
    after pytest's own ordering: tests that share a live engine then run one after another, so
    the engine starts once."""
    start = 0
    while start < len(items):
        module = items[start].module
        end = start
        while end < len(items) and items[end].module is module:
            end += 1
        key = getattr(module, "order_key", None)
        if key is not None:
            items[start:end] = sorted(items[start:end], key=key)
        start = end
