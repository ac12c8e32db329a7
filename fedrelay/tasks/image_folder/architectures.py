"""The image-folder task's architectures by name (``--model``), without importing torch: both the
task (:class:`fedrelay.tasks.image_folder.ImageFolderTask`) and :mod:`.models`, which builds
them, read :data:`MODELS` from here."""

from __future__ import annotations

__all__ = ["MODELS"]

MODELS = ("cnn", "resnet18", "cnn-gn", "cnn-wide")  # :mod:`.models` builds them; the first is the default
