"""The evaluation harness behind ``memstream eval``: datasets, metrics, the judge, the run and its report.

A top-level package (not ``benchmarks/``) because the installed ``memstream`` command imports it, and only the
packages pyproject lists are installed.
"""
