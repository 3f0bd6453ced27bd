"""Helpers the tests (and bench/serving.py) share; not part of the product."""
