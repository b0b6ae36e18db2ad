"""The compiled parts: the key-table probe (tiers/_probe.c), the host tier's id map
(tiers/_idmap.c) and the router's decision (client/routing/_route.c); everything else is in
pyproject.toml.

``optional``: where no C compiler or Python headers exist the install still succeeds and
kvtier.tiers.keytable probes with numpy instead (same answers, slower), the host tier keeps its
ids in a dict, and the router decides with numpy; CI installs the headers (.ci/run) and
tests/test_probe.py, tests/test_idmap.py and tests/test_route_compiled.py check the extensions
were built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.tiers._probe", ["tiers/_probe.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("kvtier.tiers._idmap", ["tiers/_idmap.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("kvtier.client.routing._route", ["client/routing/_route.c"],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True)])
