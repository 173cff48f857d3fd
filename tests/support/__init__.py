"""Helpers the tests share: model builders, numpy oracles, backend cases, fuzz seeds, paths.

pyproject puts tests/ on sys.path (`pythonpath`), so tests import these as `support.<module>`;
nothing here is collected. Test folders are not packages: pytest imports each test module under
its file name, so those names must be unique across the whole tree. A script a test starts as
a subprocess (a worker, a harness) sits beside that test instead.
"""
