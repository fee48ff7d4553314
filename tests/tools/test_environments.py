"""requirements.txt (a student), requirements-dev.txt (a developer), environment.yml and
pyproject.toml agree: the requirements files pin, each to one version, exactly the packages the
package and its extras name; pyproject.toml only states ranges (so another torch is kept)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ;]", spec.strip(), maxsplit=1)[0].lower()


def pins(file: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith(("-r ", "-e ")):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][\w.+]*)", line)
        assert m, f"{file}: {line!r} is not pinned to one version (NAME==VERSION)"
        out[m[1].lower()] = m[2]
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_requirements_pin_exactly_what_the_package_names():
    proj = project()
    student = {name(s) for s in proj["dependencies"] + proj["optional-dependencies"]["course"]}
    dev = {name(s) for s in proj["optional-dependencies"]["dev"]}
    assert set(pins("requirements.txt")) == student
    assert set(pins("requirements-dev.txt")) == dev
    assert "-e .[course]" in (ROOT / "requirements.txt").read_text().splitlines()
    dev_lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    assert "-r requirements.txt" in dev_lines and "-e .[course,dev]" in dev_lines


def test_pyproject_states_ranges_not_pins():
    proj = project()
    for spec in proj["dependencies"] + sum(proj["optional-dependencies"].values(), []):
        assert "==" not in spec, f"{spec}: pin in requirements*.txt, not in pyproject.toml"


def test_environment_yml_is_the_student_set_on_the_same_python():
    text = (ROOT / "environment.yml").read_text()
    assert (
        "- -r requirements.txt" in text and "requirements-dev.txt\n" not in text.split("name:")[1]
    )
    python = re.search(r"- python(\S*)", text)[1]
    assert python == project()["requires-python"] == ">=3.11"


def test_the_readme_names_the_pinned_torch_and_torchvision():
    readme = (ROOT / "README.md").read_text()
    torch, vision = pins("requirements.txt")["torch"], pins("requirements-dev.txt")["torchvision"]
    assert f"pip install torch=={torch} --index-url\nhttps://download.pytorch.org/whl/cpu" in readme
    assert f"torch {torch}, minizero" in readme and f"torchvision {vision}" in readme
    first = readme.index("pip install -r requirements.txt && python -m minizero demo")
    assert readme.index("download.pytorch.org/whl/cpu") < first  # the advice comes before
