"""Site-side strategies: one module each, named and described in :mod:`fedrelay.registry`, each
providing ``train(m0, spec, train, val, cfg, seed, device, *, finished, on_epoch, on_model)``
and ``models_to_keep(cfg)``; :func:`fedrelay.peer.training.run_site` dispatches to them."""
