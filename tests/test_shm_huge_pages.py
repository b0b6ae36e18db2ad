"""kvtierd tells whether its pool's tmpfs gives huge pages (the serving log's ``shm_huge_pages``):
the mount's ``huge=`` option wins, the kernel's tmpfs default otherwise, the longest mount
point above the directory decides, and a directory on no tmpfs says nothing."""

from __future__ import annotations

from kvtier.daemon.server import shm_huge_pages

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /var/lib/kvtier/pool tmpfs rw,relatime,size=6291456k,huge=within_size 0 0
tmpfs /var/lib/kvtier tmpfs rw,size=1024k 0 0
tmpfs /mnt/pool\\040two tmpfs rw,huge=always 0 0
"""
NEVER = "always within_size advise [never] deny force"


def test_the_mounts_huge_option_wins_over_the_kernel_default() -> None:
    assert shm_huge_pages("/var/lib/kvtier/pool/x", MOUNTS, NEVER) == "within_size"
    assert shm_huge_pages("/var/lib/kvtier/pool", MOUNTS, NEVER) == "within_size"
    assert shm_huge_pages("/mnt/pool two/p", MOUNTS, NEVER) == "always"  # /proc/mounts escapes spaces


def test_without_the_option_the_kernel_default_and_its_special_words() -> None:
    assert shm_huge_pages("/dev/shm/kvtier", MOUNTS, NEVER) == "never"
    assert shm_huge_pages("/var/lib/kvtier/poolish", MOUNTS, NEVER) == "never"  # not under .../pool
    assert shm_huge_pages("/dev/shm", MOUNTS, "always within_size advise never deny [force]") == "always"
    assert shm_huge_pages("/dev/shm", MOUNTS, "always [within_size] advise never deny force") == "within_size"
    assert shm_huge_pages("/dev/shm", MOUNTS, "[deny]") == "never"


def test_a_directory_on_no_tmpfs_says_nothing() -> None:
    assert shm_huge_pages("/srv/data", MOUNTS, NEVER) == ""


def test_this_machines_dev_shm() -> None:
    assert shm_huge_pages("/dev/shm") in {"never", "always", "within_size", "advise", ""}
