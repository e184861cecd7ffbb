# Metadata lives in setup.cfg; this shim keeps `pip install -e .` working on old pips.
from setuptools import setup

setup()
