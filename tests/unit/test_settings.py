"""The registry of settings (reduction_server/config/settings.py): every variable declared once, each
read one way, its errors naming it."""

from __future__ import annotations

import pytest

from reduction_server.config import settings
from reduction_server.errors import ConfigError


def test_every_variable_is_declared_once_with_a_default_in_its_range():
    names = [v.name for v in settings.VARIABLES]
    assert len(names) == len(set(names))
    for v in settings.VARIABLES:
        assert v.readers and v.meaning and v.default, v.name
        if v.kind in (int, float) and v.value is not None:
            assert v.least is None or v.value >= v.least, v.name
            assert v.most is None or v.value <= v.most, v.name


@pytest.mark.parametrize(
    "name, raw, words",
    [
        ("RS_TIMEOUT", "soon", "RS_TIMEOUT='soon' is not a valid float"),
        ("RS_TIMEOUT", "0.001", "RS_TIMEOUT='0.001' must be at least 0.01"),
        ("RS_WINDOW", "257", "RS_WINDOW='257' must be at most 256"),
        ("RS_SHM", "maybe", "RS_SHM='maybe' is not a switch"),
        ("RS_METRICS_PORT", "70000", "RS_METRICS_PORT='70000' must be at most 65535"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name, raw, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        settings.read(name, {name: raw})


def test_values_defaults_and_fallbacks():
    assert settings.read("RS_TIMEOUT", {}) == settings.DEFAULT_TIMEOUT
    assert settings.read("RS_TIMEOUT", {"RS_TIMEOUT": " 2.5 "}) == 2.5
    assert settings.read("RS_SHM", {}) is True and settings.read("RS_SHM", {"RS_SHM": "off"}) is False
    assert settings.read("RS_WORLD_SIZE", {}) is None
    both = ("RS_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD")
    assert settings.first_set(both, {"HOROVOD_FUSION_THRESHOLD": "7"}) == 7
    assert settings.first_set(both, {"HOROVOD_FUSION_THRESHOLD": "7", "RS_FUSION_THRESHOLD": "9"}) == 9
    assert settings.first_set(both, {}) == settings.DEFAULT_FUSION_THRESHOLD


def test_the_job_token_is_read_as_it_is():
    """A secret from a file or a Kubernetes secret may end in a newline: every reader must see the
    same bytes, or the proofs of the token would not match."""
    assert settings.read("RS_JOB_TOKEN", {"RS_JOB_TOKEN": " secret\n"}) == " secret\n"
    assert settings.read("RS_JOB_TOKEN", {"RS_JOB_TOKEN": ""}) == ""


def test_every_variable_the_package_reads_is_declared():
    """A literal RS_* name in the package's sources that is not in the registry is a setting read
    around it."""
    import re

    from helpers.source_tree import source_modules

    declared = set(settings.BY_NAME)
    found = set()
    for path in source_modules().values():
        found |= set(re.findall(r'"(RS_[A-Z_]+)"', path.read_text()))
    assert found - declared == set()
