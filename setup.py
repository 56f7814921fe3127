"""Builds the optional one-pass statistics extension; everything else is in pyproject.toml.

Without a C compiler the build of the extension is skipped (``optional=True``) and the toolkit uses
torch's own reductions instead.
"""

from glob import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension("msprobe_core.stats._fast_stats", ["msprobe_core/stats/_fast_stats.c"],
                             depends=sorted(glob("msprobe_core/stats/_fast_*.c")),  # parts it #includes
                             extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)])
