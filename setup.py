"""Setuptools shim: the package's metadata, extras and tool settings live in pyproject.toml."""

from setuptools import setup

setup()
