"""The coordinator: servicer, chain planning, ledger, dataset splitting for trials."""
