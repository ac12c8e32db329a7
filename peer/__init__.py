"""The peer daemon: servicer, run state machine, training, data, models, transfer."""
