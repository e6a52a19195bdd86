"""Plain helpers shared by test modules: prompt builders, parameters, leak checks.

Fixtures live in the nearest `conftest.py`; a test module imports from here, never from
another test module.
"""
