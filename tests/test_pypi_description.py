"""The package's long description (PYPI.md): README's first screen, install and first example,
with no link PyPI could not follow, and kept equal to README where they overlap."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def section(text, title):
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_pypi_description_has_no_relative_links_and_follows_readme():
    pypi = (ROOT / "PYPI.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert 'readme = "PYPI.md"' in (ROOT / "pyproject.toml").read_text()
    assert not re.findall(r"\]\((?!https?://)[^)]*\)", pypi)
    assert not re.findall(r"<img|!\[", pypi)
    code = re.compile(r"```.*?```", re.S)
    for title in ("Install", "First example"):
        assert code.findall(section(pypi, title)) == code.findall(section(readme, title)), title
    assert pypi.splitlines()[0] == readme.splitlines()[0]
