"""fedrelay: one-shot sequential federated learning, peer to peer."""
__version__ = "0.1.0"
