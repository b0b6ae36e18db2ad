"""The compiled key-table probe (tiers/_probe.c) and the host tier's id map (tiers/_idmap.c); everything else is in pyproject.toml.

``optional``: where no C compiler or Python headers exist the install still succeeds and
kvtier.tiers.keytable probes with numpy instead (same answers, slower); CI installs the
headers (.ci/run) and tests/test_probe.py checks the extension was built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.tiers._probe", ["tiers/_probe.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("kvtier.tiers._idmap", ["tiers/_idmap.c"], extra_compile_args=["-O2"],
                             optional=True)])
