"""fedrelay's benchmark studies: ``python -m bench.<study>``; results in bench/results.json and
bench/RESULTS.md (generated, never typed in). See bench/README.md."""
