"""Build script: the package is pure Python plus (later) one compiled extension from csrc/."""
from setuptools import setup

setup()
