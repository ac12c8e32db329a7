"""Trials an operator runs from a checkout: ``deploy/local_trial.py`` (a whole trial on
loopback, what ``make demo`` runs) and ``deploy/netns_trial.py`` (a multi-host trial with
faults). Each runs as a script (``python deploy/local_trial.py``) or a module
(``python -m deploy.local_trial``); tests and benchmark studies import them
(``from deploy import local_trial``). Not part of the installed ``fedrelay`` package."""
