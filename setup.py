"""Builds the optional extensions; everything else is in pyproject.toml.

- ``msprobe_core.stats._fast_stats`` (C): the one-pass statistics kernel. Without a C compiler its build is
  skipped (``optional=True``) and the toolkit uses torch's own reductions instead.
- ``msprobe_core.stats._torch_facts`` (C++): a tensor's facts read from torch's C++ tensor for the kernel
  (``_torch_facts.cpp``). Built only where torch imports at build time (an install with
  ``--no-build-isolation`` after torch, as the Makefile's) and with a C++ compiler (``optional=True``);
  without it the kernel asks torch's Python API.
"""

from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

EXTENSIONS = [Extension("msprobe_core.stats._fast_stats", ["msprobe_core/stats/_fast_stats.c"],
                        depends=sorted(glob("msprobe_core/stats/_fast_*.c")),  # parts it #includes
                        extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"], optional=True)]

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch at build time: the C extension alone
    setup(ext_modules=EXTENSIONS)
else:
    class _BuildExt(BuildExtension.with_options(use_ninja=False)):  # ninja would force a rebuild of both each time
        """torch's ``BuildExtension`` (its flags and ABI define) for the C++ extension; the C one built as plain
        setuptools builds it."""

        def build_extensions(self) -> None:
            every = self.extensions
            try:
                self.extensions = [e for e in every if e.language != "c++"]
                build_ext.build_extensions(self)
                self.extensions = [e for e in every if e.language == "c++"]
                super().build_extensions()
            finally:
                self.extensions = every

    setup(ext_modules=EXTENSIONS + [CppExtension("msprobe_core.stats._torch_facts",
                                                 ["msprobe_core/stats/_torch_facts.cpp"],
                                                 depends=["msprobe_core/stats/_torch_facts.h"],
                                                 extra_compile_args=["-O2", "-g0"], optional=True)],
          cmdclass={"build_ext": _BuildExt})
