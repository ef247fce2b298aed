"""Optional parts of the install (`pip install "mlxhost[vision]"`), checked where they are needed.

mlx-vlm brings OpenCV, pyarrow, pandas, SciPy and audio libraries (about 0.7 GB), so text-only
installs leave it out; a vision-language model then fails with a message naming the extra.
"""

from __future__ import annotations

import importlib.util

from mlxhost.models.loaded import ModelLoadError

VISION_HINT = 'pip install "mlxhost[vision]"'


class MissingExtraError(ModelLoadError):
    """A model needs an optional dependency that is not installed; the message says how to get it."""


def has_vision() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def require_vision(what: str) -> None:
    if not has_vision():
        raise MissingExtraError(f"{what} is a vision-language model and needs mlx-vlm, which this install "
                                f"lacks: {VISION_HINT} (or pip install -e \".[vision]\" in a checkout)")
