"""--data-path parsing: ``A``, ``A B`` (equal weights) or ``0.7 A 0.3 B`` (weighted)."""

from __future__ import annotations

from ..errors import ConfigError


def parse_data_path(tokens: list) -> list:
    """Return [(weight, prefix), ...] with weights normalised to sum 1.

    Raises ConfigError when weights and prefixes do not alternate or a weight is not positive.
    """
    if not tokens:
        return []
    def is_number(x):
        try:
            float(x)
            return True
        except ValueError:
            return False
    if not is_number(tokens[0]):
        if any(is_number(t) for t in tokens):
            raise ConfigError(f"--data-path {' '.join(tokens)}: give either all prefixes or weight/prefix pairs")
        return [(1.0 / len(tokens), t) for t in tokens]
    if len(tokens) % 2:
        raise ConfigError(f"--data-path {' '.join(tokens)}: weights and prefixes must alternate "
                          f"(e.g. 0.7 A 0.3 B)")
    pairs = []
    for w, prefix in zip(tokens[::2], tokens[1::2]):
        if not is_number(w) or float(w) <= 0 or is_number(prefix):
            raise ConfigError(f"--data-path: expected a positive weight then a prefix, got {w!r} {prefix!r}")
        pairs.append((float(w), prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, prefix) for w, prefix in pairs]
