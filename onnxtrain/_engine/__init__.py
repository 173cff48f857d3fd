"""The engine: pure step functions, execution strategies, placement, feeds, fault checks (internal; see README.md beside this file)."""
