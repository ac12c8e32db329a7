"""fedrelay: one-shot sequential federated learning, peer to peer."""
__version__ = "0.1.0"


def load_model(path, device: str = "cpu"):
    """Load a run's final model fetched with ``coordinator fetch-model``: ``(model, class_names)``,
    the ``torch.nn.Module`` in eval mode on ``device`` and its class names in logit order.
    See :func:`fedrelay.final_model.load_model` (imported here lazily: it imports torch)."""
    from fedrelay.final_model import load_model as _load

    return _load(path, device)
