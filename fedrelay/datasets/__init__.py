"""Public data sets cut into trial sites, for simulations, the demos and tests: the tool behind
``coordinator split-dataset``.

- :mod:`.split`: :func:`~fedrelay.datasets.split.split_dataset`, the entry point (a data set's
  name -> site folders and ``split.json``).
- :mod:`.partition`: the Dirichlet label-skew partition of a training set over sites and the
  disjoint test shares.
- :mod:`.site_folders`: writing the site folders (ImageFolder-style PNGs) safely into an output
  folder, and the ``split.json`` summary.
- :mod:`.fashion_mnist`: reading Fashion-MNIST's IDX files.
- :mod:`.breast_cancer`: scikit-learn's breast-cancer table as ``tabular-csv`` site folders.

Shared core: used by the coordinator's CLI, ``deploy/local_trial.py``, the benchmarks and the
tests; imports neither daemon.
"""
