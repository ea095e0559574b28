"""mptrain: a Hydra-driven training runner where numerical precision is the subject."""

import os as _os

__version__ = "0.1.0"

# configs/ ships inside the wheel as the package mptrain.configs (see pyproject.toml). When mptrain
# is imported straight from a source checkout instead (python -m pytest or python -m mptrain from
# the repository root), configs/ sits beside this package: expose it under the same name.
_here = _os.path.dirname(__file__)
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "configs")) and _os.path.isfile(
    _os.path.join(_root, "configs", "config.yaml")
):
    __path__.append(_root)
