"""The compiled parts: the key-table probe (tiers/_probe.c), the host tier's id map
(tiers/_idmap.c), the router's decision (client/routing/_route.c), the router index's pairs table
(client/routing/_pairs.c) and the pool copy with its
checksum (tiers/_copyhash.c); everything else is in pyproject.toml.

``optional``: where no C compiler or Python headers exist the install still succeeds and
kvtier.tiers.keytable probes with numpy instead (same answers, slower), the host tier keeps its
ids in a dict, the router decides with numpy (and refuses the pairs index layout), and the client copies with numpy and hashes with
the xxhash package; CI installs the headers (.ci/run) and tests/test_probe.py,
tests/test_idmap.py, tests/test_route_compiled.py and tests/test_client_checksums.py check the
extensions were built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.tiers._probe", ["tiers/_probe.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("kvtier.tiers._idmap", ["tiers/_idmap.c"], extra_compile_args=["-O2"],
                             optional=True),
                   Extension("kvtier.client.routing._route", ["client/routing/_route.c"],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True),
                   # the router index's pairs layout (client/routing/pairs.py; no numpy fallback)
                   Extension("kvtier.client.routing._pairs", ["client/routing/_pairs.c"],
                             extra_compile_args=["-O2"], optional=True),
                   # the pool copies with their checksums (client/engine/copyin.py; numpy fallback)
                   Extension("kvtier.tiers._copyhash", ["tiers/_copyhash.c", "tiers/_copyhash_avx2.c"],
                             extra_compile_args=["-O2"], optional=True,
                             depends=["tiers/_copyhash_impl.h", "tiers/xxhash/xxhash.h"])])
