"""The compiled key-table probe (tiers/_probe.c) and pool copy (tiers/_copyhash.c); everything else is in pyproject.toml.

``optional``: where no C compiler or Python headers exist the install still succeeds and
kvtier.tiers.keytable probes with numpy instead (same answers, slower); CI installs the
headers (.ci/run) and tests/test_probe.py checks the extension was built."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.tiers._probe", ["tiers/_probe.c"], extra_compile_args=["-O2"],
                             optional=True),
                   # the pool copies with their checksums (client/engine/copyin.py; numpy fallback)
                   Extension("kvtier.tiers._copyhash", ["tiers/_copyhash.c", "tiers/_copyhash_avx2.c"],
                             extra_compile_args=["-O2"], optional=True,
                             depends=["tiers/_copyhash_impl.h", "tiers/xxhash/xxhash.h"])])
