"""fedrelay: one-shot sequential federated learning, peer to peer.

The user's part of a run is a task: subclass :class:`fedrelay.Task` (``fedrelay.task``), with
:class:`fedrelay.SiteData`, :class:`fedrelay.DataSummary`, :class:`fedrelay.ModelSpec` and
:class:`fedrelay.DataError`; :func:`fedrelay.load_model` loads a run's fetched final model.
"""
from fedrelay.version import __version__

__all__ = ["Task", "SiteData", "DataSummary", "ModelSpec", "DataError", "load_model", "__version__"]

_TASK_API = ("Task", "SiteData", "DataSummary", "ModelSpec", "DataError")


def __getattr__(name: str):
    # The task interface is imported on first use, so that ``import fedrelay`` stays cheap.
    if name in _TASK_API:
        from fedrelay import task

        return getattr(task, name)
    raise AttributeError(f"module 'fedrelay' has no attribute {name!r}")


def load_model(path, device: str = "cpu"):
    """Load a run's final model fetched with ``coordinator fetch-model``: ``(model, class_names)``,
    the ``torch.nn.Module`` in eval mode on ``device`` and its class names in logit order.
    See :func:`fedrelay.final_model.load_model` (imported here lazily: it imports torch)."""
    from fedrelay.final_model import load_model as _load

    return _load(path, device)
