"""README.md's configuration reference is what scripts/config_reference.py makes from the
settings' declarations: the region between its markers, which must be there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("kvtier_config_reference", SCRIPT)
reference = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # (its dataclass needs it there)
_spec.loader.exec_module(reference)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_readme_has_the_markers_once() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.count(reference.BEGIN) == 1 and text.count(reference.END) == 1, \
        f"README.md must hold the configuration reference between {reference.BEGIN} and {reference.END}"


def test_readme_reference_is_what_the_settings_declare() -> None:
    text = (ROOT / "README.md").read_text()
    assert reference.updated(text) == text, "README.md's configuration reference is stale: run " \
                                            "python scripts/config_reference.py"


def test_every_setting_of_every_program_is_in_the_reference() -> None:
    from kvtier.settings import CONFIG

    text = reference.reference()
    for program in reference.PROGRAMS:
        settings = reference.settings_of(program)
        part = text[text.index(f"### {program.heading}"):]
        for s in settings.settings:
            assert f"| `{s.flag}`" in part and f"`{settings.env_name(s.name)}`" in part, s.name
            assert s.name == CONFIG or f"| `{s.name}` |" in part, s.name
            if s.switch:
                assert f"`--no-{s.flag[2:]}`" in part, s.name
        titles = {s.section for s in settings.settings if s.section}
        assert all(f"#### {t}\n" in part for t in titles)


def test_check_fails_with_a_diff_and_the_rewrite_touches_only_the_region(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{reference.BEGIN}\n| `--old-flag` | stale |\n{reference.END}\nafter\n")
    p = run("--check", "--readme", str(readme))
    assert p.returncode == 1 and "-| `--old-flag` | stale |" in p.stdout and "+| `--host-capacity`" in p.stdout
    assert "stale" in p.stderr
    assert run("--readme", str(readme)).returncode == 0
    text = readme.read_text()
    assert text.startswith(f"# title\n\nbefore\n{reference.BEGIN}\n") and text.endswith(f"\n{reference.END}\nafter\n")
    assert "--old-flag" not in text and "`--insecure-tcp`, `--no-insecure-tcp`" in text
    assert run("--check", "--readme", str(readme)).returncode == 0


@pytest.mark.parametrize("body", ["no markers at all\n", f"{reference.BEGIN}\nonly the first\n",
                                  f"{reference.END}\n{reference.BEGIN}\n",
                                  f"{reference.BEGIN}\n{reference.END}\n{reference.BEGIN}\n{reference.END}\n"])
def test_missing_or_misplaced_markers_fail_both_modes(tmp_path, body) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(body)
    for args in (("--check",), ()):
        p = run(*args, "--readme", str(readme))
        assert p.returncode == 2 and "config-reference:begin" in p.stderr, (args, p.stderr)
    assert readme.read_text() == body
