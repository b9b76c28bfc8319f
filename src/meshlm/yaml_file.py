"""Reading a user's YAML file (``--config``) into a mapping, every failure as one line.

The file is read as bytes and decoded as UTF-8 here, so a file that cannot be opened (missing, a
directory, no permission), is not UTF-8 text or is not valid YAML is a ConfigError naming the
flag, the file and the reason, never a PyYAML or OS traceback. A key that appears twice in one
mapping is refused with both line numbers (PyYAML would keep the last one silently).
"""

from __future__ import annotations

import yaml

from .errors import ConfigError


class _DuplicateKey(Exception):
    """A mapping key seen twice: (key, first line, second line), 1-based."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue  # an unhashable key: PyYAML's own error follows
                key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep)


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{flag} {path} is a directory; give a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be read ({e.strerror}); give a file you can read") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                          f"save it as UTF-8 YAML") from None


def read_mapping(path: str, flag: str) -> dict:
    """The top-level mapping of the YAML file ``path`` (given as ``flag``); an empty file is {}."""
    text = _read_text(path, flag)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKey as e:
        key, first, second = e.args
        raise ConfigError(f"{flag} {path}: line {second}: key {key!r} appears twice (first on line {first}); "
                          f"keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of config keys")
    return data
