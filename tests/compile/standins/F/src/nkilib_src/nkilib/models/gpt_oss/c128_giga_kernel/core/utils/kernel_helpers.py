"""``mega_flag_default_on`` as baonudesifeizhai/nki-library@9f2490f68c3ff0c222458095e169b83778fe59e5 defines it (its _FLAG_OFF_VALUES, from the interface)."""

import os

_FLAG_OFF_VALUES = ('', '0', 'false', 'False')


def mega_flag_default_on(name: str) -> bool:
    return os.environ.get(name, "1") not in _FLAG_OFF_VALUES
