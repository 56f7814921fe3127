"""Reading a user-editable YAML file whose top level must be a mapping (API lists, mapping tables)."""

from __future__ import annotations

from typing import Any

from msprobe_core.errors import ConfigError


def read_yaml_mapping(path: str, field: str, shape: str) -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path`` (empty file: ``{}``). A file that cannot be read, is
    not YAML or holds something else than a mapping raises ``ConfigError(field, path, ...)``; ``shape`` says
    what mapping is expected (e.g. "a YAML mapping of namespace -> list of API names")."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(field, path, f"a readable YAML file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(field, path, f"valid YAML ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(field, path, shape)
    return doc
